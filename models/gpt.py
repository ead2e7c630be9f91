"""A GPT-3-style decoder in plain PyTorch, read as nanoGPT reads: the model of the training suite.

Pre-norm blocks (LayerNorm, causal self-attention, LayerNorm, GELU MLP of 4x width), learned
absolute positions, the token embedding tied to the output head, as in GPT-2/GPT-3 (CONFIGS).
The attention itself is a callable `attention(q, k, v, causal, softmax_scale) -> out` on
flash-attn's layout (batch, seqlen, heads, headdim): the `forward` of a provider of the one
registry (baselines.providers), so the same model trains with every kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

VOCAB_SIZE = 50304  # GPT-2's 50257 tokens padded to a multiple of 64 (nanoGPT), for the matmuls


@dataclass(frozen=True)
class GPTConfig:
    name: str
    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int = VOCAB_SIZE

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# GPT-3's widths and depths (Brown et al. 2020, Table 2.1). Heads: head dim 64 for 125M and 350M as
# there; 128 for 1.3B and 2.7B as the FlashAttention-2 paper trains them (Table 1, and flash-attn's
# training configs), where GPT-3's table lists 24 and 32 heads. `tiny` is for tests in Triton's CPU
# interpreter, `small` for tests on a GPU.
CONFIGS = {config.name: config for config in (
    GPTConfig("gpt3-125m", n_layer=12, n_head=12, n_embd=768),
    GPTConfig("gpt3-350m", n_layer=24, n_head=16, n_embd=1024),
    GPTConfig("gpt3-1.3b", n_layer=24, n_head=16, n_embd=2048),
    GPTConfig("gpt3-2.7b", n_layer=32, n_head=20, n_embd=2560),
    GPTConfig("small", n_layer=4, n_head=4, n_embd=256, vocab_size=64),
    GPTConfig("tiny", n_layer=1, n_head=1, n_embd=32, vocab_size=16),
)}


def get_config(name: str) -> GPTConfig:
    if name not in CONFIGS:
        raise ValueError(f"model: unknown model {name!r}; known models: {', '.join(CONFIGS)}")
    return CONFIGS[name]


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float | None], torch.Tensor]


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, attention: Attention):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head) for t in (q, k, v))  # (B, T, H, D)
        y = self.attention(q, k, v, True, None)  # (B, T, H, D), causal, scale 1/sqrt(D)
        return self.c_proj(y.reshape(B, T, C))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2/GPT-3's GELU
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))  # (B, T, C) -> (B, T, 4C) -> (B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, attention: Attention):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config, attention)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """`context` is the longest sequence the model takes (the size of its position table).
    With `checkpointing`, each block's activations are recomputed in the backward instead of
    kept (only the blocks' inputs are stored)."""

    def __init__(self, config: GPTConfig, context: int, attention: Attention, checkpointing: bool = False):
        super().__init__()
        self.config, self.context, self.checkpointing = config, context, checkpointing
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(context, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, attention) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input and output embeddings
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases, and the projections that
        add into the residual stream scaled by 1/sqrt(2 * n_layer)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        for block in self.blocks:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def num_params(self) -> int:
        """Parameters, the tied embedding counted once (the N of 6 x N FLOPs per token)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx (B, T) token ids; targets (B, T), -1 where no loss is taken. Returns (logits,
        loss): logits (B, T, vocab), loss the mean cross-entropy (None without targets)."""
        B, T = idx.shape
        if T > self.context:
            raise ValueError(f"idx: sequence length {T} > the model's context {self.context}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing and self.training else block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(B * T, -1).float(), targets.view(B * T), ignore_index=-1)
        return logits, loss
