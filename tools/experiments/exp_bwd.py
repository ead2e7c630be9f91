"""EXPERIMENT (session 3): head-dim-256 (and 128) backward variants, timed kernel by kernel.

Times SDPA flash and cuDNN's backward, the production backward, and variants that launch the
dK/dV kernel (key-major as in production, or query-major: tools/experiments/fa_qmajor.py) and
the dQ kernel with their own warps and stages. Each variant's dq/dk/dv are checked against the
production backward's first. Rows go to $OUT/exp_bwd.csv.

    python tools/experiments/exp_bwd.py --hdims 256 --seqlens 4096 16384
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from functools import partial
from pathlib import Path

import pandas as pd
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import triton

from baselines.flops import attention_flops, tflops_per_second
from kernels import flash_attn as fa
from reports.timing import benchmark

spec = importlib.util.spec_from_file_location("fa_qmajor", ROOT / "tools/experiments/fa_qmajor.py")
faq = importlib.util.module_from_spec(spec)
sys.modules["fa_qmajor"] = faq
spec.loader.exec_module(faq)


def bench(fn, grad_to_none=()):
    return benchmark(fn, torch.device("cuda"), grad_to_none=grad_to_none).ms


def backward(mod, dkdv, dq_cfg, do, q, k, v, out, lse, scale, causal, parts=("pre", "dkdv", "dq"), bufs=None):
    batch, seqlen_q, heads, headdim = q.shape
    seqlen_k = k.shape[1]
    dq, dk, dv, delta = bufs
    if "pre" in parts:
        fa._bwd_preprocess_kernel[(triton.cdiv(seqlen_q, 64), batch * heads)](
            out, do, delta, *fa._strides(out), *fa._strides(do), heads, seqlen_q,
            HEAD_DIM=headdim, BLOCK_D=headdim, BLOCK_M=64)
    common = {"HEAD_DIM": headdim, "BLOCK_D": headdim, "CAUSAL": causal}
    if "dkdv" in parts:
        m1, n1, w1, s1 = dkdv
        mod._flash_bwd_dkdv_kernel[(triton.cdiv(seqlen_k, n1), batch * heads)](
            q, k, v, do, lse, delta, dk, dv,
            *fa._strides(q), *fa._strides(k), *fa._strides(v), *fa._strides(do), *fa._strides(dk), *fa._strides(dv),
            heads, seqlen_q, seqlen_k, scale, scale * fa.LOG2E.value,
            BLOCK_M=m1, BLOCK_N=n1, EVEN_M=seqlen_q % m1 == 0, EVEN_N=seqlen_k % n1 == 0,
            num_warps=w1, num_stages=s1, **common)
    if "dq" in parts:
        m2, n2, w2, s2 = dq_cfg
        fa._flash_bwd_dq_kernel[(triton.cdiv(seqlen_q, m2), batch * heads)](
            q, k, v, do, lse, delta, dq,
            *fa._strides(q), *fa._strides(k), *fa._strides(v), *fa._strides(do), *fa._strides(dq),
            heads, seqlen_q, seqlen_k, scale, scale * fa.LOG2E.value,
            BLOCK_M=m2, BLOCK_N=n2, EVEN_M=seqlen_q % m2 == 0, num_warps=w2, num_stages=s2, **common)
    return dq, dk, dv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdims", type=int, nargs="+", default=[256])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096])
    ap.add_argument("--variants", nargs="+", required=True,
                    help="MODULE:M1,N1,W1,S1:M2,N2,W2,S2 with MODULE kmajor or qmajor")
    args = ap.parse_args()
    out_path = Path(os.environ.get("OUT", ".")) / "exp_bwd.csv"
    rows = []

    def record(**row):
        rows.append(row)
        pd.DataFrame(rows).to_csv(out_path, index=False)
        print(f"s{row['seqlen']:<5d} d{row['hdim']:<3d} c={row['causal']!s:5s} {row['config']:<44s} {row.get('part','all'):5s} "
              f"{row.get('ms', float('nan')):8.3f} ms {row.get('tflops', float('nan')):6.1f} TF/s {row.get('status','')}", flush=True)

    for seqlen in args.seqlens:
        for hdim in args.hdims:
            batch, heads = 16384 // seqlen, 2048 // hdim
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            scale = hdim ** -0.5
            for causal in (False, True):
                flops = attention_flops(batch, heads, seqlen, seqlen, hdim, causal, "bwd")
                base = {"seqlen": seqlen, "hdim": hdim, "causal": causal}
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
                    qg, kg, vg = (t.detach().requires_grad_() for t in (qt, kt, vt))
                    with sdpa_kernel(backend):
                        o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
                        ms = bench(partial(o.backward, do.transpose(1, 2), retain_graph=True), grad_to_none=(qg, kg, vg))
                    record(**base, config=name, ms=ms, tflops=tflops_per_second(flops, ms), status="ok")
                out, lse = fa.flash_attn_forward(q, k, v, scale, causal)
                ref = fa.flash_attn_backward(do, q, k, v, out, lse, scale, causal)
                ms = bench(partial(fa.flash_attn_backward, do, q, k, v, out, lse, scale, causal))
                record(**base, config="production", ms=ms, tflops=tflops_per_second(flops, ms), status="ok")
                for text in args.variants:
                    modname, a, b = text.split(":")
                    mod = faq if modname == "qmajor" else fa
                    dkdv, dqc = tuple(map(int, a.split(","))), tuple(map(int, b.split(",")))
                    bufs = (torch.full_like(q, float("nan")), torch.full_like(k, float("nan")),
                            torch.full_like(v, float("nan")), torch.empty_like(lse))
                    try:
                        got = backward(mod, dkdv, dqc, do, q, k, v, out, lse, scale, causal, bufs=bufs)
                        err = max(((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(got, ref))
                        if not err < 1e-2:
                            record(**base, config=text, status=f"wrong {err:.2e}")
                            continue
                        for parts in (("pre", "dkdv", "dq"), ("dkdv",), ("dq",)):
                            ms = bench(partial(backward, mod, dkdv, dqc, do, q, k, v, out, lse, scale, causal, parts, bufs))
                            record(**base, config=text, part="+".join(parts) if len(parts) == 1 else "all", ms=ms,
                                   tflops=tflops_per_second(flops, ms), status="ok", rel_err=err)
                    except Exception as exc:  # noqa: BLE001
                        record(**base, config=text, status=f"error: {exc}"[:200])
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
