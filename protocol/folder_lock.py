"""One process at a time in a state folder: a device's home, a coordinator's state.

An exclusive `flock` on a file in the folder, taken without waiting and released when the process exits (or the
descriptor is closed). The holder writes its pid in the file, so that a refusal can name who holds it. The
device and the coordinator share it from here, the one layer both stand on.
"""
from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path


class FolderHeld(ValueError):
    """Another process holds the folder; `holder` is its pid as it wrote it."""

    def __init__(self, holder: str):
        self.holder = holder
        super().__init__(f"held by process {holder}")


def hold(lock_file: Path, wait_s: float = 0.0) -> int:
    """The lock's descriptor (keep it open while holding); FolderHeld if another process has it, at once or after
    waiting up to `wait_s` seconds for it to let go."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise FolderHeld(holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def let_go(fd: int) -> None:
    """Release a lock taken with `hold` (closing its descriptor)."""
    os.close(fd)
