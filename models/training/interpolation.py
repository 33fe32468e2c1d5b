"""How far a fine-tuned embedder moves from where it started: weight-space interpolation, chosen on unseen people.

WiSE-FT (Wortsman et al., "Robust fine-tuning of zero-shot models", CVPR 2022, eq. 1):

    theta_alpha = (1 - alpha) * theta_start + alpha * theta_tuned

Fine-tuning on a few people teaches the model their faces but can cost it everyone else's; a point on the
line between the two sets of weights is often better on new people than either end. alpha = 0 (the start)
is always a candidate, so the chosen weights are never worse than the start on the people they are chosen on.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)


def interpolate(start: dict[str, torch.Tensor], tuned: dict[str, torch.Tensor], alpha: float
                ) -> dict[str, torch.Tensor]:
    """Eq. 1 on every floating-point tensor (BatchNorm's running statistics included); counters from `tuned`."""
    if start.keys() != tuned.keys():
        raise ValueError("the two states hold different tensors: they are not the same network")
    return {k: torch.lerp(start[k].float(), tuned[k].float(), alpha).to(tuned[k].dtype)
            if tuned[k].is_floating_point() else tuned[k].clone() for k in tuned}


def choose_alpha(score: Callable[[float], float | None], alphas: tuple[float, ...] = ALPHAS
                 ) -> tuple[float, dict[float, float]]:
    """(the alpha with the highest score, every alpha's score); ties go to the smaller move.

    Returns alpha 1.0 (the tuned weights, as without this step) when no alpha could be scored."""
    scores = {a: s for a in alphas if (s := score(a)) is not None}
    if not scores:
        return 1.0, {}
    best = max(scores.values())
    return min(a for a, s in scores.items() if s == best), scores
