"""Bad calls of the public API (kernels/interface.py) raise a clear error naming the argument and
what was expected (kernels/checks.py), before any kernel runs; valid feature calls (GQA/MQA,
sliding windows, softcapping, ALiBi, dropout, variable lengths) run."""

import pytest
import torch

from kernels import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_qkvpacked_func,
)
from tests.attention_checks import make_qkv

INTERPRETER_TESTS = True  # unmarked tests run in Triton's interpreter (tests/conftest.py)


def _valid():
    return make_qkv(1, 8, 8, 2, 16, torch.float16, "cpu")


@pytest.mark.parametrize("mutate,error,match", [
    (lambda q, k, v: (q.float(), k, v), TypeError, "share one dtype"),
    (lambda q, k, v: (q.double(), k.double(), v.double()), TypeError, "float16, bfloat16 or float32"),
    (lambda q, k, v: (q.int(), k.int(), v.int()), TypeError, "float16, bfloat16 or float32"),
    (lambda q, k, v: (q[0], k, v), ValueError, "q must have 4 dimensions"),
    (lambda q, k, v: (q, k[..., :8], v[..., :8]), ValueError, "head dim 16"),
    (lambda q, k, v: (q, k[:, :4], v), ValueError, "same shape"),
    (lambda q, k, v: (q, torch.cat([k, k]), torch.cat([v, v])), ValueError, "batch size 1"),
    (lambda q, k, v: (q, k[:, :, :1].expand(-1, -1, 3, -1), v[:, :, :1].expand(-1, -1, 3, -1)),
     ValueError, "must divide q heads"),
    (lambda q, k, v: (torch.randn(1, 8, 2, 264, dtype=torch.float16),) * 3, ValueError,
     "between 1 and 256"),
    (lambda q, k, v: (q, k, "v"), TypeError, "v must be a torch.Tensor"),
    (lambda q, k, v: ("q", k, v), TypeError, "q must be a torch.Tensor"),
    (lambda q, k, v: (q, k, v.to("meta")), ValueError, "on one device"),
])
def test_bad_input_raises_naming_the_argument(mutate, error, match):
    with pytest.raises(error, match=match):
        flash_attn_func(*mutate(*_valid()))


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_softmax_scale_raises(scale):
    with pytest.raises(ValueError, match="softmax_scale must be a finite number > 0"):
        flash_attn_func(*_valid(), softmax_scale=scale)


@pytest.mark.parametrize("causal", [None, 2, "yes"])
def test_causal_must_be_a_bool(causal):
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attn_func(*_valid(), causal=causal)


def test_deterministic_must_be_a_bool():
    q, k, v = make_qkv(1, 8, 8, 1, 16, torch.float16, "cpu")
    with pytest.raises(TypeError, match="deterministic"):
        flash_attn_func(q, k, v, deterministic="yes")


def test_packed_inputs_of_the_wrong_layout_raise_naming_the_argument():
    q, k, _ = _valid()
    with pytest.raises(ValueError, match=r"qkv must be a tensor of shape \(batch, seqlen, 3, heads, headdim\)"):
        flash_attn_qkvpacked_func(torch.stack([q, k], dim=2))  # two, not three
    with pytest.raises(ValueError, match=r"kv must be a tensor of shape \(batch, seqlen_k, 2, kv_heads"):
        flash_attn_kvpacked_func(q, k)  # not packed
    with pytest.raises(ValueError, match=r"qkv must be a tensor of shape \(total_tokens, 3, heads, headdim\)"):
        flash_attn_varlen_qkvpacked_func(q, torch.tensor([0, 8], dtype=torch.int32), 8)


def test_cpu_tensor_without_interpreter_says_how_to_enable_it(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        flash_attn_func(*_valid())


def test_bfloat16_in_the_interpreter_raises_instead_of_computing_wrongly():
    """Triton's CPU interpreter computes bfloat16 dots wrongly without a word: a bfloat16 call on
    the CPU raises, pointing to float16/float32 there, instead of returning wrong numbers."""
    q, k, v = make_qkv(1, 8, 8, 2, 16, torch.bfloat16, "cpu")
    with pytest.raises(TypeError, match="q is bfloat16 on the CPU.*use float16 or float32"):
        flash_attn_func(q, k, v)


def test_gqa_and_each_feature_run_where_they_were_once_refused():
    """The feature arguments are accepted with valid values and give finite outputs."""
    q, k, v = make_qkv(1, 8, 8, 4, 16, torch.float16, "cpu")
    assert torch.isfinite(flash_attn_func(q, k[:, :, :2], v[:, :, :2])).all()
    for kwargs in ({"window_size": (8, 0)}, {"softcap": 30.0}, {"alibi_slopes": torch.full((4,), 0.5)}):
        assert torch.isfinite(flash_attn_func(q, k, v, **kwargs)).all()


# ---------------------------------------------------------------------------------------
# Variable lengths: cu_seqlens and max_seqlen are checked before the kernels are asked.
# ---------------------------------------------------------------------------------------
TOTAL, HEADS, HEADDIM = 10, 2, 16  # two sequences of 4 and 6 tokens


def _packed():
    return [torch.randn(TOTAL, HEADS, HEADDIM, dtype=torch.float16) for _ in range(3)]


def _varlen_call(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=6, max_seqlen_k=6, **kwargs):
    valid = torch.tensor([0, 4, TOTAL], dtype=torch.int32)
    cu_q = valid if cu_seqlens_q is None else cu_seqlens_q
    cu_k = valid.clone() if cu_seqlens_k is None else cu_seqlens_k
    return flash_attn_varlen_func(*_packed(), cu_q, cu_k, max_seqlen_q, max_seqlen_k, **kwargs)


def test_a_valid_varlen_call_runs():
    """Every check passes (so the cases below fail for their own reason)."""
    out = _varlen_call()
    assert out.shape == (TOTAL, HEADS, HEADDIM) and torch.isfinite(out).all()


def _int32(*bounds):
    return torch.tensor(bounds, dtype=torch.int32)


@pytest.mark.parametrize("side", ["q", "k"])
@pytest.mark.parametrize("cu_seqlens,error,match", [
    (torch.tensor([0, 4, TOTAL], dtype=torch.int64), TypeError, "{name} must be int32, got torch.int64"),
    ([0, 4, TOTAL], TypeError, "{name} must be an int32 tensor, got list"),
    (_int32(0, 4, TOTAL).to("meta"), ValueError, "{name} must be on the inputs' device cpu, got meta"),
    (_int32(TOTAL), ValueError, r"{name} must have shape \(batch \+ 1,\) with batch >= 1, got \(1,\)"),
    (_int32(1, 4, TOTAL), ValueError, "{name} must start at 0, got 1"),
    (_int32(0, 7, 4), ValueError, r"{name} must be non-decreasing, got \[0, 7, 4\]"),
    (_int32(0, 4, TOTAL - 1), ValueError, "{name} must end at the packed tensor's token count 10, got 9"),
], ids=["int64", "list", "wrong-device", "no-batch", "not-from-0", "decreasing", "not-to-total"])
def test_bad_cu_seqlens_raise_naming_the_argument(side, cu_seqlens, error, match):
    name = f"cu_seqlens_{side}"
    with pytest.raises(error, match=match.format(name=name)):
        _varlen_call(**{name: cu_seqlens})


@pytest.mark.parametrize("side", ["q", "k"])
def test_max_seqlen_below_the_longest_sequence_raises(side):
    with pytest.raises(ValueError, match=rf"max_seqlen_{side}=5 is below the longest sequence \(6\)"):
        _varlen_call(**{f"max_seqlen_{side}": 5})


@pytest.mark.parametrize("max_seqlen", [6.0, -1, True])
def test_max_seqlen_must_be_an_int(max_seqlen):
    with pytest.raises(TypeError, match="max_seqlen_q must be an int >= 0"):
        _varlen_call(max_seqlen_q=max_seqlen)


def test_cu_seqlens_of_q_and_k_must_have_one_shape():
    with pytest.raises(ValueError, match=r"cu_seqlens_q and cu_seqlens_k must have one shape .* \(3,\) and \(4,\)"):
        _varlen_call(cu_seqlens_k=_int32(0, 4, 4, TOTAL))


def test_cu_seqlens_k_is_required_with_cu_seqlens_q():
    q, k, v = _packed()
    with pytest.raises(ValueError, match="cu_seqlens_k is required"):
        flash_attn_varlen_func(q, k, v, _int32(0, 4, TOTAL), None, 6, 6)


def test_varlen_inputs_must_be_packed():
    q, k, v = _valid()
    with pytest.raises(ValueError, match=r"q must have 3 dimensions \(total_tokens, heads, headdim\)"):
        flash_attn_varlen_func(q, k, v, _int32(0, 8), _int32(0, 8), 8, 8)


# ---------------------------------------------------------------------------------------
# Feature arguments: checked for range and type before the gate of the kernels.
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("window_size,error,match", [
    ((-2, 0), ValueError, r"window_size sides must be >= -1 \(-1 = unbounded\), got \(-2, 0\)"),
    ((4, -3), ValueError, r"window_size sides must be >= -1 \(-1 = unbounded\), got \(4, -3\)"),
    (5, TypeError, r"window_size must be a pair of ints \(left, right\), got 5"),
])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_bad_window_size_raises(window_size, error, match, varlen):
    with pytest.raises(error, match=match):
        if varlen:
            _varlen_call(window_size=window_size)
        else:
            flash_attn_func(*_valid(), window_size=window_size)


@pytest.mark.parametrize("alibi_slopes,error,match", [
    (torch.full((3,), 0.5), ValueError, r"alibi_slopes must have shape \(2,\) or \({batch}, 2\), got \(3,\)"),
    (torch.full((3, 2), 0.5), ValueError, r"alibi_slopes must have shape \(2,\) or \({batch}, 2\), got \(3, 2\)"),
    (torch.full((2, 2, 1), 0.5), ValueError, r"alibi_slopes must have shape .*, got \(2, 2, 1\)"),
    (torch.full((2,), 0.5, dtype=torch.float16), TypeError, "alibi_slopes must be float32, got torch.float16"),
    (torch.full((2,), 0.5, device="meta"), ValueError, "alibi_slopes must be on the inputs' device cpu"),
    ([0.5, 0.5], TypeError, "alibi_slopes must be a float32 tensor, got list"),
], ids=["heads", "batch", "rank", "dtype", "device", "list"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_bad_alibi_slopes_raise(alibi_slopes, error, match, varlen):
    """Slopes per head (heads = 2 here) or per (batch, head): batch 1 dense, 2 packed sequences."""
    with pytest.raises(error, match=match.format(batch=2 if varlen else 1)):
        if varlen:
            _varlen_call(alibi_slopes=alibi_slopes)
        else:
            flash_attn_func(*_valid(), alibi_slopes=alibi_slopes)


@pytest.mark.parametrize("dropout_p", [1.0, -0.1, 1.5, float("nan"), True])
def test_dropout_p_outside_0_1_raises(dropout_p):
    with pytest.raises(ValueError, match=r"dropout_p must be a float in \[0, 1\)"):
        flash_attn_func(*_valid(), dropout_p=dropout_p)
    with pytest.raises(ValueError, match=r"dropout_p must be a float in \[0, 1\)"):
        _varlen_call(dropout_p=dropout_p)


@pytest.mark.parametrize("softcap", [-1.0, float("nan"), float("inf"), "30"])
def test_negative_or_non_finite_softcap_raises(softcap):
    with pytest.raises(ValueError, match=r"softcap must be a finite float >= 0 \(0 = off\)"):
        flash_attn_func(*_valid(), softcap=softcap)
    with pytest.raises(ValueError, match=r"softcap must be a finite float >= 0 \(0 = off\)"):
        _varlen_call(softcap=softcap)
