"""A long distillation run gives the CPU to the tests and the benchmarks while they run, by itself.

On a 2-core machine a background `ffr pretrain` halves every benchmark's figure and slows the tests. So
the foreground (`tests/conftest.py`, every `python -m bench...`) holds a shared `flock` on one lock file for
as long as it runs, and a yielding run checks before each step (and each batch of teacher embeddings) whether
anyone holds it; if so it waits, off the clock of its time budget, and goes on when the last holder is gone.
The kernel drops a lock when its holder exits, however it exits (`kill -9` included), so nothing is left
paused by a crash, and no process is ever signalled. A foreground process's children (the `ffr pretrain` a
test or `bench.distill_arms` starts) inherit `FFR_HOLDS_CPU` and do not wait for their own parent.
"""
from __future__ import annotations

import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HOLDER_ENV = "FFR_HOLDS_CPU"  # set in a foreground process and inherited by its children
LOCK_ENV = "FFR_CPU_LOCK"     # the lock file's path, where the default (one per user, in the temp dir) won't do

log = logging.getLogger("ffr.cpu_share")
_holds: list[int] = []  # this process's holds (a benchmark's import, the test session, a test of its own)


def lock_path() -> Path:
    return Path(os.environ.get(LOCK_ENV) or Path(tempfile.gettempdir()) / f"ffr-edge-{os.getuid()}.cpu-lock")


def _open_lock() -> int:
    return os.open(lock_path(), os.O_RDWR | os.O_CREAT, 0o600)


def hold_cpu() -> int:
    """Hold the CPU for the rest of this process (a benchmark, the test session): yielding runs wait until it
    exits or calls `release(fd)`. Returns the lock's file descriptor."""
    fd = _open_lock()
    fcntl.flock(fd, fcntl.LOCK_SH)
    _holds.append(fd)
    os.environ[HOLDER_ENV] = "1"
    return fd


def release(fd: int) -> None:
    """Let go of one hold; the process stays a holder (and its children exempt) while it has another."""
    _holds.remove(fd)
    if not _holds:
        os.environ.pop(HOLDER_ENV, None)
    os.close(fd)  # closing the last descriptor of the open file drops its lock


def held_elsewhere(fd: int) -> bool:
    """Whether a foreground process holds the CPU now (never this process or its parent chain)."""
    if os.environ.get(HOLDER_ENV):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


class Yielder:
    """Called between steps of a yielding run: returns at once while nobody holds the CPU, else waits (logging
    the pause and its length) until everybody has let go. `paused_s` sums the waits."""

    def __init__(self, enabled: bool = True, notify: Callable[[str], None] | None = None):
        self.enabled, self.paused_s = enabled, 0.0
        self.notify = notify or log.info
        self._fd: int | None = None

    def __call__(self) -> float:
        if not self.enabled:
            return 0.0
        if self._fd is None:
            self._fd = _open_lock()
        if not held_elsewhere(self._fd):
            return 0.0
        self.notify(f"paused: the tests or a benchmark hold the CPU ({lock_path()}); going on when they finish")
        start = time.monotonic()
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # granted once no shared holder is left
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        waited = time.monotonic() - start
        self.paused_s += waited
        self.notify(f"resumed after {waited:.0f} s paused")
        return waited

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
