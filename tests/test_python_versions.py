"""The code runs on every Python that `requires-python` allows (a Jetson's 3.10, a Raspberry Pi's 3.11, Ubuntu's
3.12, 3.13): vermin reads every module for the newest syntax and standard-library member it uses, so a 3.11-only
call (`datetime.UTC` was one) fails here rather than on a device."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["protocol", "models", "edge_client", "coordinator", "fleet", "ffr"]


def oldest_allowed() -> str:
    """The lower bound of `requires-python` (read as text: tomllib is itself 3.11's)."""
    spec = re.search(r'^requires-python\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    return re.search(r">=\s*(\d+\.\d+)", spec).group(1)


def test_every_module_runs_on_the_oldest_python_allowed():
    oldest = oldest_allowed()
    assert oldest == "3.10"  # the device side's promise (the device-product issue): 3.10-3.13
    vermin = Path(sys.executable).with_name("vermin")  # the dev extra's console script, beside this Python
    done = subprocess.run([str(vermin), "--no-tips", "--violations", "--eval-annotations",
                           f"-t={oldest}-", *PACKAGES], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
