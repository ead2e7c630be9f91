"""The Gluon dK/dV kernel (kernels/flash_attn_hopper.py, FA3's warp layout), with and without dQ
fused, against the Triton backward's kernels, on the H200.

    python tools/experiments/exp_bwd_gluon.py --check            # against float64, then against
                                                                  # the Triton backward
    python tools/experiments/exp_bwd_gluon.py --time --dtype bf16 # ms and TFLOPs/s, with peers

`--check` compares the Gluon kernel's dK and dV (and dQ where fused), written into NaN-poisoned
buffers, with the float64 reference's gradients at batch 2 and 1k (every head dim, causal mode and
stage count), then with the Triton backward's (`TRITON_BWD`: the table's config without the Gluon
kernel) at the paper shapes of `--seqlens`. Gluon kernels that deadlock hang the process, so run
`--check` under `timeout` before `--time`.

`--time` times, per (head dim, seqlen, causal), in one process:
- the dK/dV kernels alone: Triton (the table's config) and Gluon (each `--stages`);
- whole backwards:
  - `fa2 backward`: flash_attn_backward as the checkout has it (at head dim 128 from
    1k keys: the Gluon kernel adding dQ);
  - `fa2 backward, gluon dkdv`: the preprocessing, Gluon dK/dV and Triton dQ kernels;
  - `gluon fused dQ`: zeroing a float32 accumulator, the preprocessing, the Gluon kernel with dQ
    fused, the cast;
  - SDPA flash and SDPA cuDNN (TFLOPs/s by the paper's count, `baselines/flops.py`);
- and the fused kernel alone.
The fused variants run at head dim 128 only (the two consumers split its columns of dQ).
Rows go to OUT/exp_bwd_gluon_<dtype>.csv (`--out`) as they are measured.

The fused kernel adds dQ with one TMA reduce-add per consumer and step (FlashAttention-3's
scheme). An earlier form with element-wise float32 atomics, slower than two kernels, is at
`git show fc1794e:kernels/flash_attn_hopper.py` (docs/performance.md, "Tried").
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tools" / "experiments"))

from exp_bwd import backward as triton_backward_parts  # the production backward's launches, one by one
from tune_fa2 import SDPA_PEERS, CsvRows, bench, sdpa_ms

from baselines.flops import attention_flops, tflops_per_second
from baselines.reference import attention_reference
from kernels import flash_attn_hopper as hopper
from kernels.backward import flash_attn_backward
from kernels.configs import HOPPER_BWD_CONFIGS, default_bwd_config
from kernels.forward import flash_attn_forward

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# the Triton backward (dK/dV and dQ kernels) as the reference the Gluon kernel is compared with: the
# table's own config takes the Gluon kernel at head dim 128 from 1k keys
TRITON_BWD = {hdim: dataclasses.replace(HOPPER_BWD_CONFIGS[hdim], hopper_gluon_min_keys=0) for hdim in (64, 128)}


def inputs(batch, seqlen, heads, hdim, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=dtype, generator=gen) for _ in range(4)]


def preprocess(q, k, v, do, out):
    """D = rowsum(dO * O) (FA2 Alg. 2 line 4) by the production preprocess kernel, launched as
    exp_bwd.backward launches it."""
    batch, seqlen, heads, _ = q.shape
    delta = torch.empty(batch, heads, seqlen, device=q.device, dtype=torch.float32)
    cfg = default_bwd_config(q.shape[3], q.device)
    triton_backward_parts(cfg, do, q, k, v, out, None, None, False, ("pre",), (None, None, None, delta))
    return delta


def gluon_dkdv(q, k, v, do, lse, delta, scale, causal, stages, bufs, dq_accum=None):
    dk, dv = bufs
    hopper.flash_attn_backward_dkdv_hopper(q, k, v, do, lse, delta, dk, dv, scale, causal, dq_accum, stages)
    return dk, dv


def gluon_fused_backward(q, k, v, do, out, lse, scale, causal, stages, bufs):
    """The whole backward with dQ fused into the Gluon kernel: zero a float32 dQ accumulator,
    preprocess, the Gluon kernel (dK, dV, and dQ by TMA reduce-adds), cast dQ."""
    dq, dk, dv, _ = bufs
    dq_accum = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    delta = preprocess(q, k, v, do, out)
    hopper.flash_attn_backward_dkdv_hopper(q, k, v, do, lse, delta, dk, dv, scale, causal, dq_accum, stages)
    return dq.copy_(hopper.dq_from_accumulator(dq_accum, torch.float32, hopper.BWD_DQ_ORDER)), dk, dv


def gluon_backward(q, k, v, do, out, lse, scale, causal, stages, bufs):
    """The production backward with the Gluon dK/dV kernel: preprocess, Gluon dK/dV, Triton dQ."""
    dq, dk, dv, delta = bufs
    cfg = default_bwd_config(q.shape[3], q.device)
    triton_backward_parts(cfg, do, q, k, v, out, lse, scale, causal, ("pre",), bufs)
    hopper.flash_attn_backward_dkdv_hopper(q, k, v, do, lse, delta, dk, dv, scale, causal, stages=stages)
    triton_backward_parts(cfg, do, q, k, v, out, lse, scale, causal, ("dq",), bufs)
    return dq, dk, dv


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def check(args, record):
    dtype = DTYPES[args.dtype]
    for hdim in args.hdims:
        for causal in (False, True):
            for stages in args.stages:
                base = {"check": "float64", "hdim": hdim, "causal": causal, "stages": stages, "seqlen": 1024}
                q, k, v, do = inputs(2, 1024, 4, hdim, dtype, seed=hdim + causal)
                scale = hdim ** -0.5
                out, lse = flash_attn_forward(q, k, v, scale, causal)
                delta = preprocess(q, k, v, do, out)
                dk, dv = (torch.full_like(t, float("nan")) for t in (k, v))
                gluon_dkdv(q, k, v, do, lse, delta, scale, causal, stages, (dk, dv))
                torch.cuda.synchronize()
                # float64 gradients, and the production backward's error against them as the yardstick
                q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
                ref_out, _ = attention_reference(q64, k64, v64, scale, causal)
                ref_out.backward(do.double())
                _, prod_dk, prod_dv = flash_attn_backward(do, q, k, v, out, lse, scale, causal, TRITON_BWD[hdim],
                                                             deterministic=True)
                errs = {"dk": rel_err(dk, k64.grad), "dv": rel_err(dv, v64.grad),
                        "prod_dk": rel_err(prod_dk, k64.grad), "prod_dv": rel_err(prod_dv, v64.grad)}
                ok = (not torch.isnan(dk).any() and not torch.isnan(dv).any()
                      and errs["dk"] <= 2 * errs["prod_dk"] + 1e-4 and errs["dv"] <= 2 * errs["prod_dv"] + 1e-4)
                record(**base, **errs, status="ok" if ok else "WRONG")
                if hdim != 128:
                    continue
                dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
                gluon_fused_backward(q, k, v, do, out, lse, scale, causal, stages, (dq, dk, dv, None))
                prod_dq = flash_attn_backward(do, q, k, v, out, lse, scale, causal, TRITON_BWD[hdim],
                                                 deterministic=True)[0]
                errs = {"dq": rel_err(dq, q64.grad), "dk": rel_err(dk, k64.grad), "dv": rel_err(dv, v64.grad),
                        "prod_dq": rel_err(prod_dq, q64.grad), "prod_dk": errs["prod_dk"], "prod_dv": errs["prod_dv"]}
                ok = (not any(torch.isnan(t).any() for t in (dq, dk, dv))
                      and all(errs[n] <= 2 * errs["prod_" + n] + 1e-4 for n in ("dq", "dk", "dv")))
                record(**dict(base, check="float64 fused"), **errs, status="ok" if ok else "WRONG")
    for hdim in args.hdims:
        for seqlen in args.seqlens:
            for causal in (False, True):
                q, k, v, do = inputs(16384 // seqlen, seqlen, 2048 // hdim, hdim, dtype)
                scale = hdim ** -0.5
                out, lse = flash_attn_forward(q, k, v, scale, causal)
                delta = preprocess(q, k, v, do, out)
                want_dq, want_dk, want_dv = flash_attn_backward(do, q, k, v, out, lse, scale, causal,
                                                                   TRITON_BWD[hdim], deterministic=True)
                for stages in args.stages:
                    dk, dv = (torch.full_like(t, float("nan")) for t in (k, v))
                    gluon_dkdv(q, k, v, do, lse, delta, scale, causal, stages, (dk, dv))
                    errs = {"dk": rel_err(dk, want_dk), "dv": rel_err(dv, want_dv)}
                    ok = not torch.isnan(dk).any() and not torch.isnan(dv).any() and max(errs.values()) < 1e-2
                    record(check="production", hdim=hdim, causal=causal, stages=stages, seqlen=seqlen, **errs,
                           status="ok" if ok else "WRONG")
                    if hdim != 128:
                        continue
                    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
                    gluon_fused_backward(q, k, v, do, out, lse, scale, causal, stages, (dq, dk, dv, None))
                    errs = {"dq": rel_err(dq, want_dq), "dk": rel_err(dk, want_dk), "dv": rel_err(dv, want_dv)}
                    ok = not any(torch.isnan(t).any() for t in (dq, dk, dv)) and max(errs.values()) < 1e-2
                    record(check="prod fused", hdim=hdim, causal=causal, stages=stages, seqlen=seqlen, **errs,
                           status="ok" if ok else "WRONG")
                torch.cuda.empty_cache()


def time(args, record):
    dtype = DTYPES[args.dtype]
    for hdim in args.hdims:
        for seqlen in args.seqlens:
            batch, heads = 16384 // seqlen, 2048 // hdim
            q, k, v, do = inputs(batch, seqlen, heads, hdim, dtype)
            scale = hdim ** -0.5
            cfg = default_bwd_config(hdim, q.device)
            for causal in (False, True):
                flops = attention_flops(batch, heads, seqlen, seqlen, hdim, causal, "bwd")
                base = {"dtype": args.dtype, "hdim": hdim, "seqlen": seqlen, "causal": causal}
                out, lse = flash_attn_forward(q, k, v, scale, causal)
                bufs = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), preprocess(q, k, v, do, out))
                ms = bench(partial(triton_backward_parts, cfg, do, q, k, v, out, lse, scale, causal, ("dkdv",), bufs))
                record(**base, provider="triton dkdv", ms=ms)
                for stages in args.stages:
                    ms = bench(partial(gluon_dkdv, q, k, v, do, lse, bufs[3], scale, causal, stages, bufs[1:3]))
                    record(**base, provider=f"gluon dkdv s{stages}", ms=ms)
                for name, backend in SDPA_PEERS:
                    try:
                        ms = sdpa_ms(backend, q, k, v, do, causal, "bwd")
                        record(**base, provider=name, ms=ms, tflops=tflops_per_second(flops, ms))
                    except Exception as exc:  # noqa: BLE001 -- a peer that cannot run this shape is a row
                        record(**base, provider=name, status=f"error: {exc}"[:200])
                ms = bench(partial(flash_attn_backward, do, q, k, v, out, lse, scale, causal))
                record(**base, provider="fa2 backward", ms=ms, tflops=tflops_per_second(flops, ms))
                for stages in args.stages:
                    ms = bench(partial(gluon_backward, q, k, v, do, out, lse, scale, causal, stages, bufs))
                    record(**base, provider=f"fa2 backward, gluon dkdv s{stages}", ms=ms,
                           tflops=tflops_per_second(flops, ms))
                    if hdim != 128:
                        continue
                    ms = bench(partial(gluon_fused_backward, q, k, v, do, out, lse, scale, causal, stages, bufs))
                    record(**base, provider=f"gluon fused dQ s{stages}", ms=ms, tflops=tflops_per_second(flops, ms))
                    dq_accum = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
                    ms = bench(partial(gluon_dkdv, q, k, v, do, lse, bufs[3], scale, causal, stages, bufs[1:3], dq_accum))
                    record(**base, provider=f"gluon fused kernel alone s{stages}", ms=ms)
                    del dq_accum
            del q, k, v, do, out, lse, bufs
            torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="correctness only")
    mode.add_argument("--time", action="store_true", help="timing (run --check first)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--hdims", type=int, nargs="+", default=list(hopper.HEAD_DIMS))
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--stages", type=int, nargs="+", default=[hopper.BWD_STAGES])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")),
                    help="folder for the rows (default: $OUT, else the current folder)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out_dir = args.out
    if args.check:
        record = CsvRows(out_dir / f"exp_bwd_gluon_check_{args.dtype}.csv", lambda r: (
            f"{r['check']:10s} d{r['hdim']:<3d} s{r['seqlen']:<5d} c={r['causal']!s:5s} stages {r['stages']}  "
            f"dq {r.get('dq', float('nan')):.2e} dk {r['dk']:.2e} dv {r['dv']:.2e}  {r['status']}"))
        check(args, record)
    else:
        record = CsvRows(out_dir / f"exp_bwd_gluon_{args.dtype}.csv", lambda r: (
            f"{r['dtype']} d{r['hdim']:<3d} s{r['seqlen']:<5d} c={r['causal']!s:5s} {r['provider']:34s} "
            f"{r.get('ms', float('nan')):8.3f} ms {r.get('tflops', float('nan')):6.1f} TF/s {r.get('status', '')}"))
        time(args, record)


if __name__ == "__main__":
    main()
