"""The labelled sets' held-out people, cut as every quality benchmark cuts them (identities 70/30, seed 0).

Photos and loose crops need detection (aligned by default, Haar squares for comparison); aligned sets do not,
nor does ../shared's Extended Yale B, whose images are 24x24 thumbnails (too small to detect a face in).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.metrics import roc_auc_score

from models.evaluation.metrics import make_pairs
from models.faces.crops import CropConfig, crop_index
from models.faces.datasets import load_index
from models.faces.splits import training_split

PHOTO_SETS = ("orl", "celeba_subset")
SETS = ("orl", "extended_yale_b", "glint24_aligned", "celeba_subset")
ALIGNED = CropConfig(detector="auto", fallback_center=True, face_select="center")
HAAR = CropConfig(detector="haar", fallback_center=True, face_select="center")
GIVEN = CropConfig(detector="none")


def held_out(root: Path, config: CropConfig, seed: int, select_fraction: float = 0.0):
    """(crops, split): the held-out 30% of people is the same whatever `select_fraction` takes from the rest."""
    crops = crop_index(load_index(root), config, progress=True, min_images=2)
    return crops, training_split(crops, holdout_fraction=0.3, val_fraction=0.1, seed=seed,
                                 select_fraction=select_fraction)


def crop_kinds(name: str) -> list[tuple[str, CropConfig]]:
    """How a set's faces are cut for measuring: photos aligned by YuNet, then as Haar squares; the rest as given."""
    return [("aligned (YuNet 5-point)", ALIGNED), ("Haar square", HAAR)] if name in PHOTO_SETS else [("given", GIVEN)]


def held_out_pairs(root: Path, config: CropConfig, seed: int, max_pairs: int):
    """(held-out people's crops, pairs, same-person flags): what every quality bench scores a model on."""
    held = held_out(root, config, seed)[1].holdout
    pairs, same = make_pairs(held.labels, max_pairs, seed)
    return held, pairs, same


def d_auc_interval(same: np.ndarray, people: np.ndarray, before: np.ndarray, after: np.ndarray,
                   resamples: int = 500, seed: int = 0) -> tuple[float, float]:
    """95% interval of the candidate's AUC gain, by a paired bootstrap over the held-out people: `people` is the
    (P, 2) person of each pair's two faces, and a resample weighs a pair by how often both its people were drawn.
    People, not pairs, are the unit: a set's pairs share faces, so resampling pairs would understate the noise."""
    ids, inverse = np.unique(people, return_inverse=True)
    inverse = inverse.reshape(people.shape)
    rng, gains = np.random.default_rng(seed), []
    for _ in range(resamples):
        drawn = np.bincount(rng.integers(0, len(ids), len(ids)), minlength=len(ids))
        weight = drawn[inverse[:, 0]] * drawn[inverse[:, 1]]
        keep = weight > 0
        if same[keep].all() or not same[keep].any():
            continue
        gains.append(roc_auc_score(same[keep], after[keep], sample_weight=weight[keep])
                     - roc_auc_score(same[keep], before[keep], sample_weight=weight[keep]))
    low, high = np.percentile(gains, [2.5, 97.5]) if gains else (float("nan"), float("nan"))
    return float(low), float(high)
