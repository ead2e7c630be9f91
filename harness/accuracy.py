"""The accuracy gate: every job's provider output is checked against the float64 reference
before it is timed.

The provider runs on fresh random inputs of the job's own shape, with batch at least 2 and
heads at least 3 (`check_shape`), so that a kernel mixing up batches or heads cannot pass by
the shape alone. The float64 reference (baselines.reference) runs on a deterministic sample
of that output: the (batch, head) pairs first/last/middle x first/last (every batch and head
regime: the first, the last and one in between), and the query rows 0..S-1 when that is
affordable, else the first and the last `rows` query rows (the last ones read every key). Rows
of attention are independent, so the sample's reference is exact: with causal masking
(bottom-right aligned, seqlen_q = seqlen_k) query rows [a, b) see keys [0, b).

Backward modes also check dQ, dK and dV: the upstream gradient is random on the sampled
rows of the sampled pairs and zero elsewhere, so the provider's full-shape gradients and the
reference's gradients of the sample are the same function.

The error is max ||x - ref|| / ||ref|| over the output (and gradients) on the sample; any
inf or NaN anywhere in the provider's output or gradients makes it NaN (wrong). The check
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
# Reference work per check: sampled pairs x sampled query rows x keys score entries (float64;
# the backward keeps a few tensors of this size): 2**25 entries is 256 MiB each.
CHECK_MAX_SCORES = 2**25
CHECK_MIN_ROWS = 128  # the largest tile's rows: a sampled block spans a whole tile at least


class WrongOutput(Exception):
    """The provider returned something that is not attention's output (shape, dtype)."""


@dataclass(frozen=True)
class Check:
    error: float  # max relative error on the sample; NaN when any value is inf or NaN
    shape: str  # what was checked, for the row's check_shape column
    nonfinite: str = ""  # where an inf/NaN was found ('' when none)


def check_shape(spec: Spec) -> Spec:
    """The job's shape with batch >= 2 and heads >= 3."""
    return replace(spec, batch=max(spec.batch, CHECK_MIN_BATCH), heads=max(spec.heads, CHECK_MIN_HEADS))


def sample_pairs(batch: int, heads: int) -> list[tuple[int, int]]:
    """(batch, head) pairs: first/last x first/last and the middle one, without repeats."""
    pairs = [(0, 0), (batch - 1, heads - 1), (0, heads - 1), (batch - 1, 0), (batch // 2, heads // 2)]
    return list(dict.fromkeys(pairs))


def row_blocks(seqlen: int, pairs: int, max_scores: int = CHECK_MAX_SCORES) -> list[tuple[int, int]]:
    """Query-row blocks [start, end) of the sample: all rows when affordable, else the first
    and the last `rows` rows."""
    rows = max(CHECK_MIN_ROWS, max_scores // (2 * pairs * seqlen))
    if 2 * rows >= seqlen:
        return [(0, seqlen)]
    return [(0, rows), (seqlen - rows, seqlen)]


def describe(shape: Spec, pairs: list[tuple[int, int]], blocks: list[tuple[int, int]]) -> str:
    rows = " and ".join(f"{a}-{b - 1}" for a, b in blocks)
    sample = " ".join(f"b{b}h{h}" for b, h in pairs)
    return (f"b{shape.batch} n{shape.seqlen} h{shape.heads} d{shape.hdim} {shape.mode}; reference on "
            f"{sample}, query rows {rows}")


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


def _gather(t: torch.Tensor, pairs) -> torch.Tensor:
    """(P, S, 1, D): the sampled (batch, head) slices of a (B, S, H, D) tensor."""
    return torch.stack([t[b, :, h] for b, h in pairs])[:, :, None]


def check_accuracy(forward, spec: Spec, device: torch.device, max_scores: int = CHECK_MAX_SCORES,
                   enlarge: bool = True) -> Check:
    """Run `forward(q, k, v, causal, softmax_scale)` on check_shape(spec) (on spec's own shape
    when `enlarge` is False) and compare the sample with the float64 reference (see the module
    docstring)."""
    shape = check_shape(spec) if enlarge else spec
    with_grad = spec.mode != "fwd"
    q, k, v = random_inputs(shape, device, seed_of("check", shape), with_grad)  # (B, S, H, D)
    scale = 1.0 / math.sqrt(spec.hdim)
    out = forward(q, k, v, spec.causal, scale)
    if not isinstance(out, torch.Tensor) or out.shape != q.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise WrongOutput(f"output is {got}, expected a tensor of shape {tuple(q.shape)} (batch, seqlen, heads, "
                          "headdim)")
    pairs = sample_pairs(shape.batch, shape.heads)
    blocks = row_blocks(shape.seqlen, len(pairs), max_scores)
    text = describe(shape, pairs, blocks)
    found = _nonfinite("the output", out.detach())
    if found:
        return Check(math.nan, text, found)
    q64, k64, v64 = (_gather(t.detach(), pairs).double().requires_grad_(with_grad) for t in (q, k, v))
    out_sample = _gather(out.detach(), pairs)
    dout = torch.zeros_like(out) if with_grad else None  # random on the sample only, see the docstring
    errors, loss = [], 0.0
    for start, end in blocks:
        keys = end if spec.causal else shape.seqlen
        ref, _ = attention_reference(q64[:, start:end], k64[:, :keys], v64[:, :keys], softmax_scale=scale,
                                     causal=spec.causal)
        errors.append(_relative_error(out_sample[:, start:end], ref))
        if with_grad:
            g = torch.randn(ref.shape, device=device, generator=torch.Generator(device).manual_seed(start),
                            dtype=torch.float64)
            for index, (b, h) in enumerate(pairs):
                dout[b, start:end, h] = g[index, :, 0].to(dout.dtype)
            loss = loss + (ref * _gather(dout, pairs)[:, start:end].double()).sum()
    if with_grad:
        grads = torch.autograd.grad(out, (q, k, v), dout)
        for name, grad in zip(("dQ", "dK", "dV"), grads, strict=True):
            found = _nonfinite(name, grad)
            if found:
                return Check(math.nan, text, found)
        ref_grads = torch.autograd.grad(loss, (q64, k64, v64))
        rows = torch.cat([torch.arange(a, b) for a, b in blocks]).to(device)
        dq, dk, dv = (_gather(grad, pairs) for grad in grads)
        errors.append(_relative_error(dq[:, rows], ref_grads[0][:, rows]))
        errors += [_relative_error(dk, ref_grads[1]), _relative_error(dv, ref_grads[2])]
    error = max(errors)
    return Check(math.nan if math.isnan(error) else error, text)
