"""The one provider registry: our kernels and every baseline, each an entry with a name, a
plot label, an availability check that explains itself, a shape check, and a callable.

Every provider's `forward(q, k, v, causal, softmax_scale) -> out` takes and returns
flash-attn's layout (batch, seqlen, heads, headdim); providers that want (batch, heads,
seqlen, headdim) get transposed views. Causal masks are bottom-right aligned (flash-attn
>= 2.1, baselines.reference). A provider that cannot compute the asked function raises
`UnsupportedInput` (recorded as 'unsupported'), never computes a different one.

Optional backends (xformers, flash-attn, FA3/FA4) are imported by their availability check,
which says why one is missing. Importing this module imports no Triton kernel: `kernels` is
imported by the first call, ablations.ladder by the first use of `PROVIDERS` (a broken or
missing ladder makes only the rung providers unavailable, with the import error as reason),
so a caller can switch on Triton's interpreter (TRITON_INTERPRET=1) before that.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from baselines.flops import MODE_MULTIPLIER
from baselines.reference import attention_same_dtype

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
NEEDS_CUDA = "needs CUDA (no GPU here)"
MAX_HEADDIM = 256  # the largest head dim of our kernels, flash-attn and SDPA's flash backend
INTERPRETER_BF16 = "bf16 tl.dot is wrong in Triton's CPU interpreter (see shared/GPU.md): test bf16 on a GPU"
# The ablation rungs of docs/CONTRACTS.md, in ladder order; their kernels live in ablations/ladder.py.
RUNG_NAMES = ("rung0-fa1", "rung1-fewer-nonmatmul", "rung2-seq-parallel", "rung3-split-q", "rung4-hopper")


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


def _always(_spec: Spec) -> str | None:
    return None


@dataclass(frozen=True)
class Provider:
    name: str  # 'sdpa-flash', 'fa2', 'rung0-fa1', ...
    label: str  # plot label a reader understands
    forward: Callable  # (q, k, v, causal, softmax_scale) -> out; (B, S, H, D) in and out
    availability: Callable[[], str | None]  # None when usable here, else the reason
    supports: Callable[[Spec], str | None] = _always  # None when supported, else the reason
    kernel_regex: str = ""  # Nsight Compute kernel-name regex selecting its main forward kernel
    has_backward: bool = True  # gradients flow through `forward` via autograd
    bwd_kernel_regex: str = ""  # ... and its main backward kernel ('' when unknown or forward-only)
    config: Callable[[Spec], str] | None = None  # JSON of the kernel config for a result row


_BASE_PROVIDERS: list[Provider] = []  # every provider but the ablation rungs, in listing order


def register(provider: Provider) -> Provider:
    _BASE_PROVIDERS.append(provider)
    return provider


def __getattr__(name: str):
    """`PROVIDERS` is built on first access: the rung providers take their labels and kernel
    names from ablations.ladder, imported then (not when this module is imported, so that
    the ladder may itself import this module, and a broken ladder breaks only its rungs)."""
    if name == "PROVIDERS":
        return _registry()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_provider(name: str) -> Provider:
    registry = _registry()
    if name not in registry:
        raise ValueError(f"unknown provider {name!r}; known providers: {', '.join(registry)}")
    return registry[name]


def unavailable_reason(provider: Provider) -> str | None:
    """The provider's availability, with a failing check reported as the reason."""
    try:
        return provider.availability()
    except Exception as exc:  # noqa: BLE001 -- an availability check explains, never crashes a sweep
        return f"availability check failed: {type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------------------
# Availability helpers
# --------------------------------------------------------------------------------------
def _cuda_available() -> str | None:
    return None if torch.cuda.is_available() else NEEDS_CUDA


def _everywhere() -> str | None:
    return None


def _optional_cuda_package(module: str, probe: Callable[[], object], min_major: int = 0):
    """Availability of a CUDA-only optional package: CUDA present, the module imports, the
    GPU is new enough, and a tiny call succeeds (so compiled ops that do not load are seen)."""

    @functools.cache
    def availability() -> str | None:
        if not torch.cuda.is_available():
            return NEEDS_CUDA
        if torch.cuda.get_device_capability()[0] < min_major:
            return f"needs compute capability {min_major}.x or newer"
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 -- any import failure is the reason
            return f"`import {module}` failed: {type(exc).__name__}: {exc}"
        try:
            probe()
        except Exception as exc:  # noqa: BLE001 -- any failure of the probe is the reason
            return f"{module} imports but its ops do not run here: {type(exc).__name__}: {exc}"
        return None

    return availability


def _probe(forward: Callable) -> Callable[[], object]:
    """A tiny causal fp16 call, (1, 128, 2, 64) on the GPU, for availability checks."""
    return lambda: forward(*(torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.float16)
                             for _ in range(3)), True, None)


def _triton_supports(spec: Spec) -> str | None:
    """Our Triton kernels: any head dim up to MAX_HEADDIM; bf16 only on a GPU."""
    if spec.hdim > MAX_HEADDIM:
        return f"head dim {spec.hdim} > {MAX_HEADDIM}"
    if spec.dtype == "bf16" and not torch.cuda.is_available():
        return INTERPRETER_BF16
    return None


def _half_only(spec: Spec) -> str | None:
    if spec.dtype not in ("fp16", "bf16"):
        return f"{spec.dtype} inputs: this kernel takes fp16/bf16 only"
    if spec.hdim > MAX_HEADDIM:
        return f"head dim {spec.hdim} > {MAX_HEADDIM}"
    return None


def _check_causal_lengths(q: torch.Tensor, k: torch.Tensor, causal: bool, who: str) -> None:
    """SDPA's `is_causal` mask is top-left aligned; refuse the case where that differs from
    the bottom-right mask instead of computing another function."""
    if causal and q.shape[1] != k.shape[1]:
        raise UnsupportedInput(
            f"{who}: is_causal is top-left aligned; with seqlen_q {q.shape[1]} != seqlen_k "
            f"{k.shape[1]} it differs from flash-attn's bottom-right causal mask")


def _first(out):
    """FA3/FA4 interfaces return (out, lse); flash-attn returns out."""
    return out[0] if isinstance(out, tuple) else out


# --------------------------------------------------------------------------------------
# The project's FA2 kernel
# --------------------------------------------------------------------------------------
# A forward block config that replaces the table's for every fa2 measurement of this process
# (runner.py --fa2-fwd-config): how CI shows that a slowed kernel is flagged as a regression
# without touching the kernel's code.
_fa2_fwd_override = None


def override_fa2_fwd_config(config) -> None:
    """Use `config` (a kernels.flash_attn.FwdConfig, or None for the table) for fa2's forward."""
    global _fa2_fwd_override
    _fa2_fwd_override = config


def _fa2_forward(q, k, v, causal, softmax_scale):
    from kernels.flash_attn import flash_attn_func

    return flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, fwd_config=_fa2_fwd_override)


def _fa2_config(spec: Spec) -> str:
    from kernels.flash_attn import (
        HOPPER_GLUON_PATH,
        bwd_dkdv_path,
        bwd_fuses_dq,
        bwd_gluon_fuses_dq,
        default_bwd_config,
        default_fwd_config,
        fwd_memory_path,
    )

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fwd = _fa2_fwd_override or default_fwd_config(spec.hdim, spec.causal, device)
    # the sweep's inputs: contiguous (batch, seqlen, heads, hdim) tensors at aligned addresses,
    # stood in for by a meta tensor (address 0) of the same shape, dtype and strides
    like = torch.empty(spec.batch, spec.seqlen, spec.heads, spec.hdim, dtype=spec.torch_dtype, device="meta")
    path = fwd_memory_path(fwd, like, like, like, like, spec.causal)
    config = {"fwd": asdict(fwd), "fwd_memory_path": path, "fwd_overridden": _fa2_fwd_override is not None}
    if spec.mode != "fwd":
        bwd = default_bwd_config(spec.hdim, device)
        # which dK/dV kernel: the Triton one, or the Gluon one ('gluon-ws', head dim 128 on Hopper);
        # and whether it adds dQ itself (atomics) instead of the dQ kernel
        dkdv_path = bwd_dkdv_path(bwd, like, like, like, like)
        fuses = (bwd_gluon_fuses_dq(bwd, spec.hdim) if dkdv_path == HOPPER_GLUON_PATH
                 else bwd_fuses_dq(bwd, spec.seqlen))
        config.update(bwd=asdict(bwd), bwd_dkdv_path=dkdv_path, bwd_fuses_dq=fuses)
    return json.dumps(config, sort_keys=True)


register(Provider(
    name="fa2", label="FA2 (this repo, Triton)", forward=_fa2_forward,
    availability=_everywhere, supports=_triton_supports,
    # the forward is _flash_fwd_kernel, or the Gluon _flash_fwd_hopper_kernel (head dims 64 and 128 on
    # Hopper); the backward's dK/dV kernel _flash_bwd_dkdv_kernel, or _flash_bwd_dkdv_hopper_kernel
    # (head dim 128 on Hopper from 1k keys)
    kernel_regex="_flash_fwd(_hopper)?_kernel", bwd_kernel_regex="_flash_bwd_dkdv(_hopper)?_kernel",
    config=_fa2_config,
))


# --------------------------------------------------------------------------------------
# PyTorch eager: the paper's "PyTorch" baseline (matmul, mask, softmax in fp32, matmul)
# --------------------------------------------------------------------------------------
def _pytorch_forward(q, k, v, causal, softmax_scale):
    return attention_same_dtype(q, k, v, softmax_scale=softmax_scale, causal=causal)


register(Provider(
    name="pytorch", label="PyTorch eager (matmul + softmax)", forward=_pytorch_forward,
    availability=_everywhere, kernel_regex="gemm|softmax", bwd_kernel_regex="gemm|softmax",
))


# --------------------------------------------------------------------------------------
# PyTorch scaled_dot_product_attention, pinned to one backend each
# --------------------------------------------------------------------------------------
def _sdpa_forward(backend_name: str):
    def forward(q, k, v, causal, softmax_scale):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        _check_causal_lengths(q, k, causal, f"SDPA {backend_name}")
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) views

        def call():
            with sdpa_kernel(getattr(SDPBackend, backend_name)):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                                        scale=softmax_scale)

        try:
            out = call()
        except RuntimeError as exc:
            if not any(refusal in str(exc) for refusal in SDPA_REFUSALS):
                raise
            with warnings.catch_warnings(record=True) as caught:  # SDPA explains a refusal in warnings
                warnings.simplefilter("always")
                with contextlib.suppress(RuntimeError):
                    call()
            why = "; ".join(str(w.message) for w in caught) or str(exc)
            raise UnsupportedInput(f"SDPA {backend_name} refuses this input: {why}") from exc
        return out.transpose(1, 2)  # (B, S, H, D)

    return forward


# How SDPA says that the pinned backend does not take the input (CUDA / CPU dispatch).
SDPA_REFUSALS = ("No available kernel", "No viable backend for scaled_dot_product_attention")
SDPA_BACKENDS = (
    # name, label, backend, forward kernel regex, backward kernel regex, CUDA only
    ("sdpa-flash", "FA2 official CUDA (SDPA flash)", "FLASH_ATTENTION", "flash_fwd", "flash_bwd", True),
    ("sdpa-efficient", "xformers cutlass (SDPA efficient)", "EFFICIENT_ATTENTION", "fmha_cutlassF",
     "fmha_cutlassB", True),
    ("sdpa-cudnn", "cuDNN (SDPA cudnn)", "CUDNN_ATTENTION", "cudnn", "cudnn", True),
    ("sdpa-math", "PyTorch SDPA math", "MATH", "gemm|softmax", "gemm|softmax", False),
)
for _name, _label, _backend, _regex, _bwd_regex, _cuda_only in SDPA_BACKENDS:
    register(Provider(
        name=_name, label=_label, forward=_sdpa_forward(_backend),
        availability=_cuda_available if _cuda_only else _everywhere,
        supports=_half_only if _backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION") else _always,
        kernel_regex=_regex, bwd_kernel_regex=_bwd_regex,
    ))


# --------------------------------------------------------------------------------------
# xformers (only when the package imports and its compiled ops load)
# --------------------------------------------------------------------------------------
def _xformers_forward(op_module: str):
    def forward(q, k, v, causal, softmax_scale):
        import xformers.ops as xops
        from xformers.ops.fmha import attn_bias

        op = importlib.import_module(f"xformers.ops.fmha.{op_module}")
        bias = attn_bias.LowerTriangularFromBottomRightMask() if causal else None
        # xformers' layout is flash-attn's: (B, S, H, D)
        return xops.memory_efficient_attention(q, k, v, attn_bias=bias, scale=softmax_scale,
                                               op=(op.FwOp, op.BwOp))

    return forward


for _name, _label, _op, _regex, _bwd_regex in (
    ("xformers-cutlass", "xformers cutlass", "cutlass", "fmha_cutlassF", "fmha_cutlassB"),
    ("xformers-flash", "xformers flash (FA2 inside xformers)", "flash", "flash_fwd", "flash_bwd"),
):
    _forward = _xformers_forward(_op)
    register(Provider(
        name=_name, label=_label, forward=_forward,
        availability=_optional_cuda_package(
            "xformers.ops", _probe(_forward)),
        supports=_half_only if _op == "flash" else _always, kernel_regex=_regex, bwd_kernel_regex=_bwd_regex,
    ))


# --------------------------------------------------------------------------------------
# flash-attn packages: FA2 (flash_attn), FA3 (flash_attn_interface, Hopper), FA4 (flash_attn.cute)
# --------------------------------------------------------------------------------------
def _package_forward(module: str):
    def forward(q, k, v, causal, softmax_scale):
        return _first(importlib.import_module(module).flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal))

    return forward


for _name, _label, _module, _regex, _bwd_regex, _min_major in (
    ("flash-attn", "FA2 official CUDA (flash-attn package)", "flash_attn", "flash_fwd", "flash_bwd", 8),
    ("flash-attn-3", "FA3 (flash-attn Hopper package)", "flash_attn_interface", "FlashAttnFwd|flash_fwd",
     "FlashAttnBwd|flash_bwd", 9),
    ("flash-attn-4", "FA4 (flash-attn CuTe DSL)", "flash_attn.cute", "flash_fwd|FlashAttention",
     "flash_bwd|FlashAttentionBackward", 9),
):
    _forward = _package_forward(_module)
    register(Provider(
        name=_name, label=_label, forward=_forward,
        availability=_optional_cuda_package(
            _module, _probe(_forward), _min_major),
        supports=_half_only, kernel_regex=_regex, bwd_kernel_regex=_bwd_regex,
    ))


# --------------------------------------------------------------------------------------
# FlexAttention under torch.compile: compiled once per shape, never silently unfused
# --------------------------------------------------------------------------------------
FLEX_RECOMPILE_LIMIT = 4096  # one graph per (shape, grad mode) of a whole sweep fits under this


class _CountingInductor:
    """A torch.compile backend: inductor, counting the graphs it compiles. A FlexAttention call
    that dynamo did not hand to it ran eagerly, i.e. unfused (eager flex_attention compiles
    itself with another backend, so dynamo's own graph counter cannot tell the two apart)."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(graph_module, example_inputs)


_FLEX_BACKEND = _CountingInductor()


@functools.cache
def _flex_compiled():
    """torch.compile'd flex_attention with dynamo's silent fallbacks turned into errors:
    fullgraph=True makes a graph break raise, and the recompile limit (8 by default, after
    which dynamo runs the function eagerly, i.e. unfused) is raised and made to raise."""
    import torch._dynamo.config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    dynamo_config.recompile_limit = FLEX_RECOMPILE_LIMIT
    dynamo_config.accumulated_recompile_limit = FLEX_RECOMPILE_LIMIT
    dynamo_config.fail_on_recompile_limit_hit = True
    return torch.compile(flex_attention, backend=_FLEX_BACKEND, dynamic=False, fullgraph=True)


@functools.cache
def _flex_block_mask(seqlen_q: int, seqlen_k: int, causal: bool, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    if not causal:
        return None
    offset = seqlen_k - seqlen_q

    def bottom_right(b, h, q_idx, kv_idx):  # baselines.reference.causal_mask, as a mask_mod
        return kv_idx <= q_idx + offset

    return create_block_mask(bottom_right, None, None, seqlen_q, seqlen_k, device=device)


_FLEX_COMPILED_KEYS: set[tuple] = set()


def _flex_forward(q, k, v, causal, softmax_scale):
    """The first call for a new (shape, dtype, grad mode) compiles: it must make inductor
    compile a graph, else the call ran eagerly (FlexAttention's unfused path) and we raise."""
    compiled = _flex_compiled()
    block_mask = _flex_block_mask(q.shape[1], k.shape[1], causal, str(q.device))
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) views
    key = (tuple(q.shape), tuple(k.shape), q.dtype, str(q.device), causal, softmax_scale,
           torch.is_grad_enabled() and q.requires_grad)
    first_call = key not in _FLEX_COMPILED_KEYS
    graphs_before = _FLEX_BACKEND.graphs
    out = compiled(qt, kt, vt, block_mask=block_mask, scale=softmax_scale)
    if first_call:
        if _FLEX_BACKEND.graphs == graphs_before:
            raise RuntimeError("FlexAttention: torch.compile did not compile this shape with inductor, "
                               "so it ran the unfused eager path; refusing to time it")
        _FLEX_COMPILED_KEYS.add(key)
    return out.transpose(1, 2)  # (B, S, H, D)


def _flex_config(spec: Spec) -> str:
    return json.dumps({"compile": "torch.compile(flex_attention, dynamic=False, fullgraph=True), "
                                  "once per shape, outside the timed region"})


register(Provider(
    name="flex-attention", label="FlexAttention (torch.compile)", forward=_flex_forward,
    availability=_cuda_available, kernel_regex="triton_tem_fused", bwd_kernel_regex="triton_tem_fused",
    config=_flex_config,
))


# --------------------------------------------------------------------------------------
# The ablation ladder (ablations/ladder.py): rung 0 is the FA1 algorithm
# --------------------------------------------------------------------------------------
@functools.cache
def _ladder_rungs() -> dict:
    """{rung name: Rung} from ablations.ladder, imported on first use."""
    ladder = importlib.import_module("ablations.ladder")
    return {rung.name: rung for rung in ladder.RUNGS}


def _rung_availability(rung_name: str):
    def availability() -> str | None:
        try:
            rungs = _ladder_rungs()
        except Exception as exc:  # noqa: BLE001 -- a broken ladder disables only its rungs
            return f"ablations.ladder does not import: {type(exc).__name__}: {exc}"
        if rung_name not in rungs:
            return f"ablations.ladder.RUNGS has no rung {rung_name!r} (has {', '.join(rungs)})"
        return None

    return availability


def _rung_forward(rung_name: str):
    def forward(q, k, v, causal, softmax_scale):
        return _ladder_rungs()[rung_name].forward(q, k, v, causal, softmax_scale)

    return forward


def _forward_only_triton(spec: Spec) -> str | None:
    if spec.mode != "fwd":
        return "forward only (the ablation ladder has no backward)"
    return _triton_supports(spec)


def _rung_provider(name: str, rung_name: str, label: str | None = None) -> Provider:
    """A provider running ladder rung `rung_name`; label and kernel regex from the ladder when it
    imports (else the rung name and no regex: its availability then says why)."""
    try:
        rung = _ladder_rungs()[rung_name]
        ladder_label, regex = rung.label, rung.kernel_regex
    except Exception:  # noqa: BLE001 -- the availability check reports why
        ladder_label, regex = rung_name, ""
    return Provider(
        name=name, label=label or ladder_label, forward=_rung_forward(rung_name),
        availability=_rung_availability(rung_name), supports=_forward_only_triton,
        kernel_regex=regex, has_backward=False,
    )


@functools.cache
def _registry() -> dict[str, Provider]:
    providers = [*_BASE_PROVIDERS, _rung_provider("fa1", RUNG_NAMES[0], "FA1 algorithm (ablation rung 0)")]
    providers += [_rung_provider(name, name) for name in RUNG_NAMES]
    registry: dict[str, Provider] = {}
    for provider in providers:
        if provider.name in registry:
            raise ValueError(f"provider {provider.name!r} is registered twice")
        registry[provider.name] = provider
    return registry
