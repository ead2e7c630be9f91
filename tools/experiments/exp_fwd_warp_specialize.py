"""Does Triton 3.6's sm_90 warp specialisation (tl.range(..., warp_specialize=True)) give a correct
and faster attention forward? Triton's own attention tests for it run on Blackwell only
(python/test/unit/language/test_warp_specialization.py). The pass does transform a forward
compiled for sm_90 at 4 warps (a producer warpgroup and two consumer warpgroups, setmaxnreg).

Each variant runs in its own subprocess with a time limit (a mis-synchronised kernel can hang):
- `min128-ptr`: a minimal forward (one loop, host descriptors for Q/K/V), O stored through
  pointers, 128-row blocks.
- `min64-desc`: the same with 64-row blocks and O stored through a descriptor (the shape of
  Triton's attention test kernel).
For each: non-causal, bf16, (batch 2, seqlen 1024, heads 2, head dim 128) with O poisoned to NaN
first; the rows that differ from the float64 reference (row index mod the block size); if every
row is right, the forward's time at the paper's 4k shape next to the production table's config.
The committed log (reports/h200/tuning/exp_fwd_warp_specialize_bf16.log, run at 6f78482) also has
two variants of the production forward with a warp-specialised key loop (FwdConfig.warp_specialize,
removed after that run): with host descriptors it hung, with in-kernel ones it faulted.

    python tools/experiments/exp_fwd_warp_specialize.py                  # on the GPU
    python tools/experiments/exp_fwd_warp_specialize.py --compile-only   # sm_90 compiler report, no GPU
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch
import triton
import triton.language as tl

from kernels import flash_attn as fa

VARIANTS = ("min128-ptr", "min64-desc")


@triton.jit
def _minimal_ws_kernel(Q, K, V, Out, LSE, num_heads, seqlen_q, seqlen_k, qk_scale, stride_os,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       DESC_STORE: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    b, h = pid_bh // num_heads, pid_bh % num_heads
    q_row0, kv_row0, col0 = (b * seqlen_q).to(tl.int32), (b * seqlen_k).to(tl.int32), (h * HEAD_DIM).to(tl.int32)
    q = Q.load([q_row0 + start_m, col0])
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    for start_n in tl.range(0, seqlen_k, BLOCK_N, warp_specialize=True):
        s = tl.dot(q, K.load([kv_row0 + start_n, col0]).T)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = V.load([kv_row0 + start_n, col0])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    # l started at 1 (as in Triton's test kernel): subtract it back out
    l_i = l_i - tl.math.exp2(-m_i)
    acc = acc / l_i[:, None]
    offs_m = start_m + tl.arange(0, BLOCK_M)
    tl.store(LSE + pid_bh.to(tl.int64) * seqlen_q + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453)
    if DESC_STORE:
        Out.store([q_row0 + start_m, col0], acc.to(Out.dtype))
    else:
        rows = q_row0 + offs_m
        tl.store(Out + rows[:, None] * stride_os + col0 + tl.arange(0, HEAD_DIM)[None, :], acc.to(Out.dtype.element_ty))


def forward(variant: str, q, k, v, scale: float):
    block_m = 128 if variant == "min128-ptr" else 64
    batch, seqlen, heads, d = q.shape
    out = torch.full_like(q, float("nan"))
    lse = torch.empty(batch, heads, seqlen, device=q.device, dtype=torch.float32)

    flat = fa._flat_descriptor  # the host-descriptor path's (batch * seqlen, heads * head dim) view

    o_arg = flat(out, block_m) if variant == "min64-desc" else out
    _minimal_ws_kernel[(seqlen // block_m, batch * heads)](
        flat(q, block_m), flat(k, 128), flat(v, 128), o_arg, lse, heads, seqlen, seqlen, scale * fa.LOG2E.value,
        heads * d, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=128, DESC_STORE=variant == "min64-desc", num_warps=4, num_stages=2)
    return out, lse


def run_one(variant: str) -> None:
    """In a subprocess: correctness at a small shape, then the time at 4k if correct."""
    from baselines.reference import attention_reference
    from reports.timing import benchmark

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 1024, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, _ = forward(variant, q, k, v, 128 ** -0.5)  # O starts as NaN (forward fills it)
    torch.cuda.synchronize()
    ref, _ = attention_reference(q, k, v, 128 ** -0.5, False)
    err = (out.double() - ref).abs().amax(dim=-1)  # (batch, seqlen, heads)
    bad = (~(err < 2e-2)).nonzero()
    block = 64 if variant == "min64-desc" else 128
    pattern = sorted({int(r) % block for r in bad[:, 1].tolist()})
    print(f"{variant:12s} rows wrong: {len(bad)} of {err.numel()}; NaN: {int(torch.isnan(out).any(-1).sum())}; "
          f"wrong rows mod {block}: {pattern[:8]}{'...' if len(pattern) > 8 else ''} ({len(pattern)} distinct)", flush=True)
    if len(bad):
        return
    q, k, v = (torch.randn(4, 4096, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    device = torch.device("cuda")
    ws_ms = benchmark(lambda: forward(variant, q, k, v, 128 ** -0.5), device).ms
    table_ms = benchmark(lambda: fa.flash_attn_forward(q, k, v, 128 ** -0.5, False), device).ms
    print(f"{variant:12s} seqlen 4096 non-causal bf16: {ws_ms:.3f} ms against the table's {table_ms:.3f} ms "
          f"({table_ms / ws_ms:.3f}x)", flush=True)


def compile_report() -> None:
    """Compile both variants for sm_90 (no GPU) and print whether the pass split the loop into
    warp groups (setmaxnreg in the PTX), the warps of the program and the shared memory."""
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT / "tools"))
    from compile_check_sm90 import TARGET
    from triton.compiler import ASTSource

    print(f"sm_90, bf16, head dim 128, 128-key blocks, num_stages=2; triton {triton.__version__}")
    for variant, num_warps in [(v, 4) for v in VARIANTS] + [("min128-ptr", 8)]:
        block_m, desc_store = (128, False) if variant == "min128-ptr" else (64, True)
        signature = {"Q": f"tensordesc<bf16[{block_m},128]>", "K": "tensordesc<bf16[128,128]>",
                     "V": "tensordesc<bf16[128,128]>", "Out": f"tensordesc<bf16[{block_m},128]>" if desc_store else "*bf16",
                     "LSE": "*fp32", "num_heads": "i32", "seqlen_q": "i32", "seqlen_k": "i32", "qk_scale": "fp32",
                     "stride_os": "i32", "HEAD_DIM": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                     "DESC_STORE": "constexpr"}
        constexprs = {"HEAD_DIM": 128, "BLOCK_M": block_m, "BLOCK_N": 128, "DESC_STORE": desc_store}
        compiled = triton.compile(ASTSource(_minimal_ws_kernel, signature, constexprs), target=TARGET,
                                  options={"num_warps": num_warps, "num_stages": 2})
        ptx = compiled.asm["ptx"]
        registers = sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx)})
        print(f"{variant:12s} num_warps={num_warps} warp-specialised: {'yes' if registers else 'no'}  warps per program "
              f"{compiled.metadata.num_warps}  setmaxnreg targets {registers}  smem {compiled.metadata.shared} B")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=VARIANTS, help="run one variant in this process")
    parser.add_argument("--compile-only", action="store_true", help="the sm_90 compiler report only (no GPU)")
    parser.add_argument("--timeout", type=float, default=40.0, help="seconds per variant")
    args = parser.parse_args()
    if args.compile_only:
        compile_report()
        return
    if args.variant:
        run_one(args.variant)
        return
    for variant in VARIANTS:
        try:
            done = subprocess.run([sys.executable, __file__, "--variant", variant], capture_output=True, text=True,
                                  timeout=args.timeout, env=dict(os.environ), check=False)
            lines = [line for line in done.stdout.splitlines() if line.startswith(variant)]
            err = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line][-1:]
            print("\n".join(lines) or f"{variant:12s} exit {done.returncode}: {' '.join(err)[:200]}", flush=True)
        except subprocess.TimeoutExpired:
            print(f"{variant:12s} did not finish in {args.timeout:.0f} s (a hang)", flush=True)


if __name__ == "__main__":
    main()
