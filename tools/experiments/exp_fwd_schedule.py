"""Two schedule options of the Gluon forward against the committed kernel, on the H200: the two
consumer warpgroups taking turns to issue their matmuls (FA3's warp-scheduler barrier), and row
sums kept per lane until the end of the tile (FA4's sm90 forward).

Each consumer issues S_j = Q K_j^T and P~_{j-1} V_{j-1}, then runs the softmax of S_j under P~ V.
Nothing orders the two consumers in the committed kernel: both may run their softmax at once
while the tensor cores idle. With `flash_attn_hopper.FWD_PINGPONG` a consumer waits for its turn
(an mbarrier the other arrives on once it has issued its own matmuls) before issuing, so the two
alternate: one's softmax under the other's matmuls. FA3 and FA4's sm90 forward do this at head
dim <= 128; the longer a call's softmax (ALiBi, softcap), the more it should matter. Line 9's
row sum of P~ reduces each row across the four lanes that hold it (two shuffles and adds per row
and block); with `FWD_DEFERRED_ROW_SUM` each lane keeps its partial sum and the lanes are summed
once after the last block (non-matmul work FA2's first technique would also cut).

    python tools/experiments/exp_fwd_schedule.py --out DIR      # DIR/fwd_schedule.csv

First each option against the float64 reference on each case's small form (batch 2 x 1k, bf16):
within 2x the same-dtype PyTorch error; then per case `harness.features.measure`'s `do_bench` of
the forward with each schedule, rounds interleaved. Rows in the decisions format, written as they
are measured; a schedule that fails its check is a row 'wrong' and is not timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_fwd_schedule.py, bf16, head dim 128, do_bench of the forward"
# row -> (FWD_PINGPONG, FWD_DEFERRED_ROW_SUM)
SCHEDULES = {"as committed": (False, False), "turns": (True, False), "row sums per lane": (False, True),
             "turns, row sums per lane": (True, True)}


def cases():
    from harness.features import SOFTCAP, WINDOW, Case

    return {"dense causal 2x8k 16h": Case("score", "dense", 2, 8192, 16, 16),
            "dense full 2x8k 16h": Case("score", "dense", 2, 8192, 16, 16, causal=False),
            "dense causal 8x2k 16h": Case("score", "dense", 8, 2048, 16, 16),
            "gqa causal 1x8k 32/8h": Case("gqa", "gqa", 1, 8192, 32, 8),
            "alibi causal 2x8k 16h": Case("score", "alibi", 2, 8192, 16, 16, alibi=True),
            "softcap causal 2x8k 16h": Case("score", "softcap", 2, 8192, 16, 16, softcap=SOFTCAP),
            "window causal 1x16k 16h": Case("window", "window", 1, 16384, 16, 16, window=WINDOW)}


def set_schedule(schedule: tuple[bool, bool]) -> None:
    from kernels import flash_attn_hopper, forward

    flash_attn_hopper.FWD_PINGPONG, flash_attn_hopper.FWD_DEFERRED_ROW_SUM = schedule
    forward._PLANS.clear()


def check(schedule, device) -> tuple[bool, str]:
    import torch

    import kernels
    from baselines.reference import attention_reference, attention_same_dtype

    ok, notes = True, []
    set_schedule(schedule)
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
    set_schedule((False, False))
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
    production = flash_attn_hopper.FWD_PINGPONG, flash_attn_hopper.FWD_DEFERRED_ROW_SUM
    args.out.mkdir(parents=True, exist_ok=True)
    with DecisionWriter(args.out / "fwd_schedule.csv", TOOL) as writer:
        schedules = {}
        for name, schedule in SCHEDULES.items():
            ok, notes = check(schedule, device)
            writer.write(name, "check against float64", "ok" if ok else "wrong", float(ok),
                         tool=f"{TOOL}; {notes}"[:600])
            print(f"{name:26s} {'ok' if ok else 'WRONG'}: {notes}", flush=True)
            if ok:
                schedules[name] = schedule
        for _ in range(args.repeats):
            for column, case in cases().items():
                for name, schedule in schedules.items():
                    set_schedule(schedule)
                    row = measure(case, "ours", "fwd", device, torch.bfloat16)
                    writer.write(name, column, "ms", row.get("ms", float("nan")))
                    print(f"{column:26s} {name:26s} {row.get('ms', float('nan')):.3f} ms {row.get('status')}",
                          flush=True)
    set_schedule(production)


if __name__ == "__main__":
    main()
