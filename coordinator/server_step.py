"""The server's step: how far the published model moves from the current one towards the round's aggregate.

WiSE-FT's interpolation (Wortsman et al., CVPR 2022, eq. 1) taken once per round,

    theta_next = (1 - alpha) * theta_current + alpha * theta_aggregate,

with alpha chosen among STEPS by the AUC of each point on the faces the coordinator holds (the quality gate's:
faces no device trains on), among the points the gate passes; ties go to the smaller move. Honest devices that
each hold a few people pull the aggregate towards those people; measured on held faces, part of the way is often
better than all of it, and the whole way can overshoot the gate's bar where a quarter of it does not
(`bench.honest_round`). The other way round too: the mean of updates that each pull towards different people
cancels much of each, so it moves the model less than any one device would, and a step past the aggregate can be
better still. FedExP (Jhunjhunwala, Wang and Joshi, ICLR 2023) extrapolates the server step for that reason, by
as much as the updates disagree:

    eta = max(1, sum_i p_i ||delta_i||^2 / (2 ||sum_i p_i delta_i||^2)),

which is 1 (no extrapolation) for one update, or for updates that agree. Here eta only bounds the candidates: the
points past the aggregate (alpha > 1, learned weights only: BatchNorm's running statistics go no further than the
aggregate's) up to eta are judged like the others, and only the held faces choose them. The current model itself
(alpha 0) is not a candidate: refusing a round is the gate's, with its reason. A coordinator with no faces (no
gate) cannot choose: it takes FIXED_STEP (`--server-step`), never past the aggregate.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from models.maths.interpolation import choose_alpha, interpolate_arrays

State = dict[str, np.ndarray]
STEPS = (0.25, 0.5, 1.0, 1.5, 2.0)
WHOLE = 1.0  # the aggregate itself: its verdict is the round's when no point passes
STATISTICS = ("running_mean", "running_var")  # BatchNorm's: averages of the data, not weights to extrapolate
# without faces to choose on (no gate): the step that held faces chose in 3 of 4 honest CelebA rounds
# (bench/results/federation_value_iid.md), and the one that kept a two-device `serve` run from degrading
FIXED_STEP = 0.25


def fixed_step(current: State, aggregate: State, alpha: float) -> tuple[State, dict]:
    """(eq. 1 at `alpha`, the figure for the round's record): the coordinator's step when it holds no faces."""
    return point(current, aggregate, alpha), {"server_step": alpha}


@dataclass(frozen=True)
class Judged:
    """One point's figures on the held faces: its AUC and '' or why it may not be published."""

    auc: float
    problem: str
    metrics: dict


def point(current: State, aggregate: State, alpha: float) -> State:
    """Eq. 1 at `alpha`; past the aggregate (alpha > 1) for learned weights only, BatchNorm's statistics taken from
    the aggregate (a variance extrapolated can go negative)."""
    if alpha == WHOLE:
        return aggregate
    stepped = interpolate_arrays(current, aggregate, alpha)
    if alpha > WHOLE:
        stepped.update({k: aggregate[k].copy() for k in aggregate if k.endswith(STATISTICS)})
    return stepped


def extrapolation_limit(norms: Sequence[float], weights: Sequence[float], mean_norm: float) -> float:
    """FedExP's eta (module docstring) from the norms of the updates as they were combined (clipped, scaled), their
    weights and the norm of their mean: how far past the aggregate the candidates may reach."""
    total = float(np.sum(weights))
    if len(norms) < 2 or total <= 0 or not mean_norm > 0:
        return WHOLE
    spread = float(np.dot(np.asarray(weights, np.float64) / total, np.square(np.asarray(norms, np.float64))))
    return max(WHOLE, spread / (2.0 * mean_norm ** 2))


def best_step(current: State, aggregate: State, judge: Callable[[State], Judged],
              steps: tuple[float, ...] = STEPS, limit: float = WHOLE) -> tuple[State | None, str, dict]:
    """(the passing point of `steps` up to `limit` (`extrapolation_limit`) whose AUC is highest, or None; '' or why
    no point passes; the figures for the round's record: the chosen step, every step's AUC, the chosen (else the
    whole) step's verdict figures, the limit)."""
    steps = tuple(a for a in steps if a <= max(limit, WHOLE))
    points = {alpha: point(current, aggregate, alpha) for alpha in steps}
    judged = {alpha: judge(points[alpha]) for alpha in steps}
    passing = {a: j.auc for a, j in judged.items() if not j.problem and np.isfinite(j.auc)}
    aucs = {f"server_step_auc@{a:g}": j.auc for a, j in judged.items()} | {"server_step_limit": limit}
    if not passing:
        whole = judged.get(WHOLE, judged[max(steps)])
        return None, whole.problem, {**whole.metrics, **aucs, "server_step": 0.0}
    alpha, _ = choose_alpha(passing.get, tuple(passing))
    return points[alpha], "", {**judged[alpha].metrics, **aucs, "server_step": alpha}
