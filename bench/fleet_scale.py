"""A 1,000-device fleet on this machine: time, bytes and the peak memory (RSS) of every process.

python -m bench.fleet_scale --out bench/results [--devices 1000] [--fraction 0.02] [--rounds 3] [--backend ray]
Runs `ffr fleet simulate` on SYNTHETIC faces (two people per device, four images each), sampling
`--fraction` of the devices per round with one local epoch, while a sampler reads every process's
resident memory from /proc once a second. Reported per process role (the simulator with its
coordinator, the broker, Ray's own processes, the device workers): the largest RSS any one process
of that role reached, how many there were, and the largest total over all of them at one moment.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import write_results


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, stack = [], [root]
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, []))
    return out


def _role(pid: int, root: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    if pid == root:
        return "simulator + coordinator"
    for needle, role in (("mosquitto", "broker (mosquitto)"), ("ray::", "device worker (Ray task)"),
                         ("spawn_main", "device worker (process pool)"), ("raylet", "Ray raylet"),
                         ("gcs_server", "Ray GCS"), ("dashboard", "Ray dashboard/agents"),
                         ("agent", "Ray dashboard/agents"), ("log_monitor", "Ray log monitor"),
                         ("ray", "Ray (other)")):
        if needle in cmd:
            return role
    return cmd.split(" ")[0].rsplit("/", 1)[-1] or "other"


class Sampler(threading.Thread):
    """Once a second: every descendant's RSS, kept as the peak per process and the peak of the sum."""

    def __init__(self, root: int):
        super().__init__(daemon=True)
        self.root, self.stop = root, threading.Event()
        self.peak: dict[int, tuple[str, int]] = {}
        self.peak_total_kib = 0

    def run(self) -> None:
        while not self.stop.is_set():
            total = 0
            for pid in _descendants(self.root):
                rss = _rss_kib(pid)
                if rss is None:
                    continue
                total += rss
                _, best = self.peak.get(pid, ("", 0))
                self.peak[pid] = (_role(pid, self.root), max(best, rss))  # a Ray worker renames itself after start
            self.peak_total_kib = max(self.peak_total_kib, total)
            self.stop.wait(1.0)

    def rows(self) -> list[dict]:
        roles: dict[str, list[int]] = {}
        for role, rss in self.peak.values():
            roles.setdefault(role, []).append(rss)
        rows = [{"process": role, "processes": len(v), "peak_RSS_MiB (largest one)": max(v) / 1024,
                 "peak_RSS_MiB (sum of their peaks)": sum(v) / 1024} for role, v in sorted(roles.items())]
        rows.append(
            {
                "process": "all together (largest total at one moment)",
                "processes": len(self.peak),
                "peak_RSS_MiB (largest one)": "-",
                "peak_RSS_MiB (sum of their peaks)": self.peak_total_kib / 1024,
            }
        )
        return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--fraction", type=float, default=0.02)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=("pool", "ray"), default="ray")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--codec", default="fp16")
    parser.add_argument("--run", type=Path, help="keep the run folder here (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.run or Path(tmp) / "run"
        cmd = [sys.executable, "-m", "ffr.cli", "--quiet", "fleet", "simulate", "--clients", str(args.devices),
               "--synthetic-identities", str(2 * args.devices + args.devices // 4), "--synthetic-images", "4",
               "--holdout-identities", "0.1", "--partition", "equal", "--rounds", str(args.rounds),
               "--fraction", str(args.fraction), "--batch-size", "8", "--lr", "1e-3", "--patience", "0",
               "--backend", args.backend, "--workers", str(args.workers), "--codec", args.codec,
               "--no-centralised", "--no-mlflow", "--eval-clients", "50", "--impostor-images", "50",
               "--out", str(run_dir)]
        started = time.time()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sampler = Sampler(proc.pid)
        sampler.start()
        output = proc.stdout.read()
        rc = proc.wait()
        sampler.stop.set()
        sampler.join()
        wall = time.time() - started
        if rc != 0:
            print(output[-4000:], file=sys.stderr)
            return rc
        summary = json.loads((run_dir / "summary.json").read_text())
    trained = [h for h in summary["history"] if h["round"] > 0]
    extra = {"devices": args.devices, "fraction": args.fraction, "backend": args.backend, "codec": args.codec,
             "rounds": len(trained), "wall_seconds": wall, "updates_per_round": [h["updates"] for h in trained],
             "round_seconds": [h["wall_s"] for h in trained], "bytes_up_per_round": [h["bytes_up"] for h in trained],
             "global_auc_per_round": [h.get("holdout_auc") for h in summary["history"]],
             "command": " ".join(cmd[2:])}
    command = "python -m bench.fleet_scale " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(args.out, "fleet_scale_memory", extra, sampler.rows(),
                  f"{args.devices} devices ({args.backend}), {args.fraction:.0%} sampled per round, "
                  f"{len(trained)} rounds in {wall / 60:.1f} min: peak RSS per process role", command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
