"""From a closed round's accepted updates to the next global model, or the reason there is none.

The order is fixed: screen the updates against each other (`coordinator.update_screen`: who is admitted, clipped
to what), combine the admitted, clipped updates by the run's rule, let the update filter finish the mean (DP's
noise), step the strategy, check the result (finite, non-negative BatchNorm variances, a step within what the
bound allows), then the quality gate; a gate refusal may still save the round without its worst updates
(`leave_out`), else a shorter step of the whole; the model is then reached only as far as separates the gate's
faces best among the points that pass, or past the aggregate as far as the updates' disagreement allows
(`coordinator.server_step`). The engine only hears the outcome: a model to publish, or a reason to roll back.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from coordinator.aggregation import RunningMean, Strategy, capped_weights
from coordinator.robust import combine, l2_norm
from coordinator.round_state import OpenRound
from coordinator.server_step import WHOLE, extrapolation_limit, fixed_step
from coordinator.settings import RoundSettings
from coordinator.store import Store
from coordinator.update_filters import UpdateFilter
from coordinator.update_screen import make_screen
from protocol.codecs import decode_verified, payload_codec

if TYPE_CHECKING:
    from coordinator.quality_gate import QualityGate

log = logging.getLogger("coordinator")
State = dict[str, np.ndarray]
VARIANCE_SLACK = 1e-6  # BatchNorm's eps is 1e-5: a variance this far below zero is rounding, not an attack


@dataclass
class Outcome:
    state: State        # the new global model (the old one when `problem` is set)
    problem: str        # '' when the model may be published, else why the round rolls back
    metrics: dict
    kept: list[str]     # the devices whose updates made it (what the norm bound learns from)
    server_state: State | None = None  # the strategy's state after the kept model (the old one on a roll-back)


@dataclass
class Trial:
    """A model the round could publish, with the strategy state that comes with it."""

    model: State
    server_state: State | None


class RoundAggregator:
    def __init__(self, settings: RoundSettings, store: Store, layout: tuple, update_filter: UpdateFilter,
                 strategy: Strategy, gate: QualityGate | None = None):
        self.settings, self.store, self.layout, self.filter = settings, store, layout, update_filter
        self.strategy, self.gate = strategy, gate
        self.screen = make_screen(settings.screen)

    def load_delta(self, current: OpenRound, device_id: str) -> State:
        """A stored (already validated) update, decoded by the codec it was sent with, prepared for combining.
        The file is read once; its header, parsed here for the codec, is parsed again from protocol's cache."""
        data = self.store.update_path(current.round_id, device_id).read_bytes()
        delta, scale = self.filter.prepare(decode_verified(data, payload_codec(data), *self.layout))
        return _scaled(delta, scale)

    def combine(self, current: OpenRound, devices: list[str]) -> State:
        """The plain mean was folded in as updates arrived (memory O(model)); only the few updates whose weight
        the round's median caps are read again, or all of them when the screen left some out or clipped some.
        Robust rules need every update at once (O(n x model))."""
        raw = [current.weights[d] for d in devices]
        weights = capped_weights(raw, self.settings.weight_factor)
        scales = [current.scales.get(d, 1.0) for d in devices]
        refold = set(devices) != current.done or any(s != 1.0 for s in scales)
        if self.settings.combine == "mean" and refold:  # folded again from disk
            mean = RunningMean()
            for device, weight, scale in zip(devices, weights, scales):
                mean.add(self.load_delta(current, device), weight, scale)
            return mean.mean()
        if self.settings.combine == "mean":
            for device, old, new in zip(devices, raw, weights):
                if new != old:
                    current.running.reweight(self.load_delta(current, device), old, new)
            return current.running.mean()
        deltas = [_scaled(self.load_delta(current, d), scale) for d, scale in zip(devices, scales)]
        return combine(deltas, weights, self.settings.combine, self.settings.trim, self.settings.byzantine)

    def run(self, current: OpenRound, global_state: State, global_sha: str, sampling_rate: float,
            mean_delta: State | None = None, server_state: State | None = None) -> Outcome:
        """Bound, combine, finish, step, check, gate. `mean_delta`: FV's adopted blend (not re-formed later);
        `server_state`: the strategy's state before the round (the engine keeps it)."""
        started = time.perf_counter()
        bound = self.filter.bound()
        devices = sorted(current.done)
        fresh_mean = mean_delta is None
        screen_metrics = {}
        if fresh_mean:  # FV's blend was formed from every update already
            screening = self.screen.screen(devices, current.sketches, current.norms)
            devices, current.scales, screen_metrics = screening.admitted, screening.scales, screening.metrics
            if screen_metrics.get("screen_excluded"):
                log.warning("round %d: the update screen left out %s", current.round_id,
                            ", ".join(screen_metrics["screen_excluded_devices"]))
        mean_delta = self.combine(current, devices) if mean_delta is None else mean_delta
        mean_delta, filter_metrics, noise_allowance = self.filter.on_mean(mean_delta, len(devices), sampling_rate)
        # FedExP's premise is the plain mean of these updates: not FV's blend, not a robust rule's pick; and only
        # the gate's faces can choose a point past it
        extrapolates = fresh_mean and self.settings.combine == "mean" and self.gate is not None
        limit = self.extrapolation_limit(current, devices, mean_delta, bound) if extrapolates else WHOLE
        new_state, new_server_state = self.strategy.aggregate(global_state, mean_delta, server_state)
        problem = self.check_new_model(global_state, new_state, bound, noise_allowance)
        new_state = non_negative_variances(new_state)
        gate_metrics = {}
        if not problem and self.gate is not None:
            new_state, new_server_state, problem, gate_metrics = self.gate_and_step(
                current, global_state, global_sha, Trial(new_state, new_server_state), devices, bound, fresh_mean,
                server_state, limit)
        elif not problem:  # no faces to choose the step on: the fixed one
            new_state, gate_metrics = fixed_step(global_state, new_state, self.settings.server_step)
        metrics = {**filter_metrics, **current.validation_metrics,
                   "aggregation_seconds": time.perf_counter() - started,
                   "codec": self.settings.training.transport.codec,
                   "fold_ms_per_update": 1000 * current.fold_seconds / max(1, len(devices)),
                   "bytes_received": current.bytes_received, "norm_bound": bound,
                   "clipped_updates": sum(current.norms[d] > bound for d in devices),
                   "combine": self.settings.combine, **screen_metrics, **gate_metrics,
                   **_mean_metrics(current.metrics)}
        kept = [d for d in devices if d not in set(gate_metrics.get("gate_excluded_devices", []))]
        if problem:  # the server's state forgets the refused round too
            return Outcome(global_state, problem, metrics, kept, server_state)
        return Outcome(new_state, problem, metrics, kept, new_server_state)

    def gate_and_step(self, current: OpenRound, global_state: State, global_sha: str, whole: Trial,
                      devices: list[str], bound: float, fresh_mean: bool, server_state: State | None,
                      limit: float = WHOLE) -> tuple[State, State | None, str, dict]:
        """`publishable`, with this round's leave-out (only for a mean formed here: FV's adopted blend has none).
        Returns (model, the strategy state of the trial it came from, '' or why not, the gate's figures)."""
        chosen = whole

        def leave_out(problem: str, metrics: dict) -> tuple[State, str, dict]:
            nonlocal chosen
            trial, left_problem, metrics = self.leave_out(current, global_state, global_sha, devices, bound, problem,
                                                          metrics, server_state)
            chosen = whole if left_problem else trial
            return trial.model, left_problem, metrics

        self.gate.anchor_on(lambda: self.store.load_model(0))
        usable = fresh_mean and self.filter.allows_leave_out
        state, problem, metrics = publishable(self.gate, global_state, global_sha, whole.model,
                                              leave_out if usable else None, limit)
        if metrics.get("gate_whole_step_refused") and not problem:
            log.warning("round %d: the whole step failed the gate (%s); published %g of it", current.round_id,
                        metrics["gate_whole_step_refused"], metrics["server_step"])
        return state, chosen.server_state, problem, metrics

    def extrapolation_limit(self, current: OpenRound, devices: list[str], mean_delta: State, bound: float) -> float:
        """FedExP's eta (`coordinator.server_step`) over the updates as they were combined: clipped to the bound,
        scaled by the screen, at their capped weights."""
        norms = [min(current.norms[d], bound) * current.scales.get(d, 1.0) for d in devices]
        weights = capped_weights([current.weights[d] for d in devices], self.settings.weight_factor)
        return extrapolation_limit(norms, weights, l2_norm(mean_delta))

    def leave_out(self, current: OpenRound, global_state: State, global_sha: str, devices: list[str], bound: float,
                  problem: str, metrics: dict, server_state: State | None) -> tuple[Trial, str, dict]:
        """The gate refused the round's model: leave out, one at a time, the update without which the round's model
        accepts the fewest impostors, until the model passes, for at most half of the round's updates.
        Returns (the kept trial, '' or why not, the gate's figures); when no such subset passes, the round rolls
        back (the trial is then the old model)."""
        kept, left_out, first_problem = list(devices), [], problem
        while problem and len(left_out) < len(devices) // 2:
            trials = []
            for device in kept:
                trial = self.model_of(current, global_state, [d for d in kept if d != device], server_state)
                why, figures = self.gate.check(global_state, global_sha, trial.model)
                why = self.check_new_model(global_state, trial.model, bound) or why
                # FAR saturates at 1 while another poisoner remains: the mean impostor score still ranks them
                trials.append((figures.get("gate_far_candidate", 1.0), figures.get("gate_impostor_mean_candidate", 1.0),
                               device, trial, why, figures))
            _, _, device, chosen, problem, figures = min(trials, key=lambda t: t[:3])
            kept.remove(device)
            left_out.append(device)
            metrics = {**metrics, **figures}
        metrics.update(gate_excluded=len(left_out), gate_excluded_devices=sorted(left_out))
        if problem:
            return Trial(global_state, server_state), first_problem, metrics
        log.warning("round %d: quality gate left out %d update(s): %s", current.round_id, len(left_out),
                    ", ".join(sorted(left_out)))
        return chosen, "", metrics

    def model_of(self, current: OpenRound, global_state: State, devices: list[str],
                 server_state: State | None) -> Trial:
        """The round's model from `devices`' updates alone, from the server's state as it was before the round."""
        model, new_server_state = self.strategy.aggregate(global_state, self.combine(current, devices), server_state)
        return Trial(non_negative_variances(model), new_server_state)

    def check_new_model(self, global_state: State, new_state: State, bound: float,
                        noise_allowance: float = 0.0) -> str:
        """Why the new global model must not be published ('' when it may)."""
        if any(not np.isfinite(v).all() for v in new_state.values() if np.issubdtype(v.dtype, np.floating)):
            return "the new global model holds NaN or Inf"
        bad_var = [k for k, v in new_state.items() if k.endswith("running_var") and (v < -VARIANCE_SLACK).any()]
        if bad_var:  # BatchNorm divides by sqrt(running_var + eps): a negative variance makes embeddings NaN
            return f"the new global model has negative BatchNorm variances ({bad_var[0]}, ...)"
        step = l2_norm({k: new_state[k].astype(np.float64) - global_state[k] for k in new_state
                        if np.issubdtype(new_state[k].dtype, np.floating)})
        # a convex combination of clipped updates stays within the bound; a coordinate-wise rule may leave it by
        # up to sqrt(n) in theory, 2x allows for that in practice; the strategy says how far its step may reach
        spread = 1.0 if self.settings.combine in ("mean", "krum") else 2.0
        limit = bound * spread * self.strategy.step_scale() + noise_allowance * self.strategy.server_lr
        if step > limit * 1.001:
            return f"the new global model moved {step:.4g}, beyond the bound {limit:.4g}"
        return ""


def publishable(gate: QualityGate, global_state: State, global_sha: str, aggregate: State,
                leave_out: Callable[[str, dict], tuple[State, str, dict]] | None = None,
                limit: float = WHOLE) -> tuple[State, str, dict]:
    """What the gate lets the coordinator publish from the round's aggregate: the gate on the whole step; when it
    refuses, first the round without its worst updates (`leave_out`: a poisoner's step), then shorter steps of the
    whole aggregate (an honest round that overshoots); the server step is then chosen among the points that pass,
    up to `limit` of the way (`coordinator.server_step`; a round saved by leaving updates out goes no further than
    its aggregate). Returns (model, '' or why the round rolls back, the gate's figures)."""
    problem, metrics = gate.check(global_state, global_sha, aggregate)
    passed = aggregate
    if problem and leave_out is not None:
        passed, left_problem, metrics = leave_out(problem, metrics)
        passed = aggregate if left_problem else passed
    limit = limit if passed is aggregate else WHOLE
    stepped, step_problem, figures = gate.step(global_state, global_sha, passed, limit)
    metrics = {**metrics, **figures, **gate.start_figures()}
    if stepped is None:
        return global_state, problem or step_problem, metrics
    if problem and passed is aggregate:
        metrics["gate_whole_step_refused"] = problem
    return stepped, "", metrics


def _scaled(delta: State, scale: float) -> State:
    return delta if scale == 1.0 else {k: (v * scale if v.dtype.kind == "f" else v) for k, v in delta.items()}


def non_negative_variances(state: State) -> State:
    """fp16 rounding can leave -1e-8 where a BatchNorm variance is 0 (checked before: real negatives roll back)."""
    return {k: (np.maximum(v, 0).astype(v.dtype) if k.endswith("running_var") else v) for k, v in state.items()}


def _mean_metrics(per_device: dict[str, dict]) -> dict:
    keys = {k for m in per_device.values() for k in m}
    return {f"mean_{k}": float(np.mean([m[k] for m in per_device.values() if k in m])) for k in sorted(keys)}
