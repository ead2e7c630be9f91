"""Can Triton 3.6 overlap the forward's softmax with its matmuls on Hopper? Compile-only (no GPU):
two restructured head-dim-128 forwards are compiled for sm_90 next to the production kernel
(host-descriptor path, 128x128 tiles, 8 warps, 3 stages) and the compiler's answer printed.

- `software-pipelined`: FA3's intra-warpgroup overlap written in the source: S_{j+1} = Q K_{j+1}^T
  is issued before the softmax of S_j, so its wgmma could run while the softmax does.
- `fa3-order`: FA3's Algorithm 2 order instead: S_j = Q K_j^T issued, then P_{j-1} V_{j-1}, then
  the softmax of S_j, which could run under the P V matmul if the S wait left it in flight.
- `persistent`: one program per SM walking the (query block, batch x head) tiles, the key loop
  nested in the tile loop (no launch per tile; the O store's wait moves into the loop).
- `persistent-flattened`: the same with the two loops fused (`tl.range(..., flatten=True)`), so
  the pipeliner could prefetch the next tile's K/V under the current tile's epilogue.

For each: shared memory (the H200 allows 232,448 B per block), registers, spills, and in the
innermost loop that issues wgmma the `wgmma.wait_group` that follows its first wgmma group,
i.e. whether the S matmul is waited for at once (`0`: nothing overlaps the softmax inside a
warpgroup) or left in flight.

    python tools/experiments/exp_fwd_overlap.py
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import triton
import triton.language as tl
from compile_check_sm90 import PTXAS, TARGET
from compile_check_sm90 import signature as compile_check_signature
from triton.compiler import ASTSource

from kernels import flash_attn as fa

BM, BN, D, WARPS, STAGES = 128, 128, 128, 8, 3


@triton.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _tile_prologue(Q, pid_bh, start_m, num_heads, seqlen_q, seqlen_k, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    """Where the tile's (batch, head) starts in the 2-D host descriptors, its Q block, and FA2
    Alg. 1 lines 2-4's initial O = 0, l = 0, m = -inf."""
    b, h = fa._batch_head(pid_bh, num_heads)
    q_row0, kv_row0, col0 = (b * seqlen_q).to(tl.int32), (b * seqlen_k).to(tl.int32), (h * HEAD_DIM).to(tl.int32)
    q = Q.load([q_row0 + start_m, col0])
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    return q, q_row0, kv_row0, col0, acc, l_i, m_i


@triton.jit
def _software_pipelined_kernel(Q, K, V, Out, LSE, num_heads, seqlen_q, seqlen_k, qk_scale,
                               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    q, q_row0, kv_row0, col0, acc, l_i, m_i = _tile_prologue(Q, pid_bh, start_m, num_heads, seqlen_q, seqlen_k,
                                                             HEAD_DIM, BLOCK_M)
    s = tl.dot(q, K.load([kv_row0, col0]).T)
    for start_n in range(BLOCK_N, seqlen_k, BLOCK_N):
        s_next = tl.dot(q, K.load([kv_row0 + start_n, col0]).T)  # issued before the softmax of s
        p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, qk_scale)
        v = V.load([kv_row0 + start_n - BLOCK_N, col0])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        s = s_next
    p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, qk_scale)
    v = V.load([kv_row0 + seqlen_k - BLOCK_N, col0])
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    acc, lse = fa._finalize(acc, l_i, m_i)
    Out.store([q_row0 + start_m, col0], acc.to(Out.dtype))
    tl.store(LSE + pid_bh.to(tl.int64) * seqlen_q + start_m + tl.arange(0, BLOCK_M), lse)


@triton.jit
def _fa3_order_kernel(Q, K, V, Out, LSE, num_heads, seqlen_q, seqlen_k, qk_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    pid_bh = tl.program_id(1)
    q, q_row0, kv_row0, col0, acc, l_i, m_i = _tile_prologue(Q, pid_bh, start_m, num_heads, seqlen_q, seqlen_k,
                                                             HEAD_DIM, BLOCK_M)
    p, alpha, l_i, m_i = _softmax_step(tl.dot(q, K.load([kv_row0, col0]).T), m_i, l_i, qk_scale)
    for start_n in range(BLOCK_N, seqlen_k, BLOCK_N):
        s = tl.dot(q, K.load([kv_row0 + start_n, col0]).T)          # S_j issued
        v = V.load([kv_row0 + start_n - BLOCK_N, col0])
        acc = tl.dot(p.to(v.dtype), v, acc)                          # then P_{j-1} V_{j-1}
        p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, qk_scale)    # softmax of S_j under it
        acc = acc * alpha[:, None]
    v = V.load([kv_row0 + seqlen_k - BLOCK_N, col0])
    acc = tl.dot(p.to(v.dtype), v, acc)
    acc, lse = fa._finalize(acc, l_i, m_i)
    Out.store([q_row0 + start_m, col0], acc.to(Out.dtype))
    tl.store(LSE + pid_bh.to(tl.int64) * seqlen_q + start_m + tl.arange(0, BLOCK_M), lse)


@triton.jit
def _persistent_kernel(Q, K, V, Out, LSE, num_heads, seqlen_q, seqlen_k, qk_scale, batch_heads,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       FLATTEN: tl.constexpr):
    """Launched on a 1-D grid of one program per SM; `batch_heads` = batch x heads."""
    n_mblocks = seqlen_q // BLOCK_M
    for tile in tl.range(tl.program_id(0), n_mblocks * batch_heads, tl.num_programs(0), flatten=FLATTEN):
        pid_bh = tile // n_mblocks
        start_m = (tile % n_mblocks) * BLOCK_M
        q, q_row0, kv_row0, col0, acc, l_i, m_i = _tile_prologue(Q, pid_bh, start_m, num_heads, seqlen_q, seqlen_k,
                                                                 HEAD_DIM, BLOCK_M)
        for start_n in tl.range(0, seqlen_k, BLOCK_N):
            s = tl.dot(q, K.load([kv_row0 + start_n, col0]).T)
            p, alpha, l_i, m_i = _softmax_step(s, m_i, l_i, qk_scale)
            v = V.load([kv_row0 + start_n, col0])
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        acc, lse = fa._finalize(acc, l_i, m_i)
        Out.store([q_row0 + start_m, col0], acc.to(Out.dtype))
        tl.store(LSE + pid_bh.to(tl.int64) * seqlen_q + start_m + tl.arange(0, BLOCK_M), lse)


def signature(kernel, constexprs: dict) -> dict:
    """compile_check_sm90's argument types, with Q, K, V and Out as the host-made 2-D
    descriptors of the production kernel's TMA path 2 (BLOCK_M rows for Q/Out, BLOCK_N for K/V)."""
    host_path = {**constexprs, "TMA": fa.FWD_MEMORY_PATHS.index("tma-host"), "BLOCK_D": D}
    return compile_check_signature(kernel, host_path, "bf16")


def report(name: str, kernel, constexprs: dict) -> str:
    with tempfile.TemporaryFile("w+") as stderr:  # MLIR writes its diagnostics to file descriptor 2
        saved = os.dup(2)
        os.dup2(stderr.fileno(), 2)
        try:
            compiled = triton.compile(ASTSource(kernel, signature(kernel, constexprs), constexprs), target=TARGET,
                                      options={"num_warps": WARPS, "num_stages": STAGES})
        except Exception as exc:  # noqa: BLE001 -- a compiler failure is the answer for this variant
            compiled = exc
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        stderr.seek(0)
        diagnostics = [line.split("error: ", 1)[1] for line in stderr.read().splitlines() if "error: " in line]
    if isinstance(compiled, Exception):
        return f"{name:22s} does not compile: {'; '.join(diagnostics)[:300] or compiled}"
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    ptxas = subprocess.run([str(PTXAS), "-v", "-arch=sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True, check=True)
    os.unlink(f.name)
    registers = re.search(r"Used (\d+) registers", ptxas.stderr)
    spills = re.search(r"(\d+) bytes spill stores", ptxas.stderr)
    # loops: a label up to the branch back to it; the innermost one that issues wgmma is the
    # shortest such body holding a commit
    bodies = []
    for label in re.finditer(r"^(\$L__BB\d+_\d+):", ptx, flags=re.MULTILINE):
        back = re.compile(r"bra(?:\.uni)?\s+" + re.escape(label.group(1)) + ";").search(ptx, label.end())
        if back:
            bodies.append(ptx[label.end():back.start()])
    bodies = sorted((b for b in bodies if "wgmma.commit_group" in b), key=len)
    body = bodies[0] if bodies else ptx
    wait = re.search(r"wgmma\.commit_group\.sync\.aligned;.*?wgmma\.wait_group\.sync\.aligned (\d+);", body, re.DOTALL)
    return (f"{name:22s} smem {compiled.metadata.shared:7d} B  regs {registers.group(1) if registers else '?':>3s}  "
            f"spill stores {spills.group(1) if spills else '?':>4s} B  first wgmma group of the innermost wgmma loop waited with "
            f"wait_group {wait.group(1) if wait else 'none'}")


def main() -> None:
    common = {"HEAD_DIM": D, "BLOCK_M": BM, "BLOCK_N": BN}
    production = {"HEAD_DIM": D, "BLOCK_D": D, "BLOCK_M": BM, "BLOCK_N": BN, "CAUSAL": False, "EVEN_M": True,
                  "TMA": fa.FWD_MEMORY_PATHS.index("tma-host")}
    print(f"sm_90, bf16, head dim {D}, {BM}x{BN} tiles, {WARPS} warps, {STAGES} stages, host descriptors; "
          f"triton {triton.__version__}")
    compiled = triton.compile(ASTSource(fa._flash_fwd_kernel, compile_check_signature(fa._flash_fwd_kernel, production, "bf16"),
                                        production), target=TARGET, options={"num_warps": WARPS, "num_stages": STAGES})
    wait = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", compiled.asm["ptx"])
    print(f"{'production':22s} smem {compiled.metadata.shared:7d} B  wait_group values in order: {' '.join(wait)}")
    print(report("software-pipelined", _software_pipelined_kernel, common))
    print(report("fa3-order", _fa3_order_kernel, common))
    print(report("persistent", _persistent_kernel, {**common, "FLATTEN": False}))
    print(report("persistent-flattened", _persistent_kernel, {**common, "FLATTEN": True}))


if __name__ == "__main__":
    main()
