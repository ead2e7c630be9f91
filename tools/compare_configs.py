"""Time two configs of the same attention call against each other, in one process (two versions of
the kernels: one process each).

A config is the table's (kernels/configs.py: FwdConfig, BwdConfig) with some fields set on the
command line; every field the kernels take as an argument can be compared so (block sizes,
warps, stages, memory paths, the Gluon kernels' thresholds and hopper_gluon_dq_first,
hopper_gluon_head_section, hopper_gluon_causal_head_section, hopper_gluon_varlen_grid). Both configs are first checked against
the float64 reference (baselines/reference.py: each output within twice the same-dtype PyTorch
error, flash-attn's criterion; where that reference would not fit the device, on the call's first
batch rows and heads, packed lengths on their first heads); then rounds alternate A and B (A first in even rounds, B in odd)
so that drift of clocks and temperature falls on both. Every measurement is one row of a
long-format CSV with the environment beside it; a short table gives each config's median and
the ratio B / A of this run. A call the feature kernels take with a mask (dropout, a window,
packed lengths, causal GQA) gets configs built as it runs without one: the backward table's Gluon fields with the
features table's Triton tiles (HOPPER_FEATURE_BWD_CONFIGS), so that its Triton side is the one
such a call takes.

    python tools/compare_configs.py --call fwd --shape 4,4096,16,128 --causal --a block_m=128 --b block_m=64
    python tools/compare_configs.py --call fwd_bwd --shape 2,8192,16,128 --kv-heads 4 \\
        --a hopper_gluon_dq_first=False --b hopper_gluon_dq_first=True
    python tools/compare_configs.py --call bwd --shape 8,0,16,128 --lengths 8192,512,512,512 --causal \\
        --a hopper_gluon_varlen_grid=longest --b hopper_gluon_varlen_grid=packed
    python tools/compare_configs.py --call bwd --shape 4,2048,16,128 --causal --dropout 0.1 --a bwd.hopper_gluon_dropout=False
    python tools/compare_configs.py --call bwd --shape 8,2048,16,128 --seqlen-k 8192 --causal --b hopper_gluon_varlen_grid=longest

Several comparisons in one process: `--plan FILE`, one comparison's arguments a line (blank lines
and `#` comments aside), each after the arguments given beside --plan (e.g. `--rounds 3`); a line
without --out writes OUT's stem + _NN.csv (NN its number in the plan). A comparison that fails (a
config off the reference, a bad field, a kernel that does not build) is reported and the plan goes
on; the tool then exits 1, naming each failed line.

    python tools/compare_configs.py --plan plan.txt --rounds 3 --out results/compare.csv

With `--line-timeout S` each line runs in a process of its own, killed after S seconds: a kernel
that hangs, or an illegal instruction that leaves the CUDA context unusable, fails its line alone.

Two versions of the kernels: `--a-tree DIR` and `--b-tree DIR` take config A's or B's kernels from
another checkout's `kernels/` (a `git worktree` of another commit; the default is this one's). Each
config then runs in a process of its own that imports its tree's kernels, checks them against
float64 and times them when asked, the rounds still alternating; the rows name the tree beside the
fields (which are that tree's config fields). `--a-label TEXT` and `--b-label TEXT` name a config
in the rows' fields column instead, as a table made from the rows shows it (what the other tree's
kernels do, where a path would say nothing to a reader).

    git worktree add /tmp/before HEAD~1
    python tools/compare_configs.py --call bwd --shape 8,2048,16,128 --a-tree /tmp/before

--shape is batch,seqlen,heads,headdim (with --lengths, the packed sequences' lengths, batch and
seqlen are ignored; with --seqlen-k, seqlen is the queries' and the keys' differ). With --dropout (dense calls) the check runs each config under one seed and
compares with the references under that call's keep-mask (`return_attn_probs`). In a field list (comma-separated name=value), a name both configs have
(hopper_gluon_min_keys) takes a `fwd.` or `bwd.` prefix. On a CPU (Triton's interpreter) the
tool runs end to end, but its times say nothing of a GPU.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import itertools
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baselines.reference import attention_reference, attention_reference_varlen, attention_same_dtype
from harness.accuracy import within_twice_the_error
from harness.environment import ROW_ENV_COLUMNS
from harness.suite import SuiteRows
from harness.timing import benchmark

# A worker timing another checkout's kernels (--a-tree, --b-tree: `serve`) imports them from it; the
# reference, the accuracy check and the timing stay this checkout's (kernels/ imports neither)
TREE_ENV = "COMPARE_CONFIGS_TREE"
if os.environ.get(TREE_ENV):
    sys.path.insert(0, os.environ[TREE_ENV])
from kernels import BwdConfig, FwdConfig, flash_attn_func, flash_attn_varlen_func
from kernels.configs import default_bwd_config, default_fwd_config, takes_feature_tiles

CALLS = ("fwd", "bwd", "fwd_bwd")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# checked_shape: the (batch, heads) the float64 check ran on where it was not the whole call ('' where it was)
COLUMNS = ("tool", "call", "batch", "seqlen", "seqlen_k", "lengths", "heads", "kv_heads", "headdim", "causal", "window", "dropout_p",
           "dtype", "config", "fields", "round", "ms", "p20_ms", "p80_ms", "sm_clock_mhz", "checked_shape",
           *ROW_ENV_COLUMNS)


def parse_fields(text: str, call: str) -> dict[str, dict]:
    """`name=value,...` as {"fwd": {...}, "bwd": {...}}: each name a field of FwdConfig or BwdConfig
    (the one the call runs; `fwd.` or `bwd.` prefixed where both have it), each value a Python
    literal (128, True, None, 'l2') or else a bare string (l2). Unknown or ambiguous names raise
    a ValueError that lists the fields there are."""
    classes = {"fwd": FwdConfig, "bwd": BwdConfig}
    used = ("fwd",) if call == "fwd" else ("bwd",) if call == "bwd" else ("fwd", "bwd")
    names = {side: {f.name for f in dataclasses.fields(classes[side])} for side in used}
    fields: dict[str, dict] = {side: {} for side in classes}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, raw = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"a config field is name=value, got {item!r}")
        name = name.strip()
        side, _, bare = name.rpartition(".")
        if side and side not in used:
            raise ValueError(f"{name!r}: the prefix must be one of {', '.join(s + '.' for s in used)} for --call {call}")
        sides = [side] if side else [s for s in used if bare in names[s]]
        if not sides or bare not in names[sides[0]]:
            listing = "; ".join(f"{classes[s].__name__}: {', '.join(sorted(names[s]))}" for s in used)
            raise ValueError(f"unknown config field {name!r} for --call {call}; the fields are {listing}")
        if len(sides) > 1:
            raise ValueError(f"{bare!r} is a field of both configs: write fwd.{bare} or bwd.{bare}")
        try:
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            value = raw.strip()
        fields[sides[0]][bare] = value
    return fields


def feature_call_bwd_config(table: BwdConfig, feature_table: BwdConfig) -> BwdConfig:
    """The one backward config that runs a call of the feature kernels with a mask (causal or a
    window, dropout, packed lengths) as passing none does: flash_attn_backward then reads the Gluon
    kernels' fields from the backward table's entry (`table`), and kernels/backward_features.py the
    Triton kernels' tiles from HOPPER_FEATURE_BWD_CONFIGS (`feature_table`), where an explicit
    config would serve both."""
    return dataclasses.replace(feature_table, **{f.name: getattr(table, f.name) for f in dataclasses.fields(BwdConfig)
                                                 if f.name.startswith("hopper_gluon_")})


def make_configs(fields: dict[str, dict], headdim: int, causal: bool, device: torch.device,
                 feature_tiles: bool = False):
    """The table's configs for this call with `fields` set (dataclasses.replace); `feature_tiles`: the
    call runs the feature kernels with a mask (GQA causal, a window, dropout, packed lengths), whose backward
    takes its Triton tiles from the features table (feature_call_bwd_config)."""
    fwd = dataclasses.replace(default_fwd_config(headdim, causal, device), **fields["fwd"])
    bwd = default_bwd_config(headdim, device)
    if feature_tiles:
        bwd = feature_call_bwd_config(bwd, default_bwd_config(headdim, device, masked_features=True))
    return fwd, dataclasses.replace(bwd, **fields["bwd"])


class Call:
    """Fresh random inputs for one attention call (dense, or packed with `lengths`), its float64
    reference, and the call itself under a config pair."""

    def __init__(self, args, device: torch.device):
        batch, seqlen, heads, headdim = args.shape
        kv_heads = args.kv_heads or heads
        dtype = DTYPES[args.dtype]
        generator = torch.Generator(device="cpu").manual_seed(0)

        def randn(*shape):
            return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype).requires_grad_()

        self.causal, self.lengths, self.dropout_p = args.causal, args.lengths, args.dropout
        self.window = args.window
        if args.lengths:
            total = sum(args.lengths)
            self.q, self.k, self.v = randn(total, heads, headdim), randn(total, kv_heads, headdim), randn(
                total, kv_heads, headdim)
            self.cu = torch.tensor([0, *torch.tensor(args.lengths).cumsum(0).tolist()], dtype=torch.int32,
                                   device=device)
        else:
            seqlen_k = args.seqlen_k or seqlen
            self.q = randn(batch, seqlen, heads, headdim)
            self.k, self.v = (randn(batch, seqlen_k, kv_heads, headdim) for _ in range(2))
        self.dout = torch.randn(self.q.shape, generator=generator).to(device=device, dtype=dtype)

    def run(self, fwd: FwdConfig, bwd: BwdConfig, q=None, k=None, v=None, probs: bool = False):
        """The call's out (with `probs`: out, logsumexp and the probabilities, dropped entries negated)."""
        q, k, v = q if q is not None else self.q, k if k is not None else self.k, v if v is not None else self.v
        if self.lengths:
            longest = max(self.lengths)
            return flash_attn_varlen_func(q, k, v, self.cu, self.cu, longest, longest, causal=self.causal,
                                          fwd_config=fwd, bwd_config=bwd)
        return flash_attn_func(q, k, v, dropout_p=self.dropout_p, causal=self.causal, window_size=self.window,
                               return_attn_probs=probs, fwd_config=fwd, bwd_config=bwd)

    def keep_mask(self, fwd: FwdConfig, bwd: BwdConfig) -> torch.Tensor | None:
        """The keep-mask a dropout call draws under seed 0 (None without dropout)."""
        if not self.dropout_p:
            return None
        torch.manual_seed(0)
        with torch.no_grad():
            return ~torch.signbit(self.run(fwd, bwd, probs=True)[2])

    def reference(self, double: bool, keep: torch.Tensor | None = None):
        """(out, dq, dk, dv) of the float64 reference (double) or of PyTorch in the inputs' dtype,
        under dropout's keep-mask `keep` where given."""
        q, k, v = ((t.detach().double() if double else t.detach()).requires_grad_() for t in (self.q, self.k, self.v))
        if self.lengths and double:
            out = attention_reference_varlen(q, k, v, self.cu, self.cu, causal=self.causal)[0]
        elif self.lengths:  # each sequence on its own, in the inputs' dtype
            bounds = self.cu.tolist()
            out = torch.cat([attention_same_dtype(q[None, a:b], k[None, a:b], v[None, a:b], causal=self.causal)[0]
                             for a, b in itertools.pairwise(bounds)])
        elif double:
            out = attention_reference(q, k, v, causal=self.causal, window_size=self.window, dropout_p=self.dropout_p,
                                      dropout_keep=keep)[0]
        else:
            out = attention_same_dtype(q, k, v, causal=self.causal, window_size=self.window, dropout_p=self.dropout_p,
                                       dropout_keep=keep)
        grads = torch.autograd.grad(out, (q, k, v), self.dout.to(out.dtype))
        return (out, *grads)

    def timed(self, call: str, fwd: FwdConfig, bwd: BwdConfig):
        """The function `call` times: the forward alone (no autograd), the backward alone (of one
        forward, kept), or both."""
        if call == "fwd":
            q, k, v = (t.detach() for t in (self.q, self.k, self.v))
            return lambda: self.run(fwd, bwd, q, k, v)
        if call == "bwd":
            out = self.run(fwd, bwd)
            inputs = (self.q, self.k, self.v)
            return lambda: torch.autograd.grad(out, inputs, self.dout, retain_graph=True)
        return lambda: torch.autograd.grad(self.run(fwd, bwd), (self.q, self.k, self.v), self.dout)


ACCURACY_EPS = 1e-5  # beside twice PyTorch's same-dtype error
# What the accuracy check's references may hold on the device: the float64 one keeps about six
# tensors of (batch, heads, seqlen_q, seqlen_k) float64 scores through its backward
REFERENCE_BYTES = 16 << 30
SCORE_TENSORS = 6


def _windowed(args) -> bool:
    """Whether the call has a sliding window (--window other than -1 -1)."""
    return tuple(args.window) != (-1, -1)


def _cross(args) -> bool:
    """Whether the keys' length differs from the queries' (--seqlen-k)."""
    return bool(args.seqlen_k) and args.seqlen_k != args.shape[1]


def checked_args(args: argparse.Namespace) -> argparse.Namespace:
    """The call the accuracy check runs: the timed one, or where its float64 reference would not fit
    REFERENCE_BYTES, its first batch rows and kv heads (each with its group of q heads) that do,
    at least one: the same lengths, head dim, GQA group and configs, so the same kernels on a
    smaller grid. Packed lengths keep every sequence (the reference holds each one's scores through
    the backward) and lose kv heads alone."""
    batch, seqlen, heads, headdim = args.shape
    kv_heads = args.kv_heads or heads
    group = heads // kv_heads
    if args.lengths:
        fit = REFERENCE_BYTES // (SCORE_TENSORS * 8 * max(sum(n * n for n in args.lengths), 1))
        if heads <= fit:
            return args
        kv = max(1, min(kv_heads, fit // group))
        return argparse.Namespace(**{**vars(args), "shape": (batch, seqlen, kv * group, headdim),
                                     "kv_heads": kv if args.kv_heads else 0})
    seqlen_k = getattr(args, "seqlen_k", 0) or seqlen
    fit = REFERENCE_BYTES // (SCORE_TENSORS * 8 * max(seqlen, 1) * max(seqlen_k, 1))
    if batch * heads <= fit:
        return args
    kv = max(1, min(kv_heads, fit // group))
    rows = max(1, min(batch, fit // (kv * group)))
    return argparse.Namespace(**{**vars(args), "shape": (rows, seqlen, kv * group, headdim),
                                 "kv_heads": kv if args.kv_heads else 0})


def check_accuracy(call: Call, label: str, fwd: FwdConfig, bwd: BwdConfig, ref, same) -> None:
    """Each of out, dq, dk, dv within twice PyTorch's same-dtype error of float64 (plus 1e-5), else
    a SystemExit naming the config and the output: a config that computes something else is not
    timed. With dropout the call runs under seed 0, the references' (Call.keep_mask)."""
    torch.manual_seed(0)
    out = call.run(fwd, bwd)
    got = (out, *torch.autograd.grad(out, (call.q, call.k, call.v), call.dout))
    for name, g, r, s in zip(("out", "dq", "dk", "dv"), got, ref, same):
        ok, err, yardstick = within_twice_the_error(g, r, s, ACCURACY_EPS)
        if not ok:
            raise SystemExit(f"config {label}: {name} is off the float64 reference by {err:.3g}, or not finite "
                             f"(at most {2 * yardstick + ACCURACY_EPS:.3g} allowed: twice PyTorch's same-dtype error); "
                             "not timed")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--call", choices=CALLS, help="the call timed (required unless --plan)")
    parser.add_argument("--shape", metavar="B,S,H,D", type=lambda text: tuple(int(x) for x in text.split(",")),
                        help="batch,seqlen,heads,headdim (required unless --plan)")
    parser.add_argument("--plan", type=Path, metavar="FILE",
                        help="several comparisons in this process: one comparison's arguments a line")
    parser.add_argument("--line-timeout", type=float, default=0.0, metavar="S",
                        help="with --plan: each line in a process of its own, stopped after S seconds, so that a "
                             "kernel that hangs or breaks the CUDA context fails its line alone (default 0: every "
                             "line in this process)")
    parser.add_argument("--kv-heads", type=int, default=0, help="GQA/MQA: kv heads (default: as many as q heads)")
    parser.add_argument("--seqlen-k", type=int, default=0, metavar="K",
                        help="keys per batch row where they differ from the queries (dense calls: cross-attention, "
                             "a chunk of queries against a longer cache; causal aligned bottom-right, as flash-attn "
                             "aligns it); default: seqlen")
    parser.add_argument("--lengths", type=lambda text: [int(x) for x in text.split(",")], default=None,
                        help="packed variable lengths (flash_attn_varlen_func), comma-separated")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--window", metavar=("LEFT", "RIGHT"), type=int, nargs=2, default=(-1, -1),
                        help="sliding window (dense calls; flash-attn's window_size; default -1 -1: none)")
    parser.add_argument("--dropout", type=float, default=0.0, metavar="P", help="dropout_p (dense calls; default 0)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--a", default="", metavar="FIELDS", help="config A: name=value,... (empty: the table's)")
    parser.add_argument("--b", default="", metavar="FIELDS", help="config B: name=value,...")
    parser.add_argument("--a-tree", type=Path, metavar="DIR",
                        help="config A's kernels from the checkout DIR (its kernels/), in a process of their own")
    parser.add_argument("--b-tree", type=Path, metavar="DIR", help="config B's kernels, likewise")
    parser.add_argument("--a-label", default="", metavar="TEXT",
                        help="what the rows' fields column calls config A (default: its fields, with a tree "
                             "'kernels of DIR' before them), e.g. what a tree's kernels do that the other's do not")
    parser.add_argument("--b-label", default="", metavar="TEXT", help="config B's, likewise")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # a tree's worker (`serve`)
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds of each config, interleaved")
    parser.add_argument("--out", type=Path, default=Path("compare_configs.csv"), help="the rows (CSV)")
    args = parser.parse_args(argv)
    if args.line_timeout < 0:
        parser.error(f"--line-timeout takes seconds (0: none), got {args.line_timeout}")
    if args.plan:
        return run_plan(args.plan, _without_plan(list(sys.argv[1:] if argv is None else argv)), args.out,
                        args.line_timeout)
    if args.call is None or args.shape is None:
        parser.error("--call and --shape are required (or --plan FILE)")
    if len(args.shape) != 4:
        parser.error(f"--shape takes batch,seqlen,heads,headdim, got {args.shape}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.seqlen_k < 0 or (args.seqlen_k and args.lengths):
        parser.error(f"--seqlen-k takes a key count for dense calls, got {args.seqlen_k}"
                     + (" with --lengths" if args.lengths else ""))
    if not 0.0 <= args.dropout < 1.0 or (args.dropout and args.lengths):
        parser.error(f"--dropout takes a probability in [0, 1) for dense calls, got {args.dropout}"
                     + (" with --lengths" if args.lengths else ""))
    args.window = tuple(args.window)
    if min(args.window) < -1 or (_windowed(args) and args.lengths):
        parser.error(f"--window takes LEFT RIGHT (each -1 or more) for dense calls, got {args.window}"
                     + (" with --lengths" if args.lengths else ""))
    device = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
    trees = {"A": args.a_tree, "B": args.b_tree}
    if args.serve:
        return serve(args, device)
    if not any(trees.values()):
        try:
            configs = build_configs(args, device, {"A": args.a, "B": args.b})
        except (ValueError, TypeError) as exc:
            parser.error(str(exc))
    missing = [f"--{label.lower()}-tree {tree}" for label, tree in trees.items()
               if tree and not (tree / "kernels" / "__init__.py").is_file()]
    if missing:
        parser.error(f"{', '.join(missing)}: no kernels/ there")
    checked = checked_args(args)
    if checked is not args:
        print(f"accuracy checked at batch {checked.shape[0]}, {checked.shape[2]} heads (the float64 reference of "
              f"{args.shape} would not fit {REFERENCE_BYTES >> 30} GiB)")
    if any(trees.values()):
        workers = {}
        try:
            for label, tree in trees.items():
                workers[label] = TreeWorker(label, tree, args)
            return compare(args, device, checked, workers)
        finally:
            for worker in workers.values():
                worker.close()
    check_configs(checked, device, configs)
    call = Call(args, device)
    return compare(args, device, checked, {label: functools.partial(benchmark, call.timed(args.call, *configs[label]),
                                                                    device, cpu_reps=1) for label in configs})


def build_configs(args, device: torch.device, fields: dict[str, str]) -> dict[str, tuple[FwdConfig, BwdConfig]]:
    """The (forward, backward) config of each label: the table's for this call with its fields set
    (make_configs); a bad field raises ValueError or TypeError."""
    headdim = args.shape[3]
    windowed, cross = _windowed(args), _cross(args)
    # kernels/backward.py: dropout, packed lengths, unequal lengths and GQA take the feature kernels; their tiles by the
    # constexprs this tool's calls can have (feature_args': causal is a window)
    feature_call = bool(args.dropout or args.lengths or windowed or cross
                        or (args.kv_heads and args.kv_heads != args.shape[2]))
    flags = {"WINDOW": args.causal or windowed, "SOFTCAP": False, "ALIBI": False, "DROPOUT": bool(args.dropout),
             "VARLEN": bool(args.lengths)}
    feature_tiles = feature_call and takes_feature_tiles(flags)
    return {label: make_configs(parse_fields(text, args.call), headdim, args.causal, device, feature_tiles)
            for label, text in fields.items()}


def check_configs(checked, device: torch.device, configs: dict[str, tuple[FwdConfig, BwdConfig]]) -> None:
    """Each config's call against the float64 reference (check_accuracy) on the `checked` call
    (checked_args'), dropout's keep-mask the first config's."""
    check = Call(checked, device)
    keep = check.keep_mask(*next(iter(configs.values())))
    ref, same = check.reference(double=True, keep=keep), check.reference(double=False, keep=keep)
    for label, (fwd, bwd) in configs.items():
        check_accuracy(check, label, fwd, bwd, ref, same)


def serve(args, device: torch.device) -> None:
    """A tree's worker (TreeWorker): config A (`--a`, this process's kernels' fields) checked against
    float64, then timed once for each line read, each timing a JSON line on stdout; everything else
    it prints goes to stderr."""
    protocol, sys.stdout = sys.stdout, sys.stderr
    try:
        configs = build_configs(args, device, {"A": args.a})
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"config fields {args.a!r}: {exc}") from exc
    check_configs(checked_args(args), device, configs)
    if device.type == "cuda":  # the float64 reference's memory back to the GPU: the other tree's worker checks next
        torch.cuda.empty_cache()
    timed = Call(args, device).timed(args.call, *configs["A"])
    print(json.dumps({"ready": sys.modules["kernels"].__file__}), file=protocol, flush=True)
    for _ in sys.stdin:
        timing = benchmark(timed, device, cpu_reps=1)
        print(json.dumps({"ms": timing.ms, "ms_p20": timing.ms_p20, "ms_p80": timing.ms_p80,
                          "sm_clock_mhz": timing.sm_clock_mhz}), file=protocol, flush=True)


class TreeWorker:
    """A config of a two-tree comparison: this tool run as a process of its own (`serve`) with its
    tree's kernels (this checkout's where `tree` is None) first on the import path; calling it times
    the call once there."""

    def __init__(self, label: str, tree: Path | None, args):
        self.label, self.tree = label, tree or Path(__file__).resolve().parents[1]
        fields = args.a if label == "A" else args.b
        self.fields = (args.a_label if label == "A" else args.b_label) or (
            f"kernels of {self.tree}" + (f"; {fields}" if fields else ""))
        call = ["--call", args.call, "--shape", ",".join(map(str, args.shape)), "--dtype", args.dtype,
                "--kv-heads", str(args.kv_heads), "--seqlen-k", str(args.seqlen_k), "--dropout", str(args.dropout),
                "--window", *map(str, args.window), "--a", fields]
        call += ["--lengths", ",".join(map(str, args.lengths))] if args.lengths else []
        call += ["--causal"] if args.causal else []
        self.process = subprocess.Popen([sys.executable, __file__, "--serve", *call], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, TREE_ENV: str(self.tree.resolve())})
        self.kernels = json.loads(self._line())["ready"]

    def _line(self) -> str:
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait()
            raise SystemExit(f"config {self.label} ({self.fields}): its process ended (exit {code}; its error "
                             "above); not timed")
        return line

    def __call__(self) -> SimpleNamespace:
        self.process.stdin.write("time\n")
        self.process.stdin.flush()
        return SimpleNamespace(**json.loads(self._line()))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait()


def compare(args, device: torch.device, checked, timers: dict) -> Path:
    """`timers` (each label's: a call timing its config once) in interleaved rounds, A first in even
    rounds: the rows, as they are timed, to args.out; a short table. Returns args.out."""
    batch, seqlen, heads, headdim = args.shape
    windowed, cross = _windowed(args), _cross(args)
    labels = {"A": args.a_label or args.a, "B": args.b_label or args.b}
    fields = {label: getattr(timer, "fields", labels[label]) for label, timer in timers.items()}
    rows = []
    # the rows as they are timed, and beside them OUT's stem + .notes.txt: clocks lowered by heat or power
    with SuiteRows(args.out.parent, args.out.name, COLUMNS, notes_name=f"{args.out.stem}.notes.txt") as out:
        env = out.env
        common = {"tool": "tools/compare_configs.py", "call": args.call,
                  "batch": len(args.lengths) if args.lengths else batch, "seqlen": 0 if args.lengths else seqlen,
                  "seqlen_k": 0 if args.lengths else args.seqlen_k or seqlen,
                  "lengths": " ".join(map(str, args.lengths or ())), "heads": heads,
                  "kv_heads": args.kv_heads or heads, "headdim": headdim, "causal": args.causal,
                  "window": ",".join(map(str, args.window)) if windowed else "",
                  "dropout_p": args.dropout, "dtype": args.dtype,
                  "checked_shape": "" if checked is args else f"{checked.shape[0]} x {checked.shape[2]} heads",
                  **{k: env[k] for k in ROW_ENV_COLUMNS}}
        for round_ in range(args.rounds):
            for label in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
                timing = timers[label]()
                row = {**common, "config": label, "fields": fields[label], "round": round_, "ms": timing.ms,
                       "p20_ms": timing.ms_p20, "p80_ms": timing.ms_p80, "sm_clock_mhz": timing.sm_clock_mhz}
                out.write(row)
                rows.append(row)
    medians = {label: statistics.median(r["ms"] for r in rows if r["config"] == label) for label in ("A", "B")}
    print(f"{args.call} {args.shape}{f' keys {args.seqlen_k}' if cross else ''} causal={args.causal} {args.dtype}"
          f"{f' dropout {args.dropout}' if args.dropout else ''}{f' window {args.window}' if windowed else ''} on {env['gpu'] or device.type}, "
          f"{args.rounds} interleaved rounds (median ms):")
    clocks = {label: [r["sm_clock_mhz"] for r in rows if r["config"] == label and not math.isnan(r["sm_clock_mhz"])]
              for label in ("A", "B")}
    for label in ("A", "B"):
        # the SM clock its timings ran at (harness.environment.ClockSampler), where NVML read one
        clock = f"  at {statistics.median(clocks[label]):.0f} MHz" if clocks[label] else ""
        print(f"  {label}  {medians[label]:10.4f}  {fields[label] or '(the table)'}{clock}")
    ratio = medians["B"] / medians["A"] if medians["A"] > 0 else math.nan
    print(f"  B / A  {ratio:.3f}   rows: {args.out}")
    return args.out


def _plan_option(arg: str) -> bool:
    """Whether a command-line word is --plan (or its argparse abbreviation, --p and longer), with or
    without `=FILE`."""
    name = arg.split("=", 1)[0]
    return len(name) >= 3 and "--plan".startswith(name)


def _without_plan(argv: list[str]) -> list[str]:
    """The command line but --plan and its file: the arguments each line of the plan runs after."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif _plan_option(arg):
            skip = "=" not in arg
        else:
            kept.append(arg)
    return kept


def run_plan(plan: Path, shared: list[str], out: Path, line_timeout: float = 0.0) -> Path:
    """Each comparison of `plan` (main's arguments a line, after `shared`) in turn, in this process,
    or with `line_timeout` each in a process of its own, killed after that many seconds; one that
    fails is reported and the plan goes on, then SystemExit(1) names the failed lines.
    Returns the folder of the rows."""
    if not plan.is_file():
        raise SystemExit(f"--plan: no file {plan}")
    lines = [line.strip() for line in plan.read_text().splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    failed = []
    for number, line in enumerate(tqdm(lines, desc="comparisons", unit="comparison")):
        argv = [*shared, *shlex.split(line)]
        if any(_plan_option(arg) for arg in argv):
            failed.append(f"[{number}] {line}: a plan's line cannot hold --plan")
            continue
        if not any(arg == "--out" or arg.startswith("--out=") for arg in shlex.split(line)):
            argv += ["--out", str(out.with_name(f"{out.stem}_{number:02d}.csv"))]
        print(f"[{number}] {line}", flush=True)
        if line_timeout:
            failure = _run_line_apart(argv, line_timeout)
            if failure:
                failed.append(f"[{number}] {line}: {failure}")
            continue
        try:
            main(argv)
        except SystemExit as exc:  # argparse's error (printed above), or a config off the reference
            failed.append(f"[{number}] {line}: {exc.code if isinstance(exc.code, str) else 'bad arguments'}")
        except Exception as exc:  # noqa: BLE001 (a kernel that does not build or run: the plan goes on)
            failed.append(f"[{number}] {line}: {type(exc).__name__}: {exc}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if failed:
        print("failed:\n" + "\n".join(failed), file=sys.stderr)
        raise SystemExit(1)
    return out.parent


def _run_line_apart(argv: list[str], line_timeout: float) -> str:
    """One plan line in a process of its own (its output this one's), killed after `line_timeout`
    seconds with the tree workers it started (its process group): why it failed, or '' where it
    exited 0."""
    process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv], start_new_session=True)
    try:
        code = process.wait(timeout=line_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return f"no result within {line_timeout:g} s (killed: a kernel that hangs?)"
    return "" if code == 0 else f"its process exited {code}"


if __name__ == "__main__":
    main()
