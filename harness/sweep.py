"""The sweep engine: configurations x providers -> result rows, appended as they come.

For each configuration and provider, in order:
1. availability (once per provider), the provider's shape/dtype/mode check (`supports`) and
   its kernel config (`config`): an exception from either is an 'error' row;
2. accuracy (harness.accuracy): the provider's output (and dQ, dK, dV for backward modes) on
   the job's own shape (batch >= 2, heads >= 3) against the float64 reference on a sample of
   every batch/head/row regime; above the dtype's tolerance, or any inf/NaN, the provider is
   'wrong' here and is not timed. Each job is checked: the verdict never depends on the order;
3. timing (harness.timing) on fresh random inputs of the configuration's size, `repeats` times.
Every failure (unavailable, unsupported, OOM, wrong, any exception) is a row with its status
and reason, and the sweep goes on. Rows go to the CSV as they are made; keys in `skip`
(--resume: measured ok) are not measured again, and a failure found again with the same
status and reason as `known` holds is not appended again.
"""

from __future__ import annotations

import gc
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from baselines.flops import attention_flops, tflops_per_second
from baselines.providers import Provider, Spec, UnsupportedInput, unavailable_reason
from harness.accuracy import TOLERANCE, WrongOutput, check_accuracy, check_shape
from harness.environment import ENV_COLUMNS, PEER_VERSION_COLUMNS
from harness.results import ResultWriter, row_key
from harness.timing import CPU_REPS, random_inputs, seed_of, time_attention

MAX_REASON_CHARS = 500


@dataclass(frozen=True)
class Job:
    """One configuration of a sweep: a Spec and its ablation setting ('' outside the ablation)."""

    spec: Spec
    setting: str = ""


class SweepAborted(RuntimeError):
    """The GPU context is broken (a sticky CUDA error): the process cannot measure any more."""


def _one_line(text: str) -> str:
    return " ".join(text.split())[:MAX_REASON_CHARS]


def classify_failure(exc: BaseException, where: str = "") -> tuple[str, str]:
    """(status, reason) of a failed measurement; `where` names the call that raised."""
    message = _one_line(f"{where}{type(exc).__name__}: {exc}".strip())
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "oom", message
    if isinstance(exc, (UnsupportedInput, NotImplementedError)):
        return "unsupported", message
    if isinstance(exc, WrongOutput):
        return "wrong", message
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
                 skip: frozenset = frozenset(), known: dict | None = None,
                 log: Callable[[str], None] | None = None):
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.writer, self.device, self.repeats = writer, device, repeats
        self.warmup_ms, self.rep_ms, self.cpu_reps, self.cuda_graph = warmup_ms, rep_ms, cpu_reps, cuda_graph
        self.skip, self.known, self.log = skip, dict(known or {}), log
        self.env = ({column: environment[column] for column in ENV_COLUMNS}
                    | {column: environment.get(column, "") for column in PEER_VERSION_COLUMNS})
        self.interpreter = device.type != "cuda"
        self.status_counts: Counter = Counter()
        self.rows: list[dict] = []  # every row written, in order
        self._availability: dict[str, str | None] = {}

    # ---- rows -------------------------------------------------------------------------
    def _row(self, provider: Provider, job: Job, repeat: int, status: str, reason: str = "", timing=None,
             rel_err: float = math.nan, check_shape: str = "", config: str = "") -> dict:
        spec = job.spec
        row = {
            **self._key_row(provider, job, repeat), "label": provider.label, "status": status, "reason": reason,
            "rel_err": rel_err, "check_shape": check_shape,
            "ms": math.nan, "ms_p20": math.nan, "ms_p80": math.nan,
            "tflops": math.nan, "tflops_p20": math.nan, "tflops_p80": math.nan, "peak_mem_mb": math.nan,
            "config": config, "interpreter": self.interpreter, **self.env,
        }
        if timing is not None:
            flops = attention_flops(spec.batch, spec.heads, spec.seqlen, spec.seqlen, spec.hdim, spec.causal,
                                    spec.mode)
            row.update(ms=timing.ms, ms_p20=timing.ms_p20, ms_p80=timing.ms_p80, peak_mem_mb=timing.peak_mem_mb,
                       tflops=tflops_per_second(flops, timing.ms),
                       tflops_p20=tflops_per_second(flops, timing.ms_p20),  # p20 time: the faster call
                       tflops_p80=tflops_per_second(flops, timing.ms_p80))
        return row

    def _emit(self, row: dict) -> None:
        key = row_key(row)
        if row["status"] != "ok" and self.known.get(key) == (row["status"], row["reason"]):
            self.status_counts["already recorded"] += 1  # --resume found the same failure again
            return
        self.writer.write(row)
        self.known[key] = (row["status"], row["reason"])
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
        q, k, v = random_inputs(spec, self.device, seed_of(spec, repeat), requires_grad=spec.mode != "fwd")
        return time_attention(provider.forward, q, k, v, spec.causal, 1.0 / math.sqrt(spec.hdim), spec.mode,
                              warmup_ms=self.warmup_ms, rep_ms=self.rep_ms, cpu_reps=self.cpu_reps,
                              cuda_graph=self.cuda_graph)

    def _accuracy(self, provider: Provider, spec: Spec) -> tuple[str, str, float, str]:
        """(status, reason, rel_err, check_shape) of this job's accuracy check."""
        try:
            try:
                check = check_accuracy(provider.forward, spec, self.device)
            except torch.cuda.OutOfMemoryError as oom:
                if check_shape(spec) == spec:
                    raise
                # batch 2 / 3 heads did not fit next to this provider's memory use: the job's own shape
                self._after_failure(provider, spec, oom)
                check = check_accuracy(provider.forward, spec, self.device, enlarge=False)
        except Exception as exc:  # noqa: BLE001 -- any failure is recorded as a row
            self._after_failure(provider, spec, exc)
            return (*classify_failure(exc, "accuracy check: "), math.nan, "")
        tolerance = TOLERANCE[spec.dtype]
        if check.nonfinite:
            return "wrong", f"{check.nonfinite} (accuracy check on {check.shape})", math.nan, check.shape
        if not check.error <= tolerance:
            reason = (f"rel_err {check.error:.3g} > tolerance {tolerance:g} against the float64 reference "
                      f"(accuracy check on {check.shape})")
            return "wrong", reason, check.error, check.shape
        return "ok", "", check.error, check.shape

    def measure(self, provider: Provider, job: Job) -> None:
        """All rows of one (provider, configuration)."""
        spec = job.spec
        todo = [r for r in range(self.repeats) if row_key(self._key_row(provider, job, r)) not in self.skip]
        if not todo:
            return
        first = todo[0]
        reason = self._unavailable(provider)
        if reason is not None:
            self._emit(self._row(provider, job, first, "unavailable", reason))
            return
        try:
            reason = provider.supports(spec)
        except Exception as exc:  # noqa: BLE001 -- a provider's check explains, never crashes a sweep
            self._emit(self._row(provider, job, first, *classify_failure(exc, "supports() raised ")))
            return
        if reason is None and spec.mode != "fwd" and not provider.has_backward:
            reason = "forward only: this provider has no backward"
        if reason is not None:
            self._emit(self._row(provider, job, first, "unsupported", str(reason)))
            return
        try:
            config = provider.config(spec) if provider.config is not None else ""
        except Exception as exc:  # noqa: BLE001
            self._emit(self._row(provider, job, first, *classify_failure(exc, "config() raised ")))
            return
        status, reason, rel_err, shape = self._accuracy(provider, spec)
        if status != "ok":
            self._emit(self._row(provider, job, first, status, reason, rel_err=rel_err, check_shape=shape,
                                 config=config))
            return
        for repeat in todo:
            try:
                timing = self._time(provider, spec, repeat)
            except Exception as exc:  # noqa: BLE001 -- any failure is recorded as a row
                self._after_failure(provider, spec, exc)
                self._emit(self._row(provider, job, repeat, *classify_failure(exc), rel_err=rel_err,
                                     check_shape=shape, config=config))
                return
            self._emit(self._row(provider, job, repeat, "ok", timing=timing, rel_err=rel_err, check_shape=shape,
                                 config=config))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _key_row(self, provider: Provider, job: Job, repeat: int) -> dict:
        spec = job.spec
        return {"provider": provider.name, "setting": job.setting, "mode": spec.mode, "causal": spec.causal,
                "hdim": spec.hdim, "seqlen": spec.seqlen, "batch": spec.batch, "heads": spec.heads,
                "dtype": spec.dtype, "repeat": repeat}

    def run(self, jobs: Sequence[Job], providers: Sequence[Provider], progress: bool = True) -> Counter:
        """Measure every provider on every job; returns the count of rows per status."""
        with tqdm(total=len(jobs) * len(providers), unit="measurement", disable=not progress,
                  dynamic_ncols=True) as bar:
            for job in jobs:
                spec = job.spec
                bar.set_description(f"{job.setting + ' ' if job.setting else ''}{spec.mode} d{spec.hdim} "
                                    f"{'causal' if spec.causal else 'full'} n{spec.seqlen}")
                for provider in providers:
                    bar.set_postfix_str(provider.name)
                    self.measure(provider, job)
                    bar.update(1)
        return self.status_counts
