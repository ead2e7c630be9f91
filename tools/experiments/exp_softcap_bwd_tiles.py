"""Tiles of a softcap's backward on the Triton feature kernels, on the H200.

A softcap's backward runs the Triton dK/dV and dQ feature kernels (kernels/backward_features.py)
with the dense table's tiles (kernels/configs.py, HOPPER_BWD_CONFIGS), which measured faster than
the features' table; the features bar asks for at most 1.5x the dense backward. This times the
table entry against neighbouring tiles, warps and stages of both kernels.

    python tools/experiments/exp_softcap_bwd_tiles.py --out DIR      # DIR/softcap_bwd_tiles.csv

First each config's gradients against the float64 reference (causal and not, GQA 8/2 and MHA,
batch 2 x 1k, softcap 2, bf16; within 2x the table entry's error); then per case of the features
suite's softcap (causal, head dim 128, softcap 30) `harness.features.measure`'s `do_bench` of the
backward with each config, rounds interleaved, and of the dense backward. A config that fails
to compile or to match is a row with its reason and is not timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repository's packages, run from anywhere

TOOL = "tools/experiments/exp_softcap_bwd_tiles.py, bf16, head dim 128, do_bench of the backward"
TABLE = "the table's (64, 128 / 128, 32), 8 warps, 3 stages"


def configs() -> dict:
    from kernels.configs import BwdConfig

    return {TABLE: BwdConfig(64, 128, 128, 32, 8, 3),
            "2 stages": BwdConfig(64, 128, 128, 32, 8, 2),
            "dQ 64-key steps": BwdConfig(64, 128, 128, 64, 8, 3),
            "dQ at 4 warps": BwdConfig(64, 128, 128, 32, 8, 3, dq_num_warps=4),
            "dK/dV 32-row steps, 4 warps": BwdConfig(32, 128, 128, 32, 4, 3),
            "dQ 2 stages": BwdConfig(64, 128, 128, 32, 8, 3, dq_num_stages=2)}


def set_config(cfg) -> None:
    from kernels import backward, backward_features, configs

    backward_features.default_bwd_config = (lambda *a, **k: cfg) if cfg is not None else configs.default_bwd_config
    backward._PLANS.clear()


def gradients(cfg, q, k, v, do, causal):
    import kernels

    set_config(cfg)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    kernels.flash_attn_func(*x, causal=causal, softcap=2.0).backward(do)
    return [t.grad for t in x]


def check(candidates: dict, device) -> dict:
    """name -> (ok, notes) for each config, against float64 with the table entry's error as yardstick."""
    import torch

    from baselines.reference import attention_reference
    from harness.accuracy import _relative_error as relative_error
    from harness.accuracy import within_twice_the_error

    result = {name: [True, []] for name in candidates}
    for causal in (False, True):
        for kv_heads in (2, 8):
            gen = torch.Generator(device=device).manual_seed(5 + causal + kv_heads)
            q = torch.randn(2, 1024, 8, 128, device=device, dtype=torch.bfloat16, generator=gen)
            k, v = (torch.randn(2, 1024, kv_heads, 128, device=device, dtype=torch.bfloat16, generator=gen)
                    for _ in range(2))
            do = torch.randn_like(q)
            x64 = [t.double().requires_grad_() for t in (q, k, v)]
            ref, _ = attention_reference(*x64, 128 ** -0.5, causal, softcap=2.0)  # it repeats kv heads itself
            ref.backward(do.double())
            base = gradients(candidates[TABLE], q, k, v, do, causal)
            for name, cfg in candidates.items():
                if not result[name][0]:
                    continue
                try:
                    grads = gradients(cfg, q, k, v, do, causal)
                except Exception as exc:  # noqa: BLE001 -- a config that does not compile is a row
                    result[name] = [False, [f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"]]
                    continue
                for i, grad in enumerate(("dq", "dk", "dv")):
                    good, got, yardstick = within_twice_the_error(grads[i], x64[i].grad, base[i], 1e-4,
                                                                  error=relative_error)
                    result[name][0] &= good
                    if not good:
                        result[name][1].append(f"{grad} causal={causal} kv={kv_heads} {got:.2e} (table {yardstick:.2e})")
    set_config(None)
    return {name: (ok, "; ".join(notes)) for name, (ok, notes) in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the configs (interleaved)")
    args = parser.parse_args()
    import torch

    from harness.features import SOFTCAP, Case, measure
    from reports.decisions import DecisionWriter

    device = torch.device("cuda")
    candidates = configs()
    softcap_cases = [Case("score", "softcap", 2, 8192, 16, 16, softcap=SOFTCAP),
                     Case("score", "softcap", 2, 8192, 32, 8, softcap=SOFTCAP)]
    args.out.mkdir(parents=True, exist_ok=True)
    with DecisionWriter(args.out / "softcap_bwd_tiles.csv", TOOL) as writer:
        passed = writer.write_checks(check(candidates, device), width=36)
        variants = {**{name: candidates[name] for name in passed}, "no softcap (the dense backward)": None}
        cases = {f"{c.batch}x{c.seqlen // 1024}k {c.heads}/{c.kv_heads}h": c for c in softcap_cases}

        def time_one(case, cfg):  # the dense backward: the case without its softcap, at the default tiles
            if cfg is None:
                case = Case("score", "dense", case.batch, case.seqlen, case.heads, case.kv_heads)
            return measure(case, "ours", "bwd", device, torch.bfloat16)

        writer.time_interleaved(variants, cases, set_config, time_one, args.repeats, width=36)
    set_config(None)


if __name__ == "__main__":
    main()
