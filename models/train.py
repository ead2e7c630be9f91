"""Training the GPT of models.gpt on synthetic tokens: one process, or one process per GPU
under `torchrun` with FSDP2.

Precision: bf16 autocast over fp32 weights, fp32 gradients and fp32 AdamW state (PyTorch's
automatic mixed precision; 16 bytes of state per parameter), or plain fp32 (`dtype='fp32'`,
for Triton's CPU interpreter, whose bf16 dot is wrong). The same on one process and many:
FSDP2 shards the fp32 weights, gradients and optimizer state and all-gathers fp32 weights, and
autocast casts them in each matmul, so a run on N ranks computes what one process computes on
the same global batch, up to the order of the gradient sums.

A step: forward and loss of the whole global batch (each rank its slice, no gradient
accumulation), backward, AdamW update, gradients cleared.

Data: synthetic token batches drawn from a seeded generator (no download), the same global
batch on every rank, each rank taking its slice: 'random' tokens (throughput: the loss cannot
fall below ln(vocab)) or 'copy', a learnable task: the second half of each sequence repeats
the first, and the loss is taken where the next token is a repeat.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from baselines.providers import Provider, Spec, get_provider, unavailable_reason
from models.gpt import GPT, GPTConfig, get_config

DTYPES = ("bf16", "fp32")
TASKS = ("random", "copy")
ADAMW_BETAS, WEIGHT_DECAY = (0.9, 0.95), 0.1  # GPT-3's AdamW settings


class CannotTrain(Exception):
    """The provider cannot train this configuration here: `status` ('unavailable' or
    'unsupported') and the reason, recorded as a row instead of a measurement."""

    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


@dataclass(frozen=True)
class TrainConfig:
    model: str  # a models.gpt.CONFIGS name
    context: int  # tokens per sequence
    provider: str  # a baselines.providers name
    global_batch: int  # sequences per step over all ranks
    dtype: str = "bf16"  # 'bf16': autocast over fp32 weights and optimizer state; 'fp32': no autocast
    compile: bool = False  # torch.compile each block
    checkpointing: bool = False  # recompute each block's activations in the backward
    lr: float = 3e-4
    task: str = "random"  # 'random' or 'copy' (see the module docstring)
    seed: int = 0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        for name in ("context", "global_batch"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the training processes: rank, world size, the device it
    trains on and the FSDP2 device mesh (None for a single process without torchrun)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    mesh: object = None

    @classmethod
    def from_environment(cls) -> Ranks:
        """Under torchrun (RANK, LOCAL_RANK and WORLD_SIZE set): join the process group (NCCL on
        GPUs, gloo on CPUs) and build a 1-D mesh over every rank. Otherwise one process."""
        if "RANK" not in os.environ:
            return cls()
        from torch.distributed.device_mesh import init_device_mesh

        if torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        return cls(dist.get_rank(), dist.get_world_size(), device, mesh)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """`value` averaged over the ranks (itself on one process)."""
        if self.mesh is None:
            return value
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.AVG)
        return value

    def gather(self, obj) -> list:
        """[obj of rank 0, obj of rank 1, ...] on every rank."""
        if self.mesh is None:
            return [obj]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered


def resolve(config: TrainConfig, world_size: int) -> tuple[GPTConfig, Provider]:
    """The model's and the provider's entries for `config`. ValueError for an unknown model or
    provider, or a global batch that does not divide across the ranks; CannotTrain when the
    provider is not usable here or cannot train at this context (its own reason)."""
    gpt = get_config(config.model)
    try:
        provider = get_provider(config.provider)
    except ValueError as exc:
        raise ValueError(f"provider: {exc}") from None
    if config.global_batch % world_size:
        raise ValueError(f"global_batch: {config.global_batch} sequences do not divide across {world_size} ranks")
    reason = unavailable_reason(provider)
    if reason is not None:
        raise CannotTrain("unavailable", reason)
    if not provider.has_backward:
        raise CannotTrain("unsupported", f"provider {provider.name} has no backward: it cannot train")
    spec = Spec(mode="fwd_bwd", causal=True, hdim=gpt.head_dim, seqlen=config.context,
                batch=config.global_batch // world_size, heads=gpt.n_head, dtype=config.dtype)
    reason = provider.supports(spec)
    if reason is not None:
        raise CannotTrain("unsupported", f"context {config.context}: provider {provider.name} does not train "
                                         f"{config.model} at it ({config.dtype}, head dim {gpt.head_dim}): {reason}")
    return gpt, provider


def synthetic_batch(task: str, generator: torch.Generator, batch: int, context: int, vocab: int):
    """(idx, targets), both (batch, context) int64 on the CPU; targets are idx shifted by one
    token, -1 where no loss is taken."""
    if task == "random":
        tokens = torch.randint(vocab, (batch, context + 1), generator=generator)  # (B, T + 1)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    half = (context + 2) // 2  # the first half: random; the rest repeats it
    first = torch.randint(vocab, (batch, half), generator=generator)  # (B, half)
    tokens = torch.cat([first, first], dim=1)[:, :context + 1]  # (B, T + 1)
    targets = tokens[:, 1:].clone()  # (B, T)
    targets[:, :half - 1] = -1  # the next token is still random there
    return tokens[:, :-1].contiguous(), targets


class Trainer:
    """The model, its optimizer and the data stream of one TrainConfig on this rank."""

    def __init__(self, config: TrainConfig, ranks: Ranks | None = None):
        self.config, self.ranks = config, ranks or Ranks()
        self.gpt, self.provider = resolve(config, self.ranks.world_size)
        torch.manual_seed(config.seed)  # the same initial weights on every rank (FSDP2 keeps each its shard)
        with torch.device(self.ranks.device):
            self.model = GPT(self.gpt, config.context, self.provider.forward, config.checkpointing)
        self.num_params = self.model.num_params()  # before sharding: the whole model's
        if config.compile:
            for block in self.model.blocks:
                block.compile()
        if self.ranks.mesh is not None:
            from torch.distributed.fsdp import fully_shard

            for block in self.model.blocks:  # one all-gather per block, freed after its use
                fully_shard(block, mesh=self.ranks.mesh)
            fully_shard(self.model, mesh=self.ranks.mesh)  # the embeddings, final norm and head
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, betas=ADAMW_BETAS,
                                           weight_decay=WEIGHT_DECAY, fused=self.ranks.device.type == "cuda")
        self.generator = torch.Generator().manual_seed(config.seed)

    def next_batch(self):
        """This rank's slice of the next global batch, on its device."""
        per_rank = self.config.global_batch // self.ranks.world_size
        idx, targets = synthetic_batch(self.config.task, self.generator, self.config.global_batch,
                                       self.config.context, self.gpt.vocab_size)
        rows = slice(self.ranks.rank * per_rank, (self.ranks.rank + 1) * per_rank)
        return idx[rows].to(self.ranks.device), targets[rows].to(self.ranks.device)

    def step(self) -> torch.Tensor:
        """One training step; returns the loss of the global batch (mean over the ranks), a
        tensor on the device (reading it waits for the step)."""
        idx, targets = self.next_batch()
        with torch.autocast(self.ranks.device.type, dtype=torch.bfloat16, enabled=self.config.dtype == "bf16"):
            _, loss = self.model(idx, targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self.ranks.mean(loss.detach())


@dataclass(frozen=True)
class TrainRun:
    losses: list[float]  # every step's loss, warm-up steps included
    step_seconds: list[float]  # wall time of each timed step
    peak_memory_bytes: int | None  # peak allocated on this rank's GPU; None on the CPU
    num_params: int


def train(config: TrainConfig, steps: int, warmup: int = 0, ranks: Ranks | None = None) -> TrainRun:
    """`warmup` untimed steps (compilation, autotuning, allocator warm-up), then `steps` steps,
    each timed from a synchronised start to a synchronised end: a step lasts milliseconds to
    seconds and changes the weights, so it is timed once, not repeated as do_bench would."""
    trainer = Trainer(config, ranks)
    device = trainer.ranks.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    losses, seconds = [], []
    for index in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        losses.append(trainer.step())
        if cuda:
            torch.cuda.synchronize(device)
        if index >= warmup:
            seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return TrainRun([loss.item() for loss in losses], seconds, peak, trainer.num_params)
