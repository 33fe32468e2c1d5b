"""FedFace's Federated Validation (Liu et al., ../shared/papers/004, Algorithm 2), as pure functions and one
small class holding the aggregation weighting between rounds.

Each round, once its updates are in, the coordinator builds T candidate global models from the devices'
local backbones under T weightings (the first the current one, the others drawn uniformly from the
simplex), validators score each candidate on their private images and send back only the score, the
scores are normalised per validator (Local Norm, eq. 8), and the best candidate's weighting is blended
into the current one with rate phi (eq. 12-13) when it beats the current one by more than epsilon.

What a score reveals: one number in [0, 1] per candidate, the validator's verification AUC on its own
images. Over many rounds the scores say which devices' updates help that validator's people, i.e.
a coarse similarity between the validator's data and those devices' data; no image, embedding or
gradient leaves a validator.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def candidate_weightings(current: np.ndarray, count: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Algorithm 2, line 4: the current weighting first, then uniform draws from the simplex."""
    return [current] + [rng.dirichlet(np.ones(len(current))) for _ in range(count - 1)]


def local_norm(scores: np.ndarray, epsilon: float) -> np.ndarray:
    """Eq. 8: each validator's scores (a row over candidates) divided by sqrt(their variance + epsilon)."""
    return scores / np.sqrt(scores.var(axis=1, keepdims=True) + epsilon)


def choose(scores: np.ndarray, epsilon: float) -> int:
    """Eq. 12 over the validators that scored every candidate: the best candidate, or 0 (the current weighting)
    unless the best beats it by more than epsilon."""
    totals = local_norm(scores, epsilon).sum(axis=0)
    best = int(np.argmax(totals))
    return best if totals[best] > totals[0] + epsilon else 0


@dataclass
class FederatedValidation:
    """The weighting between rounds: a factor per device on top of its FedAvg weight (devices are sampled,
    so the weighting is kept per device and renormalised over each round's participants)."""

    candidates: int = 3     # T
    phi: float = 0.01       # smoothing rate of eq. 13
    epsilon: float = 1e-3   # eq. 8, and the margin a candidate must win by
    seed: int = 0
    factors: dict[str, float] = field(default_factory=dict)

    def current(self, devices: list[str], base: np.ndarray) -> np.ndarray:
        w = base * np.array([self.factors.get(d, 1.0) for d in devices])
        return w / w.sum()

    def draw(self, current: np.ndarray, round_id: int) -> list[np.ndarray]:
        return candidate_weightings(current, self.candidates, np.random.default_rng([self.seed, round_id]))

    def adopt(self, devices: list[str], base: np.ndarray, current: np.ndarray, chosen: np.ndarray) -> np.ndarray:
        """Eq. 13, and the per-device factors that reproduce the new weighting from the FedAvg weights."""
        new = (1.0 - self.phi) * current + self.phi * chosen
        plain = base / base.sum()
        for device, w, p in zip(devices, new, plain):
            self.factors[device] = float(w / p)
        return new
