"""An edge daemon's memory, as the operating system counts it: one `ffr edge run` of 8 CelebA people through two rounds
of `ffr coordinator serve --rounds 2 --min-clients 1` and the final model, with each round's training in a child
process (the default) and in the daemon's own process (`--in-process`).

python -m bench.daemon_memory --out bench/results

Resident memory (`VmRSS` in /proc) of the daemon is sampled every 0.2 s, and of its round's child while there is one;
"idle" is the daemon's 5 s after it took the final model. Linux only.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import face_set, write_results
from bench.two_device_serve import _ffr, _free_port, _link_people

PEOPLE = 8
IDLE_S = 5.0


def _rss_mb(pid: int) -> float:
    """Resident memory of a process in MB (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _device(work: Path, credential: Path, data: Path, extra: list[str]) -> dict:
    """Runs the device until it took the final model, sampling its memory; then stops it."""
    edge = subprocess.Popen([sys.executable, "-m", "ffr.cli", "edge", "run", "--credential", str(credential), "--data",
                             str(data), "--home", str(work / "home"), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    said: list[str] = []
    threading.Thread(target=lambda: said.extend(edge.stdout), daemon=True).start()
    peak_daemon = peak_child = 0.0
    took_final = None
    deadline = time.monotonic() + 1800
    while edge.poll() is None and time.monotonic() < deadline:
        peak_daemon = max(peak_daemon, _rss_mb(edge.pid))
        peak_child = max([peak_child] + [_rss_mb(c) for c in _children(edge.pid)])
        if took_final is None and any("final model v" in line for line in said):
            took_final = time.monotonic()
        if took_final is not None and time.monotonic() - took_final > IDLE_S:
            break
        time.sleep(0.2)
    idle = _rss_mb(edge.pid)
    edge.send_signal(signal.SIGTERM)
    edge.wait(120)
    if took_final is None:
        raise RuntimeError("the device did not take the final model:\n" + "".join(said[-30:]))
    return {"idle_mb": round(idle, 1), "peak_daemon_mb": round(peak_daemon, 1),
            "peak_round_child_mb": round(peak_child, 1) if peak_child else None,
            "final": next(line.strip() for line in said if "final model v" in line).split(";")[0]}


def run(data: Path, work: Path, mode: str) -> dict:
    people = sorted(p.name for p in data.iterdir() if p.is_dir())[:PEOPLE]
    folder = _link_people(data, people, work / "dev1")
    state = work / "state"
    serve = subprocess.Popen([sys.executable, "-m", "ffr.cli", "coordinator", "serve", "--state", str(state),
                              "--rounds", "2", "--min-clients", "1", "--http-port", str(_free_port())],
                             stdout=subprocess.DEVNULL, stderr=open(work / "serve.log", "w"))
    try:
        deadline = time.monotonic() + 120
        while not (state / "broker.json").exists() and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(3)
        credential = work / "dev1.credential"
        admitted = _ffr("coordinator", "admit", "--state", str(state), "--device-id", "dev1", "--out", str(credential))
        if admitted.returncode != 0:
            raise RuntimeError(admitted.stderr)
        return {"mode": mode, **_device(work, credential, folder, ["--in-process"] if mode == "in-process" else [])}
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--data", type=Path, help="one folder per person (default: FFR_FACES_DIR/celeba_subset)")
    args = parser.parse_args()
    data = face_set(args.data)
    if data is None or not Path(f"/proc/{os.getpid()}/status").exists():
        sys.exit("bench.daemon_memory needs CelebA (FFR_FACES_DIR or --data) and Linux's /proc")
    rows = []
    for mode in ("child process", "in-process"):
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(run(data, Path(tmp), mode))
            print(rows[-1], flush=True)
    write_results(args.out, "daemon_memory", {"people": PEOPLE, "idle_after_s": IDLE_S}, rows,
                  f"An edge daemon's resident memory (MB), {PEOPLE} CelebA people, 2 rounds and the final model",
                  "python -m bench.daemon_memory --out bench/results")


if __name__ == "__main__":
    main()
