"""How far a fine-tuned embedder moves from where it started: weight-space interpolation, chosen on unseen people.

WiSE-FT (Wortsman et al., "Robust fine-tuning of zero-shot models", CVPR 2022, eq. 1):

    theta_alpha = (1 - alpha) * theta_start + alpha * theta_tuned

Fine-tuning on a few people teaches the model their faces but can cost it everyone else's; a point on the
line between the two sets of weights is often better on new people than either end. alpha = 0 (the start)
is always a candidate, so the chosen weights are never worse than the start on the people they are chosen on.
"""
from __future__ import annotations

import torch

from models.maths.interpolation import choose_alpha as choose_between

ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)


def interpolate(start: dict[str, torch.Tensor], tuned: dict[str, torch.Tensor], alpha: float
                ) -> dict[str, torch.Tensor]:
    """Eq. 1 on every floating-point tensor (BatchNorm's running statistics included); counters from `tuned`."""
    if start.keys() != tuned.keys():
        raise ValueError("the two states hold different tensors: they are not the same network")
    return {k: torch.lerp(start[k].float(), tuned[k].float(), alpha).to(tuned[k].dtype)
            if tuned[k].is_floating_point() else tuned[k].clone() for k in tuned}


def choose_alpha(score, alphas: tuple[float, ...] = ALPHAS) -> tuple[float, dict[float, float]]:
    """`models.maths.interpolation.choose_alpha` over `ffr train`'s alphas, the start (0) among them."""
    return choose_between(score, alphas)
