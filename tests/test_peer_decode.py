"""FlashInfer's and xformers' decode and prefill entry points beyond the contiguous decode:
FlashInfer's batch decode on a paged cache (its CSR page table built from a block table),
its single-sequence decode, its ragged prefill with variable lengths, a window and a softcap,
xformers' split-K op on a paged cache, and xformers' dispatcher (a refusal as the reason). Fake modules (tests/peer_fakes.py)
record the calls and answer with the float64 reference; on a GPU, the real packages against
that reference."""

import importlib
import importlib.util
import math
import sys
import types

import pytest
import torch
from peer_fakes import (
    FakeDecodeWrapper,
    FakePrefillWrapper,
    assert_sentence,
    clear_flashinfer_caches,
    fake_gpu,
    install_fake_flashinfer,
)

from baselines.providers import UnsupportedInput, decode, get_provider, packages, unavailable_reason
from baselines.reference import attention_reference, attention_reference_varlen

POISON = 300.0


@pytest.fixture
def fake_flashinfer(monkeypatch):
    yield install_fake_flashinfer(monkeypatch)
    clear_flashinfer_caches()


def _paged(batch=3, heads=8, kv_heads=2, hdim=32, page_size=8, pages_per_sequence=6, lengths=(5, 48, 17), seed=0):
    """A cache of `pages_per_sequence` pages of `page_size` slots per sequence, its pages shuffled
    into one pool (the decode suite's layout); slots past each length, and the pool's spare pages,
    hold a large finite poison. Returns q, the pools, the block table, the lengths and the
    contiguous cache the pages hold."""
    generator = torch.Generator().manual_seed(seed)
    cache_len = pages_per_sequence * page_size
    q = torch.randn(batch, 1, heads, hdim, generator=generator, dtype=torch.float16)
    k, v = (torch.randn(batch, cache_len, kv_heads, hdim, generator=generator, dtype=torch.float16) for _ in range(2))
    for b, n in enumerate(lengths):
        k[b, n:], v[b, n:] = POISON, -POISON
    num_pages = batch * pages_per_sequence + 2  # two pages no sequence owns
    order = torch.randperm(num_pages, generator=generator)[:batch * pages_per_sequence]
    pools = [torch.full((num_pages, page_size, kv_heads, hdim), POISON, dtype=torch.float16) for _ in "kv"]
    for pool, cache in zip(pools, (k, v)):
        pool[order] = cache.reshape(-1, page_size, kv_heads, hdim)  # page j of the cache in slot order[j]
    block_table = order.reshape(batch, pages_per_sequence).to(torch.int32)
    return q, pools[0], pools[1], block_table, torch.tensor(lengths, dtype=torch.int32), k, v


def test_flashinfer_paged_decode_builds_the_csr_page_table_from_the_block_table(fake_flashinfer):
    q, k_pages, v_pages, block_table, lengths, k, v = _paged()
    paged = get_provider("flashinfer", "decode").decode_paged
    out = paged(q, k_pages, v_pages, block_table, lengths, 0.2)
    paged(q, k_pages, v_pages, block_table, lengths, 0.2)
    (wrapper,) = FakeDecodeWrapper.instances  # planned once for these lengths and this table
    (plan,) = wrapper.plans
    indptr, indices, last_page_len, heads, kv_heads, hdim, page_size, kwargs = plan
    pages = [1, 6, 3]  # ceil(5 / 8), ceil(48 / 8), ceil(17 / 8)
    assert indptr == [0, 1, 7, 10] and last_page_len == [5, 8, 1] and page_size == 8
    assert indices == [i for b, p in enumerate(pages) for i in block_table[b, :p].tolist()]
    assert (heads, kv_heads, hdim) == (8, 2, 32) and kwargs["sm_scale"] == 0.2
    ref, _ = attention_reference(q, k, v, softmax_scale=0.2, seqlens_k=lengths)
    assert torch.equal(out, ref.to(q.dtype))


def test_flashinfer_paged_decode_plans_again_for_another_block_table(fake_flashinfer):
    q, k_pages, v_pages, block_table, lengths, k, v = _paged(seed=1)
    paged = get_provider("flashinfer", "decode").decode_paged
    paged(q, k_pages, v_pages, block_table, lengths)
    # the same pages listed in another order by a second table (the suite's next copy): a new plan
    permutation = torch.randperm(k_pages.shape[0], generator=torch.Generator().manual_seed(2))
    inverse = torch.argsort(permutation)
    out = paged(q, k_pages[permutation], v_pages[permutation], inverse[block_table.long()].to(torch.int32), lengths)
    assert len(FakeDecodeWrapper.instances) == 2
    ref, _ = attention_reference(q, k, v, seqlens_k=lengths)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-3


def test_flashinfer_contiguous_decode_is_the_paged_call_with_one_page_per_sequence(fake_flashinfer):
    q, _, _, _, lengths, k, v = _paged(seed=3)
    out = get_provider("flashinfer", "decode").forward(q, k, v, lengths)
    (plan,) = FakeDecodeWrapper.instances[0].plans
    assert plan[:3] == ([0, 1, 2, 3], [0, 1, 2], lengths.tolist()) and plan[6] == k.shape[1]
    ref, _ = attention_reference(q, k, v, seqlens_k=lengths)
    assert torch.equal(out, ref.to(q.dtype))


@pytest.mark.parametrize(("change", "match"), [
    (lambda q, kp, vp, t, n: (q, kp, vp, t.long(), n), "block_table must be int32"),
    (lambda q, kp, vp, t, n: (q, kp, vp, t[:2], n), r"block_table must be int32 of shape \(3, pages_per_sequence\)"),
    (lambda q, kp, vp, t, n: (q, kp, vp[:, :4], t, n), "k_pages and v_pages must both be"),
    (lambda q, kp, vp, t, n: (q[..., :16], kp, vp, t, n), "same headdim"),
    (lambda q, kp, vp, t, n: (q, kp, vp, t, n[:2]), "cache_seqlens must be int32 of shape"),
])
def test_paged_inputs_that_break_the_contract_are_refused_naming_the_argument(fake_flashinfer, change, match):
    q, k_pages, v_pages, block_table, lengths, _, _ = _paged(seed=4)
    with pytest.raises(ValueError, match=match):
        get_provider("flashinfer", "decode").decode_paged(*change(q, k_pages, v_pages, block_table, lengths))


def test_flashinfer_paged_decode_refuses_lengths_beyond_its_pages(fake_flashinfer):
    q, k_pages, v_pages, block_table, _, _, _ = _paged(seed=5)
    with pytest.raises(ValueError, match="cache_seqlens must lie in 1..48"):
        decode.flashinfer_decode_paged(q, k_pages, v_pages, block_table, torch.tensor([5, 49, 3], dtype=torch.int32))


@pytest.mark.parametrize(("kv_heads", "tensor_cores"), [(2, True), (8, False)])
def test_flashinfer_single_decode_reads_its_sequence_up_to_its_length(fake_flashinfer, kv_heads, tensor_cores):
    q, _, _, _, lengths, k, v = _paged(batch=1, kv_heads=kv_heads, lengths=(29,), seed=6)
    out = get_provider("flashinfer-single", "decode").forward(q, k, v, lengths, 0.3)
    ((q1, k1, v1), kwargs), = fake_flashinfer.single_decode_with_kv_cache.calls
    assert q1.shape == (8, 32) and k1.shape == v1.shape == (29, kv_heads, 32)
    assert k1.data_ptr() == k.data_ptr()  # a view of the cache, no copy
    assert kwargs["use_tensor_cores"] is tensor_cores and kwargs["sm_scale"] == 0.3
    ref, _ = attention_reference(q, k, v, softmax_scale=0.3, seqlens_k=lengths)
    assert torch.equal(out, ref.to(q.dtype))


def test_flashinfer_single_decode_refuses_a_batch(fake_flashinfer):
    q, _, _, _, lengths, k, v = _paged(seed=7)
    provider = get_provider("flashinfer-single", "decode")
    with pytest.raises(UnsupportedInput, match="one sequence, not a batch of 3"):
        provider.forward(q, k, v, lengths)
    assert "not a batch of 8" in provider.supports(decode.DecodeSpec(8, 32, 8, 128, 4096, "bf16"))
    assert provider.supports(decode.DecodeSpec(1, 32, 8, 128, 4096, "bf16")) is None


@pytest.mark.parametrize(("causal", "window_left", "softcap"), [(True, -1, 0.0), (True, 7, 0.0), (False, -1, 5.0)])
def test_flashinfer_ragged_prefill_plans_the_lengths_window_and_softcap(fake_flashinfer, causal, window_left, softcap):
    generator = torch.Generator().manual_seed(window_left + 10)
    lengths = (13, 30, 4)
    q = torch.randn(sum(lengths), 4, 32, generator=generator, dtype=torch.float16)
    k, v = (torch.randn(sum(lengths), 2, 32, generator=generator, dtype=torch.float16) for _ in range(2))
    out = packages.flashinfer_ragged_forward(q, k, v, lengths, lengths, causal, 0.25, window_left, softcap)
    packages.flashinfer_ragged_forward(q, k, v, lengths, lengths, causal, 0.25, window_left, softcap)
    (wrapper,) = FakePrefillWrapper.instances
    (plan,) = wrapper.plans
    qo_indptr, kv_indptr, heads, kv_heads, hdim, kwargs = plan
    assert qo_indptr == kv_indptr == [0, 13, 43, 47] and (heads, kv_heads, hdim) == (4, 2, 32)
    assert kwargs["window_left"] == window_left and kwargs["logits_soft_cap"] == (softcap or None)
    cu = torch.tensor([0, 13, 43, 47], dtype=torch.int32)
    ref, _ = attention_reference_varlen(q, k, v, cu, cu, 0.25, causal, window_size=(window_left, -1), softcap=softcap)
    assert torch.equal(out, ref.to(q.dtype))


def test_flashinfer_ragged_prefill_refuses_lengths_that_do_not_pack_the_rows(fake_flashinfer):
    q, k, v = (torch.randn(20, 2, 32, dtype=torch.float16) for _ in range(3))
    with pytest.raises(ValueError, match="must pack q_lengths and k_lengths"):
        packages.flashinfer_ragged_forward(q, k, v, (10, 9), (10, 10), True, None)


XFORMERS_REFUSAL = """No operator found for `memory_efficient_attention_forward` with inputs:
     query       : shape=(1, 4, 32, 1, 128) (torch.bfloat16)
     key         : shape=(1, 4096, 32, 1, 128) (torch.bfloat16)
     attn_bias   : <class 'xformers.ops.fmha.attn_bias.BlockDiagonalPaddedKeysMask'>
`fa2F@2.8.3-pt` is not supported because:
    xFormers wasn't build with CUDA support
`cutlassF-pt` is not supported because:
    xFormers wasn't build with CUDA support
    operator wasn't built - see `python -m xformers.info` for more info"""


class FakeBias:
    """xformers' BlockDiagonalPaddedKeysMask: the lengths; make_paged adds the block table."""

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_padding, kv_seqlen, device=None):
        bias = cls()
        bias.kv_padding, bias.kv_seqlen, bias.block_tables, bias.page_size = kv_padding, list(kv_seqlen), None, None
        return bias

    def make_paged(self, block_tables, page_size, paged_type):
        assert paged_type == "PagedBlockDiagonalPaddedKeysMask"
        self.block_tables, self.page_size = block_tables, page_size
        return self


def _attend_by_bias(q5, k5, v5, attn_bias, scale):
    """What xformers computes for a (paged) block-diagonal padded-keys bias, from the float64
    reference: sequence b's slot j at row b * padding + j, or through its block table."""
    outs = []
    for b, length in enumerate(attn_bias.kv_seqlen):
        slots = torch.arange(length)
        if attn_bias.block_tables is None:
            rows = b * attn_bias.kv_padding + slots
        else:
            rows = attn_bias.block_tables[b, slots // attn_bias.page_size].long() * attn_bias.page_size \
                + slots % attn_bias.page_size
        qb = q5[0, b].reshape(1, 1, -1, q5.shape[-1])  # (1, 1, Hkv * G, D)
        kb, vb = (t[0, rows].reshape(1, length, -1, t.shape[-1]) for t in (k5, v5))
        outs.append(attention_reference(qb, kb, vb, softmax_scale=scale)[0].reshape(q5.shape[2:]))
    return torch.stack(outs)[None].to(q5.dtype)


class FakeInputs:
    """xformers' fmha.Inputs: the BMGHK tensors, bias and scale, as its checks and operators read them."""

    def __init__(self, query, key, value, attn_bias=None, scale=None):
        self.query, self.key, self.value, self.attn_bias, self.scale = query, key, value, attn_bias, scale

    def validate_inputs(self):
        assert self.query.dim() == self.key.dim() == self.value.dim() == 5

    def normalize_bmhk(self):
        return tuple(self.query.shape)


def _fake_xformers(monkeypatch, forward=None, split_k=None, reasons=()):
    """xformers' modules: the dispatcher's entry point `forward`, and the split-K operator whose
    apply(inp) runs `split_k` after its own checks gave `reasons`."""
    applied = []

    class FwOp:
        NAME, BLOCK_N = "triton_splitKF", 64

        @staticmethod
        def not_supported_reasons(inp):
            return [reason(inp) if callable(reason) else reason for reason in reasons]

        @staticmethod
        def apply(inp, needs_gradient):
            assert not needs_gradient
            applied.append(inp)
            return split_k(inp.query, inp.key, inp.value, inp.attn_bias, inp.scale), None

    fmha = types.SimpleNamespace(memory_efficient_attention_forward=forward, Inputs=FakeInputs,
                                 triton_splitk=types.SimpleNamespace(FwOp=FwOp))
    attn_bias = types.SimpleNamespace(BlockDiagonalPaddedKeysMask=FakeBias,
                                      PagedBlockDiagonalPaddedKeysMask="PagedBlockDiagonalPaddedKeysMask")
    for name, module in {"xformers": types.ModuleType("xformers"), "xformers.ops": types.SimpleNamespace(fmha=fmha),
                         "xformers.ops.fmha": fmha, "xformers.ops.fmha.attn_bias": attn_bias}.items():
        monkeypatch.setitem(sys.modules, name, module)
    FwOp.applied = applied
    return FwOp


def test_xformers_paged_split_k_reads_the_pages_through_its_block_table(monkeypatch):
    """The split-K operator is applied itself (not through the dispatcher) to the pool as one
    sequence axis, and the build refusal of a build without xformers' C++ extension, which does
    not concern this Triton kernel, does not stop it."""
    op = _fake_xformers(monkeypatch, split_k=_attend_by_bias, reasons=[decode.XFORMERS_BUILD_REFUSAL])
    q, k_pages, v_pages, block_table, lengths, k, v = _paged(page_size=64, pages_per_sequence=2,
                                                            lengths=(5, 128, 70), seed=11)
    out = get_provider("xformers-splitk", "decode").decode_paged(q, k_pages, v_pages, block_table, lengths)
    assert [(inp.key.shape, inp.attn_bias.page_size) for inp in op.applied] == [((1, k_pages.shape[0] * 64, 2, 4, 32),
                                                                                 64)]
    ref, _ = attention_reference(q, k, v, seqlens_k=lengths)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-3


def test_xformers_paged_split_k_refusal_of_small_pages_is_the_reason(monkeypatch):
    def small_pages(inp):
        return ("For paged attention, page size should be divisible by the block size, but got "
                f"page_size={inp.attn_bias.page_size}, cls.BLOCK_N=64.")

    op = _fake_xformers(monkeypatch, split_k=_attend_by_bias, reasons=[decode.XFORMERS_BUILD_REFUSAL, small_pages])
    q, k_pages, v_pages, block_table, lengths, _, _ = _paged(page_size=16, pages_per_sequence=3, seed=12)
    with pytest.raises(UnsupportedInput) as caught:
        get_provider("xformers-splitk", "decode").decode_paged(q, k_pages, v_pages, block_table, lengths)
    assert str(caught.value) == ("xformers' split-K op has no operator for this input: triton_splitKF: For paged "
                                 "attention, page size should be divisible by the block size, but got page_size=16, "
                                 "cls.BLOCK_N=64.")
    assert not op.applied


def test_an_xformers_error_that_is_no_refusal_is_raised_as_it_is(monkeypatch):
    def split_k(q5, k5, v5, attn_bias, scale):
        raise ValueError("a bug inside xformers")

    _fake_xformers(monkeypatch, split_k=split_k)
    q, _, _, _, lengths, k, v = _paged(seed=13)
    with pytest.raises(ValueError, match="a bug inside xformers"):
        get_provider("xformers-splitk", "decode").forward(q, k, v, lengths)


def test_xformers_imports_beside_flash_attn_4(monkeypatch, tmp_path):
    """FlashAttention-4's wheel installs a `flash_attn` package without flash_attn_interface, which
    xformers' fmha/flash.py imports whenever a `flash_attn` package exists: xformers_fmha hides
    that package from xformers' look-up during the import (and only then)."""
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    fmha = tmp_path / "xformers" / "ops" / "fmha"
    fmha.mkdir(parents=True)
    for package in (tmp_path / "xformers", tmp_path / "xformers" / "ops"):
        (package / "__init__.py").write_text("")
    (fmha / "__init__.py").write_text(  # what xformers' fmha/flash.py does at import
        "import importlib.util\n"
        "if importlib.util.find_spec('flash_attn'):\n"
        "    import flash_attn.flash_attn_interface\n")
    (fmha / "attn_bias.py").write_text(
        "class BlockDiagonalPaddedKeysMask:\n"
        "    @classmethod\n"
        "    def from_seqlens(cls, q_seqlen, kv_padding, kv_seqlen, device=None):\n"
        "        return (q_seqlen, kv_padding, kv_seqlen)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = ("flash_attn", "xformers", "xformers.ops", "xformers.ops.fmha", "xformers.ops.fmha.attn_bias",
               "flash_attn.flash_attn_interface")
    for name in modules:  # set to themselves first, so that the test's imports are undone after it
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name))
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ModuleNotFoundError, match="flash_attn.flash_attn_interface"):
        importlib.import_module("xformers.ops.fmha")
    for name in modules:
        monkeypatch.delitem(sys.modules, name, raising=False)
    # the bias, the first thing a call makes, imports xformers' fmha the same way
    assert decode._xformers_bias((3, 5), 2, 8, "cpu") == ([1, 1], 8, [3, 5])
    assert decode.xformers_fmha().__name__ == "xformers.ops.fmha"
    assert importlib.util.find_spec("flash_attn") is not None  # the look-up is itself again
    # flash-attn 2's package (with flash_attn_interface) is not hidden: xformers imports it as before
    (tmp_path / "flash_attn" / "flash_attn_interface.py").write_text("")
    for name in modules:
        monkeypatch.delitem(sys.modules, name, raising=False)
    decode.xformers_fmha()
    assert "flash_attn.flash_attn_interface" in sys.modules


def test_xformers_dispatcher_refusal_is_the_row_reason_with_each_operators_reasons(monkeypatch):
    def refuse(q5, k5, v5, attn_bias, scale):
        raise NotImplementedError(XFORMERS_REFUSAL)

    _fake_xformers(monkeypatch, refuse)
    q, _, _, _, lengths, k, v = _paged(kv_heads=8, seed=8)
    with pytest.raises(UnsupportedInput) as caught:
        get_provider("xformers-dispatch", "decode").forward(q, k, v, lengths)
    reason = str(caught.value)
    assert_sentence(reason, "xformers-dispatch")
    assert reason.startswith("xformers' dispatcher has no operator for this input: fa2F@2.8.3-pt: xFormers wasn't "
                             "build with CUDA support; cutlassF-pt: xFormers wasn't build with CUDA support, operator")


def test_xformers_dispatcher_is_called_without_an_operator_on_the_split_k_layout(monkeypatch):
    calls = []

    def forward(q5, k5, v5, attn_bias, scale):
        calls.append((q5.shape, k5.shape, k5.stride(3), scale))
        return torch.zeros_like(q5)

    _fake_xformers(monkeypatch, forward)
    q, _, _, _, lengths, k, v = _paged(seed=9)
    out = get_provider("xformers-dispatch", "decode").forward(q, k, v, lengths)
    # (1, B, Hkv, G, D) and (1, B * S, Hkv, G, D), G a stride-0 expand: xformers' GQA signal
    assert calls == [((1, 3, 2, 4, 32), (1, 3 * 48, 2, 4, 32), 0, 1 / math.sqrt(32))] and out.shape == q.shape


@pytest.mark.parametrize("name", ["flashinfer-single", "xformers-dispatch"])
def test_a_new_peer_without_its_package_says_which_to_install(monkeypatch, name):
    provider = get_provider(name, "decode")
    fake_gpu(monkeypatch, (9, 0))
    for module in ("flashinfer", "xformers", "xformers.ops"):
        monkeypatch.setitem(sys.modules, module, None)  # makes the import fail
    provider.availability.cache_clear()
    try:
        reason = unavailable_reason(provider)
    finally:
        provider.availability.cache_clear()
    assert_sentence(reason, name)
    assert "failed" in reason and ("pip install flashinfer-python" in reason or "pip install xformers" in reason)


# --------------------------------------------------------------------------------------
# On a GPU: the real packages against the float64 reference
# --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [8, 32])
@pytest.mark.parametrize(("name", "page_size"), [("flashinfer", 16), ("xformers-splitk", 64)])
def test_paged_decode_peer_on_the_gpu_matches_the_reference(name, page_size, kv_heads):
    provider = get_provider(name, "decode")
    reason = unavailable_reason(provider)
    if reason is not None:
        pytest.skip(f"{name} is unavailable here: {reason}")
    q, k_pages, v_pages, block_table, lengths, k, v = _paged(batch=4, heads=32, kv_heads=kv_heads, hdim=128,
                                                            page_size=page_size, pages_per_sequence=1024 // page_size,
                                                            lengths=(1, 700, 1024, 333), seed=kv_heads)
    q, k_pages, v_pages, k, v = (t.to("cuda", torch.bfloat16) for t in (q, k_pages, v_pages, k, v))
    block_table, lengths = block_table.cuda(), lengths.cuda()
    out = provider.decode_paged(q, k_pages, v_pages, block_table, lengths)
    ref, _ = attention_reference(q, k, v, seqlens_k=lengths)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [8, 32])
def test_flashinfer_single_decode_on_the_gpu_matches_the_reference(kv_heads):
    provider = get_provider("flashinfer-single", "decode")
    reason = unavailable_reason(provider)
    if reason is not None:
        pytest.skip(f"flashinfer-single is unavailable here: {reason}")
    generator = torch.Generator(device="cuda").manual_seed(kv_heads)
    q = torch.randn(1, 1, 32, 128, generator=generator, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 4096, kv_heads, 128, generator=generator, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    k[:, 3000:], v[:, 3000:] = POISON, -POISON
    lengths = torch.tensor([3000], dtype=torch.int32, device="cuda")
    out = provider.forward(q, k, v, lengths)
    ref, _ = attention_reference(q, k, v, seqlens_k=lengths)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize(("window_left", "softcap"), [(-1, 0.0), (300, 0.0), (-1, 30.0)])
def test_flashinfer_ragged_prefill_on_the_gpu_matches_the_reference(window_left, softcap):
    reason = unavailable_reason(get_provider("flashinfer"))
    if reason is not None:
        pytest.skip(f"flashinfer is unavailable here: {reason}")
    generator = torch.Generator(device="cuda").manual_seed(window_left)
    lengths = (513, 1024, 77)
    q = torch.randn(sum(lengths), 32, 128, generator=generator, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths), 8, 128, generator=generator, device="cuda", dtype=torch.bfloat16)
            for _ in range(2))
    out = packages.flashinfer_ragged_forward(q, k, v, lengths, lengths, True, None, window_left, softcap)
    cu = torch.tensor([0, 513, 1537, 1614], dtype=torch.int32, device="cuda")
    ref, _ = attention_reference_varlen(q, k, v, cu, cu, None, True, window_size=(window_left, -1), softcap=softcap)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 2e-2
