"""Deterministic splits of cropped faces: held-out identities, and train/val images per identity."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from models.faces.crops import FaceCrops


@dataclass
class TrainingSplit:
    train: FaceCrops      # labels 0..K-1 over the training identities
    val: FaceCrops        # images of the same identities, never trained on
    holdout: FaceCrops | None  # identities never seen in training: verification on new people
    select: FaceCrops | None = None  # other unseen identities, on which a fine-tuned run picks how far to move

    @property
    def n_classes(self) -> int:
        return len(self.train.identities)


def relabel(crops: FaceCrops, keep_ids: np.ndarray) -> FaceCrops:
    mask = np.isin(crops.labels, keep_ids)
    out = crops.select(mask)
    mapping = {old: new for new, old in enumerate(keep_ids)}
    out.labels = np.array([mapping[label] for label in out.labels], dtype=np.int64)
    out.identities = [crops.identities[i] for i in keep_ids]
    return out


def split_identities(n_identities: int, holdout_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training ids, held-out ids); held-out only when it leaves >= 2 on each side."""
    ids = np.random.default_rng(seed).permutation(n_identities)
    n_hold = int(round(n_identities * holdout_fraction))
    if n_hold < 2 or n_identities - n_hold < 2:
        return np.sort(ids), np.array([], dtype=np.int64)
    return np.sort(ids[n_hold:]), np.sort(ids[:n_hold])


def stratified_split(labels: np.ndarray, fractions: tuple[float, float, float] = (0.7, 0.1, 0.2),
                     seed: int = 0) -> np.ndarray:
    """0/1/2 (train/val/test) per image, stratified by identity; train keeps at least one image."""
    rng = np.random.default_rng(seed)
    out = np.zeros(len(labels), dtype=np.int8)
    for label in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == label))
        n_test = min(int(round(len(idx) * fractions[2])), len(idx) - 1)
        n_val = min(int(round(len(idx) * fractions[1])), len(idx) - 1 - n_test)
        out[idx[:n_test]] = 2
        out[idx[n_test:n_test + n_val]] = 1
    return out


def split_images(labels: np.ndarray, val_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of validation images: about `val_fraction` of each identity, never its last image."""
    return stratified_split(labels, (1.0 - val_fraction, val_fraction, 0.0), seed + 1) == 1


def training_split(crops: FaceCrops, holdout_fraction: float = 0.2, val_fraction: float = 0.1,
                   seed: int = 0, select_fraction: float = 0.0) -> TrainingSplit:
    """Held-out people, then (with `select_fraction`) selection people taken from the rest, then train/val images.

    The selection people come out of the training people, never the held-out ones, so the held-out set (and so
    every figure measured on it) is the same whatever `select_fraction` is; none when fewer than 2 would be left
    on either side."""
    train_ids, hold_ids = split_identities(len(crops.identities), holdout_fraction, seed)
    select_ids = np.array([], dtype=np.int64)
    if select_fraction > 0:
        keep, chosen = split_identities(len(train_ids), select_fraction, seed + 1)
        train_ids, select_ids = train_ids[keep], train_ids[chosen]
    trainable = relabel(crops, train_ids)
    val_mask = split_images(trainable.labels, val_fraction, seed)
    holdout = relabel(crops, hold_ids) if len(hold_ids) else None
    select = relabel(crops, select_ids) if len(select_ids) else None
    return TrainingSplit(_select(trainable, ~val_mask), _select(trainable, val_mask), holdout, select)


def _select(crops: FaceCrops, mask: np.ndarray) -> FaceCrops:
    out = crops.select(mask)
    out.identities = crops.identities
    return out
