"""Host cost of the launch path, piece by piece, with the GPU kept busy (a GPU sleep queued
first) so that no launch waits on the device: Triton's JIT launch against a launch of the
already compiled kernel (`CompiledKernel[grid](*args)`, which skips argument binding and the
cache-key computation) for two backward kernels, the allocations and checks around them, and
the whole `flash_attn_backward` and `flash_attn_forward`.

    python tools/experiments/exp_launch_cost.py --hdim 256 --seqlen 512
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from exp_host_overhead import gpu_and_host_ms  # the same GPU-sleep clock

from kernels import flash_attn as fa

REPS = 200


def host_us(fn) -> float:
    """Host microseconds per call of fn, REPS calls issued behind a GPU sleep."""
    return gpu_and_host_ms(fn, calls=REPS)[1] * 1e3


def all_args(kernel, args, constexprs):
    """Positional and keyword arguments in the kernel's signature order (what a compiled
    kernel's runner takes)."""
    named = dict(zip(kernel.arg_names, args)) | constexprs
    return [named[name] for name in kernel.arg_names]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdim", type=int, default=256)
    ap.add_argument("--seqlen", type=int, default=512)
    args = ap.parse_args()
    hdim, seqlen = args.hdim, args.seqlen
    batch, heads = 16384 // seqlen, 2048 // hdim
    q, k, v, do = (torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = hdim ** -0.5
    out, lse = fa.flash_attn_forward(q, k, v, scale, True)
    cfg = fa.default_bwd_config(hdim, q.device)
    delta = torch.empty_like(lse)
    dq = torch.empty_like(q)

    pre_args = (out, do, delta, *fa._strides(out), *fa._strides(do), heads, seqlen)
    pre_const = {"HEAD_DIM": hdim, "BLOCK_D": fa.padded_headdim(hdim), "BLOCK_M": 64}
    pre_grid = (triton.cdiv(seqlen, 64), batch * heads, 1)
    tma = fa.bwd_uses_tma(cfg, q, k, v, do)
    dq_args = (q, k, v, do, lse, delta, dq, *fa._strides(q), *fa._strides(k), *fa._strides(v),
               *fa._strides(do), *fa._strides(dq), heads, seqlen, seqlen, scale, scale * fa.LOG2E.value)
    dq_const = {"HEAD_DIM": hdim, "BLOCK_D": fa.padded_headdim(hdim), "CAUSAL": True, "TMA": tma,
                "BLOCK_M": cfg.block_m2, "BLOCK_N": cfg.block_n2, "EVEN_M": seqlen % cfg.block_m2 == 0,
                "num_warps": cfg.dq_warps, "num_stages": cfg.dq_stages}
    dq_grid = (triton.cdiv(seqlen, cfg.block_m2), batch * heads, 1)
    if tma:
        fa._ensure_descriptor_allocator()

    pre_compiled = fa._bwd_preprocess_kernel[pre_grid](*pre_args, **pre_const)
    dq_compiled = fa._flash_bwd_dq_kernel[dq_grid](*dq_args, **dq_const)
    pre_all = all_args(fa._bwd_preprocess_kernel, pre_args, pre_const)
    dq_all = all_args(fa._flash_bwd_dq_kernel, dq_args, {k: v for k, v in dq_const.items() if not k.startswith("num_")})
    rows = {
        "preprocess, JIT launch": lambda: fa._bwd_preprocess_kernel[pre_grid](*pre_args, **pre_const),
        "preprocess, compiled runner": lambda: pre_compiled[pre_grid](*pre_all),
        "dq kernel, JIT launch": lambda: fa._flash_bwd_dq_kernel[dq_grid](*dq_args, **dq_const),
        "dq kernel, compiled runner": lambda: dq_compiled[dq_grid](*dq_all),
        "4 x torch.empty_like": lambda: [torch.empty_like(t) for t in (q, k, v, lse)],
        "strides of 6 tensors": lambda: [fa._strides(t) for t in (q, k, v, do, dq, out)],
        "tma_compatible(q, k, v, do)": lambda: fa.tma_compatible(q, k, v, do),
        "default_bwd_config": lambda: fa.default_bwd_config(hdim, q.device),
        "flash_attn_backward": lambda: fa.flash_attn_backward(do, q, k, v, out, lse, scale, True),
        "flash_attn_forward, causal": lambda: fa.flash_attn_forward(q, k, v, scale, True),
        "flash_attn_forward, non-causal": lambda: fa.flash_attn_forward(q, k, v, scale, False),
    }
    paths = [fa.fwd_memory_path(fa.default_fwd_config(hdim, c, q.device), q, k, v, out, c) for c in (True, False)]
    print(f"head dim {hdim}, seqlen {seqlen}, bf16; backward causal, TMA: {tma}; forward paths "
          f"(causal, non-causal): {paths}")
    for name, fn in rows.items():
        print(f"{name:32s} {host_us(fn):8.1f} us host per call")


if __name__ == "__main__":
    main()
