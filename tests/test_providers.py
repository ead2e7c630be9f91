"""The provider registry: names, availability reasons, and that the CPU-usable providers
compute flash-attn's function (bottom-right causal) or refuse with a reason. The peers that
need a GPU and a package (FA4, FlashInfer, xformers) are checked here through fake modules:
their argument mapping and layouts, not their kernels (the GPU-marked tests run those)."""

import json
import math
import re
import sys
import types

import pytest
import torch
from peer_fakes import (
    FakePrefillWrapper,
    assert_sentence,
    clear_flashinfer_caches,
    fake_gpu,
    install_fake_fa4,
    install_fake_flashinfer,
)

from baselines import providers as registry
from baselines.providers import (
    RUNG_NAMES,
    Spec,
    UnsupportedInput,
    builtin,
    compiled,
    core,
    get_provider,
    packages,
    rungs,
    unavailable_reason,
)
from baselines.reference import attention_reference

HAS_CUDA = torch.cuda.is_available()
CONTRACT_NAMES = ("fa2", "pytorch", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math", "torch-compile",
                  "flex-attention", "fa4", "flash-attn", "flash-attn-3", "flashinfer", "xformers-cutlass",
                  "xformers-flash", "fa1", *RUNG_NAMES)
CPU_PROVIDERS = ("fa2", "pytorch", "sdpa-math")
CUDA_ONLY = ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "torch-compile", "flex-attention", "fa4", "flash-attn",
             "flash-attn-3", "flashinfer", "xformers-cutlass", "xformers-flash")


def _inputs(seqlen_q, seqlen_k, device, dtype=torch.float16, seed=0):
    generator = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, seqlen_q, 2, 32, generator=generator, device=device, dtype=dtype)
    k, v = (torch.randn(1, seqlen_k, 2, 32, generator=generator, device=device, dtype=dtype) for _ in range(2))
    return q, k, v


def test_registry_has_every_contract_name_once_and_get_provider_returns_it():
    for name in CONTRACT_NAMES:
        provider = get_provider(name)
        assert provider.name == name
        assert provider.label and provider.label != ""
    assert len(set(registry.PROVIDERS)) == len(registry.PROVIDERS)


def test_unknown_provider_error_names_it_and_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown provider 'no-such-kernel'.*sdpa-flash"):
        get_provider("no-such-kernel")


def test_every_provider_is_available_or_says_why_in_a_sentence():
    for provider in registry.PROVIDERS.values():
        reason = unavailable_reason(provider)
        if reason is not None:
            assert_sentence(reason, provider.name)


@pytest.mark.skipif(HAS_CUDA, reason="checks the availability seen without a GPU")
def test_without_cuda_only_interpreter_and_pytorch_providers_are_available():
    for name in CPU_PROVIDERS:
        assert unavailable_reason(get_provider(name)) is None, name
    for name in CUDA_ONLY:
        assert unavailable_reason(get_provider(name)) == registry.NEEDS_CUDA, name


def test_rungs_are_unavailable_with_the_import_error_when_the_ladder_does_not_import(monkeypatch):
    rungs.ladder_rungs.cache_clear()
    monkeypatch.setitem(sys.modules, "ablations.ladder", None)  # makes `import ablations.ladder` fail
    try:
        for name in ("fa1", *RUNG_NAMES):
            reason = unavailable_reason(get_provider(name))
            assert reason is not None and "ablations.ladder" in reason and "Error" in reason, (name, reason)
    finally:
        rungs.ladder_rungs.cache_clear()


def test_a_raising_availability_check_becomes_the_reason():
    def broken():
        raise OSError("driver went away")

    provider = registry.Provider(name="x", label="x", forward=lambda *a: None, availability=broken)
    assert "driver went away" in unavailable_reason(provider)


@pytest.mark.parametrize("name", CPU_PROVIDERS)
@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "causal"), [(48, 48, False), (48, 48, True), (32, 80, True)])
def test_cpu_provider_matches_the_float64_reference(name, seqlen_q, seqlen_k, causal, device):
    provider = get_provider(name)
    q, k, v = _inputs(seqlen_q, seqlen_k, device, seed=seqlen_q + seqlen_k)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if name.startswith("sdpa") and causal and seqlen_q != seqlen_k:
        with pytest.raises(UnsupportedInput, match="top-left"):
            provider.forward(q, k, v, causal, scale)
        return
    out = provider.forward(q, k, v, causal, scale)
    ref, _ = attention_reference(q, k, v, softmax_scale=scale, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-3


def test_sdpa_causal_with_unequal_lengths_is_refused_not_computed_top_left(device):
    q, k, v = _inputs(16, 40, device, seed=3)
    with pytest.raises(UnsupportedInput, match="seqlen_q 16 != seqlen_k 40"):
        get_provider("sdpa-math").forward(q, k, v, True, 0.125)


def test_spec_rejects_unknown_mode_dtype_and_sizes_naming_the_field():
    with pytest.raises(ValueError, match="Spec.mode"):
        Spec("forward", False, 64, 128, 1, 2, "fp16")
    with pytest.raises(ValueError, match="Spec.dtype"):
        Spec("fwd", False, 64, 128, 1, 2, "fp8")
    with pytest.raises(ValueError, match="Spec.seqlen"):
        Spec("fwd", False, 64, 0, 1, 2, "fp16")


def test_triton_providers_refuse_bf16_only_in_the_interpreter():
    spec = Spec("fwd", True, 64, 128, 1, 2, "bf16")
    reason = get_provider("fa2").supports(spec)
    assert (reason is None) if HAS_CUDA else ("interpreter" in reason)


def test_rungs_are_forward_only():
    spec = Spec("bwd", True, 64, 128, 1, 2, "fp16")
    for name in ("fa1", *RUNG_NAMES):
        provider = get_provider(name)
        assert not provider.has_backward
        assert "forward only" in provider.supports(spec)


def test_fa2_config_is_the_json_of_its_kernel_config():
    config = json.loads(get_provider("fa2").config(Spec("fwd_bwd", True, 64, 128, 1, 2, "fp16")))
    assert "block_m" in config["fwd"] and "block_m1" in config["bwd"]
    assert config["bwd_dkdv_path"] == "triton" and not config["bwd_fuses_dq"]  # the interpreter's table


@pytest.mark.parametrize(("seqlen", "path"), [(512, "triton"), (1024, "gluon-ws")])
def test_fa2_config_records_the_dkdv_kernel(seqlen, path, monkeypatch):
    """With the Hopper table, the row's config names the dK/dV kernel its rule picks at the
    paper's head-dim-128 shapes: the Gluon one from 1k keys."""
    from kernels import configs

    monkeypatch.setattr(configs, "default_bwd_config", lambda hdim, device: configs.HOPPER_BWD_CONFIGS[hdim])
    config = json.loads(get_provider("fa2").config(Spec("bwd", False, 128, seqlen, 16384 // seqlen, 16, "bf16")))
    assert config["bwd_dkdv_path"] == path
    assert config["bwd_fuses_dq"] == (path == "gluon-ws")  # the Gluon kernel adds dQ; the Triton table's does not


@pytest.mark.parametrize(("hdim", "seqlen", "path"), [(64, 128, "tma-host"), (64, 256, "tma-kernel"),
                                                     (64, 100, "tma-kernel"), (59, 128, "pointer")])
def test_fa2_config_records_the_forwards_memory_path(hdim, seqlen, path):
    """Host descriptors below 256 keys where whole blocks allow them (100 is not a multiple of
    32), in-kernel descriptors otherwise; 59-element fp16 rows are 118 bytes, not a multiple
    of 16: no TMA at all."""
    from kernels import FwdConfig

    registry.override_fa2_fwd_config(FwdConfig(32, 32, 4, 1, tma=True, tma_min_keys=0, tma_host_min_keys=0,
                                               tma_host_below_keys=256))
    try:
        config = json.loads(get_provider("fa2").config(Spec("fwd", False, hdim, seqlen, 1, 2, "fp16")))
    finally:
        registry.override_fa2_fwd_config(None)
    assert config["fwd_memory_path"] == path


def test_flex_attention_refuses_to_time_an_unfused_eager_fallback(device):
    """Dynamo falling back to eager (as at its recompile limit) runs FlexAttention unfused;
    forcing that fallback must raise instead of returning a number to time."""
    q, k, v = _inputs(24, 24, device, dtype=torch.float32, seed=5)
    with torch.compiler.set_stance("force_eager"), pytest.raises(RuntimeError, match="unfused"):
        compiled.flex_forward(q, k, v, True, 0.125)


def test_torch_compile_refuses_to_time_an_eager_fallback(device):
    """torch-compile must time Inductor's code: a call dynamo leaves eager raises instead."""
    q, k, v = _inputs(24, 24, device, dtype=torch.float32, seed=6)
    with torch.compiler.set_stance("force_eager"), pytest.raises(RuntimeError, match="unfused"):
        compiled.torch_compile_forward(q, k, v, False, 0.125)


@pytest.mark.skipif(HAS_CUDA, reason="needs a backend that refuses the input: SDPA efficient on CPU does")
def test_a_backend_refusing_the_input_is_unsupported_with_sdpas_reason():
    q, k, v = _inputs(16, 16, "cpu", seed=7)
    with pytest.raises(UnsupportedInput, match="SDPA EFFICIENT_ATTENTION refuses this input: No viable backend"):
        builtin.sdpa_forward("EFFICIENT_ATTENTION")(q, k, v, False, 0.125)


def test_kernel_regexes_select_the_project_kernels_by_name():
    """Nsight Compute selects kernels by these names: they must match the Triton kernels'."""
    from kernels import backward, flash_attn_hopper, forward

    fa2 = get_provider("fa2")
    assert re.search(fa2.kernel_regex, forward._flash_fwd_kernel.fn.__name__)
    assert re.search(fa2.kernel_regex, flash_attn_hopper._flash_fwd_hopper_kernel.fn.__name__)
    assert not re.search(fa2.kernel_regex, backward._flash_bwd_dkdv_kernel.fn.__name__)
    assert re.search(fa2.bwd_kernel_regex, backward._flash_bwd_dkdv_kernel.fn.__name__)
    assert re.search(fa2.bwd_kernel_regex, flash_attn_hopper._flash_bwd_dkdv_hopper_kernel.fn.__name__)
    assert re.search(fa2.bwd_kernel_regex, flash_attn_hopper._flash_bwd_dkdv_hopper_varlen_kernel.fn.__name__)
    assert re.search(fa2.bwd_kernel_regex, flash_attn_hopper._flash_bwd_dkdv_hopper_wide_kernel.fn.__name__)
    assert not re.search(fa2.bwd_kernel_regex, forward._flash_fwd_kernel.fn.__name__)
    assert not re.search(fa2.kernel_regex, flash_attn_hopper._flash_bwd_dkdv_hopper_kernel.fn.__name__)


def test_every_provider_with_a_backward_names_its_backward_kernel():
    from baselines.providers import PROVIDERS

    missing = [p.name for p in PROVIDERS.values() if p.has_backward and not p.bwd_kernel_regex]
    assert not missing, f"providers with a backward but no bwd_kernel_regex: {missing}"


# --------------------------------------------------------------------------------------
# Optional peers without their packages: availability reasons and shape checks
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("module", "make"), [
    ("flash_attn.cute", lambda: packages.optional_cuda_package("flash_attn.cute", "flash-attn-4",
                                                               lambda: None, packages.fa4_arch)),
    ("flashinfer", lambda: packages.optional_cuda_package("flashinfer", "flashinfer-python", lambda: None,
                                                          core.min_arch(8))),
])
def test_a_peer_that_does_not_import_says_which_package_to_install(monkeypatch, module, make):
    fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    reason = make()()
    assert_sentence(reason, module)
    assert f"`import {module}` failed" in reason and "pip install" in reason


def test_the_registered_fa4_availability_reports_the_failed_import(monkeypatch):
    fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    availability = get_provider("fa4").availability
    availability.cache_clear()
    try:
        reason = unavailable_reason(get_provider("fa4"))
    finally:
        availability.cache_clear()
    assert_sentence(reason, "fa4")
    assert "flash-attn-4" in reason and "pip install flash-attn-4" in reason


def test_fa2_package_is_probed_by_its_own_module_not_fa4s_namespace(monkeypatch):
    """FA4's wheel makes `flash_attn` a namespace package holding only `cute`: with FA4 alone
    installed, the flash-attn (FA2) provider must say that FA2's module is missing."""
    fake_gpu(monkeypatch, (9, 0))
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # FA4's namespace, no FA2
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", None)
    availability = get_provider("flash-attn").availability
    availability.cache_clear()
    try:
        reason = unavailable_reason(get_provider("flash-attn"))
    finally:
        availability.cache_clear()
    assert_sentence(reason, "flash-attn")
    assert "`import flash_attn.flash_attn_interface` failed" in reason and "pip install flash-attn" in reason


@pytest.mark.parametrize(("capability", "usable"), [((8, 0), False), ((8, 9), False), ((9, 0), True),
                                                    ((10, 0), True), ((12, 0), False)])
def test_fa4_needs_hopper_or_blackwell_and_names_this_gpu(capability, usable):
    reason = packages.fa4_arch(capability)
    if usable:
        assert reason is None
    else:
        assert_sentence(reason, capability)
        assert f"sm_{capability[0]}{capability[1]}" in reason and "sm_90" in reason


@pytest.mark.parametrize(("hdim", "dtype", "arch", "refused"), [
    (64, "bf16", 9, None), (128, "fp16", 9, None), (256, "bf16", 9, None), (72, "bf16", 9, None),
    (8, "fp16", 9, None), (192, "bf16", 9, None),
    (59, "bf16", 9, "multiples of 8"), (4, "bf16", 9, "multiples of 8"), (264, "fp16", 9, "multiples of 8"),
    (128, "fp32", 9, "fp16/bf16"),
    (192, "bf16", 10, "up to 128, or 256"), (256, "bf16", 10, None), (128, "bf16", 10, None),
])
def test_fa4_shape_check_refuses_what_it_does_not_support(monkeypatch, hdim, dtype, arch, refused):
    monkeypatch.setattr(packages, "cuda_arch_major", lambda: arch)
    reason = get_provider("fa4").supports(Spec("fwd_bwd", True, hdim, 1024, 2, 4, dtype))
    if refused is None:
        assert reason is None
    else:
        assert_sentence(reason, hdim)
        assert refused in reason


@pytest.mark.parametrize(("spec", "refused"), [
    (Spec("fwd", True, 128, 1024, 2, 4, "bf16"), None),
    (Spec("fwd", False, 64, 1024, 2, 4, "fp16"), None),
    (Spec("bwd", True, 128, 1024, 2, 4, "bf16"), "no attention backward"),
    (Spec("fwd_bwd", True, 128, 1024, 2, 4, "bf16"), "no attention backward"),
    (Spec("fwd", True, 96, 1024, 2, 4, "bf16"), "head dims"),
    (Spec("fwd", True, 128, 1024, 2, 4, "fp32"), "fp16/bf16"),
])
def test_flashinfer_is_forward_only_at_its_head_dims(spec, refused):
    provider = get_provider("flashinfer")
    assert not provider.has_backward
    reason = provider.supports(spec)
    assert reason is None if refused is None else refused in reason


def test_a_failed_flashinfer_build_is_reported_by_its_error_lines():
    build_log = ("Ninja build failed.\n[1/3] /usr/local/cuda/bin/nvcc -gencode=arch=compute_90a -O3 ... batch_prefill.cu\n"
                 "batch_prefill.cu(41): error: identifier \"__nv_fp8x4_e4m3\" is undefined\nninja: build stopped\n")

    def failing_build():
        raise RuntimeError(build_log)

    with pytest.raises(RuntimeError) as caught:
        packages.flashinfer_jit_probe(failing_build, "prefill")()
    assert str(caught.value).startswith("FlashInfer could not JIT-compile its prefill kernel: batch_prefill.cu(41)")
    assert "nvcc -gencode" not in str(caught.value)

    def other_failure():
        raise ValueError("workspace too small")

    with pytest.raises(ValueError, match="workspace too small"):  # not a build: passed on as it is
        packages.flashinfer_jit_probe(other_failure, "prefill")()


def test_xformers_reason_is_its_own_load_error_on_one_line(monkeypatch):
    """Where xformers' compiled ops were built for another torch, the reason is xformers' own
    message (built for / you have), without its multi-line install advice."""
    message = ("xFormers can't load C++/CUDA extensions. xFormers was built for:\n    PyTorch 2.10.0+cu128 with "
               "CUDA 1208 (you have 2.11.0+cu130)\n    Python  3.12.3 (you have 3.12.3)\n  Please reinstall "
               "xformers (see https://github.com/facebookresearch/xformers#installing-xformers)\n")
    fake_cpp_lib = types.ModuleType("xformers._cpp_lib")
    fake_cpp_lib._cpp_library_load_exception = RuntimeError(message)
    fake_xformers = types.ModuleType("xformers")
    fake_xformers._cpp_lib = fake_cpp_lib
    monkeypatch.setitem(sys.modules, "xformers", fake_xformers)
    monkeypatch.setitem(sys.modules, "xformers._cpp_lib", fake_cpp_lib)
    reason = packages.xformers_cpp_error()
    assert_sentence(reason, "xformers")
    assert "built for: PyTorch 2.10.0+cu128" in reason and "you have 2.11.0+cu130" in reason
    assert "Please reinstall" not in reason


def test_fa4_kernel_regexes_select_its_main_kernels_not_the_small_ones_around_them():
    """CuTe DSL names a kernel after its mangled function and arguments, the kernel object's
    module and class first (cutlass/base_dsl/dsl.py `mangle_name`); FA4's classes are in
    flash_attn/cute/flash_{fwd,bwd}_sm{90,100}.py, flash_fwd_combine.py, flash_bwd_{pre,post}process.py."""
    def name(module, cls):
        return f"kernel_cutlass_kernel_flash_attncute{module}{cls}_object_at__tensorptrbf16gmemalign16odiv8_0"

    fa4 = get_provider("fa4")
    for module, cls in (("flash_fwd_sm90", "FlashAttentionForwardSm90"), ("flash_fwd_sm100", "FlashAttentionForwardSm100")):
        assert re.search(fa4.kernel_regex, name(module, cls)) and not re.search(fa4.bwd_kernel_regex, name(module, cls))
    for module, cls in (("flash_bwd_sm90", "FlashAttentionBackwardSm90"), ("flash_bwd_sm100", "FlashAttentionBackwardSm100")):
        assert re.search(fa4.bwd_kernel_regex, name(module, cls)) and not re.search(fa4.kernel_regex, name(module, cls))
    for module, cls in (("flash_fwd_combine", "FlashAttentionForwardCombine"),
                        ("flash_bwd_preprocess", "FlashAttentionBackwardPreprocess"),
                        ("flash_bwd_postprocess", "FlashAttentionBackwardPostprocess")):
        helper = name(module, cls)
        assert not re.search(fa4.kernel_regex, helper) and not re.search(fa4.bwd_kernel_regex, helper), helper


# --------------------------------------------------------------------------------------
# FA4's and FlashInfer's argument mapping, through fake modules in sys.modules
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
def test_fa4_forward_passes_scale_and_mask_by_keyword_and_returns_the_output(monkeypatch, causal):
    """flash_attn.cute.flash_attn_func(q, k, v, qv=None, ...): a positional scale would land in
    `qv`. The wrapper passes q, k, v positionally, the rest by keyword, and returns `out` of
    the (out, lse) pair."""
    cute = install_fake_fa4(monkeypatch)
    q, k, v = _inputs(40, 40, "cpu", seed=11)
    out = get_provider("fa4").forward(q, k, v, causal, 0.2)
    (args, kwargs), = cute.flash_attn_func.calls
    assert len(args) == 3 and all(a is b for a, b in zip(args, (q, k, v), strict=True))
    assert kwargs == {"softmax_scale": 0.2, "causal": causal, "num_splits": 1}
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    ref, _ = attention_reference(q, k, v, softmax_scale=0.2, causal=causal)
    assert torch.equal(out, ref.to(q.dtype))


def test_fa4_config_records_its_version_and_no_split_kv(monkeypatch):
    monkeypatch.setattr(packages, "package_version", {"flash-attn-4": "4.0.0b36", "nvidia-cutlass-dsl": "4.8.1"}.get)
    config = json.loads(get_provider("fa4").config(Spec("fwd", True, 128, 2048, 8, 16, "bf16")))
    assert config["version"] == "4.0.0b36" and config["nvidia-cutlass-dsl"] == "4.8.1" and config["num_splits"] == 1


@pytest.fixture
def fake_flashinfer(monkeypatch):
    yield install_fake_flashinfer(monkeypatch)
    clear_flashinfer_caches()


@pytest.mark.parametrize(("seqlen_q", "seqlen_k", "causal"), [(24, 24, False), (24, 24, True), (16, 40, True)])
def test_flashinfer_prefill_packs_the_batch_and_plans_once_per_shape(fake_flashinfer, seqlen_q, seqlen_k, causal):
    generator = torch.Generator().manual_seed(seqlen_q * seqlen_k)
    q = torch.randn(3, seqlen_q, 4, 32, generator=generator, dtype=torch.float16)
    k, v = (torch.randn(3, seqlen_k, 2, 32, generator=generator, dtype=torch.float16) for _ in range(2))
    provider = get_provider("flashinfer")
    out = provider.forward(q, k, v, causal, 0.15)
    provider.forward(q, k, v, causal, 0.15)
    (wrapper,) = FakePrefillWrapper.instances
    (plan,) = wrapper.plans  # planned once: the second call reuses the plan
    qo_indptr, kv_indptr, heads, kv_heads, hdim, kwargs = plan
    assert qo_indptr == [0, seqlen_q, 2 * seqlen_q, 3 * seqlen_q] and kv_indptr == [0, seqlen_k, 2 * seqlen_k,
                                                                                    3 * seqlen_k]
    assert (heads, kv_heads, hdim) == (4, 2, 32) and kwargs["causal"] is causal and kwargs["sm_scale"] == 0.15
    ref, _ = attention_reference(q, k, v, softmax_scale=0.15, causal=causal)
    assert out.shape == q.shape and torch.equal(out, ref.to(q.dtype))


# --------------------------------------------------------------------------------------
# The peers' versions in the row environment
# --------------------------------------------------------------------------------------
def test_environment_records_each_peer_version_and_blank_for_an_absent_one(monkeypatch):
    import importlib.metadata

    from harness import environment

    installed = {"flash-attn-4": "4.0.0b36", "nvidia-cutlass-dsl": "4.8.1"}

    def version(distribution):
        if distribution not in installed:
            raise importlib.metadata.PackageNotFoundError(distribution)
        return installed[distribution]

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert set(environment.PEER_VERSION_COLUMNS) == {"flash_attn_4", "nvidia_cutlass_dsl", "flashinfer", "xformers"}
    assert environment.ROW_ENV_COLUMNS[:len(environment.ENV_COLUMNS)] == environment.ENV_COLUMNS
    assert set(environment.PEER_VERSION_COLUMNS) <= set(environment.ROW_ENV_COLUMNS)
    captured = environment.capture_environment()
    assert {column: captured[column] for column in environment.PEER_VERSION_COLUMNS} == {
        "flash_attn_4": "4.0.0b36", "nvidia_cutlass_dsl": "4.8.1", "flashinfer": "", "xformers": ""}


# --------------------------------------------------------------------------------------
# On a GPU: every available peer against the float64 reference
# --------------------------------------------------------------------------------------
PREFILL_PEERS = ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "torch-compile", "flex-attention", "fa4", "flash-attn",
                 "flash-attn-3", "flashinfer", "xformers-cutlass", "xformers-flash")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", PREFILL_PEERS)
def test_available_peer_computes_the_reference_forward_and_gradients(name, causal):
    provider = get_provider(name)
    reason = unavailable_reason(provider)
    if reason is not None:
        pytest.skip(f"{name} is unavailable here: {reason}")
    spec = Spec("fwd_bwd" if provider.has_backward else "fwd", causal, 128, 384, 2, 4, "bf16")
    refused = provider.supports(spec)
    assert refused is None, f"{name} refuses the paper's head dim 128 in bf16: {refused}"
    generator = torch.Generator(device="cuda").manual_seed(21 + causal)
    q, k, v = (torch.randn(2, 384, 4, 128, generator=generator, device="cuda", dtype=torch.bfloat16)
               .requires_grad_(provider.has_backward) for _ in range(3))
    out = provider.forward(q, k, v, causal, 128 ** -0.5)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, softmax_scale=128 ** -0.5, causal=causal)
    errors = {"out": ((out.double() - ref).norm() / ref.norm()).item()}
    if provider.has_backward:
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
        errors.update({f"d{n}": ((g.double() - r).norm() / r.norm()).item()
                       for n, g, r in zip("qkv", grads, ref_grads, strict=True)})
        for _ in range(2):  # the backward timing's call: again and again on one retained graph
            q.grad = None
            out.backward(dout, retain_graph=True)
            assert torch.equal(q.grad, grads[0]) or ((q.grad - grads[0]).norm() / grads[0].norm()).item() < 1e-2
    assert max(errors.values()) < 2e-2, (name, errors)
