"""Issue 49's one enrolment: the people enrolled with `ffr device enroll` are the people the device federates on.

Real processes as a user runs them: `ffr device enroll` into a home, `ffr coordinator serve` (embedded Mosquitto),
`ffr coordinator admit`, and `ffr edge run` with no `--data`. SYNTHETIC aligned faces (`--detector none`).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO, admitted, device_datasets, serving_coordinator

from coordinator.broker import free_port

CLI = [sys.executable, "-m", "ffr"]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def test_a_device_federates_on_the_people_enrolled_in_its_store_without_data(tmp_path):
    (data,) = device_datasets(tmp_path / "data", 1, 3, 6)
    home = tmp_path / "home"
    for person in sorted(p for p in data.iterdir() if p.is_dir()):
        enrolled = subprocess.run(CLI + ["device", "enroll", "--home", str(home), "--name", person.name, "--images",
                                         str(person), "--detector", "none", "--best", "6", "--force"],
                                  cwd=REPO, capture_output=True, text=True, env=ENV)
        assert enrolled.returncode == 0, enrolled.stderr
    state = tmp_path / "state"
    coordinator, _ = serving_coordinator("--rounds", "1", "--min-clients", "1", "--state", str(state), "--http-port",
                                         str(free_port()), "--batch-size", "8", "--exit-when-done")
    try:
        credential = admitted(state, "dev0", tmp_path / "dev0.credential")
        edge = subprocess.run(CLI + ["edge", "run", "--credential", str(credential), "--home", str(home),
                                     "--exit-when-done", "--no-export"],
                              cwd=REPO, capture_output=True, text=True, env=ENV, timeout=600)
        assert edge.returncode == 0, edge.stdout[-3000:] + edge.stderr[-3000:]
        assert coordinator.wait(60) == 0
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
    assert "18 face images of 3 people enrolled" in edge.stdout, edge.stdout
    (round_,) = json.loads((home / "rounds.json").read_text())
    assert round_["acked"] and round_["train_loss"] > 0, round_
    assert not any((home / "crops").iterdir()), "the enrolled faces are never written out in the clear"


def test_a_home_with_fewer_than_two_people_enrolled_is_one_line(tmp_path):
    home = tmp_path / "home"
    (data,) = device_datasets(tmp_path / "data", 1, 2, 3)
    person = sorted(p for p in data.iterdir() if p.is_dir())[0]  # one of the two enrolled
    subprocess.run(CLI + ["device", "enroll", "--home", str(home), "--name", person.name, "--images", str(person),
                          "--detector", "none", "--force"], cwd=REPO, check=True, capture_output=True, env=ENV)
    credential = tmp_path / "cred.json"
    credential.write_text(json.dumps({"device_id": "dev0", "token": "0" * 64, "coordinator_public_key": "ab" * 32,
                                      "broker": "mqtt://127.0.0.1:1"}))
    proc = subprocess.run(CLI + ["edge", "run", "--credential", str(credential), "--home", str(home)], cwd=REPO,
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "1 people enrolled in" in proc.stderr and "a round needs 2 at least" in proc.stderr
