"""Norms of model state dicts (numpy), shared by the device (DP clipping) and the coordinator (robust bounds).

Only floating tensors count: integer buffers such as BatchNorm counters are not parameters.
"""
from __future__ import annotations

import numpy as np

from protocol.codecs import Decoded

State = dict[str, np.ndarray]


def float_names(state: State) -> list[str]:
    return [k for k, v in state.items() if np.issubdtype(np.asarray(v).dtype, np.floating)]


def l2_norm(state: State) -> float:
    """sqrt of the sum of squares of the floating tensors; each tensor's dot product in its own precision
    (BLAS, blocked accumulation), the total in float64. A decoded update's floats lie in one vector: one dot."""
    if isinstance(state, Decoded):
        return float(np.sqrt(float(np.vdot(state.flat, state.flat))))
    total = 0.0
    for name in float_names(state):
        flat = np.ravel(state[name])
        total += float(np.vdot(flat, flat))
    return float(np.sqrt(total))


def clip_scale(norm: float, bound: float) -> float:
    """The factor that brings a delta of L2 norm `norm` down to `bound` (1 when it is within it)."""
    return 1.0 if norm <= bound or norm == 0.0 else bound / norm


def clip_to_norm(delta: State, bound: float) -> tuple[State, float]:
    """The delta scaled down to norm `bound` when longer, and its original norm."""
    norm = l2_norm(delta)
    scale = clip_scale(norm, bound)
    if scale == 1.0:
        return delta, norm
    floats = set(float_names(delta))
    return {k: (v * scale if k in floats else v) for k, v in delta.items()}, norm


RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


def without_running_stats(delta: State) -> State:
    """The delta with BatchNorm's running statistics zeroed: under DP they are not shared (they are computed
    from the device's data, and noise on a variance can make it negative), so the global ones stay."""
    return {k: (np.zeros_like(v) if k.endswith(RUNNING_STATS) else v) for k, v in delta.items()}
