"""The collapse attack (poisoning from inside every bound) and the defences against it, on real parts.

An admitted device pulls every embedding together from inside the norm bound with the largest
sample count the coordinator accepts. Shown here: it works against the bounds alone (so the tests
below can fail), the coordinator's quality gate rolls the round back on its own, the devices'
adoption check keeps their last good model on its own, and the norm bound's history survives a
restart. Small but real: a 3-device SYNTHETIC fleet from the shipped face weights over Mosquitto.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ffr.cli import main

FLEET = ["--synthetic-identities", "12", "--synthetic-images", "6", "--holdout-identities", "0.25", "--lr", "1e-4",
         "--batch-size", "16", "--workers", "2", "--clients", "3", "--rounds", "2", "--partition", "iid",
         "--method", "fedavg", "--no-dfc", "--patience", "0", "--no-centralised", "--no-mlflow",
         "--malicious", "0.34", "--attack", "collapse", "--eval-clients", "1"]


@pytest.fixture(scope="module")
def gate_faces(tmp_path_factory) -> Path:
    """Faces the coordinator holds for its gate: SYNTHETIC people no device has (another seed), 360 of them: about
    64,000 impostor pairs, so that twice the current FAR at 1e-3 is a count, not a handful."""
    from models.faces.synthetic import write_dataset

    return write_dataset(tmp_path_factory.mktemp("gate") / "faces", n_identities=60, n_images=6, seed=99)


def _faces(n_people: int = 6, n_images: int = 4, seed: int = 5):
    from models.evaluation.separation import FaceSet
    from models.faces.synthetic import generate

    images, labels = generate(n_people, n_images, seed=seed)
    return FaceSet(images, labels)


def _rounds(run: Path) -> list[dict]:
    from coordinator.store import Store

    return Store(run / "coordinator").rounds()


def test_collapse_stays_in_the_bound_and_makes_every_impostor_match():
    from coordinator.robust import l2_norm
    from fleet.attacks import poison
    from models.evaluation.separation import compare, score
    from models.networks.face_weights import face_global_state

    state, faces = face_global_state(), _faces()
    honest = {k: np.zeros_like(v, dtype=np.float64) for k, v in state.items()}
    delta, claimed = poison("collapse", honest, 24, state, images=faces.images, bound=1.0, claim=72)
    assert claimed == 72 and l2_norm(delta) <= 1.0 + 1e-6 and set(delta) == set(state)
    attacked = {k: (v + delta[k]).astype(v.dtype) for k, v in state.items()}
    before, after = score(state, faces), score(attacked, faces)
    assert after.impostor.mean() > before.impostor.mean() + 0.3  # everyone moved together
    verdict = compare(before, after, far=1e-2)  # 240 impostor pairs measure a FAR of 1e-2
    assert not verdict.ok and "impostors at the current threshold" in verdict.reason
    verdict = compare(before, after, far=1e-3)  # ... but not 1e-3: then the mean impostor score decides
    assert not verdict.ok and "mean impostor score rose" in verdict.reason
    assert compare(before, score(state, faces)).ok  # the same model passes its own check


def test_without_defences_the_collapse_is_published(tmp_path, mosquitto):
    run = tmp_path / "nodefence"
    assert main(["-q", "fleet", "simulate", "--broker", mosquitto.url, *FLEET, "--rounds", "1", "--no-gate",
                 "--out", str(run)]) == 0
    assert [r["status"] for r in _rounds(run)] == ["completed"]  # every bound held, nothing rolled back
    from coordinator.store import Store
    from models.evaluation.separation import compare, score

    store, faces = Store(run / "coordinator"), _faces(seed=11)
    assert not compare(score(store.load_model(0), faces), score(store.load_model(1), faces)).ok  # and it collapsed


def test_quality_gate_keeps_the_collapse_out_on_its_own(tmp_path, mosquitto, gate_faces):
    run = tmp_path / "gate"
    assert main(["-q", "fleet", "simulate", "--broker", mosquitto.url, *FLEET, "--gate-data", str(gate_faces),
                 "--out", str(run)]) == 0
    from coordinator.store import Store
    from fleet.attacks import malicious_clients
    from models.evaluation.separation import compare, score

    store = Store(run / "coordinator")
    rounds = store.rounds()
    attacker = {f"client-{k:03d}" for k in malicious_clients([0, 1, 2], 0.34, 0)}
    assert len(attacker) == 1
    for r in rounds:  # the round's model failed the gate; the update that fails on its own was left out
        assert r["status"] == "completed", r["reason"]
        assert r["metrics"]["gate_excluded_devices"] == sorted(attacker) and r["n_updates"] == 3
    faces = _faces(seed=11)
    assert compare(score(store.load_model(0), faces), score(store.load_model(2), faces)).ok  # nothing collapsed


def test_quality_gate_rolls_a_round_back_when_no_update_passes(tmp_path, mosquitto, gate_faces):
    run = tmp_path / "gate1"
    assert main(["-q", "fleet", "simulate", "--broker", mosquitto.url, *FLEET, "--rounds", "1", "--clients", "1",
                 "--malicious", "0.9",
                 "--gate-data", str(gate_faces), "--out", str(run)]) == 0
    rounds = _rounds(run)
    assert [r["status"] for r in rounds] == ["rolled_back"]
    assert "quality gate" in rounds[0]["reason"] and "impostors" in rounds[0]["reason"]
    assert rounds[0]["metrics"]["gate_far_candidate"] > rounds[0]["metrics"]["gate_far_limit"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["history"][-1]["model_version"] == 0  # the published model never moved
    # the summary says so: the history lists published rounds only, so the refusal and its uploads are listed apart
    assert summary["rolled_back"] == [{"round_id": rounds[0]["round_id"], "reason": rounds[0]["reason"],
                                       "bytes_up": rounds[0]["metrics"]["bytes_received"]}]
    assert rounds[0]["metrics"]["bytes_received"] > 0
    report = (run / "summary.md").read_text()
    assert "1 round(s) rolled back by the coordinator" in report and rounds[0]["reason"] in report


def test_device_adoption_check_keeps_the_last_good_model_on_its_own(tmp_path, mosquitto):
    run = tmp_path / "device"
    assert main(["-q", "fleet", "simulate", "--broker", mosquitto.url, *FLEET, "--no-gate", "--out", str(run)]) == 0
    from coordinator.store import Store

    store = Store(run / "coordinator")
    first, second = store.rounds()
    assert first["status"] == "completed"  # no gate: the poisoned v1 is published
    reports = {u["device_id"]: u["metrics"]["global_adopted"] for u in store.accepted_updates(second["round_id"])}
    first_wire_sha = {d: json.loads((run / "devices" / d / "home" / "models" / "adopted.json").read_text())["sha256"]
                      for d in reports}
    assert len(set(first_wire_sha.values())) == 1
    assert reports and set(reports.values()) == {0.0}  # every device refused v1 and said only that
    for device in reports:
        log = json.loads((run / "devices" / device / "home" / "rounds.json").read_text())
        assert [e["adopted"] for e in log] == [True, False]
        adopted = json.loads((run / "devices" / device / "home" / "models" / "adopted.json").read_text())
        assert adopted["sha256"] == first_wire_sha[device]  # still v0, the model it adopted in round 1
    assert store.robust_state()["norm_history"]  # the bound's history was saved with the completed round


def test_norm_bound_history_survives_a_restart(tmp_path):
    from coordinator.aggregation import make_strategy
    from coordinator.engine import Engine, RoundSettings
    from coordinator.store import Store
    from protocol.auth import Signer

    def engine() -> Engine:
        state = {"w": np.ones(100, np.float32)}
        return Engine(Store(tmp_path), make_strategy("fedavg"), RoundSettings(), lambda *a: None, lambda: state,
                      Signer.load_or_create(tmp_path / "key.pem"))

    first = engine()
    assert first.norms.bound == pytest.approx(1.0)  # the ceiling: 0.1 x ||w||
    first.norms.record([0.01, 0.02, 0.03])
    first.store.save_robust_state({"norm_history": first.norms.history, "fv_factors": {"client-1": 0.5}})
    second = engine()  # a restart, as after kill -9
    assert second.norms.bound == pytest.approx(0.06) and second.fv.factors == {"client-1": 0.5}


def test_a_swapped_adoption_reference_adopts_nothing(tmp_path):
    from edge_client.adoption import Adoption
    from models.networks.face_weights import face_global_state
    from protocol.tensors import encode

    state = face_global_state()
    wire = encode(state, "fp16")
    adoption = Adoption(tmp_path)
    assert adoption.judge(wire.sha256, wire.data, state, None).ok  # the first model: remembered
    poisoned = {k: (v * 0.5).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in state.items()}
    forged = encode(poisoned, "fp16")
    (tmp_path / "adopted.safetensors").write_bytes(forged.data)  # a local tamperer swaps the reference...
    (tmp_path / "adopted.json").write_text(json.dumps({"sha256": forged.sha256}))  # ... and its record
    sealed = {"adopted.safetensors": wire.sha256, "anchor.safetensors": wire.sha256}
    assert adoption.seals() == {"anchor.safetensors": wire.sha256, "adopted.safetensors": forged.sha256}
    verdict = Adoption(tmp_path, sealed=sealed).judge(forged.sha256, forged.data, poisoned, _faces())
    assert not verdict.ok and "adopted.safetensors" in verdict.reason
    assert "not the one this device sealed" in verdict.reason
    (tmp_path / "adopted.safetensors").write_bytes(wire.data)  # the reference restored, the anchor swapped instead
    (tmp_path / "adopted.json").write_text(json.dumps({"sha256": wire.sha256}))
    (tmp_path / "anchor.safetensors").write_bytes(forged.data)
    (tmp_path / "anchor.json").write_text(json.dumps({"sha256": forged.sha256}))
    verdict = Adoption(tmp_path, sealed=sealed).judge(forged.sha256, forged.data, poisoned, _faces())
    assert not verdict.ok and "anchor.safetensors" in verdict.reason


def test_the_device_refuses_the_third_small_step_of_a_drift_each_step_of_which_passes(tmp_path):
    """A drift that raises every impostor score a little each round (a shift of the embedding's BatchNorm bias):
    against the last adopted model alone, every step passes the device's check; against the first model the device
    adopted (its anchor), the third step is refused and the device keeps the second."""
    from edge_client.adoption import Adoption, check_faces
    from models.faces.synthetic import generate
    from models.networks.face_weights import face_global_state
    from protocol.tensors import encode

    images, labels = generate(8, 5, seed=3)
    public, _ = generate(40, 1, seed=9)
    faces = check_faces(images, labels, public)
    start = face_global_state()
    direction = np.random.default_rng(0).standard_normal(128).astype(np.float32)
    direction *= 1.25 / np.linalg.norm(direction)
    states = [{**start, "backbone.bn.bias": start["backbone.bn.bias"] + k * direction} for k in range(4)]
    wires = [encode(s, "fp16") for s in states]
    anchored, plain = Adoption(tmp_path / "anchored"), Adoption(tmp_path / "plain")
    verdicts = [anchored.judge(w.sha256, w.data, s, faces) for w, s in zip(wires, states)]
    assert [v.ok for v in verdicts] == [True, True, True, False]
    assert "the first model this device adopted" in verdicts[3].reason
    assert anchored.last()[0] == wires[2].sha256 and anchored.anchor()[0] == wires[0].sha256
    for w, s in zip(wires, states):  # the same drift judged against the last model only: every step adopted
        assert plain.judge(w.sha256, w.data, s, faces).ok
        plain_home = tmp_path / "plain"
        (plain_home / "anchor.safetensors").write_bytes((plain_home / "adopted.safetensors").read_bytes())
        (tmp_path / "plain" / "anchor.json").write_text(json.dumps({"sha256": w.sha256}))
