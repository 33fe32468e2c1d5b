"""Shared fixtures: synthetic datasets the tests make, the real faces in ../shared/faces, one trained run."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """Children start with Ctrl-C live, as from a terminal. A session launched in the background (`.ci/run &`)
    ignores SIGINT and every child it starts inherits that: a daemon a test stops with SIGINT would never stop.
    A Python handler is reset to the default at exec, so the children get SIGINT's default and their Python its
    KeyboardInterrupt."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Crops cached by tests go to a temporary folder, never to the user's cache."""
    os.environ["FFR_CACHE_DIR"] = str(tmp_path_factory.mktemp("ffr-cache"))
    os.environ.setdefault("OMP_NUM_THREADS", "2")


@pytest.fixture(scope="session", autouse=True)
def _cpu_to_the_tests():
    """A background `ffr pretrain` (models.training.cpu_share) pauses while the tests run."""
    from models.training.cpu_share import hold_cpu, release

    fd = hold_cpu()
    yield
    release(fd)


@pytest.fixture(scope="session")
def faces_dir() -> Path:
    """The real face sets (../shared/faces, or $FFR_FACES_DIR)."""
    path = Path(os.environ.get("FFR_FACES_DIR", REPO.parent / "shared" / "faces"))
    if not (path / "orl").is_dir():
        pytest.skip(f"real face data not found at {path} (set FFR_FACES_DIR)")
    return path


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory) -> Path:
    from models.faces.synthetic import write_dataset

    return write_dataset(tmp_path_factory.mktemp("synthetic") / "faces", n_identities=10, n_images=6, seed=3)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, synthetic_dir) -> Path:
    """A real (tiny) `ffr train` run with the DFC branch: 3 epochs on 10 synthetic identities."""
    from ffr.cli import main

    out = tmp_path_factory.mktemp("runs") / "run"
    rc = main(["-q", "train", "--data", str(synthetic_dir), "--out", str(out), "--epochs", "3", "--lr", "1e-3",
               "--dfc", "--holdout-identities", "0.3", "--no-mlflow", "--batch-size", "16"])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def mosquitto():
    """A real Mosquitto broker on a free localhost port (installed by .ci/run)."""
    from coordinator.broker import EmbeddedBroker, find_mosquitto

    if find_mosquitto() is None:
        pytest.fail("mosquitto is not installed: apt-get install mosquitto (.ci/run does this)")
    with EmbeddedBroker() as broker:
        yield broker


def device_datasets(root: Path, n_devices: int, ids_per_device: int, images: int, seed: int = 7) -> list[Path]:
    """Disjoint SYNTHETIC people per device, one folder each, as a device would hold them."""
    import shutil

    from models.faces.datasets import SYNTHETIC_MARKER
    from models.faces.synthetic import identity_name, write_dataset

    full = write_dataset(root / "all", n_devices * ids_per_device, images, seed=seed)
    out = []
    for d in range(n_devices):
        data = root / f"device{d}"
        data.mkdir()
        for i in range(d * ids_per_device, (d + 1) * ids_per_device):
            shutil.copytree(full / identity_name(i), data / identity_name(i))
        (data / SYNTHETIC_MARKER).write_text((full / SYNTHETIC_MARKER).read_text())
        out.append(data)
    return out


def serving_coordinator(*args: str, env: dict | None = None):
    """`ffr coordinator serve ARGS` in its own process, returned once its embedded broker is up (admission needs
    it): (the process, the list its output lines keep arriving in)."""
    import subprocess
    import sys
    import threading

    process = subprocess.Popen([sys.executable, "-m", "ffr", "coordinator", "serve", *args], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env or {**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("coordinator: broker"):
            break
    threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True).start()
    return process, lines


def admitted(state: Path, device_id: str, out: Path) -> Path:
    """`ffr coordinator admit` for `device_id` against a coordinator's state folder: the credential file."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-m", "ffr", "coordinator", "admit", "--state", str(state), "--device-id",
                    device_id, "--out", str(out)], cwd=REPO, check=True, capture_output=True)
    return out
