"""The training suite: the FlashAttention-2 paper's Table 1 (GPT-3 training throughput per GPU with
each attention kernel), the longest context each kernel trains at in a fixed memory budget, and
the loss curves of the same model trained with each kernel.

    python runner.py --suite train                       # all three parts, one process
    torchrun --nproc-per-node 8 -m harness.train --out DIR   # the table on 8 GPUs (FSDP2)

Parts (--train-parts):

* table: per (model, context, provider), --warmup-steps untimed then --steps timed training
  steps (models/train.py: bf16 autocast, AdamW, synthetic tokens) at --batch-tokens tokens per
  GPU; the median step time, tokens/s, model TFLOPs/s per GPU counted as the paper counts them
  (baselines.flops.training_flops_per_sequence) and peak memory. Under torchrun: a row per rank
  and an aggregate row (rank 'all': the slowest rank's step time, tokens/s of all GPUs).
* search: one model (--search-model) at one sequence per step, the context doubled from
  SEARCH_START until the step runs out of --memory-budget-gib (the allocator is capped there,
  so the budget is the same on an 80 GB and a 141 GB GPU) or exceeds --search-max-context.
* parity: the `small` model (the `tiny` one in Triton's interpreter) trained on the copying
  task for --parity-steps steps from the same seed with each provider: the loss curves.

An out-of-memory step is a row with status 'oom' and the allocator's message, and the sweep
goes on; a provider that cannot train a configuration is a row with its reason. Rows are
appended as they are made: OUT/train.csv (one per measurement, environment beside it) and
OUT/train_losses.csv (one per step); reports/train_report.py makes report.md and the plots from
them alone.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import sys
from pathlib import Path

import torch

from baselines.flops import training_flops_per_sequence
from baselines.providers import get_provider, registry
from baselines.providers.core import one_line
from harness.environment import ROW_ENV_COLUMNS, capture_environment
from models.gpt import CONFIGS, get_config
from models.train import CannotTrain, Ranks, TrainConfig, train

TRAIN_CSV, LOSSES_CSV = "train.csv", "train_losses.csv"
PARTS = ("table", "search", "parity")
GIB = 2**30
SEARCH_START = 2048


def _defaults(cuda: bool) -> dict:
    """The suite's defaults on a GPU, and on the CPU (Triton's interpreter: tiny sizes, fp32)."""
    if cuda:
        return {"models": ("gpt3-1.3b", "gpt3-2.7b"), "contexts": (2048, 8192), "batch_tokens": 8192, "dtype": "bf16",
                    "providers": ("pytorch", "sdpa-flash", "sdpa-cudnn", "fa2", "fa4", "fa1", "xformers-cutlass"),
                    "search_model": "gpt3-1.3b", "search_max_context": 65536, "parity_model": "small", "parity_context": 128,
                    "parity_batch": 16, "parity_lr": 3e-3, "parity_steps": 300}
    return {"models": ("tiny",), "contexts": (16, 32), "batch_tokens": 64, "dtype": "fp32",
                "providers": ("pytorch", "fa2", "fa1", "sdpa-math"), "search_model": "tiny", "search_max_context": 64,
                "parity_model": "tiny", "parity_context": 16, "parity_batch": 8, "parity_lr": 1e-2, "parity_steps": 150}


COLUMNS = ("part", "model", "context", "provider", "label", "world_size", "rank", "global_batch", "dtype",
           "compile", "checkpointing", "status", "reason", "params", "steps", "warmup_steps", "step_ms",
           "step_ms_min", "step_ms_max", "tokens_per_s", "tflops_per_gpu", "peak_mem_gib", "memory_budget_gib",
           "loss_first", "loss_last", "interpreter", *ROW_ENV_COLUMNS)
LOSS_COLUMNS = ("part", "model", "context", "provider", "world_size", "global_batch", "dtype", "task", "lr",
                "step", "loss", "gpu", "git_commit")


# --------------------------------------------------------------------------------------
# Command line (also added to runner.py's, for --suite train)
# --------------------------------------------------------------------------------------
def _csv(kind, name):
    def parse(text: str):
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{name} needs at least one value, got {text!r}")
        try:
            values = tuple(kind(item) for item in items)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be comma-separated {kind.__name__}s, got {text!r}") from None
        if kind is int and min(values) < 1:
            raise argparse.ArgumentTypeError(f"{name} must be positive, got {text!r}")
        return values

    return parse


def _positive(kind, name):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{name} must be a positive {kind.__name__}, got {text!r}")
        return value

    return parse


def _non_negative_int(name):
    def parse(text: str) -> int:
        if not text.isdigit():
            raise argparse.ArgumentTypeError(f"{name} must be a non-negative integer, got {text!r}")
        return int(text)

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The training suite's options (defaults: _defaults, by device)."""
    group = parser.add_argument_group("the training suite (--suite train; defaults on a GPU / without one)")
    gpu, cpu = _defaults(True), _defaults(False)

    def both(key):
        def show(value):
            return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
        return f"{show(gpu[key])} / {show(cpu[key])}"

    group.add_argument("--train-parts", type=_csv(str, "--train-parts"), default=PARTS,
                       help=f"which parts: {', '.join(PARTS)} (default: all)")
    group.add_argument("--models", type=_csv(str, "--models"),
                       help=f"models of the table ({', '.join(CONFIGS)}; default {both('models')})")
    group.add_argument("--contexts", type=_csv(int, "--contexts"),
                       help=f"context lengths of the table (default {both('contexts')})")
    group.add_argument("--batch-tokens", type=_positive(int, "--batch-tokens"),
                       help=f"tokens per GPU per step in the table: batch_tokens // context sequences "
                            f"(default {both('batch_tokens')})")
    group.add_argument("--global-batch", type=_positive(int, "--global-batch"),
                       help="sequences per step over all GPUs, instead of --batch-tokens (must divide by the number "
                            "of processes)")
    group.add_argument("--steps", type=_positive(int, "--steps"), default=5, help="timed steps (default: %(default)s)")
    group.add_argument("--warmup-steps", type=_non_negative_int("--warmup-steps"), default=3,
                       help="untimed steps first (default: %(default)s)")
    group.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    group.add_argument("--checkpointing", choices=("on", "off"), default="on",
                       help="activation checkpointing of every block (default: %(default)s)")
    group.add_argument("--search-model", choices=tuple(CONFIGS),
                       help=f"the longest-context search's model (default {both('search_model')})")
    group.add_argument("--memory-budget-gib", type=_positive(float, "--memory-budget-gib"), default=60.0,
                       help="the search's memory budget: the allocator is capped there (default: %(default)s)")
    group.add_argument("--search-max-context", type=_positive(int, "--search-max-context"),
                       help=f"the search stops here (default {both('search_max_context')})")
    group.add_argument("--parity-steps", type=_positive(int, "--parity-steps"),
                       help=f"steps of the loss curves (default {both('parity_steps')})")


# --------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------
class Rows:
    """Appends rows to OUT/train.csv and OUT/train_losses.csv as they are made (header once)."""

    def __init__(self, out_dir: Path, env: dict, verbose: bool = False):
        self.out_dir, self.env, self.verbose = Path(out_dir), env, verbose

    def _append(self, name: str, columns, rows: list[dict]) -> None:
        path = self.out_dir / name
        new = not path.exists()
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            if new:
                writer.writeheader()
            writer.writerows(rows)

    def measurement(self, **fields) -> dict:
        row = dict.fromkeys(COLUMNS, "")
        row.update({key: self.env[key] for key in ROW_ENV_COLUMNS}, interpreter=self.env["interpreter"])
        row.update(fields)
        self._append(TRAIN_CSV, COLUMNS, [row])
        if self.verbose or row["status"] != "ok":
            peak = "" if row["peak_mem_gib"] == "" else f", peak {row['peak_mem_gib']:.1f} GiB"
            shown = (f"{row['step_ms']:.0f} ms/step, {row['tflops_per_gpu']:.1f} TFLOPs/s/GPU{peak}"
                     if row["status"] == "ok" else f"{row['status']}: {row['reason']}")
            print(f"[{row['part']}] {row['model']} ctx {row['context']} {row['provider']} rank {row['rank']}: "
                  f"{shown}", file=sys.stderr)
        return row

    def losses(self, part: str, config: TrainConfig, world_size: int, losses: list[float]) -> None:
        base = {"part": part, "model": config.model, "context": config.context, "provider": config.provider,
                "world_size": world_size, "global_batch": config.global_batch, "dtype": config.dtype,
                "task": config.task, "lr": config.lr, "gpu": self.env["gpu"], "git_commit": self.env["git_commit"]}
        self._append(LOSSES_CSV, LOSS_COLUMNS, [{**base, "step": step, "loss": loss}
                                                for step, loss in enumerate(losses)])


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(rows: Rows, part: str, config: TrainConfig, steps: int, warmup: int, ranks: Ranks,
            memory_budget_gib: float | None = None) -> str:
    """Train `config` and write its rows (per rank and aggregate under torchrun); returns the
    status ('ok', 'oom', 'unsupported', 'unavailable' or 'error')."""
    base = {"part": part, "model": config.model, "context": config.context, "provider": config.provider,
            "label": get_provider(config.provider).label, "world_size": ranks.world_size,
            "global_batch": config.global_batch, "dtype": config.dtype, "compile": config.compile,
            "checkpointing": config.checkpointing, "steps": steps, "warmup_steps": warmup,
            "memory_budget_gib": "" if memory_budget_gib is None else memory_budget_gib}
    outcome = None
    try:
        run = train(config, steps, warmup, ranks)
    except CannotTrain as exc:
        outcome = (exc.status, exc.reason)
    except torch.OutOfMemoryError as exc:
        outcome = ("oom", one_line(exc))
    except Exception as exc:  # noqa: BLE001 -- a failing provider is a row; the sweep goes on
        outcome = ("error", one_line(f"{type(exc).__name__}: {exc}"))
    _free_memory()  # after the except blocks: their tracebacks held the failed step's tensors
    # the outcome of every rank: the rows say what failed on any of them
    outcomes = ranks.gather(outcome)
    failed = next((o for o in outcomes if o is not None), None)
    if failed is not None:
        if ranks.rank == 0:
            rows.measurement(**base, rank="all", status=failed[0], reason=failed[1])
        return failed[0]
    gpt = get_config(config.model)
    per_sequence = training_flops_per_sequence(run.num_params, gpt.n_layer, gpt.n_embd, config.context)
    per_rank = ranks.gather({"step_s": run.step_seconds, "peak": run.peak_memory_bytes})
    if ranks.rank == 0:
        rows.losses(part, config, ranks.world_size, run.losses)
        step_s = [max(times) for times in zip(*(r["step_s"] for r in per_rank))]  # a step ends with its slowest rank
        ranked = [(str(rank), r["step_s"], r["peak"]) for rank, r in enumerate(per_rank)] if ranks.mesh else []
        for rank, seconds, peak in [*ranked, ("all", step_s, max((r["peak"] or 0) for r in per_rank) or None)]:
            median = statistics.median(seconds)
            gpus = 1 if rank != "all" else ranks.world_size
            tokens = config.global_batch * config.context * gpus / ranks.world_size
            rows.measurement(
                **base, rank=rank, status="ok", params=run.num_params, step_ms=median * 1e3,
                step_ms_min=min(seconds) * 1e3, step_ms_max=max(seconds) * 1e3, tokens_per_s=tokens / median,
                tflops_per_gpu=per_sequence * config.global_batch / ranks.world_size / median / 1e12,
                peak_mem_gib="" if peak is None else peak / GIB, loss_first=run.losses[0], loss_last=run.losses[-1])
    return "ok"


# --------------------------------------------------------------------------------------
# The parts
# --------------------------------------------------------------------------------------
def _global_batch(args, context: int, world_size: int, batch_tokens: int) -> int:
    if args.global_batch is not None:
        if args.global_batch % world_size:
            raise ValueError(f"--global-batch: {args.global_batch} sequences do not divide across {world_size} "
                             "processes")
        return args.global_batch
    if batch_tokens < context:
        raise ValueError(f"--batch-tokens: {batch_tokens} tokens per GPU are less than one sequence of context "
                         f"{context}")
    return world_size * (batch_tokens // context)


def run_table(args, rows: Rows, settings: dict, ranks: Ranks) -> None:
    for model in settings["models"]:
        for context in settings["contexts"]:
            global_batch = _global_batch(args, context, ranks.world_size, settings["batch_tokens"])
            for provider in settings["providers"]:
                config = TrainConfig(model, context, provider, global_batch, dtype=settings["dtype"],
                                     compile=args.compile, checkpointing=args.checkpointing == "on")
                measure(rows, "table", config, args.steps, args.warmup_steps, ranks)


def run_search(args, rows: Rows, settings: dict) -> None:
    """The longest context each provider trains `search_model` at, one sequence per step, with
    the allocator capped at --memory-budget-gib (on the CPU the cap is not enforced)."""
    cuda = torch.cuda.is_available()
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_budget_gib * GIB / total))
    try:
        for provider in settings["providers"]:
            context = min(SEARCH_START, settings["search_max_context"])
            while context <= settings["search_max_context"]:
                config = TrainConfig(settings["search_model"], context, provider, 1, dtype=settings["dtype"],
                                     compile=args.compile, checkpointing=args.checkpointing == "on")
                if measure(rows, "search", config, 1, 1, Ranks(), args.memory_budget_gib) != "ok":
                    break
                context *= 2
    finally:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0)


def parity_configs(settings: dict, providers) -> list[TrainConfig]:
    """The loss-curve runs: the same model, seed and copying task with each provider."""
    return [TrainConfig(settings["parity_model"], settings["parity_context"], provider, settings["parity_batch"],
                        dtype=settings["dtype"], lr=settings["parity_lr"], task="copy") for provider in providers]


def run_parity(args, rows: Rows, settings: dict) -> None:
    for config in parity_configs(settings, settings["providers"]):
        measure(rows, "parity", config, settings["parity_steps"], 0, Ranks())


def settings_of(args, cuda: bool) -> dict:
    """The defaults, overridden by the options given; unknown names are a ValueError naming the option."""
    settings = _defaults(cuda)
    for key in ("models", "contexts", "batch_tokens", "providers", "search_model", "search_max_context",
                "parity_steps"):
        if getattr(args, key, None) is not None:
            settings[key] = getattr(args, key)
    unknown = [m for m in settings["models"] if m not in CONFIGS]
    if unknown:
        raise ValueError(f"--models: unknown model {unknown[0]!r}; known models: {', '.join(CONFIGS)}")
    known = registry()
    unknown = [p for p in settings["providers"] if p not in known]
    if unknown:
        raise ValueError(f"--providers: unknown provider {unknown[0]!r}; known providers: {', '.join(known)}")
    unknown = [p for p in args.train_parts if p not in PARTS]
    if unknown:
        raise ValueError(f"--train-parts: unknown part {unknown[0]!r}; the parts: {', '.join(PARTS)}")
    return settings


def measure_rows(args, out_dir) -> None:
    """The parts of --train-parts into out_dir/train.csv and train_losses.csv (rows appended);
    reports.train_report makes report.md and the plots from them. Under torchrun only the table
    runs (the search and the loss curves are single-GPU questions). Bad arguments: a ValueError
    naming the option."""
    out_dir = Path(out_dir)
    ranks = Ranks.from_environment()
    settings = settings_of(args, ranks.device.type == "cuda")
    for context in settings["contexts"]:
        _global_batch(args, context, ranks.world_size, settings["batch_tokens"])
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = Rows(out_dir, capture_environment(), bool(getattr(args, "verbose", False)))
    if "table" in args.train_parts:
        run_table(args, rows, settings, ranks)
    if ranks.mesh is None:
        if "search" in args.train_parts:
            run_search(args, rows, settings)
        if "parity" in args.train_parts:
            run_parity(args, rows, settings)
    if ranks.mesh is not None:  # every rank done before any tears the group down (gloo aborts otherwise)
        # the trained models' reference cycles (FSDP2 modules, their collectives' tensors) freed while
        # the group is alive: left to the interpreter's exit, gloo's worker threads can meet them
        # there and abort the rank ("terminate called without an active exception")
        gc.collect()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        gc.collect()


def main(argv: list[str] | None = None) -> int:
    """`python -m harness.train` (under torchrun or alone): the suite's rows without runner.py
    (which holds the folder's lock, one process only); `runner.py --suite train --report-only`
    then makes the report from them."""
    parser = argparse.ArgumentParser(prog="python -m harness.train", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--providers", type=_csv(str, "--providers"),
                        help="attention providers (runner.py --list; default: _defaults)")
    parser.add_argument("--out", type=Path, required=True, help="output folder (rows are appended)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every row")
    args = parser.parse_args(argv)
    try:
        measure_rows(args, args.out)
    except ValueError as exc:
        parser.error(str(exc))
    if int(os.environ.get("RANK", "0")) == 0:  # the report is made from the rows (reports/ reads harness/)
        print(f"rows: {Path(args.out) / TRAIN_CSV}; report: python runner.py --suite train --report-only --out {args.out}")
    return 0

if __name__ == "__main__":
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before `kernels` is imported (decoration time)
    sys.exit(main())
