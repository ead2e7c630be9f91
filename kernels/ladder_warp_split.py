"""Split-K against split-Q at one tile: FA2 Section 3.3 isolated, in Gluon on mma.sync.

The forward ladder's rung 2 -> 3 (kernels/fa_ladder.py) has to swap the tile's sides, because
Triton picks the warp layout from the tile shape. Gluon states layouts, so this pair shares
everything but the warp layout: tile BLOCK_M x BLOCK_N, grid (query blocks, batch x heads, FA2's
loop order), 4 warps, no software pipelining, FA2's non-matmul savings, Q kept in shared memory
and read from there at every K/V step, S computed in head-dim slices of 32, K and V loaded the
same way:

  SPLIT_Q    (FA2 Sec. 3.3)   the mma.sync layout `NVMMADistributedLayout(version=[2, 0],
                              warps_per_cta=[4, 1])` for S and O: each warp owns 16 query rows of
                              S, P and O; row statistics and P stay inside the warp.
  SPLIT_K_P  (Triton's split-K) the same layout with warps_per_cta=[1, 4]: each warp owns a
                              quarter of the keys of S, so the row max and sum are reduced across
                              warps through shared memory and P is exchanged through shared memory
                              before P V, where each warp owns a quarter of O's columns.
  SPLIT_K_O  (FA1's split-K)  warps own a quarter of the keys of S and P and multiply it with their
                              quarter of V (a batched mma.sync, warps_per_cta=[4, 1, 1]): at every
                              K/V step the row maxima and sums are combined across warps, and each
                              warp's partial O (BLOCK_M x head dim, fp32) goes to shared memory,
                              where after a barrier warp c sums the four partials of O's c-th
                              quarter of columns, which it keeps (the partial O is computed in
                              those quarters so that it fits in registers).

Scope: query and key lengths equal and multiples of 64, head dim 64 or 128, fp16 or bf16, causal
or not (the mask is applied to every block on the diagonal's side in all three). Gluon has no CPU
interpreter: CPU tests compile these kernels for sm_90, GPU tests run them.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

SPLITS = ("split-q", "split-k-p", "split-k-o")  # the kernel's SPLIT constexpr: 0, 1, 2
BLOCK_M = 64  # 4 warps x 16 rows in split-Q
BLOCK_N = 64  # 4 warps x 16 keys in split-K
NUM_WARPS = 4
HEAD_DIMS = (64, 128)
LOG2E = 1.4426950408889634


@gluon.jit
def _one_tile_fwd_kernel(Q, K, V, Out,
                         stride_qb, stride_qs, stride_qh,
                         stride_kb, stride_ks, stride_kh,
                         stride_vb, stride_vs, stride_vh,
                         stride_ob, stride_os, stride_oh,
                         num_heads, seqlen, qk_scale,
                         HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         CAUSAL: gl.constexpr, SPLIT: gl.constexpr):
    """FA2 Algorithm 1 for query block i = program_id(0) with the warp split SPLIT (module
    docstring); qk_scale = softmax scale x log2(e)."""
    dtype: gl.constexpr = Q.dtype.element_ty
    start_m = gl.program_id(0) * BLOCK_M
    pid_bh = gl.program_id(1)
    b = (pid_bh // num_heads).to(gl.int64)
    h = (pid_bh % num_heads).to(gl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    Out += b * stride_ob + h * stride_oh

    # loads: 8 contiguous elements (16 bytes) per thread along the head dim
    io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows_io = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, io))
    keys_io = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, io))
    dims_io = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io))
    smem: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, [1, 0])
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], smem,
                                       gl.load(Q + (start_m + rows_io)[:, None] * stride_qs + dims_io[None, :]))
    gl.thread_barrier()  # Q is in shared memory before any warp reads another warp's rows
    KCHUNK: gl.constexpr = 32  # head-dim slice of Q and K per S matmul (bounds the registers)
    end = gl.minimum(start_m + BLOCK_M, seqlen) if CAUSAL else seqlen

    if SPLIT == 2:
        # FA1's split-K: a batch of 4 (one per warp) of [BLOCK_M, BLOCK_N / 4] score slices
        QUARTER: gl.constexpr = BLOCK_N // 4  # keys per warp
        CHUNK: gl.constexpr = HEAD_DIM // 4  # O columns each warp owns after the exchange
        mma3: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1, 1],
                                                       instr_shape=[1, 16, 8])
        a3: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma3, k_width=2)
        b3: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma3, k_width=2)
        row: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, mma3))  # [BLOCK_M], combined over the warps
        io3: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 8, 4], [4, 1, 1], [2, 1, 0])
        # the exchange: fp32 partials in shared memory at [column chunk x 4 + source warp, row, column];
        # warp c then sums the four partials of chunk c, which it owns in `acc`
        xbuf = gl.allocate_shared_memory(gl.float32, [16, BLOCK_M, CHUNK], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        gather: gl.constexpr = gl.BlockedLayout([4, 1, 4], [1, 8, 4], [4, 1, 1], [2, 1, 0])
        acc_layout: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 8, 4], [4, 1, 1], [2, 1, 0])
        acc_row: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, acc_layout))
        warp3 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, io3)))
        key3 = gl.arange(0, QUARTER, layout=gl.SliceLayout(0, gl.SliceLayout(2, io3)))
        dimk3 = gl.arange(0, KCHUNK, layout=gl.SliceLayout(0, gl.SliceLayout(1, io3)))
        dimc3 = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, gl.SliceLayout(1, io3)))
        rows3 = start_m + gl.arange(0, BLOCK_M, layout=row)
        cols3 = gl.arange(0, QUARTER, layout=gl.SliceLayout(0, gl.SliceLayout(1, mma3)))
        slot3 = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, mma3)))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row)
        acc = gl.zeros([4, BLOCK_M, CHUNK], gl.float32, layout=acc_layout)
        s_zero = gl.zeros([4, BLOCK_M, QUARTER], gl.float32, layout=mma3)
        part_zero = gl.zeros([4, BLOCK_M, CHUNK], gl.float32, layout=mma3)
        q_zero = gl.zeros([4, BLOCK_M, KCHUNK], dtype, layout=io3)
        for start_n in range(0, end, BLOCK_N):
            key = start_n + warp3[:, None, None] * QUARTER + key3[None, :, None]  # [4, QUARTER, 1]
            # S_w = Q K_w^T for each warp's keys; every warp reads all of Q
            s = s_zero
            for c in gl.static_range(HEAD_DIM // KCHUNK):
                q_c = gl.expand_dims(q_smem.slice(c * KCHUNK, KCHUNK, dim=1).load(gl.SliceLayout(0, io3)), 0)
                k_c = gl.load(K + key * stride_ks + (c * KCHUNK + dimk3)[None, None, :])  # [4, QUARTER, KCHUNK]
                s = mma_v2(gl.convert_layout(q_c + q_zero, a3), gl.convert_layout(gl.permute(k_c, [0, 2, 1]), b3), s)
            if CAUSAL:
                key_s = start_n + slot3[:, None, None] * QUARTER + cols3[None, None, :]
                s = gl.where(rows3[None, :, None] >= key_s, s, float("-inf"))
            # each warp's row max over its keys, then the max over the warps (shared memory)
            m_new = gl.maximum(m_i, gl.max(gl.max(s, axis=2), axis=0) * qk_scale)
            p = gl.exp2(s * qk_scale - m_new[None, :, None])
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(gl.sum(p, axis=2), axis=0)
            p_op = gl.convert_layout(p.to(dtype), a3)
            # each warp's partial O = P_w V_w, column chunk by chunk, into shared memory
            for c in gl.static_range(4):
                v_c = gl.load(V + key * stride_vs + (c * CHUNK + dimc3)[None, None, :])  # [4, QUARTER, CHUNK]
                xbuf.slice(c * 4, 4, dim=0).store(mma_v2(p_op, gl.convert_layout(v_c, b3), part_zero))
            gl.thread_barrier()
            partials = gl.reshape(xbuf.load(gather), [4, 4, BLOCK_M, CHUNK])  # [chunk, source warp, ...]
            summed = gl.sum(partials, axis=1)  # warp c sums chunk c
            gl.thread_barrier()  # the buffer is rewritten at the next K/V step
            alpha_a = gl.convert_layout(alpha, acc_row)
            acc = acc * alpha_a[None, :, None] + gl.convert_layout(summed, acc_layout)
            m_i = m_new
        # line 12, and out[m, c * CHUNK + j] = acc[c, m, j]
        l_a = gl.convert_layout(l_i, acc_row)
        o3 = (acc / l_a[None, :, None]).to(dtype)
        chunk_o = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, acc_layout)))
        row_o = start_m + gl.arange(0, BLOCK_M, layout=acc_row)
        col_o = gl.arange(0, CHUNK, layout=gl.SliceLayout(0, gl.SliceLayout(1, acc_layout)))
        gl.store(Out + row_o[None, :, None] * stride_os + (chunk_o[:, None, None] * CHUNK + col_o[None, None, :]), o3)
    else:
        warps: gl.constexpr = [4, 1] if SPLIT == 0 else [1, 4]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=warps, instr_shape=[16, 8])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
        row: gl.constexpr = gl.SliceLayout(1, mma)
        rows = start_m + gl.arange(0, BLOCK_M, layout=row)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=mma)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
        dimk = gl.arange(0, KCHUNK, layout=gl.SliceLayout(0, io))
        for start_n in range(0, end, BLOCK_N):
            # FA2 Alg. 1 line 8: S = Q K_j^T, in head-dim slices as in SPLIT_K_O
            s = s_zero
            for c in gl.static_range(HEAD_DIM // KCHUNK):
                k_c = gl.load(K + (start_n + keys_io)[:, None] * stride_ks + (c * KCHUNK + dimk)[None, :])
                s = mma_v2(q_smem.slice(c * KCHUNK, KCHUNK, dim=1).load(a_op),
                           gl.convert_layout(gl.permute(k_c, [1, 0]), b_op), s)
            v = gl.load(V + (start_n + keys_io)[:, None] * stride_vs + dims_io[None, :])  # [BLOCK_N, HEAD_DIM]
            if CAUSAL:
                s = gl.where(rows[:, None] >= start_n + cols[None, :], s, float("-inf"))
            # lines 9-10: m, P~ = exp2(S - m), l; O rescaled by exp(m_old - m_new), no 1/l
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
            p = gl.exp2(s * qk_scale - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            acc = mma_v2(gl.convert_layout(p.to(dtype), a_op), gl.convert_layout(v, b_op), acc * alpha[:, None])
            m_i = m_new
        # line 12: the one 1/l
        out = gl.convert_layout((acc / l_i[:, None]).to(dtype), io)
        gl.store(Out + (start_m + rows_io)[:, None] * stride_os + dims_io[None, :], out)


def one_tile_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                     softmax_scale: float | None = None, *, split: str) -> torch.Tensor:
    """Attention forward (flash-attn layout (batch, seqlen, heads, headdim)) with warp split
    `split` in SPLITS, at the one tile BLOCK_M x BLOCK_N with 4 warps (module docstring)."""
    from .fa_ladder import check_ladder_inputs

    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    scale = check_ladder_inputs(q, k, v, softmax_scale)
    batch, seqlen, heads, headdim = q.shape
    if q.device.type != "cuda":
        raise ValueError("the one-tile pair is Gluon, which has no CPU interpreter: it needs a CUDA device")
    if k.shape[1] != seqlen or seqlen % max(BLOCK_M, BLOCK_N):
        raise ValueError(f"the one-tile pair needs equal query and key lengths in whole blocks of "
                         f"{max(BLOCK_M, BLOCK_N)}, got {seqlen} and {k.shape[1]}")
    if headdim not in HEAD_DIMS or q.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the one-tile pair takes head dim {HEAD_DIMS} in fp16/bf16, got {headdim}, {q.dtype}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    compiled = _one_tile_fwd_kernel[(seqlen // BLOCK_M, batch * heads)](
        q, k, v, out, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        heads, seqlen, scale * LOG2E,
        HEAD_DIM=headdim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=causal, SPLIT=SPLITS.index(split),
        num_warps=NUM_WARPS,
    )
    COMPILED_FACTS[(split, headdim, causal, q.dtype)] = {
        "registers": compiled.n_regs, "spill_bytes": 4 * compiled.n_spills, "shared_bytes": compiled.metadata.shared}
    return out


# What each compiled variant uses, by (split, head dim, causal, dtype): registers per thread, bytes
# spilled (Triton counts spills in 4-byte words) and shared memory; the studies record it beside
# the times, since a variant that spills measures its spills too.
COMPILED_FACTS: dict[tuple, dict] = {}


def compile_facts_sm90(split: str, headdim: int, causal: bool) -> dict:
    """Compile one variant for sm_90 without a GPU (fp16; run in a process without
    TRITON_INTERPRET): shared memory, registers and spill bytes from Triton's bundled ptxas, and
    the CTA barriers and mma.sync instructions in its PTX."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = _one_tile_fwd_kernel
    constexprs = {"HEAD_DIM": headdim, "BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "CAUSAL": causal,
                  "SPLIT": SPLITS.index(split)}
    signature = {name: "constexpr" if name in constexprs else "*fp16" if name[0].isupper() else
                 "fp32" if "scale" in name else "i32" for name in kernel.arg_names}
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": NUM_WARPS})
    ptx = compiled.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        report = subprocess.run([ptxas, "-v", "-arch=sm_90a", path, "-o", os.devnull], capture_output=True,
                                text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {"shared_bytes": compiled.metadata.shared, "registers": int(registers.group(1)) if registers else None,
            "spill_bytes": int(spills.group(1)) if spills else None,
            "barriers": len(re.findall(r"\bbar\.sync\b", ptx)), "mma_sync": len(re.findall(r"\bmma\.sync\b", ptx))}
