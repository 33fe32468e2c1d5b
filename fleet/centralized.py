"""The upper bound: one model trained centrally on the union of the clients' training images.

Same model, head, augmentation, batch size and learning rate as the devices, and the same
budget in epochs (rounds x local epochs x client fraction), so the gap to federated training
is the price of keeping the faces on the devices.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from fleet.config import SimConfig
from fleet.data import TRAIN, VAL, FleetData
from models.faces.splits import TrainingSplit, relabel
from models.networks.face_model import FaceModel, ModelConfig, load_checkpoint
from models.training.supervised import TrainConfig, Trainer
from protocol.training_parts import TrainerSettings


def budget_epochs(config: SimConfig) -> int:
    return max(1, math.ceil(config.server.rounds * config.training.optimisation.epochs * config.server.fraction))


def centralized_split(data: FleetData) -> TrainingSplit:
    train_all, val_all = data.union(TRAIN, data.training_clients), data.union(VAL, data.training_clients)
    keep = np.unique(train_all.labels)
    val = relabel(val_all, keep) if len(val_all) else relabel(train_all, keep).select(np.zeros(0, np.int64))
    return TrainingSplit(relabel(train_all, keep), val, data.holdout())


def train_centralized(data: FleetData, config: SimConfig, out_dir: Path) -> tuple[FaceModel, dict]:
    """Train (or resume, or reuse a finished run in `out_dir`) and return the best model and its metrics."""
    epochs = budget_epochs(config)
    local = config.training.optimisation
    train_config = TrainConfig(optimisation=TrainerSettings(epochs=epochs, batch_size=local.batch_size, lr=local.lr),
                               model=ModelConfig(width_mult=config.training.model.width_mult, init=config.init),
                               patience=epochs + 1, aug="weak", seed=config.seed,
                               max_eval_pairs=config.max_eval_pairs,
                               anchor_weight=0.0)  # the devices' objective (no anchor), so only federation differs
    trainer = Trainer(train_config, centralized_split(data), out_dir, progress=config.progress)
    if (out_dir / "latest.pt").exists():
        trainer.resume()
    metrics = trainer.fit()
    model, _ = load_checkpoint(out_dir / "best.pt")
    return model, metrics
