"""The backward timed kernel by kernel: which of the dK/dV and dQ kernels a config speeds up.

Times SDPA flash and cuDNN's backward, the production backward (deterministic: the dQ kernel),
and each BwdConfig given (all three kernels, then the dK/dV kernel alone, then the dQ kernel
alone; a config that fuses dQ into the dK/dV kernel, field 11 `fused_dq_min_rows` > 0, only as
a whole, through flash_attn_backward, whose time then includes zeroing the float32 dQ
accumulator and casting it). Each config's dq/dk/dv are checked against the deterministic
production backward's first. Rows go to OUT/exp_bwd.csv (`--out`). It re-checks the
head-dim-256 backward's query-major layout and descriptor loads (fields 9 and 10) and the
fused-dQ variant (docs/performance.md).

    python tools/experiments/exp_bwd.py --hdims 256 --seqlens 4096 --configs 128,64,64,32,8,1,4,3,1
"""
from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from tune_fa2 import SDPA_PEERS, CsvRows, bench, sdpa_ms  # the same peers and timing as tune_fa2.py

from baselines.flops import attention_flops, tflops_per_second
from kernels import BwdConfig
from kernels.backward import (
    _bwd_preprocess_kernel,
    _flash_bwd_dkdv_kernel,
    _flash_bwd_dq_kernel,
    flash_attn_backward,
)
from kernels.common import LOG2E, ensure_descriptor_allocator, strides
from kernels.configs import padded_headdim
from kernels.dispatch import bwd_fuses_dq, bwd_uses_tma
from kernels.forward import flash_attn_forward


def backward(cfg, do, q, k, v, out, lse, scale, causal, parts=("pre", "dkdv", "dq"), bufs=None):
    """flash_attn_backward's three launches, each only if named in `parts`, into `bufs`."""
    batch, seqlen_q, heads, headdim = q.shape
    seqlen_k = k.shape[1]
    dq, dk, dv, delta = bufs
    if "pre" in parts:
        _bwd_preprocess_kernel[(triton.cdiv(seqlen_q, 64), batch * heads)](
            out, do, delta, delta, *strides(out), *strides(do), heads, seqlen_q,
            HEAD_DIM=headdim, BLOCK_D=padded_headdim(headdim), BLOCK_M=64)
    tma = bwd_uses_tma(cfg, q, k, v, do)
    if tma:
        ensure_descriptor_allocator()
    common = {"HEAD_DIM": headdim, "BLOCK_D": padded_headdim(headdim), "CAUSAL": causal, "TMA": tma}
    if "dkdv" in parts:
        m1, n1 = cfg.block_m1, cfg.block_n1
        _flash_bwd_dkdv_kernel[(triton.cdiv(seqlen_k, n1), batch * heads)](
            q, k, v, do, lse, delta, dk, dv, dq,
            *strides(q), *strides(k), *strides(v), *strides(do), *strides(dk), *strides(dv),
            *strides(dq), heads, seqlen_q, seqlen_k, scale, scale * LOG2E.value,
            BLOCK_M=m1, BLOCK_N=n1, EVEN_M=seqlen_q % m1 == 0, EVEN_N=seqlen_k % n1 == 0,
            QUERY_MAJOR=cfg.query_major, FUSED_DQ=0, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common)
    if "dq" in parts:
        m2, n2 = cfg.block_m2, cfg.block_n2
        _flash_bwd_dq_kernel[(triton.cdiv(seqlen_q, m2), batch * heads)](
            q, k, v, do, lse, delta, dq,
            *strides(q), *strides(k), *strides(v), *strides(do), *strides(dq),
            heads, seqlen_q, seqlen_k, scale, scale * LOG2E.value,
            BLOCK_M=m2, BLOCK_N=n2, EVEN_M=seqlen_q % m2 == 0,
            num_warps=cfg.dq_warps, num_stages=cfg.dq_stages, **common)
    return dq, dk, dv


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hdims", type=int, nargs="+", default=[256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096])
    ap.add_argument("--configs", nargs="+", required=True,
                    help="BwdConfig fields: M1,N1,M2,N2,WARPS,STAGES[,DQ_WARPS,DQ_STAGES,QUERY_MAJOR,TMA,FUSED_DQ_MIN_ROWS]")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")),
                    help="folder for the rows (default: $OUT, else the current folder)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    record = CsvRows(args.out / "exp_bwd.csv", lambda row: (
        f"s{row['seqlen']:<5d} d{row['hdim']:<3d} c={row['causal']!s:5s} {row['config']:<44s} "
        f"{row.get('part', 'all'):5s} {row.get('ms', float('nan')):8.3f} ms "
        f"{row.get('tflops', float('nan')):6.1f} TF/s {row.get('status', '')}"))

    for seqlen in args.seqlens:
        for hdim in args.hdims:
            batch, heads = 16384 // seqlen, 2048 // hdim
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            scale = hdim ** -0.5
            for causal in (False, True):
                flops = attention_flops(batch, heads, seqlen, seqlen, hdim, causal, "bwd")
                base = {"seqlen": seqlen, "hdim": hdim, "causal": causal}
                for name, backend in SDPA_PEERS:
                    try:
                        ms = sdpa_ms(backend, q, k, v, do, causal, "bwd")
                        record(**base, config=name, ms=ms, tflops=tflops_per_second(flops, ms), status="ok")
                    except Exception as exc:  # noqa: BLE001 -- a peer that cannot run this shape is a row
                        record(**base, config=name, status=f"error: {exc}"[:200])
                out, lse = flash_attn_forward(q, k, v, scale, causal)
                ref = flash_attn_backward(do, q, k, v, out, lse, scale, causal, deterministic=True)
                ms = bench(partial(flash_attn_backward, do, q, k, v, out, lse, scale, causal, deterministic=True))
                record(**base, config="production", ms=ms, tflops=tflops_per_second(flops, ms), status="ok")
                for text in args.configs:
                    cfg = BwdConfig(*map(int, text.split(",")))
                    bufs = (torch.full_like(q, float("nan")), torch.full_like(k, float("nan")),
                            torch.full_like(v, float("nan")), torch.empty_like(lse))
                    fused = bwd_fuses_dq(cfg, seqlen)
                    try:
                        got = (flash_attn_backward(do, q, k, v, out, lse, scale, causal, cfg) if fused
                               else backward(cfg, do, q, k, v, out, lse, scale, causal, bufs=bufs))
                        err = max(((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(got, ref))
                        if not err < 1e-2:
                            record(**base, config=text, status=f"wrong {err:.2e}")
                            continue
                        if fused:
                            ms = bench(partial(flash_attn_backward, do, q, k, v, out, lse, scale, causal, cfg))
                            record(**base, config=text, part="all", ms=ms, tflops=tflops_per_second(flops, ms),
                                   status="ok", rel_err=err)
                            continue
                        for parts in (("pre", "dkdv", "dq"), ("dkdv",), ("dq",)):
                            ms = bench(partial(backward, cfg, do, q, k, v, out, lse, scale, causal, parts, bufs))
                            # TFLOPs/s only for the whole backward: the paper's count has no per-kernel split
                            record(**base, config=text, part=parts[0] if len(parts) == 1 else "all", ms=ms,
                                   tflops=tflops_per_second(flops, ms) if len(parts) > 1 else float("nan"),
                                   status="ok", rel_err=err)
                    except Exception as exc:  # noqa: BLE001
                        record(**base, config=text, status=f"error: {exc}"[:200])
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
