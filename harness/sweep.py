"""The sweep engine: configurations x providers -> result rows, appended as they come.

For each configuration and provider, in order:
1. availability (once per provider) and the provider's shape/dtype/mode check;
2. accuracy: the provider's output (and dQ, dK, dV for backward modes) on a small input of
   the same kind (dtype, causal, head dim; batch 1, 2 heads, seqlen <= 128) against the
   float64 reference: rel_err = max ||x - ref|| / ||ref||; above the dtype's tolerance (or
   NaN) the provider is 'wrong' and is not timed;
3. timing (harness.timing) on fresh random inputs of the configuration's size, `repeats` times.
Every failure (unavailable, unsupported, OOM, wrong, any exception) is a row with its status
and reason, and the sweep goes on. Rows go to the CSV as they are made; keys in `skip`
(--resume) are not measured again.
"""

from __future__ import annotations

import gc
import math
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from baselines.flops import attention_flops, tflops_per_second
from baselines.providers import Provider, Spec, UnsupportedInput, unavailable_reason
from baselines.reference import attention_reference
from harness.results import ResultWriter, row_key
from harness.timing import CPU_REPS, time_attention
from reports.environment import ENV_COLUMNS

# Largest relative error (norm-wise, against float64) still counted correct. fp16/bf16: a
# correct kernel is ~1e-3 (fp16) / ~8e-3 (bf16) on random inputs; fp32 allows for Triton's
# TF32 dots on a GPU.
TOLERANCE = {"fp16": 2e-2, "bf16": 2e-2, "fp32": 2e-3}
# The small accuracy-check input: a ragged length spanning several of the largest tiles
# (128 rows or keys), so that the unmasked off-diagonal loops, the diagonal blocks and the
# partial last block all run in the check.
CHECK_BATCH, CHECK_HEADS, CHECK_MAX_SEQLEN = 1, 2, 3 * 128 + 17
MAX_REASON_CHARS = 500


@dataclass(frozen=True)
class Job:
    """One configuration of a sweep: a Spec and its ablation setting ('' outside the ablation)."""

    spec: Spec
    setting: str = ""


class SweepAborted(RuntimeError):
    """The GPU context is broken (a sticky CUDA error): the process cannot measure any more."""


def random_inputs(spec: Spec, device: torch.device, seed: int, requires_grad: bool):
    """Fresh randn q, k, v of `spec`'s size, (batch, seqlen, heads, hdim), reproducible by seed."""
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (spec.batch, spec.seqlen, spec.heads, spec.hdim)
    return [torch.randn(shape, generator=generator, device=device, dtype=spec.torch_dtype)
            .requires_grad_(requires_grad) for _ in range(3)]


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def accuracy_error(provider: Provider, spec: Spec, device: torch.device) -> float:
    """max ||x - ref|| / ||ref|| over the output (and dQ, dK, dV unless spec.mode is 'fwd') on
    a small input of spec's kind; NaN if any of them has a NaN."""
    small = replace(spec, batch=CHECK_BATCH, heads=min(spec.heads, CHECK_HEADS),
                    seqlen=min(spec.seqlen, CHECK_MAX_SEQLEN))
    with_grad = spec.mode != "fwd"
    q, k, v = random_inputs(small, device, _seed("check", small), with_grad)
    scale = 1.0 / math.sqrt(spec.hdim)
    out = provider.forward(q, k, v, spec.causal, scale)
    q64, k64, v64 = (t.detach().double().requires_grad_(with_grad) for t in (q, k, v))
    ref, _ = attention_reference(q64, k64, v64, softmax_scale=scale, causal=spec.causal)
    errors = [_relative_error(out, ref)]
    if with_grad:
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
        errors += [_relative_error(g, r) for g, r in zip(grads, ref_grads, strict=True)]
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def classify_failure(exc: BaseException) -> tuple[str, str]:
    """(status, reason) of a failed measurement."""
    message = f"{type(exc).__name__}: {exc}".strip()
    message = " ".join(message.split())[:MAX_REASON_CHARS]
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "oom", message
    if isinstance(exc, (UnsupportedInput, NotImplementedError)):
        return "unsupported", message
    return "error", message


def _cuda_context_alive() -> bool:
    try:
        torch.cuda.synchronize()
    except RuntimeError:
        return False
    return True


class Sweep:
    """Runs jobs x providers, writing each row to `writer` as soon as it is made."""

    def __init__(self, writer: ResultWriter, environment: dict, *, device: torch.device, repeats: int = 1,
                 warmup_ms: float = 25, rep_ms: float = 100, cpu_reps: int = CPU_REPS, cuda_graph: bool = False,
                 skip: frozenset = frozenset(), log: Callable[[str], None] | None = None):
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.writer, self.device, self.repeats = writer, device, repeats
        self.warmup_ms, self.rep_ms, self.cpu_reps, self.cuda_graph = warmup_ms, rep_ms, cpu_reps, cuda_graph
        self.skip, self.log = skip, log
        self.env = {column: environment[column] for column in ENV_COLUMNS}
        self.interpreter = device.type != "cuda"
        self.status_counts: Counter = Counter()
        self.rows: list[dict] = []  # every row written, in order
        self._availability: dict[str, str | None] = {}
        self._accuracy: dict[tuple, tuple[str, str, float]] = {}

    # ---- rows -------------------------------------------------------------------------
    def _row(self, provider: Provider, job: Job, repeat: int, status: str, reason: str = "",
             timing=None, rel_err: float = math.nan) -> dict:
        spec = job.spec
        row = {
            **self._key_row(provider, job, repeat), "label": provider.label, "status": status, "reason": reason, "rel_err": rel_err,
            "ms": math.nan, "ms_p20": math.nan, "ms_p80": math.nan,
            "tflops": math.nan, "tflops_p20": math.nan, "tflops_p80": math.nan, "peak_mem_mb": math.nan,
            "config": self._config(provider, spec) if status not in ("unavailable", "unsupported") else "",
            "interpreter": self.interpreter, **self.env,
        }
        if timing is not None:
            flops = attention_flops(spec.batch, spec.heads, spec.seqlen, spec.seqlen, spec.hdim, spec.causal,
                                    spec.mode)
            row.update(ms=timing.ms, ms_p20=timing.ms_p20, ms_p80=timing.ms_p80, peak_mem_mb=timing.peak_mem_mb,
                       tflops=tflops_per_second(flops, timing.ms),
                       tflops_p20=tflops_per_second(flops, timing.ms_p20),  # p20 time: the faster call
                       tflops_p80=tflops_per_second(flops, timing.ms_p80))
        return row

    @staticmethod
    def _config(provider: Provider, spec: Spec) -> str:
        return provider.config(spec) if provider.config is not None else ""

    def _emit(self, row: dict) -> None:
        self.writer.write(row)
        self.rows.append(row)
        self.status_counts[row["status"]] += 1
        if self.log is not None:
            outcome = (f"{row['ms']:.4g} ms, {row['tflops']:.4g} TFLOPs/s" if row["status"] == "ok"
                       else f"{row['status']}: {row['reason']}")
            self.log(f"{row['provider']:>22} {row['setting'] or '-'} {row['mode']:>7} d{row['hdim']} "
                     f"{'causal' if row['causal'] else 'full':>6} n{row['seqlen']:<6} b{row['batch']} "
                     f"h{row['heads']} r{row['repeat']}: {outcome}")

    # ---- steps ------------------------------------------------------------------------
    def _unavailable(self, provider: Provider) -> str | None:
        if provider.name not in self._availability:
            self._availability[provider.name] = unavailable_reason(provider)
        return self._availability[provider.name]

    def _check_accuracy(self, provider: Provider, spec: Spec) -> tuple[str, str, float]:
        """(status, reason, rel_err) of the accuracy check, cached per (provider, kind of input)."""
        kind = (provider.name, spec.dtype, spec.causal, spec.hdim, spec.mode != "fwd")
        if kind not in self._accuracy:
            try:
                error = accuracy_error(provider, spec, self.device)
            except Exception as exc:  # noqa: BLE001 -- any failure is recorded as a row
                self._after_failure(provider, spec, exc)
                self._accuracy[kind] = (*classify_failure(exc), math.nan)
            else:
                tolerance = TOLERANCE[spec.dtype]
                if not error <= tolerance:  # NaN fails too
                    reason = (f"rel_err {error:.3g} > tolerance {tolerance:g} against the float64 reference "
                              "(small input of this kind)")
                    self._accuracy[kind] = ("wrong", reason, error)
                else:
                    self._accuracy[kind] = ("ok", "", error)
        return self._accuracy[kind]

    def _after_failure(self, provider: Provider, spec: Spec, exc: BaseException) -> None:
        """Free what a failed call left on the GPU; stop if the CUDA context is broken."""
        if self.device.type != "cuda":
            return
        gc.collect()
        if not _cuda_context_alive():
            raise SweepAborted(f"the CUDA context is broken after {provider.name} on {spec} "
                               f"({type(exc).__name__}: {exc}); start a new process with --resume "
                               f"and without provider {provider.name!r}") from exc
        torch.cuda.empty_cache()

    def _time(self, provider: Provider, spec: Spec, repeat: int):
        q, k, v = random_inputs(spec, self.device, _seed(spec, repeat), requires_grad=spec.mode != "fwd")
        return time_attention(provider.forward, q, k, v, spec.causal, 1.0 / math.sqrt(spec.hdim), spec.mode,
                              warmup_ms=self.warmup_ms, rep_ms=self.rep_ms, cpu_reps=self.cpu_reps,
                              cuda_graph=self.cuda_graph)

    def measure(self, provider: Provider, job: Job) -> None:
        """All rows of one (provider, configuration)."""
        spec = job.spec
        todo = [r for r in range(self.repeats) if row_key(self._key_row(provider, job, r)) not in self.skip]
        if not todo:
            return
        reason = self._unavailable(provider)
        if reason is not None:
            self._emit(self._row(provider, job, todo[0], "unavailable", reason))
            return
        reason = provider.supports(spec)
        if reason is None and spec.mode != "fwd" and not provider.has_backward:
            reason = "forward only: this provider has no backward"
        if reason is not None:
            self._emit(self._row(provider, job, todo[0], "unsupported", reason))
            return
        status, reason, rel_err = self._check_accuracy(provider, spec)
        if status != "ok":
            self._emit(self._row(provider, job, todo[0], status, reason, rel_err=rel_err))
            return
        for repeat in todo:
            try:
                timing = self._time(provider, spec, repeat)
            except Exception as exc:  # noqa: BLE001 -- any failure is recorded as a row
                self._after_failure(provider, spec, exc)
                self._emit(self._row(provider, job, repeat, *classify_failure(exc), rel_err=rel_err))
                return
            self._emit(self._row(provider, job, repeat, "ok", timing=timing, rel_err=rel_err))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _key_row(self, provider: Provider, job: Job, repeat: int) -> dict:
        spec = job.spec
        return {"provider": provider.name, "setting": job.setting, "mode": spec.mode, "causal": spec.causal,
                "hdim": spec.hdim, "seqlen": spec.seqlen, "batch": spec.batch, "heads": spec.heads,
                "dtype": spec.dtype, "repeat": repeat}

    def run(self, jobs: Sequence[Job], providers: Sequence[Provider], progress: bool = True) -> Counter:
        """Measure every provider on every job; returns the count of rows per status."""
        with tqdm(total=len(jobs), unit="config", disable=not progress, dynamic_ncols=True) as bar:
            for job in jobs:
                spec = job.spec
                bar.set_description(f"{job.setting + ' ' if job.setting else ''}{spec.mode} d{spec.hdim} "
                                    f"{'causal' if spec.causal else 'full'} n{spec.seqlen}")
                for provider in providers:
                    bar.set_postfix_str(provider.name)
                    self.measure(provider, job)
                bar.update(1)
        return self.status_counts
