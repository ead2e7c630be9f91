"""Dropout's keep-mask in Gluon, bit for bit kernels/dropout.py's: Philox 4x32-10 (Salmon et al.
2011) as `tl.philox` computes it (triton/language/random.py), keyed by the 64-bit seed, counted by
(query row, key column, batch x head, offset), its first output made a uniform draw in [0, 1) as
`tl.uint_to_uniform_float` makes it. So the Gluon dK/dV kernel redraws the entries the Triton
forward and `dropout_keep_mask` drop: a forward on one and a backward on the other agree."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

PHILOX_KEY_A: gl.constexpr = gl.constexpr(0x9E3779B9)
PHILOX_KEY_B: gl.constexpr = gl.constexpr(0xBB67AE85)
PHILOX_ROUND_A: gl.constexpr = gl.constexpr(0xD2511F53)
PHILOX_ROUND_B: gl.constexpr = gl.constexpr(0xCD9E8D57)
PHILOX_ROUNDS: gl.constexpr = gl.constexpr(10)


@gluon.jit
def _philox_first(seed, c0, c1, c2, c3):
    """The first 32-bit output of Philox 4x32-10 for counter (c0, c1, c2, c3) (int32 tensors of
    one shape and layout) and key `seed` (int64: low word k0, high word k1)."""
    seed = seed.to(gl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(gl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(gl.uint32)
    c0 = c0.to(gl.uint32, bitcast=True)
    c1 = c1.to(gl.uint32, bitcast=True)
    c2 = c2.to(gl.uint32, bitcast=True)
    c3 = c3.to(gl.uint32, bitcast=True)
    for _ in gl.static_range(PHILOX_ROUNDS):
        prev0 = c0
        prev2 = c2
        c0 = gl.umulhi(PHILOX_ROUND_B, prev2) ^ c1 ^ k0
        c2 = gl.umulhi(PHILOX_ROUND_A, prev0) ^ c3 ^ k1
        c1 = gl.mul(PHILOX_ROUND_B, prev2, sanitize_overflow=False)
        c3 = gl.mul(PHILOX_ROUND_A, prev0, sanitize_overflow=False)
        k0 = gl.add(k0, PHILOX_KEY_A, sanitize_overflow=False)
        k1 = gl.add(k1, PHILOX_KEY_B, sanitize_overflow=False)
    return c0


@gluon.jit
def _dropout_keep(seed, rng_offset, bh, rows, cols, dropout_p):
    """Which entries of a tile are kept (kernels/dropout.py's `_dropout_keep`): `rows` and `cols`
    the query and key indices within the sequence (int32, 2D broadcastable: slices of one layout),
    `bh` the batch x head index, `rng_offset` the offset drawn with the seed."""
    zero = rows * 0 + cols * 0
    r = _philox_first(seed, zero + rows, zero + cols, zero + bh, zero + rng_offset)
    x = r.to(gl.int32, bitcast=True)
    x = gl.where(x < 0, -x - 1, x)
    return x * 4.6566127342e-10 >= dropout_p


@gluon.jit
def _rng_args(RngSeed, bh, dropout_p, DROPOUT: gl.constexpr):
    """The keep-mask's (seed, offset, batch x head `bh`, p): with DROPOUT the seed and offset read
    from the (seed, offset) int64 tensor RngSeed (kernels/dropout.py's `_rng_state`); else zeros,
    not read."""
    if DROPOUT:
        seed = gl.load(RngSeed)
        rng_offset = gl.load(RngSeed + 1).to(gl.int32)
    else:
        seed = 0
        rng_offset = 0
    return seed, rng_offset, bh, dropout_p
