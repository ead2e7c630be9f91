"""A Llama-style model in transformers on the kernels against attn_implementation="sdpa" (GPU, bf16).

The model is built from a config with random weights (no download): Llama 3.2 1B's shape by
default (16 layers, hidden 2048, 32 query and 8 kv heads of head dim 64, a 128k vocabulary).
Per provider ('fa2_triton': kernels/integrations/transformers.py, 'sdpa': PyTorch's), timed with
harness.timing.benchmark (do_bench):

* prefill: a forward over a left-padded batch (the padded rows through the varlen kernels);
* train: forward and backward of the loss over a right-padded batch;
* generate: `generate` of `--new-tokens` greedy tokens through the KV cache (wall time, one call).

It first checks that the two implementations agree: the prefill logits' largest difference on the
real tokens (`max_logit_diff`, bf16 on both sides) and whether greedy generation gives the same
tokens. Rows (long format, one measurement per row, with the environment) go to
OUT/transformers_llama.csv:

    python -m tools.transformers_llama --out $OUT
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from harness.environment import ROW_ENV_COLUMNS
from harness.suite import SuiteRows
from harness.timing import Timing, benchmark
from kernels.integrations.transformers import register

VOCAB_TINY = 1000
PROMPT_TOKENS = 256  # generate's prompt: the last tokens of the prefill batch
# do_bench's window for the prefill and the training step: calls of 50-200 ms at the default
# shape, so that about ten are timed (the default window would time one)
REP_MS = 2000
COLUMNS = ("provider", "phase", "batch", "seqlen", "new_tokens", "ms", "ms_p20", "ms_p80", "peak_mem_mb",
           "max_logit_diff", "same_tokens", *ROW_ENV_COLUMNS)


def llama_config(layers: int, tiny: bool = False):
    """Llama 3.2 1B's shape with `layers` layers; `tiny`: a small one of the same design (GQA 4/2,
    head dim 32), which the CPU test runs through Triton's interpreter."""
    import transformers

    if tiny:
        return transformers.LlamaConfig(vocab_size=VOCAB_TINY, hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True)
    return transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                    num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                    head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
                                    tie_word_embeddings=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def padded_batch(batch: int, seqlen: int, side: str, device, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and a mask whose row b holds seqlen - b * seqlen // (2 * batch) tokens."""
    ids = torch.randint(0, vocab, (batch, seqlen), device=device)
    mask = torch.ones(batch, seqlen, dtype=torch.long, device=device)
    for b in range(batch):
        pad = b * seqlen // (2 * batch)
        if side == "left":
            mask[b, :pad] = 0
        else:
            mask[b, seqlen - pad:] = 0
    return ids, mask


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--tiny", action="store_true",
                        help="a small config of the same design, in float32 on the CPU where there is no GPU "
                             "(the CPU test's; its times say nothing of a GPU)")
    args = parser.parse_args(argv)
    import transformers

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        parser.error("the Llama 1B shape needs a CUDA GPU; --tiny runs a small config on the CPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vocab = VOCAB_TINY if args.tiny else 128256
    name = register()
    # building a 1B model twice and timing it takes minutes: a bar over the steps, on stderr
    steps = tqdm(total=9, unit="step", desc="transformers example", file=sys.stderr)

    begun = []

    def progress(step: str) -> None:
        """Name the step now running; the one before it is done."""
        if begun:
            steps.update()
        begun.append(step)
        steps.set_description(step)

    torch.manual_seed(0)
    models = {}
    for provider in (name, "sdpa"):
        progress(f"building the model for {provider} ({args.layers} layers) on {device.type}")
        models[provider] = transformers.AutoModelForCausalLM.from_config(
            llama_config(args.layers, args.tiny), attn_implementation=provider, dtype=dtype).to(device)
    models["sdpa"].load_state_dict(models[name].state_dict())

    ids, mask = padded_batch(args.batch, args.seqlen, "left", device, vocab)
    progress("checking: prefill logits and greedy tokens of both")
    with torch.no_grad():
        logits = {p: m(ids, attention_mask=mask).logits for p, m in models.items()}
    real = mask.bool()
    max_diff = (logits[name][real].float() - logits["sdpa"][real].float()).abs().max().item()
    del logits
    prompt_ids, prompt_mask = ids[:, -PROMPT_TOKENS:], mask[:, -PROMPT_TOKENS:]
    generate_kw = {"attention_mask": prompt_mask, "max_new_tokens": args.new_tokens, "do_sample": False,
                   "pad_token_id": 0, "min_new_tokens": args.new_tokens}
    tokens = {p: m.generate(prompt_ids, **generate_kw) for p, m in models.items()}
    same_tokens = torch.equal(tokens[name], tokens["sdpa"])

    # the rows as they are timed, and OUT/notes.txt: clocks lowered by heat or power during the run
    with SuiteRows(args.out, "transformers_llama.csv", COLUMNS) as out:
        path = out.path

        def write(provider, phase, seqlen, new_tokens, timing: Timing):
            out.write({"provider": provider, "phase": phase, "batch": args.batch, "seqlen": seqlen,
                       "new_tokens": new_tokens, "ms": timing.ms, "ms_p20": timing.ms_p20, "ms_p80": timing.ms_p80,
                       "peak_mem_mb": timing.peak_mem_mb, "max_logit_diff": max_diff, "same_tokens": same_tokens,
                       **{c: out.env[c] for c in ROW_ENV_COLUMNS}})

        train_ids, train_mask = padded_batch(args.batch, args.seqlen, "right", device, vocab)
        labels = train_ids.masked_fill(train_mask == 0, -100)
        for provider, model in models.items():
            def prefill(model=model):
                with torch.no_grad():
                    model(ids, attention_mask=mask)

            def train(model=model):
                model(train_ids, attention_mask=train_mask, labels=labels).loss.backward()

            progress(f"timing {provider}: prefill")
            write(provider, "prefill", args.seqlen, 0, benchmark(prefill, device, rep_ms=REP_MS))
            progress(f"timing {provider}: train")
            model.train()
            write(provider, "train", args.seqlen, 0,
                  benchmark(train, device, rep_ms=REP_MS, grad_to_none=list(model.parameters())))
            model.eval()
            progress(f"timing {provider}: generate")
            synchronize(device)
            start = time.perf_counter()
            model.generate(prompt_ids, **generate_kw)
            synchronize(device)
            ms = (time.perf_counter() - start) * 1e3
            write(provider, "generate", prompt_ids.shape[1], args.new_tokens, Timing(ms, ms, ms, float("nan")))
    steps.update()
    steps.close()
    print(f"max_logit_diff {max_diff:.4f}, same_tokens {same_tokens}; rows in {path}")


if __name__ == "__main__":
    main()
