"""The Gluon forward's two consumer warpgroups taking turns to issue their matmuls (FA3's
warp-scheduler barrier), against leaving their order to the warp schedulers, on the H200.

Each consumer issues S_j = Q K_j^T and P~_{j-1} V_{j-1}, then runs the softmax of S_j under P~ V.
Nothing orders the two consumers in the committed kernel: both may run their softmax at once
while the tensor cores idle. With `flash_attn_hopper.FWD_PINGPONG` a consumer waits for its turn
(an mbarrier the other arrives on once it has issued its own matmuls) before issuing, so the two
alternate: one's softmax under the other's matmuls. FA3 and FA4's sm90 forward do this at head
dim <= 128; the longer a call's softmax (ALiBi, softcap), the more it should matter.

    python tools/experiments/exp_fwd_pingpong.py --out DIR      # DIR/fwd_pingpong.csv

First the forward with turns against the float64 reference on each case's small form (batch 2 x
1k, bf16): within 2x the same-dtype PyTorch error; then per case `harness.features.measure`'s
`do_bench` of the forward without and with turns, rounds interleaved. Rows in the decisions
format, written as they are measured; if a check fails, turns are a row 'wrong' and not timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_fwd_pingpong.py, bf16, head dim 128, do_bench of the forward"
ORDERS = {"no turns (as committed)": False, "turns (FA3's warp-scheduler barrier)": True}


def cases():
    from harness.features import SOFTCAP, WINDOW, Case

    return {"dense causal 2x8k 16h": Case("score", "dense", 2, 8192, 16, 16),
            "dense full 2x8k 16h": Case("score", "dense", 2, 8192, 16, 16, causal=False),
            "dense causal 8x2k 16h": Case("score", "dense", 8, 2048, 16, 16),
            "gqa causal 1x8k 32/8h": Case("gqa", "gqa", 1, 8192, 32, 8),
            "alibi causal 2x8k 16h": Case("score", "alibi", 2, 8192, 16, 16, alibi=True),
            "softcap causal 2x8k 16h": Case("score", "softcap", 2, 8192, 16, 16, softcap=SOFTCAP),
            "window causal 1x16k 16h": Case("window", "window", 1, 16384, 16, 16, window=WINDOW)}


def set_turns(on: bool) -> None:
    from kernels import flash_attn_hopper, forward

    flash_attn_hopper.FWD_PINGPONG = on
    forward._PLANS.clear()


def check(device) -> tuple[bool, str]:
    import torch

    import kernels
    from baselines.reference import attention_reference, attention_same_dtype

    ok, notes = True, []
    set_turns(True)
    for name, case in cases().items():
        gen = torch.Generator(device=device).manual_seed(7)
        q = torch.randn(2, 1024, case.heads, 128, device=device, dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(2, 1024, case.kv_heads, 128, device=device, dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        slopes = torch.rand(case.heads, device=device, generator=gen) * 0.25 if case.alibi else None
        window = (256, 0) if case.window != (-1, -1) else (-1, -1)
        kw = {"causal": case.causal, "window_size": window, "softcap": case.softcap, "alibi_slopes": slopes}
        group = case.heads // case.kv_heads
        k_rep, v_rep = (t.repeat_interleave(group, 2) for t in (k, v))
        out = kernels.flash_attn_func(q, k, v, **kw)
        ref, _ = attention_reference(q, k_rep, v_rep, **kw)
        yardstick = (attention_same_dtype(q, k_rep, v_rep, **kw).double() - ref).abs().max().item()
        err = (out.double() - ref).abs().max().item()
        good = bool(torch.isfinite(out).all()) and err <= 2 * yardstick + 1e-5
        ok &= good
        notes.append(f"{name}: {err:.1e} (PyTorch {yardstick:.1e})")
    set_turns(False)
    return ok, "; ".join(notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the orders (interleaved)")
    args = parser.parse_args()
    import torch

    from harness.features import measure
    from kernels import flash_attn_hopper
    from reports.decisions import DecisionWriter

    device = torch.device("cuda")
    production = flash_attn_hopper.FWD_PINGPONG
    args.out.mkdir(parents=True, exist_ok=True)
    with DecisionWriter(args.out / "fwd_pingpong.csv", TOOL) as writer:
        ok, notes = check(device)
        writer.write("turns (FA3's warp-scheduler barrier)", "check against float64", "ok" if ok else "wrong",
                     float(ok), tool=f"{TOOL}; {notes}"[:600])
        print(f"turns {'ok' if ok else 'WRONG'}: {notes}", flush=True)
        orders = ORDERS if ok else {"no turns (as committed)": False}
        for _ in range(args.repeats):
            for column, case in cases().items():
                for name, on in orders.items():
                    set_turns(on)
                    row = measure(case, "ours", "fwd", device, torch.bfloat16)
                    writer.write(name, column, "ms", row.get("ms", float("nan")))
                    print(f"{column:26s} {name:38s} {row.get('ms', float('nan')):.3f} ms {row.get('status')}",
                          flush=True)
    set_turns(production)


if __name__ == "__main__":
    main()
