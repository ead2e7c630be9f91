"""Pick the FA2 kernel's block-size table on the GPU (kernels/configs.py, HOPPER_*_CONFIGS).

Times a small set of candidate configs per (head dim, causal) in the paper's setup
(hidden 2048, batch = 16384 / seqlen) next to SDPA flash (the official FA2 CUDA kernel) and
SDPA cuDNN in the same process, checks each candidate's output against the float64
reference first, and writes every row to OUT/tune_fa2.csv (`--out`).

    python tools/tune_fa2.py --seqlens 4096 16384 --hdims 64 128 256 --fwd-configs 128,128,8,3,1 128,64,8,3,1
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

import pandas as pd
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from baselines.flops import attention_flops, tflops_per_second
from baselines.reference import attention_reference
from harness.timing import benchmark
from kernels import BwdConfig, FwdConfig
from kernels.backward import flash_attn_backward
from kernels.forward import flash_attn_forward

FWD_CANDIDATES = [
    FwdConfig(128, 64, 8, 3), FwdConfig(128, 128, 8, 3), FwdConfig(128, 64, 4, 3),
    FwdConfig(64, 64, 4, 3), FwdConfig(64, 128, 4, 3), FwdConfig(128, 32, 4, 3),
    FwdConfig(128, 64, 8, 2), FwdConfig(128, 128, 8, 2), FwdConfig(128, 64, 8, 4),
]
BWD_CANDIDATES = [
    BwdConfig(32, 128, 128, 32, 4, 3), BwdConfig(32, 128, 128, 32, 4, 5),
    BwdConfig(64, 128, 128, 64, 8, 2), BwdConfig(32, 64, 64, 32, 4, 3),
    BwdConfig(64, 64, 64, 64, 4, 2), BwdConfig(32, 128, 128, 32, 8, 3),
    BwdConfig(64, 128, 128, 32, 8, 3),
    # head dim 256: no spills in ptxas's report (tools/compile_check_sm90.py) only with 32-key
    # dK/dV blocks at 8 warps and 128x16 dQ blocks
    BwdConfig(64, 32, 128, 16, 8, 2), BwdConfig(32, 32, 128, 16, 8, 2), BwdConfig(64, 32, 128, 32, 8, 2),
]


def bench(fn, grad_to_none=()) -> float:
    """Median ms through the project's one timing helper (do_bench, warm-up excluded)."""
    return benchmark(fn, torch.device("cuda"), grad_to_none=grad_to_none).ms


class CsvRows:
    """Rows as they are measured: the CSV at `path` is rewritten after each row (so a run cut
    short keeps what it measured) and `echo(row)` prints it."""

    def __init__(self, path: Path, echo):
        self.path, self.echo, self.rows = path, echo, []

    def __call__(self, **row) -> None:
        self.rows.append(row)
        pd.DataFrame(self.rows).to_csv(self.path, index=False)
        print(self.echo(row), flush=True)


SDPA_PEERS = (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION))


def sdpa_ms(backend, q, k, v, dout, causal: bool, kind: str) -> float:
    """Median ms of SDPA's forward (`kind` 'fwd') or backward ('bwd') with one backend, on
    flash-attn layout (batch, seqlen, heads, headdim) inputs."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if kind == "fwd":
        with sdpa_kernel(backend):
            return bench(partial(torch.nn.functional.scaled_dot_product_attention, qt, kt, vt, is_causal=causal))
    qg, kg, vg = (t.detach().requires_grad_() for t in (qt, kt, vt))
    with sdpa_kernel(backend):
        o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        return bench(partial(o.backward, dout.transpose(1, 2), retain_graph=True), grad_to_none=(qg, kg, vg))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096])
    parser.add_argument("--hdims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--passes", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    parser.add_argument("--fwd-configs", nargs="+", metavar="BM,BN,WARPS,STAGES,TMA[,MIN_KEYS[,HOST_MIN_KEYS,HOST_BELOW_KEYS]]",
                        help="forward candidates to time instead of the built-in list (TMA: 0 or 1; the "
                             "key counts as in FwdConfig)")
    parser.add_argument("--bwd-configs", nargs="+", metavar="M1,N1,M2,N2,WARPS,STAGES[,DQ_WARPS,DQ_STAGES,QUERY_MAJOR,TMA]",
                        help="backward candidates to time instead of the built-in list")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")),
                        help="folder for the rows (default: $OUT, else the current folder)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bwd_candidates = ([BwdConfig(*map(int, text.split(","))) for text in args.bwd_configs]
                      if args.bwd_configs else BWD_CANDIDATES)
    fwd_candidates = ([FwdConfig(*(int(x) for x in text.split(","))) for text in args.fwd_configs]
                      if args.fwd_configs else FWD_CANDIDATES)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    record = CsvRows(args.out / "tune_fa2.csv", lambda row: (
        f"{row['kind']:4s} s{row['seqlen']:<5d} d{row['hdim']:<3d} causal={row['causal']!s:5s} {row['config']:<48s} "
        f"{row.get('tflops', float('nan')):7.1f} TFLOPs/s {row.get('status', '')}"))

    for seqlen, hdim in ((s, h) for s in args.seqlens for h in args.hdims):
        batch, heads = 16384 // seqlen, 2048 // hdim
        torch.manual_seed(0)
        q, k, v, dout = (torch.randn(batch, seqlen, heads, hdim, device="cuda", dtype=dtype)
                         for _ in range(4))
        small = [t[:1, :512, :2] for t in (q, k, v)]
        scale = hdim ** -0.5
        for causal in (False, True):
            fwd_flops = attention_flops(batch, heads, seqlen, seqlen, hdim, causal, "fwd")
            bwd_flops = attention_flops(batch, heads, seqlen, seqlen, hdim, causal, "bwd")
            ref_small, _ = attention_reference(*small, scale, causal)
            # peers, same process
            for name, backend in SDPA_PEERS:
                try:
                    ms = sdpa_ms(backend, q, k, v, dout, causal, "fwd")
                    record(kind="fwd", seqlen=seqlen, hdim=hdim, causal=causal, config=name, ms=ms,
                           tflops=tflops_per_second(fwd_flops, ms), status="ok")
                    if "bwd" not in args.passes:
                        continue
                    ms = sdpa_ms(backend, q, k, v, dout, causal, "bwd")
                    record(kind="bwd", seqlen=seqlen, hdim=hdim, causal=causal, config=name, ms=ms,
                           tflops=tflops_per_second(bwd_flops, ms), status="ok")
                except Exception as exc:  # noqa: BLE001 -- a peer that cannot run this shape is a row, not a crash
                    record(kind="fwd", seqlen=seqlen, hdim=hdim, causal=causal, config=name, status=f"error: {exc}"[:200])
            out_full, lse_full = flash_attn_forward(q, k, v, scale, causal)
            for cfg in fwd_candidates if "fwd" in args.passes else []:
                label = f"{cfg}"
                try:
                    out_s, _ = flash_attn_forward(*small, scale, causal, cfg)
                    err = ((out_s.double() - ref_small).norm() / ref_small.norm()).item()
                    if not err < 2e-2:
                        record(kind="fwd", seqlen=seqlen, hdim=hdim, causal=causal, config=label, status=f"wrong {err:.2e}")
                        continue
                    ms = bench(partial(flash_attn_forward, q, k, v, scale, causal, cfg))
                    record(kind="fwd", seqlen=seqlen, hdim=hdim, causal=causal, config=label, ms=ms,
                           tflops=tflops_per_second(fwd_flops, ms), status="ok", rel_err=err)
                except Exception as exc:  # noqa: BLE001 -- a failing candidate is a row, not a crash
                    record(kind="fwd", seqlen=seqlen, hdim=hdim, causal=causal, config=label, status=f"error: {exc}"[:200])
            for cfg in bwd_candidates if "bwd" in args.passes else []:
                label = f"{cfg}"
                try:
                    ms = bench(partial(flash_attn_backward, dout, q, k, v, out_full, lse_full, scale,
                                       causal, cfg))
                    record(kind="bwd", seqlen=seqlen, hdim=hdim, causal=causal, config=label, ms=ms,
                           tflops=tflops_per_second(bwd_flops, ms), status="ok")
                except Exception as exc:  # noqa: BLE001 -- a failing candidate is a row, not a crash
                    record(kind="bwd", seqlen=seqlen, hdim=hdim, causal=causal, config=label, status=f"error: {exc}"[:200])
            torch.cuda.empty_cache()

    df = pd.DataFrame(record.rows)
    ok = df[df.status == "ok"]
    best = ok.loc[ok.groupby(["kind", "seqlen", "hdim", "causal"]).tflops.idxmax()]
    print("\nbest per (kind, hdim, causal):")
    print(best[["kind", "seqlen", "hdim", "causal", "config", "tflops"]].to_string(index=False))


if __name__ == "__main__":
    main()
