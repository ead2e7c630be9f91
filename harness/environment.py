"""The environment a measurement was taken in, stored beside every result row.

`capture_environment()` gives the fields every row carries (gpu, driver, cuda, torch, triton,
git_commit, timestamp), the versions of the optional peer packages (PEER_VERSION_COLUMNS:
flash-attn-4, nvidia-cutlass-dsl, flashinfer-python, xformers; '' when not installed) plus a
GPU state snapshot read with nvidia-ml-py (NVML): SM and memory
clocks, temperature, power, the current clock-event (throttle) reasons and NVML's cumulative
power/thermal violation counters. Take one snapshot before and one after a run:
`throttle_warnings(before, after)` reads the counters' growth, which covers the whole run and
not only the instant of the snapshot. Without a GPU, gpu is 'cpu (Triton interpreter)'.
`ClockSampler` reads the SM clock on a thread while a timing runs, so each timed row can say at
what clock its calls ran (harness/timing.py).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import os
import platform
import re
import subprocess
import threading
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
INTERPRETER_GPU = "cpu (Triton interpreter)"
ENV_COLUMNS = ("gpu", "driver", "cuda", "torch", "triton", "git_commit", "timestamp")
# The optional peers' distributions, by the column that records each one's version.
PEER_PACKAGES = {
    "flash_attn_4": "flash-attn-4",  # FA4 (flash_attn.cute)
    "nvidia_cutlass_dsl": "nvidia-cutlass-dsl",  # the CuTe DSL that FA4 compiles with
    "flashinfer": "flashinfer-python",
    "xformers": "xformers",
}
PEER_VERSION_COLUMNS = tuple(PEER_PACKAGES)
# Every environment field a result row can carry: ENV_COLUMNS, then the peers' versions.
ROW_ENV_COLUMNS = (*ENV_COLUMNS, *PEER_VERSION_COLUMNS)
# NVML clock-event reasons (nvmlClocksEventReason<X>, formerly nvmlClocksThrottleReason<X>) that
# mean the clocks were lowered by heat or a power limit.
THROTTLE_REASONS = {
    "SwPowerCap": "software power cap",
    "HwSlowdown": "hardware slowdown",
    "SwThermalSlowdown": "software thermal slowdown",
    "HwThermalSlowdown": "hardware thermal slowdown",
    "HwPowerBrakeSlowdown": "hardware power brake",
}


def _reason_bit(pynvml, reason: str) -> int:
    return getattr(pynvml, f"nvmlClocksEventReason{reason}", getattr(pynvml, f"nvmlClocksThrottleReason{reason}", 0))


def peer_versions() -> dict[str, str]:
    """{column: installed version} of PEER_PACKAGES, '' for one that is not installed. Read from
    the installed distributions' metadata: no peer is imported."""
    versions = {}
    for column, distribution in PEER_PACKAGES.items():
        try:
            versions[column] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            versions[column] = ""
    return versions


def git_commit(repo: Path = REPO_ROOT) -> str:
    """`git rev-parse HEAD`, with '-dirty' when tracked files have uncommitted changes. A copy
    of the tree without `.git` (a remote GPU machine) can name its commit in $GIT_COMMIT."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return f"{head}-dirty" if dirty else head


def _nvml_handle(pynvml, errors: list[str]):
    """NVML handle of the GPU torch uses: by UUID (CUDA_VISIBLE_DEVICES cannot mislead it),
    else by torch's device index."""
    index = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except pynvml.NVMLError as exc:
            errors.append(f"handle by UUID GPU-{uuid}: {exc}; using device index {index}")
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def gpu_state() -> dict:
    """NVML snapshot of the current GPU; a field NVML cannot read is None, with the errors
    listed under 'nvml_errors'. Empty without CUDA."""
    if not torch.cuda.is_available():
        return {}
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 -- no NVML: say so in the metadata, measure anyway
        return {"nvml_errors": [f"NVML unavailable: {type(exc).__name__}: {exc}"]}
    errors: list[str] = []
    try:
        try:
            handle = _nvml_handle(pynvml, errors)
        except pynvml.NVMLError as exc:
            return {"nvml_errors": [*errors, f"no NVML handle for this GPU: {exc}"]}

        def read(name, query):
            try:
                return query()
            except Exception as exc:  # noqa: BLE001 -- NVMLError, or a query this nvidia-ml-py lacks
                errors.append(f"{name}: {type(exc).__name__}: {exc}")
                return None

        reasons_query = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons",
                                getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
        reasons = read("clock_event_reasons", lambda: reasons_query(handle))
        state = {
            "name": read("name", lambda: pynvml.nvmlDeviceGetName(handle)),
            "driver": read("driver", pynvml.nvmlSystemGetDriverVersion),
            "sm_clock_mhz": read("sm_clock", lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            "mem_clock_mhz": read("mem_clock", lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM)),
            "max_sm_clock_mhz": read("max_sm_clock",
                                     lambda: pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_SM)),
            "temperature_c": read("temperature",
                                  lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
            "power_w": read("power", lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
            "power_limit_w": read("power_limit", lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000.0),
            "clock_event_reasons": None if reasons is None else [
                label for reason, label in THROTTLE_REASONS.items() if reasons & _reason_bit(pynvml, reason)],
            "power_violation_ns": read("power_violation", lambda: pynvml.nvmlDeviceGetViolationStatus(
                handle, pynvml.NVML_PERF_POLICY_POWER).violationTime),
            "thermal_violation_ns": read("thermal_violation", lambda: pynvml.nvmlDeviceGetViolationStatus(
                handle, pynvml.NVML_PERF_POLICY_THERMAL).violationTime),
            "nvml_errors": errors,
        }
    finally:
        pynvml.nvmlShutdown()
    return state


class ClockSampler:
    """The GPU's SM clock (MHz) read every `interval_s` on a thread while a `with` block runs; its
    mean is `sm_clock_mhz` afterwards. Under a power cap the clock a kernel gets depends on the
    power it draws and on what ran just before it, so two providers timed at different clocks
    differ by more than their code: the rows say so. (NVML's board power is not read: on the H100
    its instantaneous readings during timings of about a tenth of a second did not follow the load,
    some above the board's limit and some near idle for the longest calls:
    reports/h100/decisions/nvml_power_within_timings.csv.) NaN without
    CUDA or NVML, or where no reading succeeded. The thread sleeps between readings (NVML's calls
    release the GIL), so the timed calls' launches wait for it at most one reading's time."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.clocks: list[float] = []
        self.failed_readings = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = None

    def __enter__(self) -> ClockSampler:  # noqa: PYI034 -- typing.Self needs Python 3.11
        if not torch.cuda.is_available():
            return self
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = _nvml_handle(pynvml, [])
        except Exception:  # noqa: BLE001 -- no NVML: the row's clock stays NaN
            return self
        self._nvml = pynvml
        self._thread = threading.Thread(target=self._sample, args=(pynvml, handle), daemon=True)
        self._thread.start()
        return self

    def _sample(self, pynvml, handle) -> None:
        while True:
            try:
                self.clocks.append(float(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)))
            except Exception:  # noqa: BLE001 -- a failed reading is counted and left out of the mean
                self.failed_readings += 1
            if self._stop.wait(self.interval_s):
                return

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._nvml.nvmlShutdown()

    @property
    def sm_clock_mhz(self) -> float:
        return sum(self.clocks) / len(self.clocks) if self.clocks else math.nan


def capture_environment() -> dict:
    """The row environment columns (ROW_ENV_COLUMNS: ENV_COLUMNS and the peers' versions),
    'interpreter', 'python' and the GPU 'state' snapshot."""
    import triton

    has_cuda = torch.cuda.is_available()
    state = gpu_state()
    return {
        "gpu": (state.get("name") or torch.cuda.get_device_name()) if has_cuda else INTERPRETER_GPU,
        "driver": state.get("driver") or "",
        "cuda": torch.version.cuda or "",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "git_commit": git_commit(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **peer_versions(),
        "interpreter": not has_cuda,
        "python": platform.python_version(),
        "state": state,
    }


def throttle_warnings(before: dict, after: dict) -> list[str]:
    """Warnings when the GPU was held back by heat or power between two `capture_environment()`
    snapshots: NVML's violation counters grew, or a throttle reason is active at the end."""
    start, end = before.get("state") or {}, after.get("state") or {}
    warnings = []
    for key, what in (("power_violation_ns", "power"), ("thermal_violation_ns", "thermal")):
        if start.get(key) is not None and end.get(key) is not None and end[key] > start[key]:
            warnings.append(f"clocks were {what}-throttled for {(end[key] - start[key]) / 1e6:.1f} ms "
                            "during the run: numbers may be low")
    if end.get("clock_event_reasons"):
        warnings.append(f"throttle reasons active after the run: {', '.join(end['clock_event_reasons'])}")
    return warnings


def gpu_slug(gpu: str | None = None) -> str:
    """File-name form of a GPU name ('NVIDIA H200' -> 'nvidia-h200'); 'cpu' for the interpreter."""
    if gpu is None:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else INTERPRETER_GPU
    if gpu == INTERPRETER_GPU:
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
