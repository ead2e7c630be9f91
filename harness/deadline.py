"""A deadline for one provider call (runner.py --call-timeout): a call that hangs becomes a
row with status 'timeout' and the sweep goes on.

Two guards, because a Python thread cannot be killed and a subprocess per call would cost a
process start (and a CUDA context) per call:
1. SIGALRM (POSIX, main thread only): after `seconds` the handler raises CallTimeout into the
   call, which stops a hang in Python code (a loop, a sleep, a lock wait). CallTimeout is a
   BaseException, so a provider's `except Exception` does not swallow it.
2. A watchdog thread, `grace(seconds)` later: a call stuck in C code (a GPU kernel that never
   ends, a blocking library call) never returns to the interpreter, so the handler never runs.
   The watchdog then writes the call's row itself (`on_hang`) and ends the process with
   EXIT_ABORTED: the row is in results.csv, so `--resume` goes on after it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

from harness.stages import EXIT_ABORTED

DEFAULT_CALL_TIMEOUT_S = 600.0  # far above any healthy call: a Triton autotune, an interpreter run
MAX_GRACE_S = 60.0  # how long the watchdog waits past the deadline for the call to unwind


class CallTimeout(BaseException):
    """Raised into the main thread when a call outlives its deadline."""


def grace(seconds: float) -> float:
    """Time past the deadline before the watchdog ends the process: as long as the deadline, at most a minute."""
    return min(seconds, MAX_GRACE_S)


def _raise_timeout(signum, frame):
    raise CallTimeout


@contextmanager
def call_deadline(seconds: float, what: str, on_hang):
    """Run the block under a deadline of `seconds` (0: none). `what` names the call in the
    watchdog's message; `on_hang()` writes its row before the watchdog ends the process."""
    if not seconds:
        yield
        return
    done, lock = threading.Event(), threading.Lock()

    def watch():
        if done.wait(seconds + grace(seconds)):
            return
        with lock:  # the block may have ended meanwhile; while the lock is held it cannot end
            if done.is_set():
                return
            try:
                on_hang()
                rows = "The rows so far, this call's included, are written"
            except Exception as exc:  # noqa: BLE001 -- the process must end all the same
                rows = f"Its row could not be written ({type(exc).__name__}: {exc}); the rows before it are kept"
            print(f"\nCALL HUNG: {what} gave no result within {seconds + grace(seconds):g} s and could not be "
                  f"interrupted (it is stuck in C code, e.g. a GPU kernel that never ends). {rows}: run the same "
                  "command with --resume to go on after it (--retry-timeouts measures what timed out again).",
                  file=sys.stderr, flush=True)
            os._exit(EXIT_ABORTED)

    alarm = threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
    if alarm:
        previous = signal.signal(signal.SIGALRM, _raise_timeout)
        signal.setitimer(signal.ITIMER_REAL, seconds)
    threading.Thread(target=watch, name="call-deadline", daemon=True).start()
    try:
        yield
    finally:
        try:  # an alarm that fires in here still raises CallTimeout, after `done` is set below
            if alarm:
                try:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                finally:
                    signal.signal(signal.SIGALRM, previous)
        finally:
            with lock:
                done.set()
