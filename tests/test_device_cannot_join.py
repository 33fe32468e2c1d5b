"""Issue 49: a device that can never join says why and stops, rather than reconnecting forever.

Real processes: `ffr coordinator serve` with its embedded Mosquitto and broker ACL, `ffr coordinator admit`, and
`ffr edge run` as a user starts them.
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


@pytest.fixture
def coordinator(tmp_path):
    """A coordinator waiting for two devices (so no round starts while the tests run)."""
    state = tmp_path / "state"
    process, _ = serving_coordinator("--rounds", "1", "--min-clients", "2", "--state", str(state), "--http-port",
                                     str(free_port()))
    yield state
    process.terminate()
    process.wait(30)


def _edge(credential: Path, data: Path, home: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(CLI + ["edge", "run", "--credential", str(credential), "--data", str(data), "--home",
                                   str(home), "--no-export"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, **kw)


def test_a_wrong_broker_password_stops_the_device_with_one_line_and_a_non_zero_exit(coordinator, tmp_path):
    (data,) = device_datasets(tmp_path / "data", 1, 2, 3)
    credential = admitted(coordinator, "dev0", tmp_path / "dev0.credential")
    raw = json.loads(credential.read_text())
    raw["broker_password"] = "not-the-password"
    credential.write_text(json.dumps(raw))
    edge = _edge(credential, data, tmp_path / "home")
    out, err = edge.communicate(timeout=180)
    assert edge.returncode == 2, out + err
    last = err.strip().splitlines()[-1]
    assert last.startswith("edge device dev0: cannot join: the broker at") and "refused this device's login" in last
    assert "password is wrong or was revoked" in last


def test_a_credential_already_used_by_another_home_stops_the_device(coordinator, tmp_path):
    (data,) = device_datasets(tmp_path / "data", 1, 2, 3)
    credential = admitted(coordinator, "dev0", tmp_path / "dev0.credential")
    first = _edge(credential, data, tmp_path / "home1")
    deadline = time.monotonic() + 120
    while not (tmp_path / "home1" / "registered.json").exists() and time.monotonic() < deadline:
        time.sleep(0.5)  # admitted: the token is spent
    registered = (tmp_path / "home1" / "registered.json").exists()
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=60)
    assert registered, err
    assert first.returncode == 0 and out.strip().splitlines()[-1] == "edge device dev0: stopped", (out, err)
    second = _edge(credential, data, tmp_path / "home2")  # a new key presenting the spent token
    out, err = second.communicate(timeout=180)
    assert second.returncode == 2, out + err
    last = err.strip().splitlines()[-1]
    assert last.startswith("edge device dev0: cannot join: the coordinator refuses this device's credential")
    assert "already used" in last
