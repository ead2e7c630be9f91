"""The coverage suite: the shapes a model meets, ours against FA4, cuDNN and the official FA2,
forward and backward, with the kernel that served each of our rows.

Cases (bf16, causal masks aligned bottom-right; FLOPs on the visible pairs, as the features
suite counts them):

* sweep: the paper's sweep, batch x seqlen = 16k tokens and heads x head dim = 2048 (heads
  2048 // head dim: 21 at 96, 10 at 192), at head dims 64, 96, 128, 192, 256, seqlen 2k and
  8k, causal and not.
* off-grid: lengths off the 128-row grid, 1000 at head dim 64 and 3000 at head dim 128, causal.
* cross: 2k queries against 8k keys, causal, head dim 128.
* gqa: 32 q heads on 8 kv heads at 4k, causal, head dim 128.
* varlen: a fixed seeded list of ragged lengths packed without padding, causal, head dim 128.

Providers: the registry's of kind 'features' (baselines/providers/features.py) named in
PROVIDERS; one that does not take a case writes an `unsupported` row with its reason. Each
call is measured by harness.features.measure (the float64 check on the last query rows, then
`benchmark`); within a case the providers run in PROVIDERS' order in even rounds and in the
reverse order in odd ones (`provider_order`): under a GPU's power cap a kernel's clock depends
on what ran just before it, so no provider always follows the same one. Our rows carry
`kernel`, the kernel kernels/dispatch.py picks for the case's tensors
(harness.features.our_config), and `kernel_reason`, why it is not a Gluon kernel.
With `runner.py --kernel-times` each call of the first round is profiled after its timing too
(harness.timing.kernel_times): `kernel_us` holds its GPU kernels' microseconds, which says whether
a backward's main kernel or its preprocess and dQ cast separate ours from FA4's.
Rows are long format in `coverage.csv`; reports.coverage makes `coverage.md` from them alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from baselines.providers import get_provider, unavailable_reason
from harness import features
from harness.features import Case
from harness.suite import SuiteRows

COVERAGE_CSV, COVERAGE_MD = "coverage.csv", "coverage.md"
PROVIDERS = ("ours", "fa4", "sdpa-cudnn", "sdpa-flash")
# cases not started by then are listed as skipped (a case started before runs to its end: the
# full suite's last one, with FA4's and our compiles, ends within a minute of the budget)
BUDGET_S = {"full": 300.0, "quick": 60.0}
COLUMNS = (*features.COLUMNS, "kernel", "kernel_reason", "kernel_us")
TOKENS, WIDTH = 16384, 2048  # the paper sweep's batch x seqlen and heads x head dim


def _sweep(hdim: int, seqlen: int, causal: bool) -> Case:
    return Case("sweep", f"d{hdim}-{seqlen}-{'causal' if causal else 'full'}", TOKENS // seqlen, seqlen,
                WIDTH // hdim, WIDTH // hdim, causal=causal, hdim=hdim)


def _special() -> list[Case]:
    """The cases beside the sweep: off-grid lengths, queries against more keys, GQA, varlen."""
    lengths = tuple(torch.randint(256, 8193, (8,), generator=torch.Generator().manual_seed(0)).tolist())
    return [Case("off-grid", "d64-1000", 16, 1000, 32, 32, hdim=64),
            Case("off-grid", "d128-3000", 5, 3000, 16, 16),
            Case("cross", "q2048-k8192", 8, 2048, 16, 16, seqlen_k=8192),
            Case("gqa", "32q-8kv-4096", 4, 4096, 32, 8),
            Case("varlen", "varlen", len(lengths), max(lengths), 16, 16, lengths=lengths)]


def cases(quick: bool) -> list[Case]:
    """The suite's cases: the sweep at head dim 128 and the special cases first, then the paper's
    other head dims (64, 256), then 96 and 192 (a budget that runs out drops the last, listed in
    notes.txt); quick: a small subset."""
    if quick:
        return [_sweep(128, 2048, True), _sweep(64, 2048, False), *_special()[1:]]
    first = [_sweep(128, n, causal) for n in (2048, 8192) for causal in (False, True)]
    rest = [_sweep(d, n, causal) for d in (64, 256, 96, 192) for n in (2048, 8192) for causal in (False, True)]
    return [*first, *_special(), *rest]


# --------------------------------------------------------------------------------------
# Which kernel serves our call
# --------------------------------------------------------------------------------------
def _gluon_device(device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def _why_not_gluon(case: Case, mode: str, device) -> str:
    """Why our `mode` call of `case` is not on a Gluon kernel: the device, or kernels/dispatch.py's
    own reason (harness.features.gluon_choice; '' where its rules pick a Gluon kernel: a row on
    Triton with no reason)."""
    if device.type != "cuda":
        return "Triton's CPU interpreter runs the Triton kernels"
    if not _gluon_device(device):
        major, minor = torch.cuda.get_device_capability(device)
        return f"the Gluon kernels are built for sm_90; this GPU is sm_{major}{minor}"
    # dispatch's rules read shapes, strides and dtypes: the case's tensors on the CPU will do
    return features.gluon_choice(case, mode, device, features.case_tensors(case, torch.device("cpu")))[1]


def kernels_served(case: Case, device, config: str) -> dict[str, tuple[str, str]]:
    """{mode: (kernel, reason)} for our call of `case`: the forward's and the backward's kernels
    as kernels/dispatch.py picks them for the case's tensors (`config`: harness.features.our_config's
    record of them), and why one is not a Gluon kernel ('' for a Gluon one). In Triton's CPU
    interpreter every call runs the Triton kernels, and the kernel says so."""
    from kernels import dispatch

    paths = json.loads(config)["kernels"]
    names = {dispatch.GluonPath.DENSE: "Gluon varlen" if case.packed else "Gluon dense",
             dispatch.GluonPath.PACKED: "Gluon varlen (batch rows packed)"}
    fwd = f"{names[paths['fwd']]} fwd" if paths["fwd"] in names else f"Triton fwd, {paths['fwd']}"
    dq = "fused dQ" if paths["dq"] == "fused" else "dQ kernel"
    bwd = f"{names[paths['bwd']]} dK/dV, {dq}" if paths["bwd"] in names else f"Triton dK/dV, {dq}"
    hopper = dispatch.flash_attn_hopper
    if (paths["bwd"] == dispatch.GluonPath.DENSE and not case.packed and hopper is not None
            and case.hdim in hopper.WIDE_BWD_HEAD_DIMS):
        bwd = f"Gluon dense dK/dV for wide heads (bwd_wide.py), {dq}"
    where = " (interpreter)" if device.type != "cuda" else ""
    return {mode: (kernel + where, "" if kernel.startswith("Gluon") else _why_not_gluon(case, mode, device))
            for mode, kernel in (("fwd", fwd), ("bwd", bwd))}


# --------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------
def provider_order(repeat: int) -> tuple[str, ...]:
    """The order a case's providers run in, round `repeat`: PROVIDERS', reversed in odd rounds."""
    return PROVIDERS if repeat % 2 == 0 else PROVIDERS[::-1]


def measure_suite(quick: bool, out_dir: Path, device: torch.device | None = None,
                  case_list: list[Case] | None = None, repeats: int = 1, kernel_times: bool = False) -> Path:
    """Every case x PROVIDERS x mode into out_dir/coverage.csv (a new file) and notes.txt, in
    `repeats` rounds over the whole suite (a row's `repeat`; the budget grows with them);
    `kernel_times`: each call's kernels profiled in the first round (its rows' `kernel_us`).
    `device` cpu (tests only) runs in Triton's interpreter, in float32: times are not performance."""
    device = device or torch.device("cuda")
    dtype = features.DTYPE if device.type == "cuda" else torch.float32
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the coverage suite times GPU kernels: it needs CUDA (tests/test_coverage.py runs it "
                         "in the CPU interpreter)")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    rounds = [(repeat, case) for repeat in range(repeats)
              for case in (case_list if case_list is not None else cases(quick))]
    with SuiteRows(out_dir, COVERAGE_CSV, COLUMNS, BUDGET_S["quick" if quick else "full"] * repeats) as rows:
        for repeat, case in rounds:
            if rows.out_of_time():
                rows.skip(f"{case.group}/{case.variant}" + (f" (round {repeat + 1})" if repeats > 1 else ""))
                continue
            for provider in provider_order(repeat):
                entry = get_provider(provider, "features")
                unavailable = unavailable_reason(entry)
                for mode in ("fwd", "bwd"):
                    profile = kernel_times and repeat == 0
                    fields = ({"status": "unavailable", "reason": unavailable} if unavailable
                              else features.measure(case, provider, mode, device, dtype, profile_kernels=profile))
                    kernel, reason, ours = "", "", {}
                    if provider == "ours":  # as dispatch picks them after the call: a Gluon kernel that
                        # failed to build at its first launch has sent the call, and every later one, to Triton
                        config = features.our_config(case, device, "ours")
                        kernel, reason = kernels_served(case, device, config)[mode]
                        ours = {"config": config}
                    rows.write(features.case_row(rows.env, case, dtype, provider=provider, label=entry.label,
                                                 mode=mode, repeat=repeat, kernel=kernel, kernel_reason=reason,
                                                 **ours, **fields))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows.path


def measure_rows(args, out_dir: Path) -> None:
    """The coverage suite's rows (args.quick: a subset; args.repeats: rounds) into
    out_dir/coverage.csv; reports.coverage makes coverage.md from them."""
    measure_suite(bool(args.quick), Path(out_dir), repeats=int(args.repeats or 1),
                  kernel_times=bool(getattr(args, "kernel_times", False)))
