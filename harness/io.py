"""Files a run writes: atomic replacement and one writer per results folder.

`atomic_write_text` writes to a temporary file named after this process (pid and a random
part) in the target's folder, then renames it over the target: a reader sees the old file or
the new one, never half of one, and two processes never write the same temporary file.

`FolderLock` is a lock file (`.runner.lock`, holding host, pid and command) created with
O_EXCL: a second run writing into the same folder stops with a message naming the first. A
lock left by a process that died (same host, pid gone) is taken over with a warning.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import uuid
import warnings
from pathlib import Path

LOCK_NAME = ".runner.lock"


def atomic_write_text(path: Path, text: str) -> Path:
    """Replace `path` by `text` atomically (temporary file in the same folder, then rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def save_figure(fig, path: Path, **kwargs) -> Path:
    """fig.savefig to `path` atomically (the format follows the file's suffix)."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}{path.suffix}")
    try:
        fig.savefig(tmp, **kwargs)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


class FolderBusy(RuntimeError):
    """Another live process holds the results folder's lock."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class FolderLock:
    """Exclusive right to write into `folder` while the `with` block runs."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK_NAME
        self._held = False

    def _holder(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def acquire(self) -> None:
        me = {"host": socket.gethostname(), "pid": os.getpid(), "command": " ".join(sys.argv)}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                same_host = holder.get("host") == me["host"]
                pid = holder.get("pid")
                if same_host and isinstance(pid, int) and not _alive(pid):
                    warnings.warn(f"{self.path}: taking over the lock of process {pid}, which no longer runs",
                                  stacklevel=2)
                    self.path.unlink(missing_ok=True)
                    continue
                raise FolderBusy(
                    f"{self.path.parent} is being written by another run (process {pid} on "
                    f"{holder.get('host', '?')}: {holder.get('command', '?')}); wait for it to finish or "
                    f"choose another --out. If no such run exists, delete {self.path}") from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self._held = True
            return
        raise FolderBusy(f"could not take the lock {self.path}")

    def release(self) -> None:
        if self._held:
            self.path.unlink(missing_ok=True)
            self._held = False

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
