"""The decode providers (baselines/providers/decode.py, kind 'decode' in the one registry): its contract (argument checks, cache
lengths read once per tensor version), the CPU providers against the float64 reference with
poisoned unused cache slots, and FA4's, FlashInfer's and xformers' split-K argument mapping and
layouts through fake modules; on a GPU, every available decode peer against the reference."""

import sys
import types

import pytest
import torch
from peer_fakes import (
    FakeDecodeWrapper,
    assert_sentence,
    clear_flashinfer_caches,
    install_fake_fa4,
    install_fake_flashinfer,
)

from baselines.providers import UnsupportedInput, decode, get_provider, registry, unavailable_reason
from baselines.reference import attention_reference


@pytest.fixture
def fake_flashinfer(monkeypatch):
    yield install_fake_flashinfer(monkeypatch)
    clear_flashinfer_caches()


POISON = 300.0
DECODE_NAMES = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "pytorch", "torch-compile", "fa4",
                "flashinfer", "flashinfer-single", "xformers-splitk", "xformers-dispatch")


def _decode_inputs(batch=3, heads=8, kv_heads=2, hdim=32, cache_len=48, lengths=(5, 48, 17), seed=0):
    """Random q and cache; the slots past each sequence's length hold a large finite poison
    (the contract asks for finite values there: a kernel may load them and multiply by P = 0),
    which would dominate the scores if a decode attended to it."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 1, heads, hdim, generator=generator, dtype=torch.float16)
    k, v = (torch.randn(batch, cache_len, kv_heads, hdim, generator=generator, dtype=torch.float16)
            for _ in range(2))
    for b, n in enumerate(lengths):
        k[b, n:], v[b, n:] = POISON, -POISON
    return q, k, v, torch.tensor(lengths, dtype=torch.int32)


def test_decode_registry_has_every_peer_once_and_says_why_one_is_unavailable():
    assert tuple(registry("decode")) == DECODE_NAMES
    for provider in registry("decode").values():
        assert get_provider(provider.name, "decode") is provider and provider.label
        reason = unavailable_reason(provider)
        if reason is not None:
            assert_sentence(reason, provider.name)
    with pytest.raises(ValueError, match="unknown decode provider 'nope'.*fa4"):
        get_provider("nope", "decode")


@pytest.mark.parametrize("name", ["pytorch", "sdpa-math"])
@pytest.mark.parametrize(("kv_heads", "lengths"), [(8, (48, 48, 48)), (2, (5, 48, 17)), (1, (1, 30, 48))])
def test_cpu_decode_matches_the_reference_on_its_cache_lengths(name, kv_heads, lengths):
    q, k, v, cache_seqlens = _decode_inputs(kv_heads=kv_heads, lengths=lengths, seed=kv_heads)
    out = get_provider(name, "decode").forward(q, k, v, cache_seqlens)
    ref, _ = attention_reference(q, k, v, seqlens_k=cache_seqlens)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-3


def test_decode_reads_new_lengths_after_an_in_place_change():
    """Host copies of the lengths (SDPA's mask) are kept per tensor and version: an in-place
    update of cache_seqlens must be seen, as the next decode step's lengths."""
    q, k, v, cache_seqlens = _decode_inputs(lengths=(5, 30, 17), seed=4)
    k[:, 5:], v[:, 5:] = 0.5, -0.25  # the longer lengths read these slots
    sdpa_math = get_provider("sdpa-math", "decode").forward
    sdpa_math(q, k, v, cache_seqlens)
    cache_seqlens.add_(7)
    ref, _ = attention_reference(q, k, v, seqlens_k=cache_seqlens)
    out = sdpa_math(q, k, v, cache_seqlens)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 5e-3


@pytest.mark.parametrize(("change", "match"), [
    (lambda q, k, v, n: (q.expand(-1, 2, -1, -1), k, v, n), "q must be"),
    (lambda q, k, v, n: (q, k, v[:, :-1], n), "k_cache and v_cache"),
    (lambda q, k, v, n: (q[:, :, :5], k, v, n), "kv_heads dividing heads"),
    (lambda q, k, v, n: (q, k, v, n.long()), "cache_seqlens must be int32"),
    (lambda q, k, v, n: (q, k.float(), v.float(), n), "share a dtype"),
])
def test_decode_inputs_that_break_the_contract_are_refused_naming_the_argument(change, match):
    with pytest.raises(ValueError, match=match):
        get_provider("pytorch", "decode").forward(*change(*_decode_inputs()))


def test_decode_lengths_outside_the_cache_are_refused():
    q, k, v, _ = _decode_inputs()
    with pytest.raises(ValueError, match="cache_seqlens must lie in 1..48"):
        get_provider("sdpa-math", "decode").forward(q, k, v, torch.tensor([5, 49, 0], dtype=torch.int32))


@pytest.mark.parametrize(("capability", "num_splits"), [((9, 0), 1), ((10, 0), 0)])
def test_fa4_decode_passes_the_cache_lengths_as_seqused_k_and_no_split_kv_on_hopper(monkeypatch, capability,
                                                                                   num_splits):
    cute = install_fake_fa4(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: capability)
    q, k, v, cache_seqlens = _decode_inputs(seed=8)
    out = get_provider("fa4", "decode").forward(q, k, v, cache_seqlens, 0.3)
    (args, kwargs), = cute.flash_attn_varlen_func.calls
    assert len(args) == 3 and kwargs["seqused_k"] is cache_seqlens
    assert kwargs["num_splits"] == num_splits and kwargs["causal"] is False and kwargs["softmax_scale"] == 0.3
    ref, _ = attention_reference(q, k, v, softmax_scale=0.3, seqlens_k=cache_seqlens)
    assert torch.equal(out, ref.to(q.dtype))


def test_flashinfer_decode_maps_the_cache_to_one_page_per_sequence_and_plans_once_per_lengths(fake_flashinfer):
    q, k, v, cache_seqlens = _decode_inputs(seed=9)
    flashinfer_decode = get_provider("flashinfer", "decode").forward
    out = flashinfer_decode(q, k, v, cache_seqlens)
    flashinfer_decode(q, k, v, cache_seqlens)
    (wrapper,) = FakeDecodeWrapper.instances
    (plan,) = wrapper.plans
    assert plan[:3] == ([0, 1, 2, 3], [0, 1, 2], [5, 48, 17]) and plan[6] == 48 and wrapper.use_tensor_cores
    ref, _ = attention_reference(q, k, v, seqlens_k=cache_seqlens)
    assert torch.equal(out, ref.to(q.dtype))
    cache_seqlens[0] = 6  # the next step: a new plan for the new lengths
    k[0, 5], v[0, 5] = 0.25, -0.5
    flashinfer_decode(q, k, v, cache_seqlens)
    assert len(FakeDecodeWrapper.instances) == 2 and FakeDecodeWrapper.instances[1].plans[0][2] == [6, 48, 17]


def test_xformers_splitk_decode_folds_the_batch_into_a_block_diagonal_bmghk_call(monkeypatch):
    """The wrapper hands xformers' split-K operator q (1, B, Hkv, G, D) and k/v (1, B*S, Hkv, G, D)
    with a block-diagonal padded-keys bias; a fake operator that attends by that bias's lengths
    must give the reference's answer, so the layout and the head grouping are xformers' own."""
    calls = []

    class FakeBias:
        @classmethod
        def from_seqlens(cls, q_seqlen, kv_padding, kv_seqlen, device=None):
            bias = cls()
            bias.q_seqlen, bias.kv_padding, bias.kv_seqlen = list(q_seqlen), kv_padding, list(kv_seqlen)
            return bias

    def forward(q5, k5, v5, attn_bias, scale):
        calls.append((q5.shape, k5.shape))
        outs = []
        for b, length in enumerate(attn_bias.kv_seqlen):
            start = b * attn_bias.kv_padding
            qb = q5[0, b].reshape(1, 1, -1, q5.shape[-1])  # (1, 1, Hkv * G, D)
            kb, vb = (t[0, start:start + length].reshape(1, length, -1, t.shape[-1]) for t in (k5, v5))
            outs.append(attention_reference(qb, kb, vb, softmax_scale=scale)[0].reshape(q5.shape[2:]))
        return torch.stack(outs)[None].to(q5.dtype)

    class Inputs:
        def __init__(self, query, key, value, attn_bias, scale):
            self.query, self.key, self.value, self.attn_bias, self.scale = query, key, value, attn_bias, scale

        def validate_inputs(self):
            pass

        def normalize_bmhk(self):
            return tuple(self.query.shape)

    class FwOp:  # the split-K operator, applied itself
        NAME = "triton_splitKF"

        @staticmethod
        def not_supported_reasons(inp):
            return []

        @staticmethod
        def apply(inp, needs_gradient):
            return forward(inp.query, inp.key, inp.value, inp.attn_bias, inp.scale), None

    fmha = types.SimpleNamespace(Inputs=Inputs, triton_splitk=types.SimpleNamespace(FwOp=FwOp))
    modules = {"xformers": types.ModuleType("xformers"), "xformers.ops": types.SimpleNamespace(fmha=fmha),
               "xformers.ops.fmha": fmha,
               "xformers.ops.fmha.attn_bias": types.SimpleNamespace(BlockDiagonalPaddedKeysMask=FakeBias)}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    q, k, v, cache_seqlens = _decode_inputs(seed=10)
    out = get_provider("xformers-splitk", "decode").forward(q, k, v, cache_seqlens)
    (q_shape, k_shape), = calls
    assert q_shape == (1, 3, 2, 4, 32) and k_shape == (1, 3 * 48, 2, 4, 32)
    ref, _ = attention_reference(q, k, v, seqlens_k=cache_seqlens)
    assert out.shape == q.shape and ((out.double() - ref).norm() / ref.norm()).item() < 1e-3


@pytest.mark.parametrize(("name", "spec", "refused"), [
    ("fa4", decode.DecodeSpec(8, 32, 8, 128, 8192, "bf16"), None),
    ("fa4", decode.DecodeSpec(8, 32, 8, 100, 8192, "bf16"), "multiples of 8"),
    ("fa4", decode.DecodeSpec(8, 32, 8, 128, 8192, "fp32"), "fp16/bf16"),
    ("flashinfer", decode.DecodeSpec(8, 32, 8, 96, 8192, "bf16"), "head dims"),
    ("xformers-splitk", decode.DecodeSpec(8, 32, 8, 80, 8192, "fp16"), "head dims"),
    ("sdpa-flash", decode.DecodeSpec(1, 32, 32, 512, 8192, "bf16"), "up to 256"),
    ("sdpa-math", decode.DecodeSpec(1, 32, 32, 512, 8192, "fp32"), None),
])
def test_decode_shape_checks_refuse_what_the_kernel_does_not_take(name, spec, refused):
    reason = get_provider(name, "decode").supports(spec)
    assert reason is None if refused is None else refused in reason


def test_decode_spec_rejects_kv_heads_that_do_not_divide_heads():
    with pytest.raises(ValueError, match="DecodeSpec.kv_heads"):
        decode.DecodeSpec(1, 32, 6, 128, 1024, "bf16")


# --------------------------------------------------------------------------------------
# On a GPU: every available peer against the float64 reference
# --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [8, 32])
@pytest.mark.parametrize("name", DECODE_NAMES)
def test_available_decode_peer_attends_to_each_sequences_cache_only(name, kv_heads):
    provider = get_provider(name, "decode")
    reason = unavailable_reason(provider) or provider.supports(
        decode.DecodeSpec(4, 32, kv_heads, 128, 1024, "bf16"))
    if reason is not None:
        pytest.skip(f"{name} is unavailable here: {reason}")
    generator = torch.Generator(device="cuda").manual_seed(kv_heads)
    q = torch.randn(4, 1, 32, 128, generator=generator, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(4, 1024, kv_heads, 128, generator=generator, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    for lengths in ((1024, 1024, 1024, 1024), (1, 700, 1024, 333)):
        cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        k_poisoned, v_poisoned = k.clone(), v.clone()
        for b, n in enumerate(lengths):
            k_poisoned[b, n:], v_poisoned[b, n:] = POISON, -POISON
        try:
            out = provider.forward(q, k_poisoned, v_poisoned, cache_seqlens)
        except UnsupportedInput as exc:  # e.g. SDPA flash takes no mask: ragged lengths refused, not ignored
            # every decode peer takes the plain case (full caches, one kv head per q head) but xformers'
            # dispatcher, whose operators for it are compiled ones that may not load beside this torch
            assert name == "xformers-dispatch" or not (kv_heads == 32 and lengths == (1024,) * 4), (name, exc)
            continue
        ref, _ = attention_reference(q, k_poisoned, v_poisoned, seqlens_k=cache_seqlens)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2, (name, lengths)
