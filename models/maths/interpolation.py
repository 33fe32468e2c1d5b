"""A point on the line between two sets of weights, chosen by a score: WiSE-FT's step, torch-free.

WiSE-FT (Wortsman et al., "Robust fine-tuning of zero-shot models", CVPR 2022, eq. 1):

    theta_alpha = (1 - alpha) * theta_start + alpha * theta_tuned

`ffr train` ends with it (from the start to the fine-tuned backbone, `models.training.interpolation`), and the
coordinator takes each round's step with it (from the current model to the round's aggregate,
`coordinator.server_step`).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np


def choose_alpha(score: Callable[[float], float | None], alphas: tuple[float, ...]) -> tuple[float, dict[float, float]]:
    """(the alpha with the highest score, every alpha's score); ties go to the smaller move.

    Returns alpha 1.0 (the far end, as without this step) when no alpha could be scored."""
    scores = {a: s for a in alphas if (s := score(a)) is not None}
    if not scores:
        return 1.0, {}
    best = max(scores.values())
    return min(a for a, s in scores.items() if s == best), scores


def interpolate_arrays(start: dict[str, np.ndarray], end: dict[str, np.ndarray], alpha: float) -> dict[str, np.ndarray]:
    """Eq. 1 on every floating-point array (BatchNorm's running statistics included); counters from `end`."""
    if start.keys() != end.keys():
        raise ValueError("the two states hold different tensors: they are not the same network")
    return {k: ((1.0 - alpha) * start[k].astype(np.float64) + alpha * end[k]).astype(end[k].dtype)
            if end[k].dtype.kind == "f" else end[k].copy() for k in end}
