"""The Gluon dK/dV kernel's schedule (kernels/flash_attn_hopper.py, BWD_STATS_IN_SHARED and
BWD_DQ_FIRST), each combination against the others in one process, on the H200:

- L_i and D_i read from global memory by the consumers at each query step, or brought into
  shared memory by the loader warp with Q_i and dO_i (FlashAttention-3's producer does so);
- the fused dQ's matmul issued after dK and dV have finished, or before the dK matmul, with dQ's
  store and reduce-add under it (FlashAttention-3's order).

    python tools/experiments/exp_bwd_schedule.py --out DIR      # DIR/bwd_schedule.csv

Per schedule: the whole backward through kernels.flash_attn_func (the plans rebuilt for it),
first checked against the float64 reference at batch 2 x 1k x 4 heads, both causal modes (dQ,
dK, dV within 2x the Triton deterministic backward's error), then timed by harness.features
(`do_bench` of `out.backward`, bf16, head dim 128) on the features suite's dense, GQA, window and
ALiBi cases, and its packed variable lengths as a control (the varlen kernel reads L and D by pointers
whatever the setting), SDPA cuDNN beside the dense ones. Rows in the decisions format (row, column, unit, value,
tool, git_commit), written as they are measured; a schedule that fails its check is a row
'wrong' and is not timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_bwd_schedule.py, bf16, head dim 128, do_bench of the whole backward"


def set_schedule(stats: bool, dq_first: bool) -> None:
    from kernels import backward
    from kernels import flash_attn_hopper as hopper

    hopper.BWD_STATS_IN_SHARED, hopper.BWD_DQ_FIRST = stats, dq_first
    backward._PLANS.clear()  # plans hold the schedule they were made with


DENSE_CHECKS = ((False, 4, (-1, -1)), (True, 4, (-1, -1)))  # (causal, kv heads of 4 q heads, window)
FEATURE_CHECKS = (*DENSE_CHECKS, (True, 2, (-1, -1)), (True, 4, (256, 0)))


def check(device, cases=DENSE_CHECKS) -> tuple[bool, str]:
    """The schedule's gradients against float64 (flash-attn's criterion, the Triton deterministic
    backward as the same-dtype yardstick) on `cases`: the dense backward both causal modes, and
    with FEATURE_CHECKS GQA and a window too."""
    import torch

    import kernels
    from baselines.reference import attention_reference
    from harness.accuracy import _relative_error as relative_error  # ||got - want|| / ||want||, in float64
    from harness.accuracy import within_twice_the_error
    from kernels.configs import HOPPER_BWD_CONFIGS

    triton_cfg = dataclasses.replace(HOPPER_BWD_CONFIGS[128], hopper_gluon_min_keys=0)  # the Triton kernels
    notes = []
    ok = True
    for case in cases:
        causal, kv_heads, window = case[:3]
        softcap = case[3] if len(case) > 3 else 0.0  # (causal, kv heads, window[, softcap])
        gen = torch.Generator(device=device).manual_seed(1 + causal + 2 * (kv_heads != 4) + 4 * (window != (-1, -1))
                                                         + 8 * bool(softcap))
        q, do = (torch.randn(2, 1024, 4, 128, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
        k, v = (torch.randn(2, 1024, kv_heads, 128, device=device, dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        grads = {}
        for name, cfg in (("gluon", None), ("triton", triton_cfg)):
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            out = kernels.flash_attn_func(*x, causal=causal, window_size=window, softcap=softcap, bwd_config=cfg,
                                          deterministic=name == "triton")
            out.backward(do)
            grads[name] = [t.grad for t in x]
        x64 = [t.double().requires_grad_() for t in (q, k, v)]
        ref, _ = attention_reference(*x64, 128 ** -0.5, causal, window_size=window, softcap=softcap)
        ref.backward(do.double())
        label = f"causal={causal}" + (f" kv_heads={kv_heads}" if kv_heads != 4 else "") + (
            f" window={window}" if window != (-1, -1) else "") + (f" softcap={softcap}" if softcap else "")
        for i, grad in enumerate(["dq", "dk", "dv"]):
            want = x64[i].grad
            good, got, yardstick = within_twice_the_error(grads["gluon"][i], want, grads["triton"][i], 1e-4,
                                                          error=relative_error)
            ok &= good
            notes.append(f"{grad} {label} {got:.2e} (triton {yardstick:.2e})")
    return ok, "; ".join(notes)


def _tool(row: dict, tool: str = TOOL) -> str:
    """The rows' tool column (`tool`), with the measurement's status and reason where it is not
    'ok' (the table lists those cells)."""
    from reports.decisions import status_tool

    if row.get("status") == "ok":
        return tool
    return status_tool(tool, row.get("status"), row.get("reason", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the schedules (interleaved)")
    args = parser.parse_args()
    import torch

    from harness.features import WINDOW, Case, measure
    from harness.features import cases as feature_cases
    from kernels import flash_attn_hopper as hopper
    from reports.decisions import DecisionWriter, status_tool
    from reports.embed import bwd_schedule_label as schedule_name  # the rows' names, as the table reads them

    device = torch.device("cuda")
    cases = [Case("score", "dense", 2, 8192, 16, 16), Case("score", "dense", 8, 2048, 16, 16),
             Case("gqa", "gqa", 2, 8192, 32, 8), Case("window", "window", 1, 16384, 16, 16, window=WINDOW),
             Case("window", "full-causal", 1, 16384, 16, 16), Case("score", "alibi", 2, 8192, 16, 16, alibi=True),
             next(c for c in feature_cases(quick=False) if c.variant == "varlen")]  # a control
    schedules = list(itertools.product((False, True), (False, True)))
    production = (hopper.BWD_STATS_IN_SHARED, hopper.BWD_DQ_FIRST)
    args.out.mkdir(parents=True, exist_ok=True)
    with DecisionWriter(args.out / "bwd_schedule.csv", TOOL) as writer:
        good = []
        for stats, dq_first in schedules:
            set_schedule(stats, dq_first)
            ok, notes = check(device)
            writer.write(schedule_name(stats, dq_first), "check against float64", "ok" if ok else "wrong", float(ok),
                         tool=TOOL if ok else status_tool(TOOL, "wrong", notes))
            print(f"{schedule_name(stats, dq_first):50s} {'ok' if ok else 'WRONG'}  {notes}", flush=True)
            if ok:
                good.append((stats, dq_first))
        for _ in range(args.repeats):
            for case in cases:
                column = f"{case.variant} {case.batch}x{case.seqlen // 1024}k {case.heads}/{case.kv_heads}h"
                for stats, dq_first in good:
                    set_schedule(stats, dq_first)
                    row = measure(case, "ours", "bwd", device, torch.bfloat16)
                    writer.write(schedule_name(stats, dq_first), column, "ms", row.get("ms", float("nan")),
                                 tool=_tool(row))
                    print(f"{column:28s} {schedule_name(stats, dq_first):50s} {row.get('ms', float('nan')):.3f} ms "
                          f"{row.get('tflops', float('nan')):6.1f} TF/s {row.get('status')}", flush=True)
                if case.variant in ("dense", "gqa"):
                    row = measure(case, "sdpa-cudnn", "bwd", device, torch.bfloat16)
                    writer.write("sdpa-cudnn", column, "ms", row.get("ms", float("nan")), tool=_tool(row))
                    print(f"{column:28s} {'sdpa-cudnn':50s} {row.get('ms', float('nan')):.3f} ms", flush=True)
    set_schedule(*production)


if __name__ == "__main__":
    main()
