"""The FlashAttention-2 backward in Triton (FA2 Algorithm 2) and its launcher.

Split as Triton's fused-attention tutorial splits it: a preprocessing kernel (D = rowsum(dO * O),
Alg. 2 line 4), a dK/dV kernel (one program per key block, query blocks inner) and a dQ kernel
(one program per query block) that recomputes S and dP, so that dQ is written once by one program
and bit-identical between runs (7 matmuls instead of 5; TFLOPs/s always use the paper's count of
5, baselines/flops.py). Where dispatch says so, the dK/dV pass adds dQ itself into a float32
accumulator (TMA reduce-adds on Hopper, atomics elsewhere) unless `deterministic=True`.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from . import dispatch
from .backward_features import flash_attn_backward_features
from .backward_steps import _bwd_dkdv_inner, _bwd_dq_inner, _bwd_preprocess_launcher
from .checks import DENSE, Features
from .common import (
    LOG2E,
    _batch_head,
    _key_range,
    _load_tile,
    _query_block_start,
    _store_tile,
    cdiv,
    ensure_descriptor_allocator,
    last_dim_contiguous,
    strides,
)
from .configs import BwdConfig, default_bwd_config, on_hopper, padded_headdim
from .dispatch import (
    GluonPath,
    bwd_dkdv_path,
    bwd_fuses_dq,
    bwd_gluon_fuses_dq,
    bwd_uses_tma,
    tma_compatible,
)
from .features import feature_args
from .launch import CachedLauncher, DirectLaunch, PlanCache
from .row_chunks import GRID_ROWS, backward_in_chunks, row_spans, spans_of


@triton.jit
def _flash_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, Delta, DK, DV, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_dqb, stride_dqs, stride_dqh,
    num_heads, seqlen_q, seqlen_k, softmax_scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr, QUERY_MAJOR: tl.constexpr,
    TMA: tl.constexpr, FUSED_DQ: tl.constexpr,
):
    """One program per (key block, batch x head) owns dK_j and dV_j (FA2 Alg. 2 lines 5-18):
    every element is written by exactly one program, so no atomics for them. With FUSED_DQ the
    program also adds its part of every dQ_i into DQ, a float32 accumulator (line 15, atomics:
    the sum's order varies between runs); without, DQ is unused and the dQ kernel follows."""
    start_n = tl.program_id(0) * BLOCK_N
    pid_bh = tl.program_id(1)
    b, h = _batch_head(pid_bh, num_heads)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_dob + h * stride_doh
    DK += b * stride_dkb + h * stride_dkh
    DV += b * stride_dvb + h * stride_dvh
    LSE += pid_bh.to(tl.int64) * seqlen_q
    Delta += pid_bh.to(tl.int64) * seqlen_q
    if FUSED_DQ:
        DQ += b * stride_dqb + h * stride_dqh
    if FUSED_DQ == 2:
        DQ = tl.make_tensor_descriptor(DQ, shape=[seqlen_q, HEAD_DIM], strides=[stride_dqs, 1],
                                       block_shape=[BLOCK_M, BLOCK_D])

    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < seqlen_k
    d_ok = offs_d < HEAD_DIM
    # line 6: load K_j, V_j; line 7: dK_j = dV_j = 0. Keys past seqlen_k load zeros and
    # only produce rows of dK/dV that are never stored.
    k = _load_tile(K + offs_n[:, None] * stride_ks + offs_d[None, :], n_ok, d_ok,
                   not EVEN_N, not EVEN_D)
    v = _load_tile(V + offs_n[:, None] * stride_vs + offs_d[None, :], n_ok, d_ok,
                   not EVEN_N, not EVEN_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if TMA:
        Q = tl.make_tensor_descriptor(Q, shape=[seqlen_q, HEAD_DIM], strides=[stride_qs, 1],
                                      block_shape=[BLOCK_M, BLOCK_D])
        DO = tl.make_tensor_descriptor(DO, shape=[seqlen_q, HEAD_DIM], strides=[stride_dos, 1],
                                       block_shape=[BLOCK_M, BLOCK_D])

    if CAUSAL:
        # query blocks that see some of these keys: row i sees key j iff i >= j - offset
        offset = seqlen_k - seqlen_q
        lo = tl.maximum(start_n - offset, 0) // BLOCK_M * BLOCK_M
        full = tl.minimum(tl.maximum(start_n + BLOCK_N - 1 - offset, lo), seqlen_q)
        full = tl.cdiv(full, BLOCK_M) * BLOCK_M  # from here on every row sees every key
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, Delta, DQ, stride_qs, stride_dos, stride_dqs,
                                 offs_n, offs_d, lo, full, seqlen_q, seqlen_k, softmax_scale, qk_scale,
                                 0, 0, 0.0, 0.0, 0.0, 0, 0, 0,
                                 HEAD_DIM, BLOCK_M, EVEN_M, True, EVEN_D, QUERY_MAJOR, TMA, FUSED_DQ,
                                 False, False, False, False)
    else:
        full = 0
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, Delta, DQ, stride_qs, stride_dos, stride_dqs,
                             offs_n, offs_d, full, seqlen_q, seqlen_q, seqlen_k, softmax_scale, qk_scale,
                             0, 0, 0.0, 0.0, 0.0, 0, 0, 0,
                             HEAD_DIM, BLOCK_M, EVEN_M, False, EVEN_D, QUERY_MAJOR, TMA, FUSED_DQ,
                             False, False, False, False)
    # line 18: write dK_j (scaled once: S = scale * Q K^T) and dV_j
    _store_tile(DK + offs_n[:, None] * stride_dks + offs_d[None, :],
                (dk * softmax_scale).to(DK.dtype.element_ty), n_ok, d_ok, not EVEN_N, not EVEN_D)
    _store_tile(DV + offs_n[:, None] * stride_dvs + offs_d[None, :],
                dv.to(DV.dtype.element_ty), n_ok, d_ok, not EVEN_N, not EVEN_D)


@triton.jit
def _flash_bwd_dq_kernel(
    Q, K, V, DO, LSE, Delta, DQ,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh,
    num_heads, seqlen_q, seqlen_k, softmax_scale, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, TMA: tl.constexpr,
):
    """One program per (query block, batch x head) owns dQ_i: the dQ part of FA2 Alg. 2
    (line 15) as a separate pass, so dQ needs no atomics and the result is deterministic."""
    start_m = _query_block_start(CAUSAL, BLOCK_M)
    pid_bh = tl.program_id(1)
    b, h = _batch_head(pid_bh, num_heads)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_dob + h * stride_doh
    DQ += b * stride_dqb + h * stride_dqh
    LSE += pid_bh.to(tl.int64) * seqlen_q
    Delta += pid_bh.to(tl.int64) * seqlen_q

    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < seqlen_q
    d_ok = offs_d < HEAD_DIM
    q = _load_tile(Q + offs_m[:, None] * stride_qs + offs_d[None, :], m_ok, d_ok,
                   not EVEN_M, not EVEN_D)
    do = _load_tile(DO + offs_m[:, None] * stride_dos + offs_d[None, :], m_ok, d_ok,
                    not EVEN_M, not EVEN_D)
    lse = tl.load(LSE + offs_m, mask=m_ok, other=float("inf")) * LOG2E
    delta = tl.load(Delta + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if TMA:
        K = tl.make_tensor_descriptor(K, shape=[seqlen_k, HEAD_DIM], strides=[stride_ks, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])
        V = tl.make_tensor_descriptor(V, shape=[seqlen_k, HEAD_DIM], strides=[stride_vs, 1],
                                      block_shape=[BLOCK_N, BLOCK_D])

    full, end = _key_range(start_m, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_ks, stride_vs, offs_m, offs_d,
                       0, full, seqlen_q, seqlen_k, qk_scale, 0, 0, 0.0, 0.0, 0.0, 0, 0, 0,
                       HEAD_DIM, BLOCK_N, CAUSAL, False, EVEN_D, TMA, False, False, False, False)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_ks, stride_vs, offs_m, offs_d,
                       full, end, seqlen_q, seqlen_k, qk_scale, 0, 0, 0.0, 0.0, 0.0, 0, 0, 0,
                       HEAD_DIM, BLOCK_N, CAUSAL, True, EVEN_D, TMA, False, False, False, False)
    _store_tile(DQ + offs_m[:, None] * stride_dqs + offs_d[None, :],
                (dq * softmax_scale).to(DQ.dtype.element_ty), m_ok, d_ok, not EVEN_M, not EVEN_D)




# After a shape's first call, launched without Triton's per-call argument binding.
_bwd_dkdv_launcher = CachedLauncher(_flash_bwd_dkdv_kernel)
_bwd_dq_launcher = CachedLauncher(_flash_bwd_dq_kernel)


def flash_attn_backward(do, q, k, v, out, lse, softmax_scale: float, causal: bool,
                        config: BwdConfig | None = None, deterministic: bool = False, features: Features = DENSE):
    """Backward pass: returns (dq, dk, dv) in the inputs' dtype. Where the config fuses dQ into
    the dK/dV kernel (`bwd_gluon_fuses_dq` on the Gluon path, `bwd_fuses_dq` on the Triton one), dQ
    is summed by atomics in an order that varies between runs (as flash-attn's own backward does);
    `deterministic=True` takes the dQ kernel instead. Calls with any feature, or fewer kv heads
    than q heads, run kernels/backward_features.py (atomic-free), or on Hopper the Gluon dK/dV
    kernel with dQ fused where dispatch.bwd_dkdv_path sends them (not deterministic); packed
    variable lengths its varlen variant where dispatch.hopper_gluon_varlen_bwd_applies holds. Dense calls
    run a per-shape plan (`_dense_plan`), as the forward does; more (batch x head) rows than a grid
    axis takes, in chunks of batch rows (row_chunks.py)."""
    if features is not DENSE or k.shape[-2] != q.shape[-2]:
        spans = spans_of(q, features)
        if spans:
            return backward_in_chunks(flash_attn_backward, spans, do, q, k, v, out, lse, softmax_scale, causal, config,
                                      deterministic, features)
        if features.varlen and on_hopper(q.device) and min(q.shape[0], k.shape[0], q.shape[1]):
            cfg = config or default_bwd_config(q.shape[-1], q.device)
            if dispatch.hopper_gluon_varlen_bwd_applies(cfg, q, k, v, do, features, deterministic):
                try:
                    return _backward_varlen_gluon(do, q, k, v, out, lse, softmax_scale, causal, features, cfg)
                except dispatch.GLUON_BUILD_ERRORS as exc:
                    dispatch.disable_gluon(exc)  # the Triton kernels from now on
                    _PLANS.clear()
        if not features.varlen and on_hopper(q.device) and min(q.shape[1], k.shape[1], q.shape[0] * q.shape[2]):
            cfg = config or default_bwd_config(q.shape[-1], q.device)
            path = bwd_dkdv_path(cfg, q, k, v, do, features, deterministic)
            if path in (GluonPath.DENSE, GluonPath.PACKED):
                try:
                    if path == GluonPath.PACKED:
                        return backward_packed(do, q, k, v, out, lse, softmax_scale, causal, cfg)
                    return _backward_features_gluon(do, q, k, v, out, lse, softmax_scale, causal, features, cfg)
                except dispatch.GLUON_BUILD_ERRORS as exc:
                    dispatch.disable_gluon(exc)  # the Triton kernels from now on
                    _PLANS.clear()
        return flash_attn_backward_features(do, q, k, v, out, lse, softmax_scale, causal, config, features)
    do, q, k, v = (last_dim_contiguous(t) for t in (do, q, k, v))
    batch, seqlen_q, heads, headdim = q.shape
    seqlen_k = k.shape[1]
    if batch * heads > GRID_ROWS:
        return backward_in_chunks(flash_attn_backward, row_spans(batch, heads), do, q, k, v, out, lse, softmax_scale,
                                  causal, config, deterministic, features)
    if seqlen_q == 0 or seqlen_k == 0 or batch * heads == 0:
        return (torch.zeros_like(q, memory_format=torch.contiguous_format),
                torch.zeros_like(k, memory_format=torch.contiguous_format),
                torch.zeros_like(v, memory_format=torch.contiguous_format))
    device = q.device  # the config passed in the key (None: the table's, as the forward's plan key has it)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), do.stride(), out.stride(), q.dtype, device, causal,
           config, deterministic, q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, do.data_ptr() % 16,
           out.data_ptr() % 16, dispatch.gluon_unavailable)
    plan = _PLANS.get(key) or _PLANS.put(key, _dense_plan(q, k, v, do, out, causal,
                                                          config or default_bwd_config(headdim, device), deterministic))
    try:
        if getattr(plan, "packed", False):  # the varlen kernels' path makes its own outputs
            return plan(do, q, k, v, out, lse, None, None, None, softmax_scale)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
        return plan(do, q, k, v, out, lse, torch.empty_like(lse), dk, dv, softmax_scale)
    except dispatch.GLUON_BUILD_ERRORS as exc:
        if not plan.gluon:
            raise
        dispatch.disable_gluon(exc)  # a Triton whose Gluon cannot build it: the Triton kernels from now on
        _PLANS.clear()
        return flash_attn_backward(do, q, k, v, out, lse, softmax_scale, causal, config, deterministic)


_PLANS = PlanCache()


def _backward_features_gluon(do, q, k, v, out, lse, softmax_scale: float, causal: bool, features: Features,
                             config: BwdConfig):
    """The Gluon dK/dV kernel with dQ fused (kernels/flash_attn_hopper.py) for a call with GQA/MQA,
    a window, softcap or ALiBi (or dropout, where the config asks): D = rowsum(dO * O), then one
    launch that adds dQ into a float32 accumulator and writes dK and dV summed over the q heads that
    share each kv head."""
    do, q, k, v = (last_dim_contiguous(t) for t in (do, q, k, v))
    batch, seqlen, heads, headdim = q.shape
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    delta = torch.empty_like(lse)
    dq_acc = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    _bwd_preprocess_launcher[(cdiv(seqlen, 64), batch * heads)](
        out, do, delta, dq_acc, *strides(out), *strides(do), heads, seqlen, HEAD_DIM=headdim,
        BLOCK_D=padded_headdim(headdim), BLOCK_M=64, ZERO_DQ=True)
    flags = dispatch.gluon_feature_flags(features, causal)
    dropout = bool(features.dropout_p)
    key = ("gluon", q.shape, q.stride(), k.shape, k.stride(), v.stride(), do.stride(), q.dtype, q.device, causal,
           tuple(flags.values()), dropout, config, q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16,
           do.data_ptr() % 16)
    hopper = dispatch.flash_attn_hopper
    plan = _PLANS.get(key) or _PLANS.put(key, hopper.backward_dkdv_hopper_plan(q, k, v, do, dk, dv, dq_acc, causal,
                                                                              config, flags=flags, dropout=dropout))
    qk_scale, values, _ = feature_args(q, k, softmax_scale, causal, features)
    _, window_left, window_right, softcap_log2, dropout_p, alibi, stride_alibi_b, _, _, rng_seed = values
    plan(q, k, v, do, lse, delta, dk, dv, dq_acc, softmax_scale,
         (qk_scale, window_left, window_right, softcap_log2, alibi, stride_alibi_b, dropout_p, rng_seed))
    return hopper.dq_from_accumulator(dq_acc, q.dtype, softmax_scale), dk, dv


def _backward_varlen_gluon(do, q, k, v, out, lse, softmax_scale: float, causal: bool, features: Features,
                           config: BwdConfig):
    """The Gluon dK/dV kernel with dQ fused for packed sequences: D = rowsum(dO * O) over all
    tokens (one packed sequence for the preprocess kernel) with the float32 dQ accumulator zeroed
    (its padded rows too: hopper/dq_cast.py's varlen_dq_accumulator), then one launch, then dQ
    cast from the accumulator."""
    from .forward import varlen_strides

    hopper = dispatch.flash_attn_hopper
    do, q, k, v = (last_dim_contiguous(t) for t in (do, q, k, v))
    total_q, heads, headdim = q.shape
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    delta = torch.empty_like(lse)
    cu_seqlens_q = features.cu_seqlens_q
    dq_acc = hopper.varlen_dq_accumulator(q, cu_seqlens_q.shape[0] - 1)
    _bwd_preprocess_launcher[(cdiv(dq_acc.shape[0], 64), heads)](
        out, do, delta, dq_acc, *varlen_strides(out), *varlen_strides(do), heads, total_q, HEAD_DIM=headdim,
        BLOCK_D=padded_headdim(headdim), BLOCK_M=64, ZERO_DQ=2)
    cu_seqlens_k, batch = features.cu_seqlens_k, cu_seqlens_q.shape[0] - 1
    # the varlen dK/dV plan's key: what its descriptors, grid and compiled kernel depend on (every
    # pointer's 16-byte alignment: Triton specialises on it)
    key = ("gluon-varlen", q.shape, q.stride(), k.shape, k.stride(), v.stride(), do.stride(), q.dtype, q.device,
           batch, features.max_seqlen_k, causal, config,
           *(t.data_ptr() % 16 for t in (q, k, v, do, lse, cu_seqlens_q, cu_seqlens_k)))
    plan = _PLANS.get(key) or _PLANS.put(key, hopper.varlen_backward_dkdv_hopper_plan(
        q, k, v, do, dk, dv, dq_acc, batch, features.max_seqlen_k, causal, config))
    plan(q, k, v, do, lse, delta, dk, dv, dq_acc, cu_seqlens_q, cu_seqlens_k, softmax_scale)
    dq = hopper.dq_from_varlen_accumulator(dq_acc, cu_seqlens_q, features.max_seqlen_q, q.shape, q.dtype,
                                           softmax_scale)
    return dq, dk, dv


def backward_packed(do, q, k, v, out, lse, softmax_scale: float, causal: bool, config: BwdConfig):
    """A dense call on the Gluon varlen backward (dispatch.GluonPath.PACKED): the batch
    rows as packed sequences; L copied to the packed (heads, batch * seqlen_q) layout the kernel
    reads (the forward wrote the dense one)."""
    do, q, k, v, out = (last_dim_contiguous(t) for t in (do, q, k, v, out))
    views = [dispatch.packed_view(t) for t in (do, q, k, v, out)]
    views = [t if t is not None else full.reshape(-1, *full.shape[2:]) for t, full in zip(views, (do, q, k, v, out))]
    packed_lse = lse.transpose(0, 1).reshape(lse.shape[1], -1)
    dq, dk, dv = _backward_varlen_gluon(*views, packed_lse, softmax_scale, causal, dispatch.packed_features(q, k),
                                        config)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)


class _DensePlan:
    """The dense backward's launches for tensors like these: D = rowsum(dO * O), then dK/dV (the
    Gluon kernel or the Triton one, adding dQ into a float32 accumulator where fused), then dQ
    (its own kernel into a fresh dq, or the accumulator converted to the inputs' dtype)."""

    def __init__(self, preprocess, dkdv, dq, gluon: bool, fused_dq: bool, dq_from_accumulator=None):
        self.preprocess, self.dkdv, self.dq = preprocess, dkdv, dq
        self.gluon, self.fused_dq = gluon, fused_dq
        # the accumulator cast to dQ: the Gluon kernel's holds dS K unscaled in register order, the
        # Triton kernel's dQ itself
        self.dq_from_accumulator = dq_from_accumulator or (lambda acc, dtype, softmax_scale: acc.to(dtype))

    def __call__(self, do, q, k, v, out, lse, delta, dk, dv, softmax_scale):
        if self.fused_dq:
            # the fused dQ's float32 accumulator (contiguous like dq), zeroed by the preprocess kernel
            dq_acc = torch.empty(q.shape, device=q.device, dtype=torch.float32)
            self.preprocess(out, do, delta, dq_acc)
            self.dkdv(q, k, v, do, lse, delta, dk, dv, dq_acc, softmax_scale)
            return self.dq_from_accumulator(dq_acc, q.dtype, softmax_scale), dk, dv
        self.preprocess(out, do, delta)
        self.dkdv(q, k, v, do, lse, delta, dk, dv, None, softmax_scale)
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)
        self.dq(q, k, v, do, lse, delta, dq, softmax_scale)
        return dq, dk, dv


def _dense_plan(q, k, v, do, out, causal: bool, cfg: BwdConfig, deterministic: bool) -> _DensePlan:
    """The launches of `flash_attn_backward` for tensors shaped, strided and aligned like these
    (dq, dk and dv are fresh and contiguous)."""
    batch, seqlen_q, heads, headdim = q.shape
    seqlen_k = k.shape[1]
    # for their strides (and a Triton plan's accumulator's); not kept by the plan
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    module = sys.modules[__name__]
    block_d = padded_headdim(headdim)
    pre_constexprs = {"HEAD_DIM": headdim, "BLOCK_D": block_d, "BLOCK_M": 64}
    pre_launch = DirectLaunch(module, "_bwd_preprocess_launcher", (cdiv(seqlen_q, 64), batch * heads),
                              {**pre_constexprs, "ZERO_DQ": False})
    pre_zero_launch = DirectLaunch(module, "_bwd_preprocess_launcher", (cdiv(seqlen_q, 64), batch * heads),
                                   {**pre_constexprs, "ZERO_DQ": True})
    pre_ints = (*strides(out), *strides(do), heads, seqlen_q)

    def preprocess(out, do, delta, dq_acc=None):
        if dq_acc is None:
            pre_launch(out, do, delta, delta, *pre_ints)
        else:  # also zeroes the fused dQ's accumulator
            pre_zero_launch(out, do, delta, dq_acc, *pre_ints)

    tma = bwd_uses_tma(cfg, q, k, v, do)
    common = {"HEAD_DIM": headdim, "BLOCK_D": block_d, "CAUSAL": causal, "TMA": tma}
    dq_ints = (*strides(q), *strides(k), *strides(v), *strides(do), *strides(dq), heads, seqlen_q, seqlen_k)
    dq_launch = DirectLaunch(module, "_bwd_dq_launcher", (cdiv(seqlen_q, cfg.block_m2), batch * heads), {
        "BLOCK_M": cfg.block_m2, "BLOCK_N": cfg.block_n2, "EVEN_M": seqlen_q % cfg.block_m2 == 0,
        "num_warps": cfg.dq_warps, "num_stages": cfg.dq_stages, **common})

    def dq_pass(q, k, v, do, lse, delta, dq, softmax_scale):
        if tma:
            ensure_descriptor_allocator()
        dq_launch(q, k, v, do, lse, delta, dq, *dq_ints, softmax_scale, softmax_scale * LOG2E.value)

    path = bwd_dkdv_path(cfg, q, k, v, do, deterministic=deterministic)
    if path == GluonPath.PACKED and on_hopper(q.device):
        def run_packed(do, q, k, v, out, lse, delta, dk, dv, softmax_scale):
            return backward_packed(do, q, k, v, out, lse, softmax_scale, causal, cfg)

        run_packed.gluon = run_packed.packed = True
        return run_packed
    if path == GluonPath.DENSE and on_hopper(q.device):
        # the Gluon kernel (compiled for sm_90 only), adding dQ itself where the config says so
        hopper = dispatch.flash_attn_hopper
        fused = bwd_gluon_fuses_dq(cfg, headdim, deterministic)
        gluon_runs = []  # made by the first call (where the kernel compiles, or fails to)

        def dkdv_gluon(q, k, v, do, lse, delta, dk, dv, dq_acc, softmax_scale):
            if not gluon_runs:
                gluon_runs.append(hopper.backward_dkdv_hopper_plan(q, k, v, do, dk, dv, dq_acc, causal, cfg))
            gluon_runs[0](q, k, v, do, lse, delta, dk, dv, dq_acc, softmax_scale)

        return _DensePlan(preprocess, dkdv_gluon, dq_pass, True, fused, hopper.dq_from_accumulator)
    fused = bwd_fuses_dq(cfg, seqlen_q, deterministic)
    fused_mode = 0
    if fused:  # TMA reduce-adds on Hopper, else element-wise atomics (also in Triton's CPU interpreter,
        # which has no descriptor reduce); the accumulator is fresh and contiguous like dq
        accumulator = torch.empty(q.shape, device=q.device, dtype=torch.float32)
        fused_mode = 2 if on_hopper(q.device) and tma_compatible(accumulator) else 1
    dkdv_ints = (*strides(q), *strides(k), *strides(v), *strides(do), *strides(dk), *strides(dv),
                 *(strides(dq) if fused else strides(dk)), heads, seqlen_q, seqlen_k)
    dkdv_launch = DirectLaunch(module, "_bwd_dkdv_launcher", (cdiv(seqlen_k, cfg.block_n1), batch * heads), {
        "BLOCK_M": cfg.block_m1, "BLOCK_N": cfg.block_n1, "EVEN_M": seqlen_q % cfg.block_m1 == 0,
        "EVEN_N": seqlen_k % cfg.block_n1 == 0, "QUERY_MAJOR": cfg.query_major, "FUSED_DQ": fused_mode,
        "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **common})

    def dkdv_triton(q, k, v, do, lse, delta, dk, dv, dq_acc, softmax_scale):
        if tma or fused_mode == 2:
            ensure_descriptor_allocator()
        acc = dk if dq_acc is None else dq_acc  # DQ is unused by the kernel unless dQ is fused
        dkdv_launch(q, k, v, do, lse, delta, dk, dv, acc, *dkdv_ints, softmax_scale, softmax_scale * LOG2E.value)

    return _DensePlan(preprocess, dkdv_triton, dq_pass, False, fused)

