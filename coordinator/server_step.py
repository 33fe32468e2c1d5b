"""The server's step: how far the published model moves from the current one towards the round's aggregate.

WiSE-FT's interpolation (Wortsman et al., CVPR 2022, eq. 1) taken once per round,

    theta_next = (1 - alpha) * theta_current + alpha * theta_aggregate,

with alpha chosen among STEPS by the AUC of each point on the faces the coordinator holds (the quality gate's:
faces no device trains on), among the points the gate passes; ties go to the smaller move. Honest devices that
each hold a few people pull the aggregate towards those people; measured on held faces, part of the way is often
better than all of it, and the whole way can overshoot the gate's bar where a quarter of it does not
(`bench.honest_round`). The current model itself (alpha 0) is not a candidate: refusing a round is the gate's,
with its reason. A coordinator with no faces (no gate) cannot choose: it takes FIXED_STEP (`--server-step`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from models.maths.interpolation import choose_alpha, interpolate_arrays

State = dict[str, np.ndarray]
STEPS = (0.25, 0.5, 1.0)
# without faces to choose on (no gate): the step that held faces chose in 3 of 4 honest CelebA rounds
# (bench/results/federation_value_iid.md), and the one that kept a two-device `serve` run from degrading
FIXED_STEP = 0.25


def fixed_step(current: State, aggregate: State, alpha: float) -> tuple[State, dict]:
    """(eq. 1 at `alpha`, the figure for the round's record): the coordinator's step when it holds no faces."""
    stepped = aggregate if alpha == 1.0 else interpolate_arrays(current, aggregate, alpha)
    return stepped, {"server_step": alpha}


@dataclass(frozen=True)
class Judged:
    """One point's figures on the held faces: its AUC and '' or why it may not be published."""

    auc: float
    problem: str
    metrics: dict


def best_step(current: State, aggregate: State, judge: Callable[[State], Judged],
              steps: tuple[float, ...] = STEPS) -> tuple[State | None, str, dict]:
    """(the passing point of `steps` whose AUC is highest, or None; '' or why no point passes; the figures for the
    round's record: the chosen step, every step's AUC, the chosen (else the whole) step's verdict figures)."""
    points = {alpha: interpolate_arrays(current, aggregate, alpha) if alpha != 1.0 else aggregate for alpha in steps}
    judged = {alpha: judge(points[alpha]) for alpha in steps}
    passing = {a: j.auc for a, j in judged.items() if not j.problem and np.isfinite(j.auc)}
    aucs = {f"server_step_auc@{a:g}": j.auc for a, j in judged.items()}
    if not passing:
        whole = judged[max(steps)]
        return None, whole.problem, {**whole.metrics, **aucs, "server_step": 0.0}
    alpha, _ = choose_alpha(passing.get, tuple(passing))
    return points[alpha], "", {**judged[alpha].metrics, **aucs, "server_step": alpha}
