"""A background distillation run yields the CPU to the tests and benchmarks (models.training.cpu_share).

Real processes and real `flock`s on a lock file of the test's own: a yielding child waits while a holder holds
it, goes on when the holder lets go or is killed (-9), and never waits for its own parent."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from models.training.cpu_share import HOLDER_ENV, LOCK_ENV, hold_cpu, release

REPO = Path(__file__).resolve().parents[1]
YIELDER = ("import time; from models.training.cpu_share import Yielder; y = Yielder(notify=print); "
           "start = time.monotonic(); y(); print(f'waited {time.monotonic() - start:.2f} paused {y.paused_s:.2f}')")
HOLDER = "from models.training.cpu_share import hold_cpu; import sys, time; hold_cpu(); print('held', flush=True); " \
         "time.sleep(120)"


def _env(lock: Path, holder: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k != HOLDER_ENV}
    env[LOCK_ENV] = str(lock)
    if holder:
        env[HOLDER_ENV] = "1"
    return env


def _yielding_child(lock: Path, holder: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-u", "-c", YIELDER], env=_env(lock, holder), cwd=REPO,
                            stdout=subprocess.PIPE, text=True)  # unbuffered: its "paused:" line is read as said


def _paused_line(child: subprocess.Popen) -> str:
    """The child's first line, read once it says it paused (however long a loaded machine takes to start it)."""
    line = child.stdout.readline()
    assert line.startswith("paused: the tests or a benchmark hold the CPU"), line
    assert child.poll() is None, "the yielding child went on while the CPU was held"
    return line


def _waited(out: str) -> tuple[float, float]:
    _, waited, _, paused = out.strip().splitlines()[-1].split()  # the child's last line: waited W paused P
    return float(waited), float(paused)


def test_nobody_holding_costs_nothing(tmp_path):
    out = _yielding_child(tmp_path / "cpu.lock").communicate(timeout=60)[0]
    assert "paused:" not in out
    assert _waited(out)[1] == 0.0


def test_a_yielding_run_waits_while_the_cpu_is_held_and_counts_the_pause(tmp_path, monkeypatch):
    lock = tmp_path / "cpu.lock"
    monkeypatch.setenv(LOCK_ENV, str(lock))
    fd = hold_cpu()  # this test is the foreground; the child is the background run
    child = _yielding_child(lock)
    out = _paused_line(child)
    time.sleep(1.0)  # held a second longer after the child said it paused: a lower bound, however slow the machine
    release(fd)
    out += child.communicate(timeout=60)[0]
    assert "resumed after" in out
    waited, paused = _waited(out)
    assert waited >= paused >= 1.0


def test_a_killed_holder_leaves_nothing_paused(tmp_path):
    lock = tmp_path / "cpu.lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], env=_env(lock), cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "held"
    child = _yielding_child(lock)
    out = _paused_line(child)
    time.sleep(0.5)
    holder.kill()  # SIGKILL: no cleanup runs; the kernel drops the lock
    holder.wait(timeout=30)
    out += child.communicate(timeout=60)[0]
    assert "resumed after" in out and _waited(out)[1] >= 0.5


def test_a_holders_own_children_never_wait_for_it(tmp_path, monkeypatch):
    lock = tmp_path / "cpu.lock"
    monkeypatch.setenv(LOCK_ENV, str(lock))
    fd = hold_cpu()
    try:
        out = _yielding_child(lock, holder=True).communicate(timeout=60)[0]  # e.g. bench.distill_arms' runs
    finally:
        release(fd)
    assert "paused:" not in out and _waited(out)[1] == 0.0


def test_letting_go_of_one_hold_keeps_the_others(tmp_path, monkeypatch):
    """The test session holds the CPU for the whole run; a test's own hold and release must not end the session's
    exemption, or a run the tests start in-process would wait for the session's own lock forever."""
    monkeypatch.setenv(LOCK_ENV, str(tmp_path / "cpu.lock"))
    outer = hold_cpu()
    inner = hold_cpu()
    release(inner)
    assert os.environ.get(HOLDER_ENV) == "1"
    release(outer)
    assert os.environ.get(HOLDER_ENV) == "1"  # the session fixture (tests/conftest.py) still holds
