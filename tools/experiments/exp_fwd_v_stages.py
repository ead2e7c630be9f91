"""V's ring in the Gluon forward: 3 stages released with K's, or 2 released apart, on the H200.

The forward's loader fills rings of K_j and V_j blocks in shared memory (kernels/flash_attn_hopper.py,
`_fwd_shared_buffers`). With one ring size a key block's K and V share a stage, released once
P~_j V_j is done; with V's ring shorter (`flash_attn_hopper.V_STAGES` = 2) K's stage is released
as soon as S_j = Q K_j^T is done, so K_{j+3} can load while P~_j V_j still runs, and V's 2
stages are released after their matmuls. ALiBi by matmul takes the second form at head dim 128
(its bias tile needs the room); this experiment asks whether every forward should.

    python tools/experiments/exp_fwd_v_stages.py --out DIR      # DIR/fwd_v_stages.csv

First each variant against the float64 reference on each case's small form (batch 2 x 1k, bf16):
within 2x the same-dtype PyTorch error; then per case `harness.features.measure`'s `do_bench` of
the forward with each variant, rounds interleaved. Rows in the decisions format, written as they
are measured; a variant that fails its check is a row 'wrong' and is not timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_fwd_v_stages.py, bf16, do_bench of the forward"
VARIANTS = {"3 V stages, released with K's": None, "2 V stages, released apart": 2}  # row -> V_STAGES


def cases():
    from harness.features import SOFTCAP, WINDOW, Case

    return {"dense causal 2x8k 16h": Case("score", "dense", 2, 8192, 16, 16),
            "dense full 2x8k 16h": Case("score", "dense", 2, 8192, 16, 16, causal=False),
            "dense causal 1x16k 16h": Case("score", "dense", 1, 16384, 16, 16),
            "dense causal 8x2k 16h": Case("score", "dense", 8, 2048, 16, 16),
            "dense full 8x1k 16h": Case("score", "dense", 8, 1024, 16, 16, causal=False),
            "dense causal d64 4x8k 16h": Case("score", "dense", 4, 8192, 16, 16, hdim=64),
            "gqa causal 2x8k 32/8h": Case("gqa", "gqa", 2, 8192, 32, 8),
            "softcap causal 2x8k 16h": Case("score", "softcap", 2, 8192, 16, 16, softcap=SOFTCAP),
            "window causal 1x16k 16h": Case("window", "window", 1, 16384, 16, 16, window=WINDOW)}


def set_variant(v_stages: int | None) -> None:
    from kernels import flash_attn_hopper, forward

    flash_attn_hopper.V_STAGES = v_stages
    forward._PLANS.clear()


def check(v_stages, device) -> tuple[bool, str]:
    import torch

    import kernels
    from baselines.reference import attention_reference, attention_same_dtype
    from harness.accuracy import within_twice_the_error

    ok, notes = True, []
    set_variant(v_stages)
    for name, case in cases().items():
        gen = torch.Generator(device=device).manual_seed(7)
        q = torch.randn(2, 1024, case.heads, case.hdim, device=device, dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(2, 1024, case.kv_heads, case.hdim, device=device, dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        window = (256, 0) if case.window != (-1, -1) else (-1, -1)
        kw = {"causal": case.causal, "window_size": window, "softcap": case.softcap}
        out = kernels.flash_attn_func(q, k, v, **kw)
        ref, _ = attention_reference(q, k, v, **kw)  # both references repeat kv heads for GQA themselves
        good, err, yardstick = within_twice_the_error(out, ref, attention_same_dtype(q, k, v, **kw), 1e-5)
        ok &= good
        notes.append(f"{name}: {err:.1e} (PyTorch {yardstick:.1e})")
    return ok, "; ".join(notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the variants (interleaved)")
    args = parser.parse_args()
    import torch

    from harness.features import measure
    from kernels import flash_attn_hopper
    from reports.decisions import DecisionWriter

    device = torch.device("cuda")
    production = flash_attn_hopper.V_STAGES
    args.out.mkdir(parents=True, exist_ok=True)
    with DecisionWriter(args.out / "fwd_v_stages.csv", TOOL) as writer:
        passed = writer.write_checks({name: check(v_stages, device) for name, v_stages in VARIANTS.items()})
        writer.time_interleaved({name: VARIANTS[name] for name in passed}, cases(), set_variant,
                                lambda case, _: measure(case, "ours", "fwd", device, torch.bfloat16), args.repeats)
    set_variant(production)


if __name__ == "__main__":
    main()
