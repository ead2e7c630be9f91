"""The order the Gluon kernels start causal programs in (kernels/flash_attn_hopper.py,
LAUNCH_GROUP_ROWS and launch_group_shift), each setting against the others in one process, on the H200.

A causal program's length depends on its block: in the forward the last query block visits every
key block, in the backward the first key block sees every query step. In the grid's own order
(x fastest, then heads) a head's long programs start only after every earlier head's programs have
started, and the last heads' long programs run alone at the end. Renumbered so that groups of
heads run x-major, every head of a group starts its longest program first. Settings:

- 'grid order' (groups of 1 head: the kernels as they were);
- groups of at most 4, 16 or 1024 heads (1024: the whole grid x-major, whatever the L2 holds);
- 'the rule' (launch_group_shift: as many heads as share L2_SHARE of the L2 cache).

    python tools/experiments/exp_launch_order.py --out DIR      # DIR/launch_order.csv

The prediction these rows test, from the orders alone: tools/experiments/sim_launch_order.py.

Per setting: the forward and the backward through kernels.flash_attn_func (the plans rebuilt for
it) first checked against the float64 reference, causal, at batch 2 x 1k x 8 q heads over 4 kv
heads (out, dQ, dK, dV within 2x the Triton kernels' error; deterministic backward as yardstick),
then timed by harness.features.measure (`do_bench`, bf16, head dim 128) on causal dense and GQA
cases and the features suite's packed variable lengths, SDPA cuDNN beside the dense and GQA ones.
Rows in the decisions format, written as they are measured; a setting that fails its check is a
row 'wrong' and is not timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_launch_order.py, bf16, head dim 128, causal, do_bench"
SETTINGS = {"grid order": 1, "groups of 4 heads": 4, "groups of 16 heads": 16, "whole grid": 1024, "the rule": None}


def set_order(group_rows: int | None) -> None:
    from kernels import backward, forward
    from kernels import flash_attn_hopper as hopper

    hopper.LAUNCH_GROUP_ROWS = group_rows
    forward._PLANS.clear()  # plans hold the group they were made with
    backward._PLANS.clear()


def check(device) -> tuple[bool, str]:
    """The setting's output and gradients against float64 (flash-attn's criterion, the Triton
    kernels as the same-dtype yardstick)."""
    import torch

    import kernels
    from baselines.reference import attention_reference
    from harness.accuracy import _relative_error as err  # ||got - want|| / ||want||, in float64
    from kernels.configs import HOPPER_BWD_CONFIGS, HOPPER_FWD_CONFIGS

    triton_fwd = dataclasses.replace(HOPPER_FWD_CONFIGS[(128, True)], hopper_gluon_min_keys=1 << 30)
    triton_bwd = dataclasses.replace(HOPPER_BWD_CONFIGS[128], hopper_gluon_min_keys=1 << 30)
    gen = torch.Generator(device=device).manual_seed(3)
    q = torch.randn(2, 1024, 8, 128, device=device, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, 1024, 4, 128, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    do = torch.randn_like(q)
    results = {}
    for name, fwd_cfg, bwd_cfg in (("gluon", None, None), ("triton", triton_fwd, triton_bwd)):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        out = kernels.flash_attn_func(*x, causal=True, fwd_config=fwd_cfg, bwd_config=bwd_cfg,
                                      deterministic=name == "triton")
        out.backward(do)
        results[name] = [out.detach(), *(t.grad for t in x)]
    x64 = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_reference(x64[0], x64[1].repeat_interleave(2, 2), x64[2].repeat_interleave(2, 2),
                                 128 ** -0.5, True)
    ref.backward(do.double())
    wants = [ref.detach(), *(t.grad for t in x64)]
    ok, notes = True, []
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        got, yardstick = err(results["gluon"][i], wants[i]), err(results["triton"][i], wants[i])
        good = bool(torch.isfinite(results["gluon"][i]).all()) and got <= 2 * yardstick + 1e-4
        ok &= good
        notes.append(f"{name} {got:.2e} (triton {yardstick:.2e})")
    return ok, "; ".join(notes)


def _tool(row: dict) -> str:
    if row.get("status") == "ok":
        return TOOL
    return f"{TOOL}; {row.get('status')}: {' '.join(str(row.get('reason', '')).split())}"[:400]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the settings (interleaved)")
    args = parser.parse_args()
    import torch

    from harness.features import Case, measure
    from harness.features import cases as feature_cases
    from kernels import flash_attn_hopper as hopper
    from reports.decisions import DecisionWriter

    device = torch.device("cuda")
    cases = [Case("score", "dense", 2, 8192, 16, 16), Case("score", "dense", 8, 2048, 16, 16),
             Case("score", "dense", 1, 16384, 16, 16), Case("gqa", "gqa", 8, 2048, 32, 8),
             Case("gqa", "gqa", 4, 4096, 32, 8), Case("gqa", "gqa", 2, 8192, 32, 8), Case("gqa", "gqa", 1, 16384, 32, 8),
             next(c for c in feature_cases(quick=False) if c.variant == "varlen")]
    production = hopper.LAUNCH_GROUP_ROWS
    args.out.mkdir(parents=True, exist_ok=True)
    with DecisionWriter(args.out / "launch_order.csv", TOOL) as writer:
        good = {}
        for name, group_rows in SETTINGS.items():
            set_order(group_rows)
            ok, notes = check(device)
            writer.write(name, "check against float64", "ok" if ok else "wrong", float(ok),
                         tool=TOOL if ok else f"{TOOL}; wrong: {notes}"[:400])
            print(f"{name:20s} {'ok' if ok else 'WRONG'}  {notes}", flush=True)
            if ok:
                good[name] = group_rows
        for _ in range(args.repeats):
            for case in cases:
                column = f"{case.variant} {case.batch}x{case.seqlen // 1024}k {case.heads}/{case.kv_heads}h"
                for mode in ("fwd", "bwd"):
                    for name, group_rows in good.items():
                        set_order(group_rows)
                        row = measure(case, "ours", mode, device, torch.bfloat16)
                        writer.write(name, f"{mode} {column}", "ms", row.get("ms", float("nan")), tool=_tool(row))
                        print(f"{mode} {column:26s} {name:20s} {row.get('ms', float('nan')):.3f} ms "
                              f"{row.get('tflops', float('nan')):6.1f} TF/s {row.get('status')}", flush=True)
                    if case.variant in ("dense", "gqa"):
                        row = measure(case, "sdpa-cudnn", mode, device, torch.bfloat16)
                        writer.write("sdpa-cudnn", f"{mode} {column}", "ms", row.get("ms", float("nan")),
                                     tool=_tool(row))
                        print(f"{mode} {column:26s} {'sdpa-cudnn':20s} {row.get('ms', float('nan')):.3f} ms", flush=True)
    set_order(production)


if __name__ == "__main__":
    main()
