"""A softcap's backward on the Gluon dK/dV kernel against the Triton feature kernels, and both
against the dense backward (the features bar: a softcap at most 1.5x the dense time), on the H200.

The Gluon kernel needs tanh's derivative 1 - t^2 per element; with causal tiles it reads t back
from P^T (t = (log2 P + L) / (softcap log2 e), kernels/flash_attn_hopper.py) instead of keeping
it in registers, where it spilled. dispatch.GLUON_SOFTCAP_BWD picks the kernel.

    python tools/experiments/exp_softcap_backward.py --out DIR      # DIR/softcap_backward.csv

First the Gluon softcap backward's gradients against the float64 reference (causal and not, GQA
8/2 and MHA, batch 2 x 1k, bf16; within 2x the Triton kernels' error); then, per case of the
features suite's softcap (causal, head dim 128, softcap 30): harness.features.measure's
`do_bench` of the backward with each kernel and of the dense case without a softcap. Rows in the
decisions format, written as they are measured; if the check fails the Gluon kernel is a row
'wrong' and is not timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_softcap_backward.py, bf16, head dim 128, do_bench of the backward"
KERNELS = {"Gluon dK/dV kernel": True, "Triton feature kernels": False}


def set_kernel(gluon: bool) -> None:
    from kernels import backward, dispatch

    dispatch.GLUON_SOFTCAP_BWD = gluon
    backward._PLANS.clear()


def check(device) -> tuple[bool, str]:
    import torch

    import kernels
    from baselines.reference import attention_reference
    from harness.accuracy import _relative_error as err

    ok, notes = True, []
    for causal in (False, True):
        for kv_heads in (2, 8):
            gen = torch.Generator(device=device).manual_seed(5 + causal + kv_heads)
            q = torch.randn(2, 1024, 8, 128, device=device, dtype=torch.bfloat16, generator=gen)
            k, v = (torch.randn(2, 1024, kv_heads, 128, device=device, dtype=torch.bfloat16, generator=gen)
                    for _ in range(2))
            do = torch.randn_like(q)
            grads = {}
            for name, gluon in KERNELS.items():
                set_kernel(gluon)
                x = [t.clone().requires_grad_() for t in (q, k, v)]
                kernels.flash_attn_func(*x, causal=causal, softcap=2.0).backward(do)
                grads[name] = [t.grad for t in x]
            x64 = [t.double().requires_grad_() for t in (q, k, v)]
            group = 8 // kv_heads
            ref, _ = attention_reference(x64[0], x64[1].repeat_interleave(group, 2), x64[2].repeat_interleave(group, 2),
                                         128 ** -0.5, causal, softcap=2.0)
            ref.backward(do.double())
            for i, grad in enumerate(("dq", "dk", "dv")):
                got = err(grads["Gluon dK/dV kernel"][i], x64[i].grad)
                yardstick = err(grads["Triton feature kernels"][i], x64[i].grad)
                good = bool(torch.isfinite(grads["Gluon dK/dV kernel"][i]).all()) and got <= 2 * yardstick + 1e-4
                ok &= good
                notes.append(f"{grad} causal={causal} kv={kv_heads} {got:.2e} (triton {yardstick:.2e})")
    set_kernel(False)
    return ok, "; ".join(notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the kernels (interleaved)")
    args = parser.parse_args()
    import torch

    from harness.features import SOFTCAP, Case, measure
    from kernels import dispatch
    from reports.decisions import DecisionWriter

    device = torch.device("cuda")
    production = dispatch.GLUON_SOFTCAP_BWD
    cases = [Case("score", "softcap", 2, 8192, 16, 16, softcap=SOFTCAP),
             Case("score", "softcap", 2, 8192, 32, 8, softcap=SOFTCAP)]
    args.out.mkdir(parents=True, exist_ok=True)
    with DecisionWriter(args.out / "softcap_backward.csv", TOOL) as writer:
        ok, notes = check(device)
        writer.write("Gluon dK/dV kernel", "check against float64", "ok" if ok else "wrong", float(ok),
                     tool=TOOL if ok else f"{TOOL}; wrong: {notes}"[:400])
        print(f"Gluon softcap backward {'ok' if ok else 'WRONG'}: {notes}", flush=True)
        kernels = KERNELS if ok else {"Triton feature kernels": False}
        for _ in range(args.repeats):
            for case in cases:
                column = f"{case.batch}x{case.seqlen // 1024}k {case.heads}/{case.kv_heads}h"
                for name, gluon in kernels.items():
                    set_kernel(gluon)
                    row = measure(case, "ours", "bwd", device, torch.bfloat16)
                    writer.write(f"softcap, {name}", column, "ms", row.get("ms", float("nan")))
                    print(f"{column:16s} softcap, {name:24s} {row.get('ms', float('nan')):.3f} ms {row.get('status')}",
                          flush=True)
                dense = Case("score", "dense", case.batch, case.seqlen, case.heads, case.kv_heads)
                row = measure(dense, "ours", "bwd", device, torch.bfloat16)
                writer.write("no softcap (the dense backward)", column, "ms", row.get("ms", float("nan")))
                print(f"{column:16s} {'no softcap':34s} {row.get('ms', float('nan')):.3f} ms", flush=True)
    set_kernel(production)


if __name__ == "__main__":
    main()
