"""The provider registry: names, availability reasons, and that the CPU-usable providers
compute flash-attn's function (bottom-right causal) or refuse with a reason. The peers that
need a GPU and a package (FA4, FlashInfer, xformers) are checked here through fake modules:
their argument mapping and layouts, not their kernels (gpu_scripts run those)."""

import json
import math
import re
import sys

import pytest
import torch

from baselines import providers as registry
from baselines.providers import (
    RUNG_NAMES,
    Spec,
    UnsupportedInput,
    builtin,
    compiled,
    get_provider,
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


def assert_sentence(reason, who):
    """A reason a reader can act on: one line of several words, not an empty or bare token."""
    assert isinstance(reason, str), (who, reason)
    assert "\n" not in reason and reason == reason.strip(), (who, reason)
    assert len(reason.split()) >= 3 and len(reason) <= 400, (who, reason)


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
    assert not re.search(fa2.bwd_kernel_regex, forward._flash_fwd_kernel.fn.__name__)
    assert not re.search(fa2.kernel_regex, flash_attn_hopper._flash_bwd_dkdv_hopper_kernel.fn.__name__)


def test_every_provider_with_a_backward_names_its_backward_kernel():
    from baselines.providers import PROVIDERS

    missing = [p.name for p in PROVIDERS.values() if p.has_backward and not p.bwd_kernel_regex]
    assert not missing, f"providers with a backward but no bwd_kernel_regex: {missing}"
