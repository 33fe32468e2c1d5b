"""`bench.honest_round` at its smallest: real rounds of the device's own training and the coordinator's mean."""
from __future__ import annotations

import json

import pytest

from bench.honest_round import main


def test_it_replays_rounds_and_scores_the_start_beside_each(tmp_path):
    from models.faces.synthetic import write_dataset

    faces = write_dataset(tmp_path / "faces", n_identities=10, n_images=12, seed=2)
    out = tmp_path / "results"
    assert main(["--data", str(faces), "--out", str(out), "--name", "tiny", "--clients", "2", "--rounds", "1",
                 "--strangers", "12", "--gate-identities", "0", "--centralised",
                 "--arm", "frozen:batchnorm=frozen,epochs=1"]) == 0
    results = json.loads((out / "tiny.json").read_text())
    assert results["start"]["unseen_auc"] is not None
    # each device's people against strangers (too few here for a TAR at 1e-3: its AUC says the pairs were scored)
    assert all(row["global"]["auc"] is not None for row in results["start"]["per_client"].values())
    (round_,) = results["arms"]["frozen"]["rounds"]
    assert results["arms"]["frozen"]["overrides"] == {"batchnorm": "frozen", "epochs": 1}
    assert set(round_["own_tar@1e-3"]) == {"global", "local", "local+dfc", "global+dfc"}
    # no gate here, and two updates are too few to screen: the coordinator's mean of both
    assert round_["coordinator"] == {"screen": "flame", "screen_skipped": 2}
    assert all(set(row) == {"global", "local", "local+dfc", "global+dfc"} for row in round_["per_client"].values())
    assert round_["unseen_auc"] != results["start"]["unseen_auc"], "the round moved the shared model"
    assert results["centralised"]["epochs"] == 1 and 0 < results["centralised"]["unseen_auc"] <= 1
    table = (out / "tiny.md").read_text()
    assert "| start | shipped model | 0 |" in table and "| frozen | batchnorm=frozen, epochs=1 | 1 |" in table


def test_the_personalisation_bench_scores_each_arm_against_the_start(tmp_path):
    from bench.personalisation import main as personalisation
    from bench.personalisation import table_of
    from models.faces.synthetic import write_dataset

    faces = write_dataset(tmp_path / "faces", n_identities=10, n_images=12, seed=2)
    public = write_dataset(tmp_path / "public", n_identities=20, n_images=2, seed=3)  # faces of nobody's people
    out = tmp_path / "results"
    assert personalisation(["--data", str(faces), "--out", str(out), "--name", "tiny", "--clients", "2",
                            "--partition", "iid", "--strangers", "12", "--gate-identities", "0",
                            "--public-faces", str(public), "--public-limit", "40",
                            "--arm", "few:dfc_steps=5,dfc_negatives=hard", "--arm", "none:dfc_steps=0"]) == 0
    results = json.loads((out / "tiny.json").read_text())
    assert set(results["arms"]) == {"few", "none"}
    assert results["arms"]["few"]["overrides"] == {"dfc_steps": 5, "dfc_negatives": "hard"}
    assert set(results["arms"]["few"]["per_client"]) == {"0", "1"} and results["public_faces"]["judge"] == 20
    # no fit leaves the identity transform: the personalised model scores as the starting one, device by device,
    # and its door (calibrated on the same faces, with the same capture shift) decides as the starting model's
    for k, row in results["start"]["per_client"].items():
        assert results["arms"]["none"]["per_client"][k]["auc"] == pytest.approx(row["auc"], abs=1e-6)
    assert set(results["start"]["doors"]) == {"0", "1"}
    for k, gate in results["start"]["doors"].items():
        same = results["arms"]["none"]["doors"][k]
        assert same["threshold"] == pytest.approx(gate["threshold"], abs=1e-4) and same["far"] == gate["far"]
        assert 0 <= gate["tar"] <= 1 and gate["far_promised"] == 1e-3 and gate["capture_shift"] >= 0
    assert "| few | dfc_steps=5, dfc_negatives=hard |" in (out / "tiny.md").read_text()
    # the door each device would verify with: an unfitted branch ties the starting model, and a tie keeps it
    rows = {row["arm"]: row for row in table_of(results)}
    assert rows["none"]["personalised chosen"] == "0 of 2" and rows["none"]["devices +10 points"].startswith("0 of")
    assert rows["none"]["chosen door TAR"] == rows["start"]["door TAR"]
    assert rows["none"]["chosen door FAR"] == rows["start"]["door FAR"]


def test_the_personalisation_bench_embeds_as_the_device_model_does():
    """`Fits` applies the branch to the backbone's embedding made once; it must give what the fitted model itself
    gives, at every vote weight an arm may set."""
    import numpy as np

    from bench.honest_round import BASE
    from bench.personalisation import Fits
    from edge_client.local_training import personalised_global
    from fleet.evaluation import embed
    from models.faces.crops import CropReport, FaceCrops
    from models.networks.face_model import initial_global_state
    from protocol.messages import TrainingConfig

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (12, 112, 112, 3), dtype=np.uint8)
    crops = FaceCrops(images, np.repeat(np.arange(3), 4), ["a", "b", "c"], [""] * 12, CropReport())
    fits = Fits(initial_global_state())
    model = personalised_global(fits.state, crops, TrainingConfig(**{**BASE, "dfc_steps": 20}), 0)
    for weight in (0.0, 0.3, 1.0):
        model.dfc.posterior_weight = weight
        want = embed(model, images, True)
        got = fits.personalised(model.dfc, {"posterior_weight": weight})(images)
        assert got.shape == want.shape and np.allclose(got, want, atol=1e-5)
    assert np.allclose(fits.generic(images.copy()), embed(model, images), atol=1e-5)
    assert len(fits._generic) == 12, "each face is embedded once, whichever array it comes in"
    assert np.allclose(fits.generic(images[[3, 0]]), embed(model, images[[3, 0]]), atol=1e-5)
    assert len(fits._generic) == 12


def test_arms_that_change_only_the_vote_share_one_fit(tmp_path, monkeypatch):
    """A spy on the real fit (it still runs): three arms, two fit settings, so two fits a device."""
    import bench.personalisation as bench
    from models.faces.synthetic import write_dataset

    calls = []
    real = bench.personalised_global
    monkeypatch.setattr(bench, "personalised_global", lambda *a, **k: calls.append(1) or real(*a, **k))
    faces = write_dataset(tmp_path / "faces", n_identities=10, n_images=12, seed=2)
    public = write_dataset(tmp_path / "public", n_identities=20, n_images=2, seed=3)
    out = tmp_path / "results"
    assert bench.main(["--data", str(faces), "--out", str(out), "--name", "tiny", "--clients", "2",
                       "--partition", "iid", "--strangers", "12", "--gate-identities", "0",
                       "--public-faces", str(public), "--public-limit", "40",
                       "--arm", "v0:dfc_steps=5,posterior_weight=0", "--arm", "v1:dfc_steps=5,posterior_weight=1",
                       "--arm", "more:dfc_steps=6"]) == 0
    assert len(calls) == 2 * 2
    results = json.loads((out / "tiny.json").read_text())
    assert results["arms"]["v1"]["overrides"] == {"dfc_steps": 5, "posterior_weight": 1.0}
    # the vote changes the scores of the same fit: the two arms differ on some device
    assert any(results["arms"]["v0"]["per_client"][k] != results["arms"]["v1"]["per_client"][k]
               for k in results["arms"]["v0"]["per_client"])


def test_the_door_bench_calibrates_many_devices_and_tries_strangers_on_each(tmp_path):
    from bench.door_far import main as door_far
    from models.faces.synthetic import write_dataset

    faces = write_dataset(tmp_path / "faces", n_identities=12, n_images=8, seed=4)
    public = write_dataset(tmp_path / "public", n_identities=30, n_images=2, seed=5)
    out = tmp_path / "results"
    assert door_far(["--data", str(faces), "--public-faces", str(public), "--out", str(out), "--name", "tiny",
                     "--people", "3", "--devices", "4", "--strangers", "5", "--public", "40", "--far", "0.01"]) == 0
    results = json.loads((out / "tiny.json").read_text())
    size = results["sizes"]["3"]
    assert size["summary"]["devices"] == len(size["devices"]) == 4
    for door in size["devices"]:
        # 5 strangers x 8 photos x 3 templates scored: the FAR is a count of those, the TAR one of held-out photos
        assert door["false_accepts"] == round(door["far"] * 5 * 8 * 3)
        assert 0 <= door["tar"] <= 1 and door["capture_shift"] >= 0
    assert size["summary"]["far_worst"] == max(d["far"] for d in size["devices"])
    assert "| 3 | 4 |" in (out / "tiny.md").read_text()
    # an oracle door on the 4 people in no role, and each door's interval over its 5 strangers
    assert all(0 <= d["far_oracle"] <= 1 and d["far_interval"][0] <= d["far"] <= d["far_interval"][1]
               for d in size["devices"])
    assert 0 <= size["summary"]["share_beyond_2x"] <= size["summary"]["share_over_2x"]
    # served people of the set as the public set, as `ffr fleet simulate` does
    assert door_far(["--data", str(faces), "--public-faces", str(public), "--out", str(out), "--name", "people",
                     "--people", "3", "--devices", "2", "--strangers", "5", "--public-people", "2"]) == 0
    assert "2 people of the set" in (out / "people.md").read_text()


def test_the_door_summary_counts_the_devices_over_twice_the_promise():
    from bench.door_far import summary

    rows = [{"far": f, "tar": 0.9, "threshold": 0.5, "capture_shift": 0.0, "top_stranger_share": s}
            for f, s in ((0.0, 0.0), (0.001, 0.5), (0.0021, 1.0), (0.004, 0.5))]
    got = summary(rows, 1e-3)
    assert got["share_over_2x"] == 0.5 and got["over_2x_top_stranger_share"] == 0.75
    assert got["far_mean"] == pytest.approx(0.001775) and got["far_worst"] == 0.004
