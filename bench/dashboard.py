"""A screenshot of the coordinator dashboard during a live fleet simulation (for the README).

python -m bench.dashboard --out bench/results
Runs `ffr fleet simulate` on SYNTHETIC faces with `--dashboard-port`, waits until a few rounds are
aggregated and evaluated, and saves OUT/dashboard.png from a headless chromium (Playwright).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _completed_rounds(base: str, token: str) -> int:
    request = urllib.request.Request(f"{base}/dashboard/data", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return sum(r["status"] == "completed" for r in json.load(response)["rounds"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--shoot-after", type=int, default=4, help="screenshot once this many rounds are done")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        parser.error("needs chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ffr.cli",
                "--quiet",
                "fleet",
                "simulate",
                "--clients",
                str(args.clients),
                "--rounds",
                str(args.rounds),
                "--fraction",
                "0.5",
                "--lr",
                "1e-3",
                "--no-centralised",
                "--no-mlflow",
                "--dashboard-port",
                str(port),
                "--out",
                f"{tmp}/run",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(run.stdout), daemon=True).start()
        try:
            url = _wait(lambda: next((m.group(0) for line in lines
                                      if (m := re.search(r"http://\S+/dashboard#token=\w+", line))), None), run, lines)
            base, token = url.split("/dashboard#token=")
            _wait(lambda: _completed_rounds(base, token) >= args.shoot_after or None, run, lines)
            args.out.mkdir(parents=True, exist_ok=True)
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
                page = browser.new_page(viewport={"width": 1400, "height": 860})
                page.goto(url)
                page.locator("#rounds tr").first.wait_for()
                time.sleep(2.5)  # one more poll, so the chart has its points
                page.screenshot(path=str(args.out / "dashboard.png"), full_page=True)
                browser.close()
        finally:
            run.send_signal(signal.SIGINT)  # Ctrl-C: the simulator stops its devices and its broker cleanly
            run.wait(120)
    print(f"screenshot: {args.out / 'dashboard.png'}")
    return 0


def _wait(probe, run: subprocess.Popen, lines: list[str], timeout_s: float = 1800.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if run.poll() is not None:
            raise SystemExit("the simulation ended early:\n" + "".join(lines[-30:]))
        try:
            value = probe()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(1.0)
    raise SystemExit("timed out waiting for the simulation")


if __name__ == "__main__":
    sys.exit(main())
