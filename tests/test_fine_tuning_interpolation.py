"""`ffr train`'s last step from a trained start: WiSE-FT's alpha chosen on people kept out of training."""
from __future__ import annotations

import pytest
import torch

from ffr.cli import build_parser, main
from models.evaluation.evaluate import verification
from models.faces.crops import CropConfig, crop_index
from models.faces.datasets import load_index
from models.faces.splits import training_split
from models.networks.face_model import ModelConfig, load_checkpoint, new_embedder
from models.training.interpolation import choose_alpha, interpolate
from models.training.supervised import TrainConfig, Trainer
from protocol.training_parts import TrainerSettings


def test_interpolate_is_eq_1_on_floats_and_keeps_counters():
    start = {"w": torch.zeros(3), "n": torch.tensor(1)}
    tuned = {"w": torch.full((3,), 4.0), "n": torch.tensor(7)}
    assert torch.equal(interpolate(start, tuned, 0.0)["w"], start["w"])
    assert torch.equal(interpolate(start, tuned, 1.0)["w"], tuned["w"])
    half = interpolate(start, tuned, 0.25)
    assert torch.allclose(half["w"], torch.ones(3)) and half["n"].item() == 7
    with pytest.raises(ValueError, match="not the same network"):
        interpolate(start, {"w": tuned["w"]}, 0.5)


def test_choose_alpha_takes_the_best_ties_to_the_smaller_move_and_skips_the_unmeasured():
    assert choose_alpha({0.0: 0.9, 0.5: 0.95, 1.0: 0.95}.get, (0.0, 0.5, 1.0)) == (0.5, {0.0: 0.9, 0.5: 0.95,
                                                                                        1.0: 0.95})
    assert choose_alpha({0.0: 0.9, 1.0: None}.get, (0.0, 1.0))[0] == 0.0
    assert choose_alpha(lambda a: None) == (1.0, {})


@pytest.fixture(scope="module")
def crops(synthetic_dir):
    return crop_index(load_index(synthetic_dir), CropConfig(detector="none"), use_cache=False, progress=False)


def test_selection_people_come_from_the_training_people_and_leave_the_held_out_alone(crops):
    plain = training_split(crops, holdout_fraction=0.3, val_fraction=0.1, seed=0)
    split = training_split(crops, holdout_fraction=0.3, val_fraction=0.1, seed=0, select_fraction=0.3)
    assert plain.select is None
    assert split.holdout.identities == plain.holdout.identities and len(split.holdout) == len(plain.holdout)
    select, train = set(split.select.identities), set(split.train.identities)
    assert len(select) == 2 and not select & train and not select & set(split.holdout.identities)
    assert select | train == set(plain.train.identities)
    assert training_split(crops, 0.3, 0.1, 0, select_fraction=0.1).select is None  # 1 person: too few to score


def test_a_fine_tune_that_hurts_ends_no_worse_than_its_start_on_the_selection_people(crops, tmp_path):
    split = training_split(crops, holdout_fraction=0.3, val_fraction=0.1, seed=0, select_fraction=0.3)
    torch.manual_seed(0)
    # a learning rate far too high for fine-tuning, without the anchor: the tuned weights are worse than the start
    config = TrainConfig(optimisation=TrainerSettings(epochs=2, batch_size=16, lr=5e-2), model=ModelConfig(init="face"),
                         anchor_weight=0.0)
    metrics = Trainer(config, split, tmp_path / "run", progress=False).fit()
    moved = metrics["interpolation"]
    scores = {float(a): s for a, s in moved["select_auc"].items()}
    assert moved["select_identities"] == 2 and set(scores) == {0.0, 0.25, 0.5, 0.75, 1.0}
    assert scores[1.0] < scores[0.0], "the test needs a fine-tune that hurts"
    assert moved["alpha"] < 1.0 and scores[moved["alpha"]] == max(scores.values())
    best, payload = load_checkpoint(tmp_path / "run" / "best.pt")
    assert payload["interpolation"] == moved
    start_auc = verification(new_embedder("face").eval(), split.select, 100_000, 0)[0]["auc"]
    assert verification(best, split.select, 100_000, 0)[0]["auc"] >= start_auc - 1e-9
    # a second finish (a finished run resumed) keeps best.pt as chosen instead of moving again
    again = Trainer(config, split, tmp_path / "run", progress=False)
    again.resume()
    assert again.fit()["interpolation"] == moved
    # ... and refuses a record it cannot have written (best.pt is read back: a damaged one must not pass)
    payload["interpolation"] = {"alpha": 7.0}
    torch.save(payload, tmp_path / "run" / "best.pt")
    damaged = Trainer(config, split, tmp_path / "run", progress=False)
    damaged.resume()
    with pytest.raises(ValueError, match="interpolation record is damaged"):
        damaged.fit()


def test_ffr_train_keeps_selection_people_by_default_from_a_trained_start_only(tmp_path, synthetic_dir, capsys):
    parse = build_parser().parse_args
    assert parse(["train", "--data", "d", "--out", "o"]).select_identities is None
    for bad in ("1", "-0.1", "nan"):
        with pytest.raises(SystemExit):
            parse(["train", "--data", "d", "--out", "o", "--select-identities", bad])
    import json

    for init, expected in (("none", 0), ("face", 2)):  # the default, 0.2 of 10 training people from the face start
        out = tmp_path / init
        assert main(["-q", "train", "--data", str(synthetic_dir), "--out", str(out), "--epochs", "1", "--init", init,
                     "--holdout-identities", "0", "--no-mlflow", "--batch-size", "16"]) == 0
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["data"]["select_identities"] == expected
        assert (metrics["interpolation"] is None) == (init == "none")
        printed = json.loads(capsys.readouterr().out)  # the summary says how far the run moved from its start
        assert printed["moved_from_start"] == (None if init == "none" else metrics["interpolation"]["alpha"])
