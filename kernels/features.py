"""What the forward and backward Triton kernels share for flash-attn's features beyond dense
attention: the score modifications (softcap, ALiBi), the sliding-window mask and the key or query
block ranges it leaves, and the host side that turns a `Features` into kernel arguments.

Semantics are flash-attn 2.x's (baselines/reference.py states them): scores are scaled, then
softcapped (`softcap * tanh(s / softcap)`), then biased by ALiBi (`-slope * |i + sk - sq - j|`),
then masked; query row i sees key j iff `i + sk - sq - left <= j <= i + sk - sq + right`
(bottom-right aligned; causal is right = 0). The kernels work in log2 units (exp2), so the
host folds log2(e) into the softcap and the kernels into the ALiBi slope.

Window sides reach the kernels as non-negative ints: an unbounded side is `UNBOUNDED`, wider than
any sequence, so one formula serves causal, one-sided and two-sided windows alike. Every helper
takes row and column indices as broadcastable 2D tensors, so the backward's transposed tiles
(S^T = K Q^T) call them with the roles of the axes swapped.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .checks import Features
from .common import LOG2E, interpreter_enabled

UNBOUNDED = 1 << 30  # a window side without a bound (sequence lengths stay below 2^30)


# On the GPU tanh is one special-function instruction (PTX tanh.approx.f32, relative error at
# most 2^-11: far below bf16's rounding of the scores), where the exp2 form costs two (ex2 and a
# reciprocal) beside the softmax's own exp2. Triton's interpreter has no inline PTX.
_TANH_APPROX = tl.constexpr(not interpreter_enabled())


@triton.jit
def _tanh(x):
    """tanh(x); off the GPU 2 / (1 + exp(-2x)) - 1 (saturates to +-1, never NaN)."""
    if _TANH_APPROX:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return 2.0 / (1.0 + tl.math.exp2(x * (-2.0 * LOG2E))) - 1.0


@triton.jit
def _scores(s, qk_scale, softcap_log2, alibi_log2, rows, cols, offset,
            SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Scores in log2 units from raw dots `s` = q . k, and the tanh of the softcap (for its
    derivative 1 - tanh^2 in the backward; `s` itself when there is no softcap). With SOFTCAP,
    qk_scale is softmax_scale / softcap and softcap_log2 is softcap * log2(e); without, qk_scale
    is softmax_scale * log2(e). `rows` and `cols` index the tile's queries and keys (2D,
    broadcastable), `offset` = seqlen_k - seqlen_q."""
    if SOFTCAP:
        t = _tanh(s * qk_scale)
        s = softcap_log2 * t
    else:
        t = s
        s = s * qk_scale
    if ALIBI:
        dist = rows + offset - cols
        s = s - alibi_log2 * tl.where(dist < 0, -dist, dist).to(tl.float32)
    return s, t


@triton.jit
def _in_window(rows, cols, offset, window_left, window_right):
    """Whether query `rows` see key `cols` (2D, broadcastable) under a bottom-right window."""
    diag = rows + offset
    return (cols <= diag + window_right) & (cols >= diag - window_left)


@triton.jit
def _window_key_blocks(start_m, seqlen_q, seqlen_k, window_left, window_right,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks the query block [start_m, start_m + BLOCK_M) visits under a window, as
    (lo, full_lo, full_hi, hi): [lo, full_lo) and [full_hi, hi) need a mask, [full_lo, full_hi)
    is visible to every row. Blocks entirely outside the window are outside [lo, hi): skipped."""
    first = start_m + seqlen_k - seqlen_q  # the first row's diagonal key
    lo = tl.maximum(first - window_left, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(tl.maximum(first + BLOCK_M + window_right, 0), seqlen_k)
    # every row sees every key of a block from the last row's leftmost key to the first row's rightmost
    full_lo = tl.minimum(tl.cdiv(tl.maximum(first + BLOCK_M - 1 - window_left, 0), BLOCK_N) * BLOCK_N, hi)
    full_hi = tl.maximum(tl.maximum(tl.minimum(first + window_right + 1, seqlen_k), 0) // BLOCK_N * BLOCK_N,
                         full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _window_query_blocks(start_n, seqlen_q, seqlen_k, window_left, window_right,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query blocks that see some key of [start_n, start_n + BLOCK_N) under a window, as
    (lo, full_lo, full_hi, hi) like _window_key_blocks: row i sees key j iff
    j - offset - right <= i <= j - offset + left."""
    offset = seqlen_k - seqlen_q
    lo = tl.maximum(start_n - offset - window_right, 0) // BLOCK_M * BLOCK_M
    hi = tl.minimum(tl.maximum(start_n + BLOCK_N - offset + window_left, 0), seqlen_q)
    full_lo = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - offset - window_right, 0), BLOCK_M) * BLOCK_M,
                         hi)
    full_hi = tl.maximum(tl.maximum(tl.minimum(start_n - offset + window_left + 1, seqlen_q), 0) // BLOCK_M
                         * BLOCK_M, full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def _seq_bounds(Cu, b):
    """(start as int64, length as int32) of sequence b in a packed varlen tensor."""
    start = tl.load(Cu + b)
    return start.to(tl.int64), tl.load(Cu + b + 1) - start


def feature_args(q, k, softmax_scale: float, causal: bool, features: Features) -> tuple[float, tuple, dict]:
    """(qk_scale, runtime arguments, constexprs) of the feature kernels for one call.

    Runtime arguments, in the kernels' order: kv_group (q heads per kv head), window_left,
    window_right (non-negative, UNBOUNDED for no bound; causal is right = 0), softcap * log2(e),
    dropout_p, Alibi and its batch stride (0 for slopes of shape (heads,)), CuSeqQ, CuSeqK,
    RngSeed (None where unused: a constexpr for Triton)."""
    left, right = features.window_left, features.window_right
    window = causal or left >= 0 or right >= 0
    softcap = features.softcap
    qk_scale = softmax_scale / softcap if softcap else softmax_scale * LOG2E.value
    alibi = features.alibi_slopes
    if alibi is not None:
        alibi = alibi.contiguous()  # the kernels read slope (b, h) at b * stride + h
    args = (q.shape[-2] // k.shape[-2],
            min(left, UNBOUNDED) if left >= 0 else UNBOUNDED,
            0 if causal else (min(right, UNBOUNDED) if right >= 0 else UNBOUNDED),
            softcap * LOG2E.value, features.dropout_p,
            alibi, 0 if alibi is None or alibi.dim() == 1 else alibi.stride(0),
            *(None if cu is None else cu.contiguous() for cu in (features.cu_seqlens_q, features.cu_seqlens_k)),
            features.rng_seed if features.dropout_p else None)
    constexprs = {"WINDOW": window, "SOFTCAP": bool(softcap), "ALIBI": alibi is not None,
                  "DROPOUT": bool(features.dropout_p), "VARLEN": features.varlen}
    return qk_scale, args, constexprs
