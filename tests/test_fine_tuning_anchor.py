"""`ffr train`'s anchor to the starting embedder: on by default from the face weights, and it holds the model back."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from ffr.cli import build_parser
from models.evaluation.evaluate import embed_all
from models.faces.crops import CropConfig, crop_index
from models.faces.datasets import load_index
from models.faces.splits import training_split
from models.networks.embedders import TorchEmbedder
from models.networks.face_model import ModelConfig
from models.training.supervised import FACE_ANCHOR_WEIGHT, TrainConfig, Trainer
from protocol.training_parts import TrainerSettings


def test_the_anchor_is_on_from_the_face_weights_and_off_otherwise():
    assert TrainConfig(model=ModelConfig(init="face")).anchor_weight == FACE_ANCHOR_WEIGHT > 0
    assert TrainConfig(model=ModelConfig(init="imagenet")).anchor_weight == 0.0
    assert TrainConfig(model=ModelConfig(init="none")).anchor_weight == 0.0
    assert TrainConfig(model=ModelConfig(init="imagenet"), anchor_weight=3.0).anchor_weight == 3.0
    assert TrainConfig(model=ModelConfig(init="face"), anchor_weight=0.0).anchor_weight == 0.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="anchor_weight"):
            TrainConfig(anchor_weight=bad)
    assert build_parser().parse_args(["train", "--data", "d", "--out", "o"]).anchor_weight is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--data", "d", "--out", "o", "--anchor-weight", "-2"])


@pytest.fixture(scope="module")
def split(synthetic_dir):
    crops = crop_index(load_index(synthetic_dir), CropConfig(detector="none"), use_cache=False, progress=False)
    return training_split(crops, holdout_fraction=0.3, val_fraction=0.1, seed=0)


def _trainer(split, out, anchor: float) -> Trainer:
    torch.manual_seed(0)
    config = TrainConfig(optimisation=TrainerSettings(epochs=2, batch_size=16, lr=3e-3),
                         model=ModelConfig(init="none", width_mult=0.35), anchor_weight=anchor)
    return Trainer(config, split, out, progress=False)


def _embed(backbone, images) -> np.ndarray:
    return embed_all(TorchEmbedder(copy.deepcopy(backbone)), images)


def test_the_anchor_keeps_the_embedding_near_where_training_started(split, tmp_path):
    images = np.concatenate([split.train.images, split.holdout.images])
    agreement = {}
    for anchor in (0.0, 50.0):
        trainer = _trainer(split, tmp_path / f"anchor-{anchor}", anchor)
        start = _embed(trainer.model.backbone, images)
        metrics = trainer.fit()
        assert metrics["config"]["anchor_weight"] == anchor
        end = _embed(trainer.model.backbone, images)
        agreement[anchor] = float(np.mean(np.sum(start * end, axis=1)))
    # both moved, but the anchored run stayed much closer to the model it started from, on new people too
    assert agreement[0.0] < 0.9 and agreement[50.0] > agreement[0.0] + 0.05, agreement


def test_a_resumed_run_anchors_to_the_start_not_to_the_checkpoint(split, tmp_path):
    first = _trainer(split, tmp_path / "run", 5.0)
    start = copy.deepcopy(first.start_net.state_dict())
    first.fit()
    again = _trainer(split, tmp_path / "run", 5.0)
    again.resume()
    resumed = again.start_net.state_dict()
    assert all(torch.equal(resumed[k], start[k]) for k in start)
    trained = again.model.backbone.state_dict()
    assert any(not torch.equal(trained[k], start[k]) for k in start if start[k].is_floating_point())
