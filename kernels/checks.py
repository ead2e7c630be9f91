"""Argument checks shared by the public API, the custom ops' real and fake implementations, so
that a bad call raises the same clear message eagerly, under torch.compile and under export.

Every error names the argument and what was expected. Checks that read tensor values
(cu_seqlens) need the values on the host: they run in eager calls and are skipped while a
CUDA graph is being captured (a capture cannot synchronise) and on fake tensors (no values).
"""

from __future__ import annotations

import itertools
import math
import numbers
import weakref
from dataclasses import dataclass

import torch

from .common import interpreter_enabled
from .configs import MAX_HEADDIM, SUPPORTED_DTYPES


@dataclass(frozen=True)
class Features:
    """What a call asks for beyond dense attention (flash-attn 2.x semantics). Window sides are
    -1 when unbounded; a causal call keeps window_right = -1 (causal is its right side, 0). `rng_seed` is an int64 tensor of two
    values (seed, offset) drawn from PyTorch's generator for dropout, read inside the kernel."""

    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    alibi_slopes: torch.Tensor | None = None
    dropout_p: float = 0.0
    rng_seed: torch.Tensor | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def dense(self) -> bool:
        """No feature but causal: the case every kernel (the Gluon ones too) serves."""
        return (self.window_left < 0 and self.window_right < 0 and not self.softcap and self.alibi_slopes is None
                and not self.dropout_p and not self.varlen)


DENSE = Features()


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, torch._subclasses.FakeTensor) or t.device.type == "meta"


# CUDA inputs (types, shapes, dtypes, devices) that passed check_qkv: a repeated call skips the
# checks, which cost a short call's host time as much as a launch (bounded: cleared when full)
_VALID_CUDA_QKV: set[tuple] = set()
_VALID_CUDA_QKV_MAX = 1024


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: bool = False) -> None:
    """q (batch, seqlen_q, heads, headdim) and k, v (batch, seqlen_k, kv_heads, headdim), or the
    packed (total, heads, headdim) layout when `varlen`."""
    key = None
    if type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor and q.is_cuda:
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, varlen)
        if key in _VALID_CUDA_QKV:
            return
    _check_qkv(q, k, v, varlen)
    if key is not None:
        if len(_VALID_CUDA_QKV) >= _VALID_CUDA_QKV_MAX:
            _VALID_CUDA_QKV.clear()
        _VALID_CUDA_QKV.add(key)


def _check_qkv(q, k, v, varlen: bool) -> None:
    dims = 3 if varlen else 4
    layout = "(total_tokens, heads, headdim)" if varlen else "(batch, seqlen, heads, headdim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name} must have {dims} dimensions {layout}, got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.device.type not in ("cuda", "meta") and not interpreter_enabled() and not _is_fake(q):
        raise ValueError(f"q is on {q.device}: the Triton kernels need a CUDA tensor, or set "
                         "TRITON_INTERPRET=1 in the environment before importing `kernels` to "
                         "run them in Triton's CPU interpreter (slow, for tests)")
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and interpreter_enabled():
        raise TypeError("q is bfloat16 on the CPU: Triton's interpreter computes bfloat16 dots wrongly "
                        "(silently); use float16 or float32 there, bfloat16 on a GPU")
    heads, headdim = q.shape[-2], q.shape[-1]
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not varlen and k.shape[0] != q.shape[0]:
        raise ValueError(f"k and v must have q's batch size {q.shape[0]}, got {k.shape[0]}")
    if k.shape[-1] != headdim:
        raise ValueError(f"k and v must have q's head dim {headdim}, got {k.shape[-1]}")
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"head dim must be between 1 and {MAX_HEADDIM}, got {headdim}")
    kv_heads = k.shape[-2]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"k and v heads ({kv_heads}) must divide q heads ({heads})")


def _python_scalar(value):
    """A numpy scalar or a 0-d tensor as the Python number it holds (flash-attn's arguments are
    read by Python, which takes both); anything else unchanged. A 0-d CUDA tensor is read with
    one device-to-host copy, as flash-attn's conversion to a C++ float does."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        return value.item()
    return value


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def softmax_scale_or_default(softmax_scale, headdim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(headdim)
    softmax_scale = _python_scalar(softmax_scale)
    if not _real(softmax_scale):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale}")
    return float(softmax_scale)


def check_flag(name: str, value, default: bool | None = None) -> bool:
    """A flag as Python reads flash-attn's: a bool, 0 or 1, a numpy bool or a 0-d tensor of one;
    None is `default` where the argument has one (flash-attn's `deterministic`)."""
    if value is None and default is not None:
        return default
    value = _python_scalar(value)
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name} must be a bool (or 0/1), got {value!r}")


def window_sides(window_size, causal: bool) -> tuple[int, int]:
    """(left, right) from flash-attn's window_size (a pair of ints: a tuple, a list, a 2-element
    integer tensor), -1 meaning unbounded; causal sets right to 0 (and keeps a tighter right
    side), as flash-attn does. A side that is not a whole number is refused, not truncated."""
    if isinstance(window_size, torch.Tensor):
        if window_size.dtype.is_floating_point or window_size.dtype.is_complex or window_size.dim() != 1:
            raise TypeError(f"window_size must be a pair of ints (left, right), got a tensor {window_size!r}")
        window_size = window_size.tolist()
    try:
        sides = [_python_scalar(side) for side in window_size]
    except TypeError:
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}") from None
    if len(sides) != 2 or not all(_real(side) and math.isfinite(side) and side == int(side) for side in sides):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = (int(side) for side in sides)
    if left < -1 or right < -1:
        raise ValueError(f"window_size sides must be >= -1 (-1 = unbounded), got {(left, right)}")
    if causal:
        right = 0
    return left, right


def check_scalars(dropout_p, softcap) -> tuple[float, float]:
    dropout_p, softcap = _python_scalar(dropout_p), _python_scalar(softcap)
    if not _real(dropout_p) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    if not _real(softcap) or not math.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be a finite float >= 0 (0 = off), got {softcap!r}")
    if softcap and dropout_p:
        raise ValueError(f"softcap ({softcap}) cannot be combined with dropout_p ({dropout_p}): flash-attn "
                         "refuses the pair (its backward has no softcapped dropout); pass one of them")
    return float(dropout_p), float(softcap)


def check_alibi(alibi_slopes, batch: int, heads: int, device: torch.device) -> None:
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a float32 tensor, got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes must be on the inputs' device {device}, got {alibi_slopes.device}")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}), "
                         f"got {tuple(alibi_slopes.shape)}")


def check_cu_seqlens(name: str, cu_seqlens, total: int, max_seqlen, device: torch.device) -> None:
    """cu_seqlens: int32 (batch + 1,) on the inputs' device, starting at 0, non-decreasing, ending
    at the packed tensor's token count; `max_seqlen` at least the longest sequence."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.device != device:
        raise ValueError(f"{name} must be on the inputs' device {device}, got {cu_seqlens.device}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{name} must have shape (batch + 1,) with batch >= 1, got {tuple(cu_seqlens.shape)}")
    max_name = "max_seqlen_" + name[-1]
    if not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool) or max_seqlen < 0:
        raise TypeError(f"{max_name} must be an int >= 0, got {max_seqlen!r}")
    if _is_fake(cu_seqlens) or (cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    key = (total, max_seqlen, cu_seqlens._version)
    seen = _VALIDATED.get(id(cu_seqlens))
    if seen is not None and seen[0]() is cu_seqlens and seen[1] == key:
        return  # these values passed for this very tensor, unmodified since (its version counter)
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    if bounds[0] != 0:
        raise ValueError(f"{name} must start at 0, got {bounds[0]}")
    if min(lengths) < 0:
        raise ValueError(f"{name} must be non-decreasing, got {bounds}")
    if bounds[-1] != total:
        raise ValueError(f"{name} must end at the packed tensor's token count {total}, got {bounds[-1]}")
    if max(lengths) > max_seqlen:
        raise ValueError(f"{max_name}={max_seqlen} is below the longest sequence ({max(lengths)})")
    if len(_VALIDATED) >= _VALIDATED_MAX:
        _VALIDATED.clear()
    _VALIDATED[id(cu_seqlens)] = (weakref.ref(cu_seqlens), key)


# cu_seqlens tensors whose values passed check_cu_seqlens: id -> (weak reference, (total,
# max_seqlen, version counter)). Reading the values costs a device-to-host copy, which waits for
# the GPU; a training loop or a benchmark passing the same tensor again pays it once. A tensor
# that died (its id reused), was written to (its version moved) or comes with another total or
# max_seqlen is checked again.
_VALIDATED: dict[int, tuple[weakref.ref, tuple[int, int, int]]] = {}
_VALIDATED_MAX = 256


def check_call(q, k, v, causal, features: Features) -> None:
    """Everything the kernels need of one call, for the real op and the fake one alike."""
    check_qkv(q, k, v, varlen=features.varlen)
    if features.varlen:
        if features.cu_seqlens_k is None:
            raise ValueError("cu_seqlens_k is required with cu_seqlens_q")
        check_cu_seqlens("cu_seqlens_q", features.cu_seqlens_q, q.shape[0], features.max_seqlen_q, q.device)
        check_cu_seqlens("cu_seqlens_k", features.cu_seqlens_k, k.shape[0], features.max_seqlen_k, q.device)
        if features.cu_seqlens_q.shape != features.cu_seqlens_k.shape:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one shape (batch + 1,), got "
                             f"{tuple(features.cu_seqlens_q.shape)} and {tuple(features.cu_seqlens_k.shape)}")
        batch = features.cu_seqlens_q.shape[0] - 1
    else:
        batch = q.shape[0]
    check_alibi(features.alibi_slopes, batch, q.shape[-2], q.device)
    if features.dropout_p and features.rng_seed is None:
        raise ValueError("dropout needs rng_seed (an int64 tensor (seed, offset))")

