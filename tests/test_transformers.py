"""The transformers integration (kernels/integrations/transformers.py) on tiny random models, in
Triton's CPU interpreter (float32): Llama (GQA), Mistral (a sliding window shorter than the
sequence) and Gemma 2 (softcap, query_pre_attn_scalar, sliding and full layers) against the same
weights under attn_implementation="eager": logits with no, right and left padding, greedy
`generate` through the KV cache, a training step's gradients; dropout while training; the
padding helpers; the `kernels` name clash with Hugging Face's package."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the integration's tests need the [transformers] extra")

from kernels.integrations.transformers import register
from kernels.padding import index_first_axis, pad_input, unpad_input

INTERPRETER_TESTS = True
NAME = register()
VOCAB, SEQLEN = 61, 14


def _config(family: str):
    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
              "initializer_range": 0.5}  # large weights: attention moves the logits far beyond rounding
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=5)
    return transformers.Gemma2Config(**common, sliding_window=5, attn_logit_softcapping=3.0,
                                     final_logit_softcapping=None, query_pre_attn_scalar=16,
                                     layer_types=["sliding_attention", "full_attention"])


def _models(family: str):
    """(eager, ours) with the same fresh random weights, float32."""
    torch.manual_seed(0)  # one config each: from_config writes the implementation into its config
    eager = transformers.AutoModelForCausalLM.from_config(_config(family), attn_implementation="eager")
    ours = transformers.AutoModelForCausalLM.from_config(_config(family), attn_implementation=NAME)
    assert eager.config._attn_implementation == "eager" and ours.config._attn_implementation == NAME
    ours.load_state_dict(eager.state_dict())
    return eager, ours


def _batch(padding: str):
    ids = torch.randint(0, VOCAB, (3, SEQLEN))
    mask = torch.ones(3, SEQLEN, dtype=torch.long)
    if padding == "left":
        mask[1, :4], mask[2, :9] = 0, 0
    elif padding == "right":
        mask[1, -4:], mask[2, -9:] = 0, 0
    return ids, mask


FAMILIES = ["llama", "mistral", "gemma2"]


@pytest.mark.parametrize("padding", ["none", "right", "left"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_eager(family, padding):
    eager, ours = _models(family)
    ids, mask = _batch(padding)
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    real = mask.bool()  # logits at padding positions are not defined alike
    assert expected[real].abs().max() > 1.0
    torch.testing.assert_close(got[real], expected[real], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_gives_the_same_tokens(family):
    """Greedy decoding of a left-padded batch through the KV cache (queries of one token)."""
    eager, ours = _models(family)
    ids, mask = _batch("left")
    kw = {"attention_mask": mask, "max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    expected = eager.generate(ids, **kw)
    assert torch.equal(ours.generate(ids, **kw), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_training_step_gives_eagers_gradients(family):
    eager, ours = _models(family)
    ids, mask = _batch("right")
    labels = ids.masked_fill(mask == 0, -100)
    for model in (eager, ours):
        model.train()
        model(ids, attention_mask=mask, labels=labels).loss.backward()
    for (name, expected), got in zip(eager.named_parameters(), ours.parameters()):
        torch.testing.assert_close(got.grad, expected.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_dropout_applies_while_training_only():
    torch.manual_seed(0)
    config = _config("llama")
    config.attention_dropout = 0.3
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=NAME)
    ids, mask = _batch("left")
    model.eval()
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).logits
    model.train()
    torch.manual_seed(1)
    first = model(ids, attention_mask=mask).logits
    torch.manual_seed(1)
    again = model(ids, attention_mask=mask).logits
    torch.manual_seed(2)
    other = model(ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.equal(first, again) and not torch.allclose(first[real], plain[real], atol=1e-3)
    assert not torch.allclose(first[real], other[real], atol=1e-3)
    first[real].sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_padding_helpers_round_trip_and_differentiate():
    x = torch.randn(3, 7, 2, 4, requires_grad=True)
    mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0]])
    packed, indices, cu_seqlens, max_seqlen, seqused = unpad_input(x, mask)
    assert cu_seqlens.tolist() == [0, 7, 12, 15] and cu_seqlens.dtype == torch.int32
    assert max_seqlen == 7 and seqused.tolist() == [7, 5, 3] and packed.shape == (15, 2, 4)
    assert torch.equal(packed, x[mask.bool()]) and torch.equal(index_first_axis(x, indices), packed)
    back = pad_input(packed, indices, 3, 7)
    assert torch.equal(back[mask.bool()], x[mask.bool()]) and not back[~mask.bool()].any()
    back.sum().backward()
    assert torch.equal(x.grad, mask[:, :, None, None].expand_as(x).float())


def test_a_model_builds_from_the_checkout_with_hugging_faces_kernels_installed(tmp_path):
    """Hugging Face's `kernels` distribution installed (its metadata here) while the checkout's
    `kernels` package is first on the path: without register(), transformers imports its hub API
    from ours and fails; with it, the model builds and runs on the kernels."""
    dist = tmp_path / "kernels-0.18.5.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.18.5\n")
    build = textwrap.dedent("""
        import torch, transformers
        cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME)
        print(model(torch.randint(0, 16, (1, 5))).logits.shape)
    """)
    env = {"PYTHONPATH": f".:{tmp_path}", "TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    def run(code):
        return subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True)

    clash = run("NAME = 'eager'" + build)
    assert "cannot import name" in clash.stderr  # the failure this guards against still exists upstream
    fixed = run("from kernels.integrations.transformers import register\nNAME = register()" + build)
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    assert "torch.Size([1, 5, 16])" in fixed.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_bf16_model_is_as_close_to_float32_as_pytorch(family):
    """A 4-layer model at real head counts in bf16 on the GPU, left-padded batch of 2 x 1000: the
    logits' error against the same weights in float32 (eager) is within twice PyTorch's in bf16
    (SDPA; transformers' eager attention for Gemma 2, which it does not run on SDPA), and a
    training step's gradients are finite."""
    import transformers as tf

    def config():
        common = {"vocab_size": 1000, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 4,
                  "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64}
        if family == "llama":
            return tf.LlamaConfig(**common)
        if family == "mistral":
            return tf.MistralConfig(**common, sliding_window=256)
        return tf.Gemma2Config(**common, sliding_window=256, query_pre_attn_scalar=64,
                               layer_types=["sliding_attention", "full_attention"] * 2)

    torch.manual_seed(0)
    reference = tf.AutoModelForCausalLM.from_config(config(), attn_implementation="eager").cuda().eval()
    ids = torch.randint(0, 1000, (2, 1000), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :300] = 0
    real = mask.bool()
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits[real].double()
    errors = {}
    yardstick = "eager" if family == "gemma2" else "sdpa"
    for provider in (NAME, yardstick):
        model = tf.AutoModelForCausalLM.from_config(config(), attn_implementation=provider, dtype=torch.bfloat16)
        model.load_state_dict(reference.state_dict())
        model.cuda().eval()
        with torch.no_grad():
            errors[provider] = (model(ids, attention_mask=mask).logits[real].double() - expected).abs().max().item()
        if provider == NAME:
            model.train()
            model(ids, attention_mask=mask, labels=ids.masked_fill(~real, -100)).loss.backward()
            assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
            model.eval()
            out = model.generate(ids[:, -64:], attention_mask=mask[:, -64:], max_new_tokens=8, do_sample=False,
                                 pad_token_id=0)
            assert out.shape == (2, 72)
    assert errors[NAME] <= 2 * errors[yardstick] + 1e-2, errors


def test_a_forwards_layers_share_one_packing_of_the_mask(monkeypatch):
    """The padding mask's lengths are read back from the device once per forward, not per layer."""
    from kernels.integrations import transformers as integration

    calls = []
    original = integration.padding_indices

    def counted(mask):
        calls.append(mask.shape)
        return original(mask)

    monkeypatch.setattr(integration, "padding_indices", counted)
    _, ours = _models("llama")  # two layers
    ids, mask = _batch("left")
    with torch.no_grad():
        ours(ids, attention_mask=mask)
    assert len(calls) == 2  # the keys' packing and the queries', for both layers


def test_the_llama_example_writes_a_row_per_provider_and_phase(tmp_path):
    """tools/transformers_llama.py end to end on a tiny config (Triton's interpreter on the CPU):
    the two implementations agree, and every (provider, phase) row is written with its times
    and the environment."""
    import csv

    from tools import transformers_llama

    transformers_llama.main(["--out", str(tmp_path), "--tiny", "--layers", "1", "--batch", "2", "--seqlen", "40",
                             "--new-tokens", "2"])
    with (tmp_path / "transformers_llama.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(row["provider"], row["phase"]) for row in rows] == [
        (provider, phase) for provider in (NAME, "sdpa") for phase in ("prefill", "train", "generate")]
    assert all(float(row["ms"]) > 0 and float(row["ms_p20"]) <= float(row["ms_p80"]) for row in rows)
    assert all(row["same_tokens"] == "True" and float(row["max_logit_diff"]) < 1e-4 for row in rows)
    assert all(row["torch"] == torch.__version__ for row in rows)
