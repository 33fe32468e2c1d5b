"""FedFace's Federated Validation (Liu et al., Algorithm 2) as a phase between a round's quorum and its aggregation.

At quorum the round's updates are combined under T candidate weightings; each candidate model is published for
the validator devices, which score it on their own faces (`ValidationScore`). When every validator has scored, or
the deadline passes, the complete score rows are normalised, one candidate chosen (eq. 12) and the weighting
blended towards it (eq. 13); the round's mean delta is that blend. The weightings themselves live in
`coordinator.validation` (pure maths); this module holds a round's candidates and scores.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from coordinator.aggregation import RunningMean, apply_delta, capped_weights
from coordinator.broadcast import ModelBroadcast
from coordinator.round_state import OpenRound, Validation
from coordinator.validation import FederatedValidation, choose
from protocol.messages import Ack, MessageError, ValidationRequest, ValidationScore

log = logging.getLogger("coordinator")
State = dict[str, np.ndarray]


class NoValidation:
    """Federated Validation off: a round goes from quorum straight to aggregation, and a score is refused."""

    def holding(self, current: OpenRound, now: float) -> bool:
        return False

    def release(self, current: OpenRound) -> State | None:
        return None

    def hold(self, current: OpenRound, load_delta: Callable[[OpenRound, str], State], global_state: State,
             validators: set[str], now: float) -> bool:
        return False

    def on_score(self, current: OpenRound | None, device_id: str, score: ValidationScore) -> None:
        raise MessageError(f"round {score.round_id} is not being validated")


class ValidationPhase:
    """The stage between quorum and aggregation the engine asks, in order: is the round `holding` (candidates
    out, scores still coming)? what does it `release` (the validated mean delta, once)? should it `hold` a round
    that has just reached quorum?"""

    def __init__(self, fv: FederatedValidation, broadcast: ModelBroadcast, tell: Callable[[str, object], None],
                 weight_factor: float, timeout_s: float):
        self.fv, self.broadcast, self.tell = fv, broadcast, tell
        self.weight_factor, self.timeout_s = weight_factor, timeout_s

    def start(self, current: OpenRound, deltas: list[State], global_state: State, validators: set[str],
              now: float) -> None:
        """Candidate models from the round's updates (`deltas`, in sorted device order) under T weightings,
        published for the validators."""
        devices = sorted(current.done)
        base = np.array(capped_weights([current.weights[d] for d in devices], self.weight_factor))
        weighting = self.fv.current(devices, base)
        candidates = self.fv.draw(weighting, current.round_id)
        deadline = now + self.timeout_s
        chunks, means = [], []
        for t, w in enumerate(candidates, start=1):
            mean = RunningMean()
            for delta, weight in zip(deltas, w):
                mean.add(delta, max(float(weight), 1e-12))
            means.append(mean.mean())
            published = self.broadcast.publish_candidate(current.round_id, t, apply_delta(global_state, means[-1]))
            chunks.append(published.chunks)
            for validator in sorted(validators):
                self.tell(validator, ValidationRequest(round_id=current.round_id, candidate=t,
                                                       model_sha256=published.sha256, model_bytes=published.size,
                                                       model_chunks=published.chunks, deadline_unix=deadline))
        current.validation = Validation(devices, base, weighting, candidates, set(validators), deadline, chunks,
                                        means)
        log.info("round %d: %d candidate weightings sent to %d validator(s)", current.round_id, len(candidates),
                 len(validators))

    def holding(self, current: OpenRound, now: float) -> bool:
        return current.validation is not None and not self.ready(current, now)

    def release(self, current: OpenRound) -> State | None:
        """The round's mean delta under the validated weighting, when it was validated; None otherwise."""
        return self.finish(current) if current.validation is not None else None

    def hold(self, current: OpenRound, load_delta: Callable[[OpenRound, str], State], global_state: State,
             validators: set[str], now: float) -> bool:
        """At quorum, with validators online and two or more updates to weigh: send the candidates and hold."""
        if not validators or len(current.done) < 2:
            return False
        self.start(current, [load_delta(current, d) for d in sorted(current.done)], global_state, validators, now)
        return True

    def on_score(self, current: OpenRound | None, device_id: str, score: ValidationScore) -> None:
        validation = current.validation if current is not None else None
        if validation is None or score.round_id != current.round_id:
            raise MessageError(f"round {score.round_id} is not being validated")
        if device_id not in validation.requested:
            raise MessageError(f"{device_id} was not asked to validate round {score.round_id}")
        if score.candidate > len(validation.candidates):
            raise MessageError(f"round {score.round_id} has {len(validation.candidates)} candidates")
        mine = validation.scores.setdefault(device_id, {})
        if score.candidate in mine:
            raise MessageError(f"candidate {score.candidate} of round {score.round_id} is already scored")
        mine[score.candidate] = score.score
        self.tell(device_id, Ack(of="score", round_id=score.round_id))

    @staticmethod
    def ready(current: OpenRound, now: float) -> bool:
        """Every validator has scored every candidate, or the validators' time is up."""
        return current.validation.complete() or now >= current.validation.deadline

    def finish(self, current: OpenRound) -> State:
        """Normalise the complete score rows, choose (eq. 12), blend (eq. 13); clear the candidates. Returns the
        round's mean delta under the adopted weighting: the same blend of the current and chosen candidates'
        means (a weighted mean is linear in its weights), so no update is read again."""
        v = current.validation
        rows = [[mine[t] for t in range(1, len(v.candidates) + 1)] for mine in v.scores.values()
                if len(mine) == len(v.candidates)]
        chosen = choose(np.array(rows), self.fv.epsilon) if rows else 0
        weighting = self.fv.adopt(v.devices, v.base, v.current, v.candidates[chosen]) if rows else v.current
        for t, n_chunks in enumerate(v.chunks, start=1):
            self.broadcast.retract_candidate(current.round_id, t, n_chunks)
        current.validation_metrics = {"fv_validators": len(rows), "fv_chosen": chosen + 1,
                                      "fv_candidates": len(v.candidates),
                                      "fv_mean_scores": [float(np.mean([r[t] for r in rows])) if rows else None
                                                         for t in range(len(v.candidates))],
                                      "fv_weighting": dict(zip(v.devices, map(float, weighting)))}
        log.info("round %d: FV chose candidate %d of %d (%d validator(s))", current.round_id, chosen + 1,
                 len(v.candidates), len(rows))
        if not rows or chosen == 0:  # the current weighting stays: its mean is already built
            return v.means[0]
        return {k: (1.0 - self.fv.phi) * v.means[0][k] + self.fv.phi * v.means[chosen][k] for k in v.means[0]}
