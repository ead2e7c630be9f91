"""The features suite: flash-attn's training features against every peer that has them.

Groups (bf16, head dim 128; FLOPs are 4 x heads x head dim x the (query, key) pairs the mask
leaves visible, times 2.5 for the backward, the FA2 paper's count on the visible pairs):

* gqa: 32 q heads on 8 kv heads, causal, batch x seqlen = 16k tokens, seqlen 2k-16k; peers
  SDPA flash and cuDNN with `enable_gqa`, FlexAttention (`enable_gqa`), FA4.
* window: sliding window (4096, 0) at seqlen 8k-32k, 16 heads, with our full causal call at
  the same length beside it (the window's time over the full time, against the visible-FLOP
  ratio); peers FlexAttention (a sliding-window mask_mod) and FA4 (`window_size`).
* varlen: 8 random lengths in 512-4096 packed without padding, causal, 16 heads; against our
  dense kernel on the batch padded to the longest (useful FLOPs for both, so the TFLOPs/s
  ratio is the time ratio), FlexAttention (a document mask over the packed tokens), FA4.
* score: ALiBi and softcap 30 at 8k, causal, 16 heads, against the dense call (the overhead);
  peers FlexAttention (score_mod) and FA4 (softcap; its backward has none).

The providers are the registry's of kind 'features' (baselines/providers/features.py). Every
call is timed by `triton.testing.do_bench` (harness/timing.py: warm-up and compile untimed);
each row's output is checked against the float64 reference on the last query rows
(bottom-right alignment keeps their masks). Rows are long format (one measurement per row,
the environment beside them) in `features.csv`; `reports.features.write_features_report` makes
`features.md` from those rows alone, with the bar's checks.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd
import torch

from baselines.flops import tflops_per_second, visible_flops
from baselines.providers import UnsupportedInput, get_provider, registry, unavailable_reason
from baselines.reference import attention_reference
from harness.environment import ROW_ENV_COLUMNS
from harness.suite import SuiteRows
from harness.timing import benchmark, kernel_times, seed_of

FEATURES_CSV, FEATURES_MD = "features.csv", "features.md"
HDIM, DTYPE = 128, torch.bfloat16
WINDOW = (4096, 0)
SOFTCAP = 30.0
CHECK_ROWS = 256  # query rows (the last ones) checked against float64
WRONG_REL_ERR = 0.02  # max |out - ref| / max |ref| above this marks a row 'wrong' (bf16: ~0.005)
BUDGET_S = {"full": 170.0, "quick": 60.0}  # cases not started by then are listed as skipped
# FlexAttention compiles a forward and a backward per shape and mask (tens of seconds each):
# once its calls have taken this long in all, its remaining rows are listed as skipped.
PROVIDER_BUDGET_S = {"flex-attention": 75.0}
COLUMNS = ("group", "variant", "provider", "label", "mode", "causal", "batch", "seqlen_q", "seqlen_k", "heads",
           "kv_heads", "hdim", "dtype", "window_left", "window_right", "softcap", "alibi", "lengths",
           "visible_pairs", "status", "reason", "ms", "ms_p20", "ms_p80", "tflops", "peak_mem_mb", "rel_err",
           "sm_clock_mhz", "config", "repeat", "interpreter", *ROW_ENV_COLUMNS)


@dataclass(frozen=True)
class Case:
    group: str
    variant: str  # what the call does: 'gqa', 'window', 'full-causal', 'varlen', 'padded', 'dense', 'alibi', 'softcap'
    batch: int
    seqlen: int  # per sequence (dense), the longest (varlen)
    heads: int
    kv_heads: int
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi: bool = False
    lengths: tuple[int, ...] = field(default=())  # varlen and padded: the sequences' lengths
    hdim: int = HDIM
    seqlen_k: int = 0  # dense: keys per sequence where they differ from seqlen (masks align bottom-right)

    @property
    def keys(self) -> int:
        return self.seqlen_k or self.seqlen

    @property
    def packed(self) -> bool:
        return bool(self.lengths) and self.variant != "padded"

    def visible_pairs(self) -> int:
        """(query, key) pairs the mask leaves visible, summed over sequences (one head): for the
        padded batch, the useful pairs (its sequences' own), so TFLOPs/s compare with varlen's.
        Query row i's diagonal is key i + keys - seqlen (bottom-right alignment)."""
        lengths = [(n, n) for n in self.lengths] or [(self.seqlen, self.keys)] * self.batch
        left, right = self.window
        right = 0 if self.causal else right
        total = 0
        for n, keys in lengths:
            rows = torch.arange(n, dtype=torch.int64) + (keys - n)
            hi = torch.clamp(rows + (right if right >= 0 else keys), max=keys - 1)
            lo = torch.clamp(rows - left, min=0) if left >= 0 else torch.zeros_like(rows)
            total += int((hi - lo + 1).clamp(min=0).sum())
        return total


def _window_pair(n: int) -> list[Case]:
    return [Case("window", "window", 1, n, 16, 16, window=WINDOW), Case("window", "full-causal", 1, n, 16, 16)]


def cases(quick: bool) -> list[Case]:
    """The suite's cases: every group's anchor first (the shapes the bar names, so a budget that
    runs out drops the rest of the sweeps, not a group), then the other lengths."""
    generator = torch.Generator().manual_seed(0)
    lengths = tuple(torch.randint(512, 4097, (8,), generator=generator).tolist())
    out = [Case("gqa", "gqa", 2, 8192, 32, 8), *_window_pair(16384),
           Case("varlen", "varlen", len(lengths), max(lengths), 16, 16, lengths=lengths),
           Case("varlen", "padded", len(lengths), max(lengths), 16, 16, lengths=lengths),
           Case("score", "dense", 2, 8192, 16, 16), Case("score", "alibi", 2, 8192, 16, 16, alibi=True),
           Case("score", "softcap", 2, 8192, 16, 16, softcap=SOFTCAP)]
    out += [Case("gqa", "gqa", 16384 // n, n, 32, 8) for n in ((2048,) if quick else (2048, 4096, 16384))]
    for n in () if quick else (8192, 32768):
        out += _window_pair(n)
    return out


@dataclass
class Inputs:
    """One case's tensors: dense (batch, seqlen, heads, hdim), or packed (total, heads, hdim)
    for varlen (the padded batch is dense: each sequence as long as the longest)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_seqlens: torch.Tensor | None
    slopes: torch.Tensor | None
    scale: float

    @classmethod
    def make(cls, case: Case, device, dtype, requires_grad=False) -> Inputs:
        generator = torch.Generator(device=device).manual_seed(seed_of(case.group, case.variant, case.seqlen))

        def randn(*shape):
            return torch.randn(shape, generator=generator, device=device, dtype=dtype).requires_grad_(requires_grad)

        d = case.hdim
        if case.packed:
            total = sum(case.lengths)
            cu = torch.tensor([0, *torch.tensor(case.lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
            q, k, v = randn(total, case.heads, d), randn(total, case.kv_heads, d), randn(total, case.kv_heads, d)
        else:
            cu = None
            q = randn(case.batch, case.seqlen, case.heads, d)
            k, v = (randn(case.batch, case.keys, case.kv_heads, d) for _ in range(2))
        slopes = (torch.exp2(-8.0 * torch.arange(1, case.heads + 1, device=device) / case.heads)
                  if case.alibi else None)  # ALiBi's geometric slopes (Press et al., 2022)
        return cls(q, k, v, cu, slopes, d ** -0.5)


# Per-shape compiles (tens of seconds) fit the suite's time at the anchor shapes only.
FLEX_SHAPES = {("gqa", 8192), ("window", 16384), ("varlen", 0), ("score", 8192)}


# --------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------
def _reference_rel_err(case: Case, x: Inputs, out: torch.Tensor) -> float:
    """max |out - ref| / max |ref| on the last CHECK_ROWS query rows (of the last sequence),
    all q heads of the first kv head's group, against float64."""
    group = case.heads // case.kv_heads
    if case.packed:
        start, end = int(x.cu_seqlens[-2]), int(x.cu_seqlens[-1])
        q, k, v, got = (t[None, start:end] for t in (x.q, x.k, x.v, out))
    else:
        q, k, v, got = (t[:1] for t in (x.q, x.k, x.v, out))
    rows = min(CHECK_ROWS, q.shape[1])
    slopes = None if x.slopes is None else x.slopes[:group]
    ref, _ = attention_reference(q[:, -rows:, :group].detach(), k[:, :, :1].detach(), v[:, :, :1].detach(),
                                 x.scale, case.causal, case.window, case.softcap, slopes)
    err = (got[:, -rows:, :group].double() - ref).abs().max().item()
    return err / ref.abs().max().item()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(case: Case, provider: str, mode: str, device, dtype, profile_kernels: bool = False) -> dict:
    """One row's measured fields: status, times, TFLOPs/s on the visible pairs, rel_err; with
    `profile_kernels`, `kernel_us` too: each GPU kernel's microseconds in one call, as JSON
    (harness.timing.kernel_times, after the timing)."""
    try:
        x = Inputs.make(case, device, dtype, requires_grad=mode == "bwd")
        call = get_provider(provider, "features").forward(case, x, mode)
        out = call()
        _sync(device)
        rel_err = _reference_rel_err(case, x, out)
        grads = ()
        if mode == "bwd":
            dout = torch.randn_like(out)
            call, grads = (lambda: out.backward(dout, retain_graph=True)), (x.q, x.k, x.v)
        timing = benchmark(call, device, grad_to_none=grads)
        kernels = {"kernel_us": _profiled_kernels(call, device, grads)} if profile_kernels else {}
    except UnsupportedInput as exc:
        return {"status": "unsupported", "reason": str(exc)}
    except torch.cuda.OutOfMemoryError as exc:
        torch.cuda.empty_cache()
        return {"status": "oom", "reason": " ".join(str(exc).split())[:200]}
    except Exception as exc:  # noqa: BLE001 -- a provider's failure is a row, not the suite's end
        return {"status": "error", "reason": " ".join(f"{type(exc).__name__}: {exc}".split())[:240]}
    flops = visible_flops(case.visible_pairs(), case.heads, case.hdim, mode)
    status = "ok" if rel_err <= WRONG_REL_ERR else "wrong"
    return {"status": status, "reason": "" if status == "ok" else f"relative error {rel_err:.3g}",
            "ms": timing.ms, "ms_p20": timing.ms_p20, "ms_p80": timing.ms_p80,
            "tflops": tflops_per_second(flops, timing.ms), "peak_mem_mb": timing.peak_mem_mb, "rel_err": rel_err,
            "sm_clock_mhz": timing.sm_clock_mhz, **kernels}


def _profiled_kernels(call, device, grads) -> str:
    """kernel_times of a timed call as JSON, or 'error: ...' with the reason where the profiler
    fails: the row's timing stands without it."""
    try:
        return json.dumps(kernel_times(call, device, grad_to_none=grads))
    except Exception as exc:  # noqa: BLE001 -- the profile is an extra; its failure fails no measurement
        return "error: " + " ".join(f"{type(exc).__name__}: {exc}".split())[:200]


def case_tensors(case: Case, device) -> tuple:
    """(q, k-or-v, Features) shaped as our call of `case` takes them, uninitialised, for
    kernels/dispatch.py's rules (which read shapes, strides and dtypes only)."""
    from kernels.checks import DENSE, Features

    if case.packed:
        total = sum(case.lengths)
        q = torch.empty(total, case.heads, case.hdim, device=device, dtype=DTYPE)
        kv = torch.empty(total, case.kv_heads, case.hdim, device=device, dtype=DTYPE)
        cu = torch.zeros(len(case.lengths) + 1, dtype=torch.int32, device=device)
        return q, kv, Features(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(case.lengths),
                               max_seqlen_k=max(case.lengths))
    batch = len(case.lengths) if case.lengths else case.batch
    q = torch.empty(batch, case.seqlen, case.heads, case.hdim, device=device, dtype=DTYPE)
    kv = torch.empty(batch, case.keys, case.kv_heads, case.hdim, device=device, dtype=DTYPE)
    left, right = case.window
    features = Features(window_left=left, window_right=-1 if case.causal else right, softcap=case.softcap,
                        alibi_slopes=torch.empty(case.heads, device=device) if case.alibi else None)
    return q, kv, DENSE if features == Features() else features


def gluon_choice(case: Case, mode: str, device, tensors: tuple | None = None) -> tuple[str, str]:
    """The Gluon kernel kernels/dispatch.py picks for our `mode` call of `case` by the table's
    configs for `device`, and why none: (path, '') or ('', the reason), from dispatch's own
    rules; `tensors` are case_tensors' (made on `device` where not given)."""
    from kernels import dispatch
    from kernels.configs import default_bwd_config, default_fwd_config

    q, kv, features = tensors or case_tensors(case, device)
    if mode == "fwd":
        fwd = default_fwd_config(case.hdim, case.causal, device)
        return dispatch.fwd_gluon_path(fwd, q, kv, kv, q, case.causal, features)
    bwd = default_bwd_config(case.hdim, device)
    if case.packed:
        refusal = dispatch.hopper_gluon_varlen_bwd_refusal(bwd, q, kv, kv, q, features)
        return (dispatch.GluonPath.DENSE, "") if not refusal else ("", refusal)
    return dispatch.bwd_gluon_path(bwd, q, kv, kv, q, features)


def our_config(case: Case, device, provider: str) -> str:
    """Which kernels serve our call, as kernels/dispatch.py decides for this case's shapes:
    'kernels' names the forward's path ('gluon-ws', the Gluon kernel of flash_attn_hopper.py, or
    the Triton kernel's memory path), the backward's dK/dV kernel ('gluon-ws' or 'triton') and
    where dQ is made ('fused' into the dK/dV kernel, or by the 'dq-kernel'), with the block
    configs."""
    from kernels import dispatch
    from kernels.checks import DENSE
    from kernels.configs import default_bwd_config, default_fwd_config

    masked = case.causal or case.window != (-1, -1) or case.softcap or case.alibi or case.packed
    q, kv, features = case_tensors(case, device)
    fwd = default_fwd_config(case.hdim, case.causal, device)
    uses_features = features is not DENSE or case.kv_heads != case.heads
    # kernels/backward.py asks the dense table's config whether the Gluon kernel serves the call;
    # the Triton feature kernels then take the features' table (ours; the dense table for
    # 'ours-dense-bwd-table')
    dense_bwd = default_bwd_config(case.hdim, device)
    gluon_device = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
    fwd_path = dispatch.fwd_memory_path(fwd, q, kv, kv, q, case.causal, features)
    bwd_path = gluon_choice(case, "bwd", device, (q, kv, features))[0] or "triton"
    bwd = dense_bwd
    gluon_paths = (dispatch.GluonPath.DENSE, dispatch.GluonPath.PACKED)
    if uses_features and bwd_path not in gluon_paths and provider == "ours":
        bwd = default_bwd_config(case.hdim, device, masked_features=masked)
    if not gluon_device:  # the Gluon kernels run on sm_90 only; elsewhere the Triton ones
        fwd_path = fwd_path if fwd_path not in gluon_paths else "triton"
        bwd_path = "triton"
    # kernels/backward.py: the Gluon kernels fuse dQ where bwd_gluon_fuses_dq says so (the varlen
    # one, packed lengths' and batch rows packed, always); the Triton feature kernels (features or
    # GQA) never do, the dense one by bwd_fuses_dq
    if bwd_path in gluon_paths:
        fused = case.packed or bwd_path == dispatch.GluonPath.PACKED or dispatch.bwd_gluon_fuses_dq(
            dense_bwd, case.hdim)
    else:
        fused = not uses_features and dispatch.bwd_fuses_dq(bwd, case.seqlen)
    return json.dumps({"kernels": {"fwd": fwd_path, "bwd": bwd_path, "dq": "fused" if fused else "dq-kernel"},
                       "fwd": asdict(fwd), "bwd": asdict(bwd)})


def _measured(case: Case, provider: str, mode: str) -> bool:
    """Which providers a case times: ours always; the padded batch and the full causal call are
    our ratios' baselines (FA4's full causal too, for its own window ratio); FlexAttention only
    at FLEX_SHAPES, and so our backward with the dense table's configs."""
    if provider == "ours":
        return True
    if provider == "ours-dense-bwd-table":
        return (mode == "bwd" and case.variant in ("gqa", "window", "varlen", "alibi", "softcap")
                and (case.group, 0 if case.packed else case.seqlen) in FLEX_SHAPES)
    if case.variant == "padded" or (case.variant == "full-causal" and provider != "fa4"):
        return False
    return provider != "flex-attention" or (case.group, 0 if case.packed else case.seqlen) in FLEX_SHAPES


def case_row(env, case: Case, dtype, **fields) -> dict:
    """One row of the features suite's COLUMNS: the case, the environment, then `fields`."""
    row = dict.fromkeys(COLUMNS, "")
    row.update({k: env[k] for k in ROW_ENV_COLUMNS})
    row.update(group=case.group, variant=case.variant, causal=case.causal, batch=case.batch, seqlen_q=case.seqlen,
               seqlen_k=case.keys, heads=case.heads, kv_heads=case.kv_heads, hdim=case.hdim,
               dtype={torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype],
               window_left=case.window[0], window_right=case.window[1], softcap=case.softcap, alibi=case.alibi,
               lengths=" ".join(map(str, case.lengths)), visible_pairs=case.visible_pairs(),
               interpreter=env["interpreter"])
    row.update(fields)
    return row


def measure_suite(quick: bool, out_dir: Path, device: torch.device | None = None,
                  case_list: list[Case] | None = None, repeats: int = 1) -> Path:
    """Every case x provider x mode into out_dir/features.csv (a new file) and notes.txt, in
    `repeats` rounds over the whole suite (a row's `repeat`; the budget grows with them), so that
    each round's same-run ratios see the same clocks and the rounds show their spread.
    `device` cpu (tests only) runs in Triton's interpreter, in float32 (its bf16 dots are wrong):
    times are not performance."""
    device = device or torch.device("cuda")
    dtype = DTYPE if device.type == "cuda" else torch.float32
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the features suite times GPU kernels: it needs CUDA (tests/test_features.py checks "
                         "correctness in the CPU interpreter)")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    spent = dict.fromkeys(PROVIDER_BUDGET_S, 0.0)
    rounds = [(repeat, case) for repeat in range(repeats) for case in (case_list if case_list is not None
                                                                       else cases(quick))]
    with SuiteRows(out_dir, FEATURES_CSV, COLUMNS, BUDGET_S["quick" if quick else "full"] * repeats) as rows:
        env = rows.env
        for repeat, case in rounds:
            where = f" (round {repeat + 1})" if repeats > 1 else ""
            if rows.out_of_time():
                rows.skip(f"{case.group}/{case.variant} at {case.seqlen}{where}")
                continue
            for provider, entry in registry("features").items():
                ours, label = provider.startswith("ours"), entry.label
                modes = [mode for mode in ("fwd", "bwd") if _measured(case, provider, mode)]
                unavailable = unavailable_reason(entry)
                if unavailable:
                    for mode in modes:
                        rows.write(case_row(env, case, dtype, provider=provider, label=label, mode=mode, repeat=repeat,
                                        status="unavailable", reason=unavailable))
                    continue
                config = our_config(case, device, provider) if ours else ""
                for mode in modes:
                    if spent.get(provider, 0.0) > PROVIDER_BUDGET_S.get(provider, math.inf) * repeats:
                        rows.skip(f"{provider} {mode} on {case.group}/{case.variant} at {case.seqlen}{where}")
                        continue
                    began = time.monotonic()
                    rows.write(case_row(env, case, dtype, provider=provider, label=label, mode=mode, config=config,
                                    repeat=repeat, **measure(case, provider, mode, device, dtype)))
                    if provider in spent:
                        spent[provider] += time.monotonic() - began
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows.path


def measure_rows(args, out_dir: Path) -> None:
    """The features suite's rows (args.quick: fewer lengths; args.repeats: rounds) into
    out_dir/features.csv; reports.features makes features.md from them."""
    measure_suite(bool(args.quick), Path(out_dir), repeats=int(args.repeats or 1))


def load_rows(out_dir, csv_name: str = FEATURES_CSV) -> pd.DataFrame:
    """The suite's rows (or another suite's of the same columns, in csv_name); rows from before
    rounds were counted are round 0."""
    df = pd.read_csv(Path(out_dir) / csv_name, keep_default_na=False,
                     na_values={c: [""] for c in ("ms", "tflops", "rel_err", "ms_p20", "ms_p80", "repeat")})
    df["repeat"] = df["repeat"].fillna(0).astype(int) if "repeat" in df else 0
    return df
