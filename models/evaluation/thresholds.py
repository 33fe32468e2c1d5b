"""Operating points from impostor scores, with numpy only (devices calibrate without scikit-learn)."""
from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np


def threshold_at_far(impostor_scores: np.ndarray, far: float) -> tuple[float, bool]:
    """The score a match must exceed for a false-accept rate of at most `far`, and whether
    there were enough impostor scores (at least 1/far) to measure that rate. When there were
    not, the threshold is the highest impostor score: no impostor seen would be accepted."""
    impostor = np.sort(np.asarray(impostor_scores, dtype=np.float64))[::-1]
    if len(impostor) == 0:
        raise ValueError("need impostor scores to set a threshold")
    measurable = len(impostor) >= math.ceil(1.0 / far)
    allowed = int(math.floor(far * len(impostor))) if measurable else 0  # impostors allowed above the threshold
    return float(impostor[min(allowed, len(impostor) - 1)]), measurable


def gaussian_tail(scores: np.ndarray, far: float) -> float:
    """The score a normal fitted to `scores` exceeds with probability `far`: an estimate of the threshold for
    impostors not yet seen, when too few scores exist to count a rate of `far` among them."""
    return float(np.mean(scores) + NormalDist().inv_cdf(1.0 - far) * np.std(scores, ddof=1))
