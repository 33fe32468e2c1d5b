"""The server's step: how far the published model moves from the current one towards the round's aggregate.

WiSE-FT's interpolation (Wortsman et al., CVPR 2022, eq. 1) taken once per round,

    theta_next = (1 - alpha) * theta_current + alpha * theta_aggregate,

with alpha chosen among STEPS by the AUC of each point on the faces the coordinator holds (the quality gate's:
faces no device trains on); ties go to the smaller move. Honest devices that each hold a few people pull the
aggregate towards those people; measured on held faces, part of the way is often better than all of it
(`bench.honest_round`). The step is taken after the quality gate passed the whole way (so a poisoner is left
out on the full step, `coordinator.round_aggregation.leave_out`, not let in diluted), and the chosen point is judged
again. The current model itself (alpha 0) is not a candidate: refusing a round is the gate's, with its reason.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from models.maths.interpolation import choose_alpha, interpolate_arrays

State = dict[str, np.ndarray]
STEPS = (0.25, 0.5, 1.0)


def best_step(current: State, aggregate: State, auc_of: Callable[[State], float],
              steps: tuple[float, ...] = STEPS) -> tuple[State, dict]:
    """(the point of `steps` whose `auc_of` is highest, the figures for the round's record)."""
    points = {alpha: interpolate_arrays(current, aggregate, alpha) if alpha != 1.0 else aggregate for alpha in steps}
    alpha, scores = choose_alpha(lambda a: _finite(auc_of(points[a])), steps)
    return points[alpha], {"server_step": alpha, **{f"server_step_auc@{a:g}": s for a, s in scores.items()}}


def _finite(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None
