"""A device's round work (`edge_client.round_work`) in a child process started for the round and ended with it.

Why: torch and torchvision's imports are most of an edge daemon's memory; a daemon that trains in its own process
holds them between rounds forever (938 MB idle, 133 MB with this: `bench/results/daemon_memory.md`). Here the daemon
stays torch-free: each round spawns one child (a fresh interpreter, not a fork of a process with MQTT threads), calls
it over a pipe, and lets it exit. The child ignores Ctrl-C; the daemon ends it when it stops. `RoundWork` itself is
the same seam without the child (`--in-process`, a simulation's devices).
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import threading
from collections.abc import Iterator

from edge_client.device_faces import DeviceFaces
from edge_client.home import DeviceHome
from edge_client.public_set import DevicePublicSet

log = logging.getLogger("edge_client")
POLL_S = 0.5


class ChildWork:
    """The round's work in a child process, one per `session` (a round, or taking the final model)."""

    model = None  # the model lives in the child, for one round

    def __init__(self, home: DeviceHome, faces: DeviceFaces, public: DevicePublicSet, seed: int, device_id: str,
                 stop: threading.Event):
        """What the child builds its `RoundWork` from (all of it picklable), and the daemon's stop."""
        self._args = (home, faces, public, seed, device_id, log_levels())
        self.device_id, self.stop = device_id, stop
        self._process: multiprocessing.Process | None = None
        self._conn = None

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, *self._args), daemon=True,
                                        name=f"ffr-round-{self.device_id}")
        self._process.start()
        child.close()
        try:
            yield
        finally:
            self._end()

    def judge(self, job, payload: bytes) -> bool:
        return self._call("judge", job, payload)

    def train(self, job, momentum: bytes | None):
        return self._call("train", job, momentum)

    def export(self, job, trained: bool = True) -> str | None:
        return self._call("export", job, trained)

    def _call(self, name: str, *args):
        """One call answered by the child; its exception raised here; a child that died or a daemon that stops
        ends the call with a RuntimeError that says which."""
        if self._process is None or self._conn is None:
            raise RuntimeError("the round's child process is not running: call inside `session()`")
        self._conn.send((name, args))
        while not self._conn.poll(POLL_S):
            if self.stop.is_set():
                raise RuntimeError("the daemon is stopping")
            if not self._process.is_alive():
                raise RuntimeError(f"the round's training process ended (exit code {self._process.exitcode}) "
                                   "before answering: out of memory?")
        try:
            ok, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the round's training process ended (exit code {self._process.exitcode})") from None
        if not ok:
            raise value
        return value

    def _end(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self._conn.send(None)
        self._process.join(30 if not self.stop.is_set() else 0)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(10)
        self._conn.close()
        self._process, self._conn = None, None


def _serve(conn, home: DeviceHome, faces: DeviceFaces, public: DevicePublicSet, seed: int, device_id: str,
           levels: dict[str, int]) -> None:
    """The child: build the work, answer calls until told to stop or the daemon is gone. `levels`: the daemon's
    loggers' levels, so that the child says what the daemon would."""
    from edge_client.round_work import RoundWork

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the daemon decides
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    work = RoundWork(home, lambda: faces.crops, public, seed, device_id)
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        name, args = request
        try:
            conn.send((True, getattr(work, name)(*args)))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the daemon, which logs the round's end
            log.debug("the round's %s failed in its child process", name, exc_info=True)  # where, with -v
            conn.send((False, _sendable(exc)))


def _sendable(exc: Exception) -> Exception:
    """`exc` if it survives pickling and its class is not torch's (the daemon would import torch to read it), else a
    RuntimeError that says the same."""
    import pickle

    try:
        if type(exc).__module__.split(".")[0] not in ("torch", "torchvision"):
            pickle.loads(pickle.dumps(exc))
            return exc
    except Exception:  # noqa: BLE001 - any exception class that cannot be rebuilt
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def log_levels() -> dict[str, int]:
    """The levels the daemon's process set on its loggers (ffr's `-v`/`-q`)."""
    manager = logging.Logger.manager
    return {name: lg.level for name, lg in manager.loggerDict.items()
            if isinstance(lg, logging.Logger) and lg.level != logging.NOTSET}
