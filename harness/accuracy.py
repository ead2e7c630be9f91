"""The accuracy gate: every job's provider output is checked against the float64 reference
before it is timed.

The provider runs on fresh random inputs of the job's own shape, with batch at least 2 and
heads at least 3 (`check_shape`), so that a kernel mixing up batches or heads cannot pass by
the shape alone. The float64 reference (baselines.reference) runs on copies of the inputs
made before the call, for every (batch, head) pair, in chunks of at most CHECK_CHUNK_SCORES
score entries (its memory). Its query rows are all rows when the whole check stays within
CHECK_MAX_SCORES score entries (its time; in the paper's sweep, batch x heads x seqlen^2 =
2^25 x seqlen / head dim: up to seqlen = 64 x head dim), else the first and the last `rows`
query rows of every pair, at least 2048 in the paper's sweep (the last ones read every key).
Rows of attention are independent, so the reference of a block of rows is exact: with causal
masking (bottom-right aligned, seqlen_q = seqlen_k) query rows [a, b) see keys [0, b).

Backward modes also check dQ, dK and dV: the upstream gradient is random on the checked rows
and zero elsewhere, so the provider's full-shape gradients and the reference's gradients of
the checked rows are the same function.

The error is the largest ||x - ref|| / ||ref|| over every (batch, head, tile of CHECK_TILE
rows) of the output (and of dQ, dK, dV), so that one wrong batch, head or tile is not
averaged away by the right ones. Any inf or NaN in the provider's output or gradients, or
inputs that the provider modified in place, make it wrong whatever the error. The check
depends only on the job, never on the order of the sweep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from baselines.providers import Spec
from baselines.reference import attention_reference
from harness.timing import random_inputs, seed_of

# Largest relative error (norm-wise, against float64) still counted correct. fp16/bf16: a
# correct kernel is ~1e-3 (fp16) / ~8e-3 (bf16) on random inputs; fp32 allows for Triton's
# TF32 dots on a GPU.
TOLERANCE = {"fp16": 2e-2, "bf16": 2e-2, "fp32": 2e-3}
CHECK_MIN_BATCH, CHECK_MIN_HEADS = 2, 3
# Reference work per check, as float64 score entries (query rows x keys, over every pair): the
# whole check (its time), and one chunk of it (its memory: the backward keeps a few tensors of
# this size, 2**25 entries is 256 MiB each).
CHECK_MAX_SCORES = 2**31
CHECK_CHUNK_SCORES = 2**25
CHECK_MIN_ROWS = 128  # the largest tile's rows: a sampled block spans a whole tile at least
CHECK_TILE = 128  # rows of the unit the error is taken over, per (batch, head)


class WrongOutput(Exception):
    """The provider returned something that is not attention's output (shape, dtype)."""


@dataclass(frozen=True)
class Check:
    error: float  # the largest relative error of a (batch, head, tile); NaN when the check found a fault
    shape: str  # what was checked, for the row's check_shape column
    fault: str = ""  # what makes the output wrong whatever the error: an inf/NaN, modified inputs ('' when none)
    worst: str = ""  # where the largest error is


def check_shape(spec: Spec) -> Spec:
    """The job's shape with batch >= 2 and heads >= 3."""
    return replace(spec, batch=max(spec.batch, CHECK_MIN_BATCH), heads=max(spec.heads, CHECK_MIN_HEADS))


def row_blocks(seqlen: int, pairs: int, max_scores: int = CHECK_MAX_SCORES) -> list[tuple[int, int]]:
    """Query-row blocks [start, end) checked in every pair: all rows when affordable, else the
    first and the last `rows` rows."""
    rows = max(CHECK_MIN_ROWS, max_scores // (2 * pairs * seqlen))
    if 2 * rows >= seqlen:
        return [(0, seqlen)]
    return [(0, rows), (seqlen - rows, seqlen)]


def chunks(pairs: int, blocks: list[tuple[int, int]], seqlen: int, chunk_scores: int = CHECK_CHUNK_SCORES):
    """(pair start, pair end, row start, row end) pieces of the check, each at most
    `chunk_scores` score entries (or one row of one pair)."""
    for start, end in blocks:
        per_pair = (end - start) * seqlen
        if per_pair <= chunk_scores:
            step = max(1, chunk_scores // per_pair)
            yield from ((p, min(p + step, pairs), start, end) for p in range(0, pairs, step))
        else:
            rows = max(1, chunk_scores // seqlen)
            yield from ((p, p + 1, a, min(a + rows, end)) for p in range(pairs) for a in range(start, end, rows))


def describe(shape: Spec, blocks: list[tuple[int, int]]) -> str:
    rows = " and ".join(f"{a}-{b - 1}" for a, b in blocks)
    return (f"b{shape.batch} n{shape.seqlen} h{shape.heads} d{shape.hdim} {shape.mode}; reference on every "
            f"(batch, head), query rows {rows}, error per {CHECK_TILE}-row tile")


def _relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def _max_abs_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref).abs().max().item()


def within_twice_the_error(actual: torch.Tensor, reference: torch.Tensor, yardstick: torch.Tensor, eps: float,
                           error=_max_abs_error) -> tuple[bool, float, float]:
    """flash-attn's criterion: `actual` is finite and no further from the float64 `reference` than
    twice `yardstick`'s distance (PyTorch's same-dtype result, or a kept kernel's) plus `eps`.
    Returns (whether it holds, actual's error, yardstick's error), `error` max |x - ref| unless given."""
    got, bound = error(actual, reference), error(yardstick, reference)
    return bool(torch.isfinite(actual).all()) and got <= 2 * bound + eps, got, bound


def _nonfinite(name: str, t: torch.Tensor) -> str:
    bad = (~torch.isfinite(t)).nonzero()
    if bad.numel() == 0:
        return ""
    b, s, h = bad[0, :3].tolist()
    kinds = sorted({"NaN" if math.isnan(x) else "inf" for x in t[tuple(bad[:64].T)].float().tolist()})
    return f"{'/'.join(kinds)} in {name} ({len(bad)} values; first at batch {b}, row {s}, head {h})"


class _TileErrors:
    """Sums of squared error and squared reference per (batch x head, tile of CHECK_TILE rows)."""

    def __init__(self, name: str, pairs: int, seqlen: int, device):
        self.name, self.seqlen = name, seqlen
        tiles = math.ceil(seqlen / CHECK_TILE)
        self.error = torch.zeros(pairs, tiles, dtype=torch.float64, device=device)
        self.norm = torch.zeros_like(self.error)

    def add(self, p0: int, row0: int, x: torch.Tensor, ref: torch.Tensor) -> None:
        """x, ref: (pairs p0.., rows row0.., D)."""
        pairs, rows = ref.shape[:2]
        tile = (torch.arange(row0, row0 + rows, device=ref.device) // CHECK_TILE)[None, :]
        cell = ((torch.arange(p0, p0 + pairs, device=ref.device)[:, None] * self.error.shape[1]) + tile).flatten()
        self.error.view(-1).index_add_(0, cell, ((x.double() - ref) ** 2).sum(-1).flatten())
        self.norm.view(-1).index_add_(0, cell, (ref ** 2).sum(-1).flatten())

    def worst(self, heads: int) -> tuple[float, str]:
        """(largest relative error of a cell, where it is); an empty cell counts 0."""
        ratio = torch.where(self.norm > 0, self.error / self.norm.clamp_min(1e-300),
                            torch.where(self.error > 0, math.inf, 0.0)).sqrt()
        index = int(ratio.argmax())
        pair, tile = divmod(index, ratio.shape[1])
        rows = f"{tile * CHECK_TILE}-{min((tile + 1) * CHECK_TILE, self.seqlen) - 1}"
        return ratio.view(-1)[index].item(), f"{self.name} at batch {pair // heads}, head {pair % heads}, rows {rows}"


def _pairs(t: torch.Tensor, p0: int, p1: int, rows: slice) -> torch.Tensor:
    """(p1 - p0, rows, D): pairs p0..p1-1 (p = batch * heads + head) of a (B, S, H, D) tensor."""
    heads = t.shape[2]
    p = torch.arange(p0, p1, device=t.device)
    return t[p // heads, rows, p % heads]


def _modified(inputs, copies) -> str:
    changed = [name for name, t, copy in zip("qkv", inputs, copies, strict=True) if not torch.equal(t.detach(), copy)]
    return f"the provider modified its input {', '.join(changed)} in place" if changed else ""


def check_accuracy(forward, spec: Spec, device: torch.device, max_scores: int = CHECK_MAX_SCORES,
                   enlarge: bool = True, chunk_scores: int = CHECK_CHUNK_SCORES) -> Check:
    """Run `forward(q, k, v, causal, softmax_scale)` on check_shape(spec) (on spec's own shape
    when `enlarge` is False) and compare it with the float64 reference (see the module
    docstring)."""
    shape = check_shape(spec) if enlarge else spec
    with_grad = spec.mode != "fwd"
    q, k, v = random_inputs(shape, device, seed_of("check", shape), with_grad)  # (B, S, H, D)
    copies = [t.detach().clone() for t in (q, k, v)]  # the reference's inputs, whatever the call does to q, k, v
    scale = 1.0 / math.sqrt(spec.hdim)
    out = forward(q, k, v, spec.causal, scale)
    if not isinstance(out, torch.Tensor) or out.shape != q.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise WrongOutput(f"output is {got}, expected a tensor of shape {tuple(q.shape)} (batch, seqlen, heads, "
                          "headdim)")
    pairs, seqlen = shape.batch * shape.heads, shape.seqlen
    blocks = row_blocks(seqlen, pairs, max_scores)
    text = describe(shape, blocks)
    found = _modified((q, k, v), copies) or _nonfinite("the output", out.detach())
    if found:
        return Check(math.nan, text, found)
    grads = ()
    if with_grad:  # random upstream gradient on the checked rows only, see the module docstring
        dout = torch.zeros_like(out)
        generator = torch.Generator(device).manual_seed(seed_of("dout", shape))
        for start, end in blocks:
            dout[:, start:end] = torch.randn(dout[:, start:end].shape, generator=generator, device=device,
                                             dtype=torch.float64).to(dout.dtype)
        dout_copy = dout.clone()
        grads = torch.autograd.grad(out, (q, k, v), dout)
        found = _modified((q, k, v), copies) or next(
            (f for f in (_nonfinite(name, g) for name, g in zip(("dQ", "dK", "dV"), grads, strict=True)) if f), "")
        if found:
            return Check(math.nan, text, found)
    errors = {name: _TileErrors(name, pairs, seqlen, device) for name in ("the output", "dQ", "dK", "dV")}
    ref_dk = torch.zeros(pairs, seqlen, shape.hdim, dtype=torch.float64, device=device) if with_grad else None
    ref_dv = torch.zeros_like(ref_dk) if with_grad else None
    q0, k0, v0 = copies
    for p0, p1, start, end in chunks(pairs, blocks, seqlen, chunk_scores):
        keys = end if spec.causal else seqlen
        qc = _pairs(q0, p0, p1, slice(start, end)).double()[:, :, None].requires_grad_(with_grad)  # (P, r, 1, D)
        kc, vc = (_pairs(t, p0, p1, slice(0, keys)).double()[:, :, None].requires_grad_(with_grad) for t in (k0, v0))
        ref, _ = attention_reference(qc, kc, vc, softmax_scale=scale, causal=spec.causal)
        errors["the output"].add(p0, start, _pairs(out.detach(), p0, p1, slice(start, end)), ref[:, :, 0].detach())
        if with_grad:
            upstream = _pairs(dout_copy, p0, p1, slice(start, end)).double()[:, :, None]
            dq, dk, dv = torch.autograd.grad((ref * upstream).sum(), (qc, kc, vc))
            errors["dQ"].add(p0, start, _pairs(grads[0], p0, p1, slice(start, end)), dq[:, :, 0])
            ref_dk[p0:p1, :keys] += dk[:, :, 0]
            ref_dv[p0:p1, :keys] += dv[:, :, 0]
    if with_grad:
        errors["dK"].add(0, 0, _pairs(grads[1], 0, pairs, slice(None)), ref_dk)
        errors["dV"].add(0, 0, _pairs(grads[2], 0, pairs, slice(None)), ref_dv)
    error, worst = max(e.worst(shape.heads) for name, e in errors.items() if with_grad or name == "the output")
    return Check(math.nan if math.isnan(error) else error, text, worst=worst)
