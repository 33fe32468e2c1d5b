"""`ffr fleet simulate`: the real client and coordinator over Mosquitto, resume after Ctrl-C, bad input."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from ffr.cli import main
from fleet.data import TEST, TRAIN
from fleet.evaluation import client_pairs, fairness
from fleet.final_report import best_round
from fleet.report import compare
from fleet.simulate import should_stop

# small but real: 12 SYNTHETIC people x 10 images, a narrow MobileNetV2, 3 devices
TINY = ["--synthetic-identities", "12", "--synthetic-images", "10", "--holdout-identities", "0.25",
        "--width-mult", "0.35", "--init", "none", "--lr", "1e-3", "--batch-size", "16", "--workers", "2"]


@pytest.fixture(scope="module")
def simulated(tmp_path_factory, mosquitto) -> Path:
    out = tmp_path_factory.mktemp("fleet") / "run"
    rc = main(["-q", "fleet", "simulate", "--clients", "3", "--rounds", "2", "--partition", "iid", "--method",
               "fedprox", "--dfc", "--broker", mosquitto.url, "--patience", "0", *TINY, "--out", str(out)])
    assert rc == 0
    return out


def test_simulation_runs_real_rounds_and_writes_the_summary(simulated):
    from PIL import Image

    summary = json.loads((simulated / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    assert summary["data_kind"] == "synthetic"
    # 3 people on no device: too few to keep any for the gate or the public set, so all are unseen
    assert summary["people_on_no_device"] == {"unseen": 3, "gate": 0, "public": 0, "public_data": None}
    pngs = sorted(simulated.glob("*.png"))
    assert {"rounds.png", "client_tar.png", "partition.png"} <= {p.name for p in pngs}
    assert all("SYNTHETIC" in Image.open(p).text.get("Description", "") for p in pngs), "SYNTHETIC plots say so"
    assert [h["model_version"] for h in summary["history"]] == [0, 1, 2]  # round 0: the starting model
    assert all(h["updates"] == 3 and h["bytes_up"] > 0 for h in summary["history"][1:])
    assert summary["initial"]["auc"] == summary["history"][0]["holdout_auc"]
    assert 0.0 <= summary["global"]["auc"] <= 1.0 and summary["global"]["n_impostor_pairs"] > 0
    assert summary["centralized"]["epochs"] == 2 and 0.0 <= summary["centralized"]["global"]["auc"] <= 1.0
    personalised = summary["personalized"]["training_clients"]
    assert set(personalised) == {"start", "global", "local", "local+dfc", "global+dfc", "centralized"}
    # the starting model is scored per device like the rest, against strangers (people on no device)
    assert summary["personalized"]["impostors"] == "people on no device"
    rows = summary["personalized"]["per_client"]
    assert all(r["start"]["auc"] is not None and "tar@1e-3" in r["start"] for r in rows)
    low, high = summary["history"][0]["holdout_interval"]["auc"]  # a bootstrap over the unseen people
    assert 0.0 <= low <= high <= 1.0 and summary["global"]["interval"]["auc"] is not None
    assert summary["best_round"] == max(summary["history"][1:], key=lambda h: h["holdout_auc"])["round"]
    assert personalised["local+dfc"]["clients"] == 3 and personalised["local+dfc"]["auc"]["std"] >= 0.0
    # the local models really differ from the global one (they were trained on the device)
    rows = summary["personalized"]["per_client"]
    assert any(r["local"]["auc"] != r["global"]["auc"] for r in rows)
    assert summary["bytes"]["up"] == sum(h["bytes_up"] for h in summary["history"])
    # each device's whole turn is timed beside its phases (its start and stop are the difference)
    assert all(h["turn_s"] >= h["fetch_s"] + h["train_s"] + h["upload_s"] > 0 for h in summary["history"][1:])
    for name in ("rounds", "roc_global", "roc_personalized", "client_tar", "confusion", "partition"):
        png = Path(summary["plots"][name])
        assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    markdown = (simulated / "summary.md").read_text()
    assert "| federated (round " in markdown and "## Round by round, people no device holds" in markdown
    assert "| 0 (start) |" in markdown and "| start | 3 |" in markdown
    # each device's door at the threshold it calibrates: start, global and personalised; without a public set no
    # device may verify with its personalised model, so each keeps the global one
    doors = summary["personalized"]["doors"]
    assert set(doors["per_client"]) == {"0", "1", "2"} and doors["far_promised"] == 1e-3
    for row in doors["per_client"].values():
        assert row["chosen"] == "global"
        for name in ("start", "global", "personalised"):
            assert 0 <= row[name]["tar"] <= 1 and 0 <= row[name]["far"] <= 1 and row[name]["capture_shift"] == 0
        assert row["start"]["threshold"] != row["global"]["threshold"], "two rounds moved the global model's door"
        low, high = row["global"]["far_interval"]  # over the strangers drawn
        assert 0 <= low <= row["global"]["far"] <= high <= 1
    assert doors["chosen"] == {**doors["global"], "personalised": 0} and doors["start"]["devices"] == 3
    assert "## Each device's door (mean over devices)" in markdown
    assert "| start (before the federation) | 3 |" in markdown


def test_simulation_used_the_real_coordinator_and_devices(simulated):
    db = sqlite3.connect(simulated / "coordinator" / "coordinator.sqlite")
    statuses = [r[0] for r in db.execute("SELECT status FROM rounds ORDER BY round_id")]
    assert statuses == ["completed", "completed"]
    accepted = db.execute("SELECT COUNT(*) FROM updates WHERE accepted=1").fetchone()[0]
    assert accepted == 6  # 3 devices x 2 rounds, each delta sent over MQTT and verified
    for k in range(3):
        home = simulated / "devices" / f"client-{k:03d}" / "home"
        assert (home / "private" / "local_backbone.safetensors").exists()
        assert len(json.loads((home / "rounds.json").read_text())) == 2


def test_devices_hold_only_their_training_images(simulated):
    from fleet.config import SimConfig
    from fleet.data import prepare

    config = SimConfig.load(simulated / "config.json")
    config.progress = False
    data = prepare(config, simulated)
    for k in data.training_clients:
        linked = {str(p.resolve()) for p in (simulated / "devices" / f"client-{k:03d}" / "data").rglob("*.png")}
        expected = {str(Path(data.crops.paths[i]).resolve()) for i in np.flatnonzero(data.client_mask(k, TRAIN))}
        assert linked == expected
        tests = {str(Path(data.crops.paths[i]).resolve()) for i in np.flatnonzero(data.client_mask(k, TEST))}
        assert not linked & tests


def test_the_device_checks_bench_replays_each_devices_adoption_check_on_the_published_models(simulated, tmp_path):
    """bench.device_checks rebuilds every training device's check faces and judges each published step (and the run
    against v0) on face pairs and on faces against templates, as the device does."""
    from bench.device_checks import main as bench_main

    assert bench_main(["--run", str(simulated), "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "device_checks.json").read_text())
    rows = result["table"]
    assert {r["device"] for r in rows} == {0, 1, 2}
    assert sorted({r["step"] for r in rows}) == ["v0 -> v1", "v0 -> v2", "v1 -> v2"] and len(rows) == 9
    assert result["refused"] == {"pairs": sum(not r["pairs_ok"] for r in rows),
                                 "templates": sum(not r["templates_ok"] for r in rows)}


def test_mlflow_has_the_run(simulated):
    db = sqlite3.connect(simulated / "mlflow.db")
    steps = {r[0] for r in db.execute("SELECT step FROM metrics WHERE key='holdout_auc'")}
    assert steps == {0, 1, 2}
    assert (
        db.execute("SELECT COUNT(*) FROM metrics WHERE key LIKE 'final_personalized_local_dfc_auc%'").fetchone()[0] == 2
    )


def test_report_puts_runs_side_by_side(simulated, capsys):
    assert main(["fleet", "report", str(simulated), str(simulated)]) == 0
    table = capsys.readouterr().out.strip().splitlines()
    assert table[0].startswith("| run |") and len(table) == 4
    assert "| start AUC | global AUC |" in table[0] and "pers. TAR@1e-3 start" in table[0]
    assert "| pers. TAR@1e-3 local+dfc | pers. TAR@1e-3 global+dfc |" in table[0]  # what a device personalises
    assert "| door TAR start | door TAR now | door FAR start | door FAR now | doors over 2x now (beyond interval) |" \
        in table[0]
    doors = json.loads((simulated / "summary.json").read_text())["personalized"]["doors"]
    assert f"| {doors['start']['tar']:.3f} | {doors['chosen']['tar']:.3f} |" in table[2]
    assert compare([simulated]).count("fedprox +DFC") == 1


def test_the_summary_lists_each_device_start_against_now_and_counts_the_bar():
    from fleet.report import _device_lines

    def door(tar, far, interval=None):
        return {"tar": tar, "far": far, "far_interval": interval}

    per_client = [{"client": 0, "held_out": False, "start": {"tar@1e-3": 0.60}, "global": {"tar@1e-3": 0.62},
                   "global+dfc": {"tar@1e-3": 0.75}},
                  {"client": 1, "held_out": False, "start": {"tar@1e-3": 0.70}, "global": {"tar@1e-3": 0.68},
                   "global+dfc": {"tar@1e-3": 0.72}},
                  {"client": 2, "held_out": True, "start": {"tar@1e-3": 0.5}}]
    doors = {"per_client": {"0": {"start": door(0.9, 0.001), "global": door(0.91, 0.001),
                                  "personalised": door(0.95, 0.0025, [0.001, 0.004]), "chosen": "personalised"},
                            "1": {"start": door(0.8, 0.0), "global": door(0.79, 0.0005, [0.0, 0.001]),
                                  "chosen": "global"}}}
    lines = _device_lines({"per_client": per_client, "doors": doors})
    table = [line for line in lines if line.startswith("| 0 |") or line.startswith("| 1 |") or line.startswith("| 2")]
    assert table == ["| 0 | 0.600 | 0.620 | 0.750 | +0.150 | personalised | 0.900 -> 0.950 | "
                     "0.00100 -> 0.00250 [0.00100, 0.00400] |",
                     "| 1 | 0.700 | 0.680 | 0.720 | +0.020 | global | 0.800 -> 0.790 | 0.00000 -> 0.00050 [0.00000, "
                     "0.00100] |"]
    # device 0 clears the bar; device 1 verifies with its global model, below its start on its own people
    assert lines[-1] == ("1 of 2 devices gain 10 points or more on their own people with the personalised model; "
                         "1 end below the start with the model they verify with (1 at the door they calibrated).")
    assert _device_lines({"per_client": per_client}) == []  # a run from before doors were scored
    # a device whose people start at 0.950 cannot gain 10 points: counted as a miss, and said why
    ceiling = {"client": 3, "held_out": False, "start": {"tar@1e-3": 0.95}, "global": {"tar@1e-3": 0.95},
               "global+dfc": {"tar@1e-3": 1.0}}
    doors["per_client"]["3"] = {"start": door(0.97, 0.0), "global": door(0.97, 0.0), "chosen": "global"}
    lines = _device_lines({"per_client": per_client + [ceiling], "doors": doors})
    assert lines[-1] == ("1 of 3 devices gain 10 points or more on their own people with the personalised model; "
                         "1 end below the start with the model they verify with (1 at the door they calibrated); 1 "
                         "start above 0.900, where 10 points cannot be gained.")


@pytest.mark.parametrize("text, says", [('{"x":', "Expecting value"), ("[1, 2]", "not a JSON object"),
                                        ('{"history": "zz"}', "KeyError")])
def test_report_names_a_damaged_summary_in_one_line(simulated, tmp_path, capsys, text, says):
    (tmp_path / "summary.json").write_text(text)
    for json_flag in ([], ["--json"]):
        assert main(["fleet", "report", str(simulated), str(tmp_path), *json_flag]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / 'summary.json'} is damaged" in err and says in err and err.count("\n") == 1, err


def _history(run: Path) -> list[dict]:
    path = run / "state.json"
    try:
        return json.loads(path.read_text())["history"] if path.exists() else []
    except json.JSONDecodeError:
        return []


def test_ctrl_c_leaves_a_resumable_run(tmp_path, mosquitto):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "ffr", "-q", "fleet", "simulate", "--clients", "3", "--rounds", "3",
           "--no-centralised", "--no-mlflow", "--patience", "0", "--broker", mosquitto.url, *TINY, "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # Ctrl-C live: conftest
    deadline = time.monotonic() + 240
    while not _history(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Run the same command again to resume" in err
    state = json.loads((out / "state.json").read_text())
    assert state["status"] == "interrupted"
    first = state["history"][0]

    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 3
    assert summary["history"][0] == first  # the finished round is kept, not redone
    assert [h["model_version"] for h in summary["history"]] == [0, 1, 2, 3]


@pytest.mark.parametrize("args, message", [
    (["--data", "/nonexistent/faces"], "does not exist"),
    (["--clients", "40"], "cannot give each of 40 clients an identity"),
    (["--partition", "attribute", "--rules", "RULES"], "no per-image attributes"),
    (["--partition", "attribute", "--rules", "NOT_JSON"], "is not JSON"),
    (["--data", "DATA", "--partition", "attribute", "--rules", "BAD_RULES"], '{"where": {"Male": 2}} is not a rule'),
    (["--method", "fedfr", "--public-identities", "0"], "hard negatives need a public set: --public-data DIR"),
    (["--method", "fedfr", "--clients", "3"], "public set: the 3 people on no device are too few"),
    (["--method", "fedfr", "--public-data", "/nonexistent/public"], "--public-data folder does not exist"),
    (["--ray-address", "127.0.0.1:6379"], "--ray-address needs --backend ray"),
    (["--backend", "ray", "--cpus-per-device", "0"], "--cpus-per-device must be positive"),
    (["--codec", "topk", "--topk-fraction", "1.5"], "--topk-fraction in (0, 1]"),
])
def test_bad_input_fails_before_training(tmp_path, capsys, args, message):
    files = {"RULES": [{"where": {"Male": 1}}], "BAD_RULES": [{"where": {"Male": 2}}], "NOT_JSON": "{not json"}
    for name, content in files.items():
        (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    (tmp_path / "DATA").mkdir()
    args = [str(tmp_path / a) if a in (*files, "DATA") else a for a in args]
    out = tmp_path / "run"
    assert main(["-q", "fleet", "simulate", *TINY, *args, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not (out / "coordinator").exists() and not (out / "devices").exists()


def test_resuming_with_other_options_is_refused(simulated, capsys):
    assert main(["-q", "fleet", "simulate", "--clients", "4", "--rounds", "2", *TINY, "--out", str(simulated)]) == 2
    assert "holds another simulation" in capsys.readouterr().err


def test_early_stopping_and_best_round():
    history = [{"round": r, "select_auc": a} for r, a in enumerate([0.6, 0.7, 0.69, 0.7005, 0.65], 1)]
    assert best_round(history) == 4
    assert not should_stop(history[:3], patience=2, min_delta=1e-3)
    assert should_stop(history[:4], patience=2, min_delta=1e-3)   # 0.7005 < 0.7 + 1e-3
    assert not should_stop(history[:4], patience=2, min_delta=1e-4)
    assert not should_stop(history, patience=0, min_delta=0.0)


def test_client_pairs_are_own_genuine_and_cross_client_impostors():
    pairs, same = client_pairs(np.array([0, 0, 1, 1, 1]), n_other=4)
    assert same.sum() == 1 + 3 and (~same).sum() == 5 * 4
    assert (pairs[~same][:, 1] >= 5).all() and (pairs[~same][:, 0] < 5).all()
    stats = fairness([{"held_out": False, "g": {"auc": 0.5, "eer": 0.2, "tar@1e-2": None, "tar@1e-3": None}},
                      {"held_out": False, "g": {"auc": 0.7, "eer": 0.4, "tar@1e-2": None, "tar@1e-3": None}}], ["g"])
    assert stats["g"]["auc"] == pytest.approx({"mean": 0.6, "std": 0.1}) and stats["g"]["tar@1e-2"] is None


def test_a_failing_device_is_dropped_and_the_round_goes_on(simulated, tmp_path, mosquitto, capsys):
    """One device loses its data (a real failure of the real client: no images to train on)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(simulated, run)
    for identity in (run / "devices" / "client-000" / "data").iterdir():
        if identity.is_dir():
            shutil.rmtree(identity)
    rc = main(["-q", "fleet", "simulate", "--clients", "3", "--rounds", "3", "--partition", "iid", "--method",
               "fedprox", "--dfc", "--broker", mosquitto.url, "--patience", "0", *TINY, "--out", str(run)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "client-000: dropped from round 3: DatasetError: no images found" in captured.out + captured.err
    last = json.loads((run / "summary.json").read_text())["history"][-1]
    assert last["round"] == 3 and last["updates"] == 2 and last["dropped"] == 1


def test_a_wiping_device_is_neutralised_by_the_median(tmp_path):
    """One of four devices sends -global with 10^15 samples; with the median the model is not wiped, and
    the coordinator recorded the attacker's weight capped and its update clipped. (The embedded broker, with
    its logins and ACLs: the simulator admits its own devices.)"""
    out = tmp_path / "attacked"
    rc = main(["-q", "fleet", "simulate", "--clients", "4", "--rounds", "1", "--partition", "iid", "--method",
               "fedavg", "--no-dfc", "--no-centralised", "--no-mlflow", *TINY,
               "--malicious", "0.25", "--attack", "wipe", "--combine", "median", "--out", str(out)])
    assert rc == 0
    from coordinator.store import Store
    from fleet.attacks import malicious_clients

    store = Store(out / "coordinator")
    row = store.rounds()[0]
    assert row["status"] == "completed" and row["metrics"]["clipped_updates"] >= 1
    bad = malicious_clients([0, 1, 2, 3], 0.25, 0)
    attacker = next(u for u in store.accepted_updates(1) if u["device_id"] == f"client-{min(bad):03d}")
    assert attacker["n_samples"] == 10 ** 15 and attacker["metrics"]["weight"] < 1000
    before, after = store.load_model(0), store.load_model(1)
    floats = [k for k in before if before[k].dtype.kind == "f" and "running" not in k]
    ratio = np.sqrt(sum(np.sum(after[k] ** 2) for k in floats) / sum(np.sum(before[k] ** 2) for k in floats))
    assert ratio > 0.9, f"the global model shrank to {ratio:.2f} of its norm"


def test_fedfr_through_the_cli_with_two_devices(tmp_path, mosquitto):
    """`ffr fleet simulate --method fedfr --public-data DIR`: hard negatives, the contrastive term and the fitted DFC
    branch over the real broker; the hard-negative fraction is reported per round."""
    from models.faces.synthetic import write_dataset

    public = write_dataset(tmp_path / "public", n_identities=5, n_images=4, seed=123)  # people no client has
    out = tmp_path / "run"
    rc = main(["-q", "fleet", "simulate", "--clients", "2", "--rounds", "2", "--method", "fedfr", "--public-data",
               str(public), "--t-hn", "0.0", "--dfc-steps", "50", "--broker", mosquitto.url, "--patience", "0",
               "--no-centralised", "--no-mlflow", *TINY, "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    assert summary["config"]["method.name"] == "fedfr" and summary["config"]["method.hard_negatives"]
    assert all(0.0 <= h["hn_fraction"] <= 1.0 for h in summary["history"][1:])
    assert (out / "public_set.safetensors").exists()
    assert f"the devices' public set is --public-data ({public})" in (out / "summary.md").read_text()
    personalised = summary["personalized"]["training_clients"]
    assert {"global", "local", "local+dfc"} <= set(personalised)
    assert "fedfr +HN +con +DFC" in compare([out])


def test_the_ray_backend_runs_the_fleet_through_the_cli_on_a_local_ray(tmp_path, mosquitto):
    started = time.time()
    out = tmp_path / "run"
    rc = main(["-q", "fleet", "simulate", "--clients", "3", "--rounds", "2", "--partition", "iid", "--backend", "ray",
               "--broker", mosquitto.url, "--patience", "0", "--no-centralised", "--codec", "int8", *TINY,
               "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    assert all(h["updates"] == 3 for h in summary["history"][1:])
    session = Path(tempfile.gettempdir()) / "ray" / "session_latest"
    assert session.exists() and session.stat().st_mtime >= started - 1, "a local Ray was started for the run"
    assert not __import__("ray").is_initialized(), "and shut down after it"


def test_a_turns_reference_cycles_are_still_collected_after_the_imports_are_frozen():
    """fleet.devices.freeze_imports hides the imports from the collector; a finished device (held in a cycle
    by paho's callbacks, as here by its own bound method) must still be freed by release_memory."""
    script = """
import weakref, numpy as np
from edge_client.memory import release_memory
from fleet.devices import freeze_imports
freeze_imports()
class Device:
    def __init__(self):
        self.crops = np.ones((64, 1024, 1024), np.uint8)
        self.callback = self.on_message
    def on_message(self):
        pass
device = Device(); alive = weakref.ref(device); del device
assert alive() is not None, "the cycle outlives its last name"
release_memory()
assert alive() is None, "release_memory frees it"
print("freed")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "freed", done.stderr


@pytest.mark.parametrize("text", ["{not json", '{"history": 5}', '{"history": [1]}', '{"unknown": 1}', "[]"])
def test_a_damaged_run_state_is_refused_in_one_line(tmp_path, text):
    """state.json is read back when a run resumes: damaged or foreign, it is named, not half-used."""
    from fleet.simulate import RunState

    (tmp_path / "state.json").write_text(text)
    with pytest.raises(ValueError, match="state.json is damaged or was not written by ffr fleet simulate"):
        RunState.load(tmp_path / "state.json")


def test_a_taken_dashboard_port_is_refused_before_the_run(tmp_path, capsys):
    """Before, the run printed the dashboard's URL, uvicorn logged that it could not bind, and the run went on."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = tmp_path / "r"
        assert main(["-q", "fleet", "simulate", *TINY, "--dashboard-port", str(port), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--dashboard-port {port} on 127.0.0.1 cannot be used" in err and err.count("\n") == 1, err
    assert not (tmp_path / "r" / "devices").exists()


def test_the_people_on_no_device_split_between_the_figures_the_gate_and_every_devices_public_set(tmp_path):
    """Without --public-data a seeded share of the people on no device is packed into the public set devices are
    served (their strangers to calibrate on); no unseen-people figure uses them, nor the gate's people."""
    from fleet.config import SimConfig
    from fleet.simulate import Simulation
    from models.public_set import load_public_set
    from protocol.messages import TrainingConfig

    def config(**change) -> SimConfig:
        c = SimConfig(synthetic_identities=30, synthetic_images=4, holdout_identities=0.5, clients=3, progress=False,
                      mlflow=False, centralized=False, **change)
        training = c.training.model_dump()
        c.server.training = TrainingConfig.model_validate({**training, "model": {**training["model"],
                                                                                "width_mult": 0.35}})
        return c

    sim = Simulation(config(), tmp_path / "run")
    data = sim.data
    unseen = set(data.partition.holdout_identities)
    gate, public = set(data.gate_people), set(data.public_people)
    figures = {str(n) for n in data.names[data.holdout_mask()]}
    assert len(unseen) == 15 and len(public) == 3 and len(gate) >= 2
    assert gate | public | figures == unseen and not (gate & public or gate & figures or public & figures)
    packed = load_public_set(sim.public_set)
    assert len(packed) == int(data.public_mask().sum()) and len(np.unique(packed.labels)) == 3
    assert Simulation(config(), tmp_path / "run").data.public_people == data.public_people  # resumed: the same
    assert Simulation(config(public_identities=0.0), tmp_path / "none").public_set is None
    given = tmp_path / "given"
    (given / "someone").mkdir(parents=True)
    import cv2

    cv2.imwrite(str(given / "someone" / "a.png"), np.full((128, 128, 3), 90, np.uint8))
    other = Simulation(config(public_data=str(given)), tmp_path / "given_run")
    assert other.data.public_people == () and len(load_public_set(other.public_set)) == 1
