"""The sweep engine: configurations x providers -> result rows, appended as they come.

For each configuration and provider, in order:
1. availability (once per provider), the provider's shape/dtype/mode check (`supports`) and
   its kernel config (`config`): an exception from either is an 'error' row;
2. accuracy (harness.accuracy): the provider's output (and dQ, dK, dV for backward modes) on
   the job's own shape (batch >= 2, heads >= 3) against the float64 reference of every (batch,
   head), made from copies of the inputs; above the dtype's tolerance, any inf/NaN or inputs
   modified in place, the provider is 'wrong' here and is not timed. Each job is checked: the
   verdict never depends on the order;
3. timing (harness.timing) on fresh random inputs of the configuration's size, `repeats` times.
Every failure (unavailable, unsupported, OOM, wrong, any exception, a SystemExit from
provider code) is a row with its status and reason, and the sweep goes on. Each call into
provider code (its availability, supports, config, the accuracy check, each timing) runs under
harness.deadline's `call_timeout`: a call that hangs is a 'timeout' row. A KeyboardInterrupt
stops the sweep (the caller prints the --resume hint). Rows go to the CSV as they are made;
keys in `skip` (--resume: measured ok) are not measured again, nor is a (provider,
configuration) in `timed_out` (--resume: it timed out before), and a failure found again with
the same status and reason as `known` holds is not appended again.
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
from harness.deadline import DEFAULT_CALL_TIMEOUT_S, CallTimeout, call_deadline, grace
from harness.environment import ENV_COLUMNS, PEER_VERSION_COLUMNS
from harness.results import ResultWriter, config_key, row_key
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
                 skip: frozenset = frozenset(), timed_out: frozenset = frozenset(), known: dict | None = None,
                 call_timeout: float = DEFAULT_CALL_TIMEOUT_S, log: Callable[[str], None] | None = None):
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        if not call_timeout >= 0:
            raise ValueError(f"call_timeout must be seconds >= 0 (0: no deadline), got {call_timeout}")
        self.writer, self.device, self.repeats = writer, device, repeats
        self.warmup_ms, self.rep_ms, self.cpu_reps, self.cuda_graph = warmup_ms, rep_ms, cpu_reps, cuda_graph
        self.skip, self.timed_out, self.known, self.log = skip, timed_out, dict(known or {}), log
        self.call_timeout = call_timeout
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
            "config": config, "interpreter": self.interpreter, **self.env, "sm_clock_mhz": math.nan,
        }
        if timing is not None:
            flops = attention_flops(spec.batch, spec.heads, spec.seqlen, spec.seqlen, spec.hdim, spec.causal,
                                    spec.mode)
            row.update(ms=timing.ms, ms_p20=timing.ms_p20, ms_p80=timing.ms_p80, peak_mem_mb=timing.peak_mem_mb,
                       sm_clock_mhz=timing.sm_clock_mhz,
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
    def _call(self, provider: Provider, spec: Spec, call: str, fn, row: Callable[[str, str], dict],
              raised: str = ""):
        """fn(), provider code named `call`, under the call deadline: (True, its value), or
        (False, None) once the failure's row, row(status, reason), is written and the GPU freed;
        an exception's reason starts with `raised`."""
        hung = (f"{call} gave no result within {self.call_timeout + grace(self.call_timeout):g} s and could not be "
                "interrupted (stuck in C code): the run exited here")
        try:
            with call_deadline(self.call_timeout, f"{call} of {provider.name} on {spec}",
                               on_hang=lambda: self._emit(row("timeout", hung))):
                return True, fn()
        except CallTimeout:
            status, reason = "timeout", f"{call} gave no result within {self.call_timeout:g} s (--call-timeout)"
        except SystemExit as exc:  # sys.exit() in provider code ends the call, not the sweep
            status, reason = "error", _one_line(f"{call} called sys.exit({exc.code!r}) (SystemExit): provider code "
                                                "must return its result or raise")
        except Exception as exc:  # noqa: BLE001 -- any failure is recorded as a row
            status, reason = classify_failure(exc, raised)
        self._emit(row(status, reason))
        self._after_failure(provider, spec, reason)
        return False, None

    def _unavailable(self, provider: Provider, spec: Spec, row) -> tuple[bool, str | None]:
        """(whether the availability check ran, its reason); once per provider."""
        if provider.name not in self._availability:
            ran, reason = self._call(provider, spec, "the availability check", lambda: unavailable_reason(provider),
                                     row)
            if not ran:
                return False, None
            self._availability[provider.name] = reason
        return True, self._availability[provider.name]

    def _free_gpu(self, provider: Provider, spec: Spec, reason: str) -> None:
        """Free what a failed call left on the GPU; stop if the CUDA context is broken."""
        if self.device.type != "cuda":
            return
        gc.collect()
        if not _cuda_context_alive():
            raise SweepAborted(f"the CUDA context is broken after {provider.name} on {spec} ({reason}); start a "
                               f"new process with --resume and without provider {provider.name!r}")
        torch.cuda.empty_cache()

    def _after_failure(self, provider: Provider, spec: Spec, reason: str) -> None:
        """_free_gpu under the call deadline: a kernel that never ends hangs the synchronize."""
        if self.device.type != "cuda":
            return
        try:
            with call_deadline(self.call_timeout, f"freeing the GPU after {provider.name} on {spec}",
                               on_hang=lambda: None):  # the failure's row is already written
                self._free_gpu(provider, spec, reason)
        except CallTimeout:
            raise SweepAborted(f"the GPU did not come back within {self.call_timeout:g} s after {provider.name} on "
                               f"{spec} ({reason}); start a new process with --resume") from None

    def _time(self, provider: Provider, spec: Spec, repeat: int):
        q, k, v = random_inputs(spec, self.device, seed_of(spec, repeat), requires_grad=spec.mode != "fwd")
        return time_attention(provider.forward, q, k, v, spec.causal, 1.0 / math.sqrt(spec.hdim), spec.mode,
                              warmup_ms=self.warmup_ms, rep_ms=self.rep_ms, cpu_reps=self.cpu_reps,
                              cuda_graph=self.cuda_graph)

    def _check(self, provider: Provider, spec: Spec):
        """The accuracy check at check_shape(spec), at the job's own shape when that runs out of memory."""
        try:
            return check_accuracy(provider.forward, spec, self.device)
        except torch.cuda.OutOfMemoryError as oom:
            if check_shape(spec) == spec:
                raise
            # batch 2 / 3 heads did not fit next to this provider's memory use: the job's own shape
            self._free_gpu(provider, spec, f"{type(oom).__name__}: {oom}")  # under the check's deadline
            return check_accuracy(provider.forward, spec, self.device, enlarge=False)

    @staticmethod
    def _verdict(check, spec: Spec) -> tuple[str, str]:
        """(status, reason) of a finished accuracy check."""
        if check.fault:
            return "wrong", f"{check.fault} (accuracy check on {check.shape})"
        tolerance = TOLERANCE[spec.dtype]
        if not check.error <= tolerance:
            return "wrong", (f"rel_err {check.error:.3g} > tolerance {tolerance:g} against the float64 reference, "
                             f"worst in {check.worst} (accuracy check on {check.shape})")
        return "ok", ""

    def measure(self, provider: Provider, job: Job) -> None:
        """All rows of one (provider, configuration)."""
        spec = job.spec
        if config_key(self._key_row(provider, job, 0)) in self.timed_out:
            self.status_counts["skipped: timed out before"] += 1
            return
        todo = [r for r in range(self.repeats) if row_key(self._key_row(provider, job, r)) not in self.skip]
        if not todo:
            return
        first = todo[0]

        def failed(status, reason, repeat=first, **fields):
            return self._row(provider, job, repeat, status, reason, **fields)

        ran, reason = self._unavailable(provider, spec, failed)
        if not ran:
            return
        if reason is not None:
            self._emit(failed("unavailable", reason))
            return
        ran, reason = self._call(provider, spec, "supports()", lambda: provider.supports(spec), failed,
                                 raised="supports() raised ")
        if not ran:  # a provider's check explains, never crashes a sweep
            return
        if reason is None and spec.mode != "fwd" and not provider.has_backward:
            reason = "forward only: this provider has no backward"
        if reason is not None:
            self._emit(failed("unsupported", str(reason)))
            return
        ran, config = self._call(provider, spec, "config()",
                                 lambda: provider.config(spec) if provider.config is not None else "", failed,
                                 raised="config() raised ")
        if not ran:
            return
        ran, check = self._call(provider, spec, "the accuracy check", lambda: self._check(provider, spec),
                                lambda status, reason: failed(status, reason, config=config),
                                raised="accuracy check: ")
        if not ran:
            return
        status, reason = self._verdict(check, spec)
        measured = {"rel_err": check.error, "check_shape": check.shape, "config": config}
        if status != "ok":
            self._emit(failed(status, reason, **measured))
            return
        for repeat in todo:
            ran, timing = self._call(provider, spec, f"timing repeat {repeat}",
                                     lambda r=repeat: self._time(provider, spec, r),
                                     lambda status, reason, r=repeat: failed(status, reason, r, **measured))
            if not ran:
                return
            self._emit(self._row(provider, job, repeat, "ok", timing=timing, **measured))
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
