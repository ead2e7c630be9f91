"""The provider contract (Spec, Provider, UnsupportedInput) and the helpers every family of
providers shares: registration in listing order, availability checks that explain
themselves, and shape checks."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

import torch

from baselines.flops import MODE_MULTIPLIER

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
NEEDS_CUDA = "needs CUDA (no GPU here)"
MAX_HEADDIM = 256  # the largest head dim of our kernels, flash-attn and SDPA's flash backend
INTERPRETER_BF16 = "bf16 tl.dot is wrong in Triton's CPU interpreter: test bf16 on a GPU"


class UnsupportedInput(Exception):
    """The provider cannot compute this input's function (a shape, dtype or mask limit)."""


@dataclass(frozen=True)
class Spec:
    """One benchmark configuration. seqlen is both the query and the key length."""

    mode: str  # 'fwd' | 'bwd' | 'fwd_bwd'
    causal: bool
    hdim: int
    seqlen: int
    batch: int
    heads: int
    dtype: str  # 'fp16' | 'bf16' | 'fp32'

    def __post_init__(self):
        if self.mode not in MODE_MULTIPLIER:
            raise ValueError(f"Spec.mode must be one of {sorted(MODE_MULTIPLIER)}, got {self.mode!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"Spec.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("hdim", "seqlen", "batch", "heads"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"Spec.{name} must be a positive int, got {getattr(self, name)!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def any_input(_spec) -> str | None:
    """A shape check that accepts every input."""
    return None


# What a provider computes, and so its call's signature:
#   'attention': forward(q, k, v, causal, softmax_scale) -> out, (B, S, H, D) in and out; supports(Spec)
#   'decode':    forward(q, k_cache, v_cache, cache_seqlens, softmax_scale=None) -> out, one query token
#                per sequence against a KV cache (baselines.providers.decode's contract); supports(DecodeSpec)
#   'features':  forward(case, inputs, mode) -> call, a training feature's call (GQA, windows, packed
#                variable lengths, ALiBi, softcap; baselines.providers.features' contract)
KINDS = ("attention", "decode", "features")


@dataclass(frozen=True)
class Provider:
    name: str  # 'sdpa-flash', 'fa2', 'rung0-fa1', ...: unique within its kind
    label: str  # plot label a reader understands
    forward: Callable  # the call of its kind (KINDS)
    availability: Callable[[], str | None]  # None when usable here, else the reason
    supports: Callable[[Spec], str | None] = any_input  # None when supported, else the reason
    kernel_regex: str = ""  # Nsight Compute kernel-name regex selecting its main forward kernel
    has_backward: bool = True  # gradients flow through `forward` via autograd
    bwd_kernel_regex: str = ""  # ... and its main backward kernel ('' when unknown or forward-only)
    config: Callable[[Spec], str] | None = None  # JSON of the kernel config for a result row
    kind: str = "attention"  # one of KINDS
    # kind 'decode' only: the same attention over a paged cache,
    # (q, k_pages, v_pages, block_table, cache_seqlens, softmax_scale=None) -> out
    decode_paged: Callable | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Provider.kind must be one of {KINDS}, got {self.kind!r} ({self.name})")


BASE_PROVIDERS: list[Provider] = []  # every provider of every kind but the ablation rungs, in listing order


def register(provider: Provider) -> Provider:
    BASE_PROVIDERS.append(provider)
    return provider


def unavailable_reason(provider) -> str | None:
    """The provider's availability, with a failing check reported as the reason."""
    try:
        return provider.availability()
    except Exception as exc:  # noqa: BLE001 -- an availability check explains, never crashes a sweep
        return one_line(f"the availability check failed: {type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------------------
# Availability
# --------------------------------------------------------------------------------------
def cuda_available() -> str | None:
    return None if torch.cuda.is_available() else NEEDS_CUDA


def everywhere() -> str | None:
    return None


def package_version(distribution: str) -> str:
    """The installed version of a distribution ('flash-attn-4'), '' when it is not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


MAX_REASON_CHARS = 400


def one_line(text: object, limit: int = MAX_REASON_CHARS) -> str:
    """`text` on one line (whitespace collapsed), cut to `limit` characters: a row's reason."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def min_arch(major: int) -> Callable[[tuple[int, int]], str | None]:
    """An arch check: compute capability `major`.x or newer."""
    def check(capability: tuple[int, int]) -> str | None:
        if capability[0] < major:
            return f"needs compute capability {major}.x or newer; this GPU is sm_{capability[0]}{capability[1]}"
        return None

    return check


def optional_cuda_package(module: str, distribution: str, probe: Callable[[], object],
                          arch: Callable[[tuple[int, int]], str | None]):
    """Availability of a CUDA-only optional package: CUDA present, the GPU's architecture
    accepted by `arch`, `module` importable (else: which distribution to install), and a tiny
    `probe()` call succeeding (so compiled ops that do not load, or kernels that do not
    compile, are seen). Cached: the probe runs once per process."""

    @functools.cache
    def availability() -> str | None:
        if not torch.cuda.is_available():
            return NEEDS_CUDA
        reason = arch(torch.cuda.get_device_capability())
        if reason is not None:
            return reason
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 -- any import failure is the reason
            return one_line(f"{distribution} does not import here (`import {module}` failed: "
                            f"{type(exc).__name__}: {exc}); install it with `pip install {distribution}`")
        try:
            probe()
        except Exception as exc:  # noqa: BLE001 -- any failure of the probe is the reason
            return one_line(f"{distribution} imports but its kernels do not run here: {type(exc).__name__}: {exc}")
        return None

    return availability


def probe_call(forward: Callable) -> Callable[[], object]:
    """A tiny causal fp16 call, (1, 128, 2, 64) on the GPU, for availability checks."""
    return lambda: forward(*(torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.float16)
                             for _ in range(3)), True, None)


# --------------------------------------------------------------------------------------
# Shape checks and input guards
# --------------------------------------------------------------------------------------
def triton_supports(spec: Spec) -> str | None:
    """Our Triton kernels: any head dim up to MAX_HEADDIM; bf16 only on a GPU."""
    if spec.hdim > MAX_HEADDIM:
        return f"head dim {spec.hdim} > {MAX_HEADDIM}"
    if spec.dtype == "bf16" and not torch.cuda.is_available():
        return INTERPRETER_BF16
    return None


def half_only(spec: Spec) -> str | None:
    if spec.dtype not in ("fp16", "bf16"):
        return f"{spec.dtype} inputs: this kernel takes fp16/bf16 only"
    if spec.hdim > MAX_HEADDIM:
        return f"head dim {spec.hdim} > {MAX_HEADDIM}"
    return None


def check_causal_lengths(q: torch.Tensor, k: torch.Tensor, causal: bool, who: str) -> None:
    """SDPA's `is_causal` mask is top-left aligned; refuse the case where that differs from
    the bottom-right mask instead of computing another function."""
    if causal and q.shape[1] != k.shape[1]:
        raise UnsupportedInput(
            f"{who}: is_causal is top-left aligned; with seqlen_q {q.shape[1]} != seqlen_k "
            f"{k.shape[1]} it differs from flash-attn's bottom-right causal mask")


def first(out):
    """FA3/FA4 interfaces return (out, lse); flash-attn returns out."""
    return out[0] if isinstance(out, tuple) else out


# --------------------------------------------------------------------------------------
# torch.compile without silent fallbacks (torch-compile, flex-attention, their decode forms)
# --------------------------------------------------------------------------------------
RECOMPILE_LIMIT = 4096  # one graph per (shape, grad mode) of a whole sweep fits under this


def raise_recompile_limits() -> None:
    """Dynamo recompiles per shape (dynamic=False); at its default limit of 8 it stops
    compiling and runs the function eagerly, i.e. unfused. Raise the limits above any sweep
    and make hitting them an error instead of a fallback. Also lets a compiled backward run
    again on a retained graph (the harness's backward timing)."""
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config

    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, RECOMPILE_LIMIT)
    dynamo_config.accumulated_recompile_limit = max(dynamo_config.accumulated_recompile_limit, RECOMPILE_LIMIT)
    dynamo_config.fail_on_recompile_limit_hit = True
    # The backward is timed as `out.backward(dout, retain_graph=True)` on one forward's graph
    # (harness/timing.py); AOTAutograd's donated buffers (saved activations reused by the
    # backward) refuse a retained graph, so they are off: a memory reuse, not a kernel change.
    functorch_config.donated_buffer = False


class CountingInductor:
    """A torch.compile backend: inductor, counting the graphs it compiles. A call that dynamo
    did not hand to it ran eagerly (dynamo's own counters cannot tell that apart from a
    compiled call: eager flex_attention, for one, compiles itself with another backend)."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(graph_module, example_inputs)


class CompiledOnce:
    """`torch.compile(fn, backend=inductor, dynamic=False, fullgraph=True)` that refuses to
    return an eager result: the first call for a new key must make inductor compile a
    graph, else the call ran uncompiled and RuntimeError is raised (the sweep records it)."""

    def __init__(self, fn: Callable, what: str):
        self.fn, self.what = fn, what
        self.backend = CountingInductor()
        self.compiled_keys: set = set()

    @functools.cached_property
    def compiled(self) -> Callable:
        raise_recompile_limits()
        return torch.compile(self.fn, backend=self.backend, dynamic=False, fullgraph=True)

    def __call__(self, key: tuple, *args, **kwargs):
        first_call = key not in self.compiled_keys
        graphs_before = self.backend.graphs
        out = self.compiled(*args, **kwargs)
        if first_call:
            if self.backend.graphs == graphs_before:
                raise RuntimeError(f"{self.what}: torch.compile did not compile this shape with inductor, "
                                   "so it ran the unfused eager path; refusing to time it")
            self.compiled_keys.add(key)
        return out
