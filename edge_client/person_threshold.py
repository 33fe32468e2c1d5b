"""Each enrolled person's own threshold: the device's threshold, raised for a person whom strangers resemble.

One threshold for all of a device's people keeps the promised false-accept rate on average over them, but a person
many faces resemble takes more than their share of the false accepts, and a device of such people breaks its promise.
Scored against one template t, the public faces' scores have mean mu.t and variance t'St (mu, S: the mean and
covariance of their embeddings), so a normal fitted to them gives every template its own tail at the promised FAR
from mu and S alone: kept in the calibration, they serve people enrolled after it too. A person's threshold is the
higher of that tail (moved by the capture shift, as the public scores are) and the device's threshold, so it only
ever refuses more. `python -m bench.door_far` measures it over 200 simulated devices per size.
"""
from __future__ import annotations

from statistics import NormalDist

import numpy as np


def stranger_spread(strangers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mean and covariance (n - 1) of the strangers' embeddings (n x d, n >= 2): all a person's tail needs."""
    strangers = np.asarray(strangers, np.float64)
    return strangers.mean(0), np.atleast_2d(np.cov(strangers, rowvar=False))


def person_thresholds(templates: np.ndarray, mean: np.ndarray, cov: np.ndarray, shift: float, far: float,
                      threshold: float) -> np.ndarray:
    """Each template's threshold (`templates`: one per row, or one template): the normal tail of the strangers' scores
    against it at `far`, moved up by `shift`, and never below the device's `threshold`."""
    templates = np.atleast_2d(np.asarray(templates, np.float64))
    spread = np.sqrt(np.maximum(np.einsum("id,de,ie->i", templates, cov, templates), 0.0))
    tail = templates @ mean + shift + NormalDist().inv_cdf(1.0 - far) * spread
    return np.maximum(threshold, tail)
