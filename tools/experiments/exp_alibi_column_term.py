"""ALiBi's key term in the Gluon forward: per element in registers, or by the tensor cores, on the H200.

Under a causal mask the forward splits ALiBi's bias -slope * (i - j) into a key term slope * j
and a query term that cancels in the softmax (kernels/flash_attn_hopper.py, `_scores_log2`). In
registers the key term costs an add per score plus its share of the per-key offsets. The tensor
cores can add it instead: each S matmul chains on a wgmma of depth 16 (A: a = slope * log2(e) /
scale in three bf16/fp16 terms, B: the 128 key offsets), which costs the softmax nothing per
element. Its 4 KiB B tile does not fit beside 3-stage K and V rings at head dim 128; with K's and
V's stages released separately (K's after its S matmul, V's after its P~ V matmul) V's ring can
hold 2 blocks (`flash_attn_hopper.V_STAGES`). `flash_attn_hopper.ALIBI_COLUMN_TERM` chooses
'registers' or 'matmul-wide'; the experiment sets both.

    python tools/experiments/exp_alibi_column_term.py --out DIR      # DIR/alibi_matmul_wide.csv

First each variant's output and logsumexp against the float64 reference (bf16 and fp16, slopes
in [0, 0.25], [0.5, 1] and 2^-8, batch 2 x 2k, 8 heads, causal): within 2x the same-dtype
PyTorch error (the output) and 1e-3 (the logsumexp, natural log); then per shape
`harness.features.measure`'s `do_bench` of the dense causal forward (3 and 2 V stages) and of
each variant, rounds interleaved. Rows in the decisions format, written as they are measured; a
variant that fails the check is a row 'wrong' and is not timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_alibi_column_term.py, bf16, head dim 128, causal, do_bench of the forward"
SHAPES = ((2, 8192, 16), (1, 16384, 16), (8, 2048, 16))
SLOPES = {"slopes 0-0.25": (0.0, 0.25), "slopes 0.5-1": (0.5, 1.0), "slopes 2^-8": (2.0 ** -8, 2.0 ** -8)}
LSE_TOLERANCE = 1e-3


# row -> (ALIBI_COLUMN_TERM, V_STAGES)
VARIANTS = {"ALiBi, registers": ("registers", None), "ALiBi, registers, 2 V stages": ("registers", 2),
            "ALiBi, matmul, 2 V stages": ("matmul-wide", 2)}
DENSE = {"no ALiBi (the dense forward)": None, "no ALiBi, 2 V stages": 2}


def set_variant(term: str, v_stages: int | None) -> None:
    from kernels import flash_attn_hopper, forward

    flash_attn_hopper.ALIBI_COLUMN_TERM = term
    flash_attn_hopper.V_STAGES = v_stages
    forward._PLANS.clear()


def check(variant: tuple[str, int | None], device) -> tuple[bool, str]:
    import torch

    import kernels
    from baselines.reference import attention_reference, attention_same_dtype
    from harness.accuracy import within_twice_the_error

    ok, notes = True, []
    set_variant(*variant)
    for dtype in (torch.bfloat16, torch.float16):
        for label, (lo, hi) in SLOPES.items():
            gen = torch.Generator(device=device).manual_seed(11)
            q, k, v = (torch.randn(2, 2048, 8, 128, device=device, dtype=dtype, generator=gen) for _ in range(3))
            slopes = torch.rand(8, device=device, generator=gen) * (hi - lo) + lo
            out, lse, _ = kernels.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
            ref, ref_lse = attention_reference(q, k, v, causal=True, alibi_slopes=slopes)
            good, err, yardstick = within_twice_the_error(
                out, ref, attention_same_dtype(q, k, v, causal=True, alibi_slopes=slopes), 1e-5)
            lse_err = (lse.double() - ref_lse).abs().max().item()
            good = good and lse_err <= LSE_TOLERANCE
            ok &= good
            notes.append(f"{str(dtype)[6:]} {label}: out {err:.1e} (PyTorch {yardstick:.1e}) lse {lse_err:.1e}")
    return ok, "; ".join(notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the variants (interleaved)")
    args = parser.parse_args()
    import torch

    from harness.features import Case, measure
    from kernels import flash_attn_hopper
    from reports.decisions import DecisionWriter

    device = torch.device("cuda")
    production = flash_attn_hopper.ALIBI_COLUMN_TERM, flash_attn_hopper.V_STAGES
    args.out.mkdir(parents=True, exist_ok=True)
    with DecisionWriter(args.out / "alibi_matmul_wide.csv", TOOL) as writer:
        passed = writer.write_checks({name: check(variant, device) for name, variant in VARIANTS.items()}, width=30)
        # row -> (ALIBI_COLUMN_TERM, V_STAGES, ALiBi on): the dense forwards first, then each checked way
        timed = {**{name: ("registers", v_stages, False) for name, v_stages in DENSE.items()},
                 **{name: (*VARIANTS[name], True) for name in passed}}
        shapes = {f"{batch}x{seqlen // 1024}k {heads}h": (batch, seqlen, heads) for batch, seqlen, heads in SHAPES}

        def time_one(shape, value):
            batch, seqlen, heads = shape
            case = Case("score", "alibi" if value[2] else "dense", batch, seqlen, heads, heads, alibi=value[2])
            return measure(case, "ours", "fwd", device, torch.bfloat16)

        writer.time_interleaved(timed, shapes, lambda value: set_variant(value[0], value[1]), time_one, args.repeats,
                                width=30)
    set_variant(*production)


if __name__ == "__main__":
    main()
