"""Issue 49: an idle edge daemon holds no torch (each round's training runs in a child process that ends with it), and
a daemon stopped while its child trains ends that child and says "stopped".

Real processes as a user runs them: `ffr coordinator serve` (embedded Mosquitto), `ffr coordinator admit`,
`ffr edge run`. What the daemon holds is read from Linux's `/proc/PID/maps` (every shared library it loaded) and
`/proc/PID/task/*/children`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, admitted, device_datasets, serving_coordinator

from coordinator.broker import free_port

CLI = [sys.executable, "-m", "ffr"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc")


def _round_children(pid: int) -> set[int]:
    """The daemon's child processes that run a round (multiprocessing's spawned interpreters; its resource tracker,
    a small helper that lives as long as the daemon, is not one)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            if _alive(int(child)) and b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.add(int(child))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _torch_loaded(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate(timeout=30) if proc.poll() is not None else ("", "")
            raise AssertionError(f"{what}: not within {timeout:.0f} s (exit {proc.poll()})\n{out[-2000:]}{err[-2000:]}")
        time.sleep(0.2)


def _rounds(home: Path) -> list[dict]:
    path = home / "rounds.json"
    return json.loads(path.read_text()) if path.exists() else []


@pytest.fixture
def federation(tmp_path):
    """A coordinator running two rounds for one device, its credential and data."""
    (data,) = device_datasets(tmp_path / "data", 1, 3, 6)
    state = tmp_path / "state"
    coordinator, said = serving_coordinator("--rounds", "2", "--min-clients", "1", "--state", str(state),
                                            "--http-port", str(free_port()), "--batch-size", "8", "--local-epochs", "3")
    from coordinator.service import NO_PUBLIC_SET  # issue 47: an operator is told what serving no public set costs

    assert NO_PUBLIC_SET + "\n" in said, said
    yield admitted(state, "dev0", tmp_path / "dev0.credential"), data
    coordinator.terminate()
    coordinator.wait(30)


def test_an_idle_daemon_holds_no_torch_and_a_stop_mid_round_ends_its_child(federation, tmp_path):
    credential, data = federation
    home = tmp_path / "home"
    edge = subprocess.Popen(CLI + ["edge", "run", "--credential", str(credential), "--data", str(data), "--home",
                                   str(home), "--no-export"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        _wait(lambda: len(_rounds(home)) == 1, 300, "round 1 trained and logged", edge)
        assert _rounds(home)[0]["train_loss"] > 0
        assert not _torch_loaded(edge.pid), "the daemon itself imported torch"
        _wait(lambda: bool(_round_children(edge.pid)), 300, "round 2's child process started", edge)
        children = _round_children(edge.pid)
        edge.send_signal(signal.SIGTERM)
        out, err = edge.communicate(timeout=120)
    finally:
        if edge.poll() is None:
            edge.kill()
    assert edge.returncode == 0 and out.strip().splitlines()[-1] == "edge device dev0: stopped", (out, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    time.sleep(1)
    assert not [c for c in children if _alive(c)], "the round's child outlived the daemon"
