"""Byzantine-robust combination of device updates: pure functions over numpy state dicts.

A federation cannot trust each update, so before a strategy applies the round's delta:
- every update's L2 norm is bounded (`clip_to_norm`), the bound adapted from recent honest
  rounds (`NormBound`), so one device cannot scale its update up;
- the deltas are combined by a rule chosen per run:
  * `mean`: the sample-weighted mean (FedAvg, McMahan et al., AISTATS 2017);
  * `trimmed-mean`: per coordinate, drop the `beta` largest and smallest values, average the rest
    (Yin et al., "Byzantine-Robust Distributed Learning", ICML 2018, eq. (2));
  * `median`: per coordinate median (Yin et al. 2018, eq. (1));
  * `krum`: Multi-Krum (Blanchard et al., NeurIPS 2017): score each update by the summed squared
    distance to its n - f - 2 nearest neighbours, average the m best-scored ones.
Robust rules weigh every device alike (a self-reported sample count is what an attacker lies about).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from models.maths.state_norms import State, clip_to_norm, float_names, l2_norm  # noqa: F401 - re-exported

COMBINERS = ("mean", "trimmed-mean", "median", "krum")


@dataclass
class NormBound:
    """The largest update norm accepted: `factor` x the median of recent accepted norms,
    never above `ceiling` (an absolute bound from the model's own norm, used until there is history)."""

    ceiling: float
    factor: float = 3.0
    window: int = 50
    history: list[float] = field(default_factory=list)

    @property
    def bound(self) -> float:
        if len(self.history) < 3:
            return self.ceiling
        return min(self.ceiling, self.factor * float(np.median(self.history[-self.window:])))

    def record(self, norms: list[float]) -> None:
        self.history.extend(norms)
        del self.history[:-self.window]


def combine(deltas: list[State], weights: list[float], rule: str = "mean", trim: float = 0.2,
            byzantine: int | None = None) -> State:
    """The round's delta from device deltas by `rule`; integer buffers take the plain mean."""
    if not deltas:
        raise ValueError("no updates to combine")
    if rule not in COMBINERS:
        raise ValueError(f"unknown combination rule {rule!r}; choose one of {', '.join(COMBINERS)}")
    names = list(deltas[0])
    floats = set(float_names(deltas[0]))
    if rule == "krum":
        chosen = multi_krum_indices(deltas, byzantine if byzantine is not None else max(0, (len(deltas) - 3) // 2))
        deltas, weights = [deltas[i] for i in chosen], [1.0] * len(chosen)
        rule = "mean"
    out = {}
    for name in names:
        stack = np.stack([np.asarray(d[name], dtype=np.float64) for d in deltas])
        if rule == "mean" or name not in floats:
            w = np.asarray(weights if rule == "mean" else [1.0] * len(deltas), dtype=np.float64)
            out[name] = np.tensordot(w / w.sum(), stack, axes=1)
        elif rule == "median":
            out[name] = np.median(stack, axis=0)
        else:
            out[name] = trimmed_mean(stack, trim)
    return out


def trimmed_mean(stack: np.ndarray, trim: float) -> np.ndarray:
    """Per coordinate along axis 0: drop floor(trim * n) values at each end, average the rest."""
    n = stack.shape[0]
    k = min(int(np.floor(trim * n)), (n - 1) // 2)
    if k == 0:
        return stack.mean(axis=0)
    ordered = np.sort(stack, axis=0)
    return ordered[k:n - k].mean(axis=0)


def multi_krum_indices(deltas: list[State], byzantine: int, keep: int | None = None) -> list[int]:
    """Indices of the `keep` updates (default n - f) with the lowest Krum scores."""
    n = len(deltas)
    flat = np.stack([np.concatenate([np.asarray(d[k], dtype=np.float64).ravel() for k in float_names(d)])
                     for d in deltas])
    squared = np.square(flat).sum(axis=1)
    distances = np.maximum(squared[:, None] + squared[None, :] - 2.0 * flat @ flat.T, 0.0)
    neighbours = max(1, n - byzantine - 2)
    scores = [float(np.sort(np.delete(distances[i], i))[:neighbours].sum()) if n > 1 else 0.0 for i in range(n)]
    keep = keep if keep is not None else max(1, n - byzantine)
    return sorted(np.argsort(scores, kind="stable")[:keep].tolist())
