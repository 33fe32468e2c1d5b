"""Update filters: what happens to each accepted update before it is combined, and to the round's mean after.

They compose around any strategy and any combination rule, as NVFlare's filters and Flower's DP wrappers do:
the engine asks its one filter for a round's bound, an update's weight and clip factor, and hands it the round's
mean; a wrapper (DP-FedAvg) changes what it must and delegates the rest to the filter it wraps.

- `NormBoundFilter`: the adaptive norm bound (`coordinator.robust.NormBound`: `factor` x the median recent
  accepted norm, never above a ceiling from the model's own norm); an update above it is clipped or refused.
  Weights are the self-reported sample counts, capped by what the device registered.
- `DPFedAvg` (McMahan, Ramage, Talwar, Zhang, ICLR 2018, Algorithm 1; `coordinator.dp`): every update clipped
  to C without its BatchNorm running statistics, equal weights, Gaussian noise N(0, (z C / n)^2) on the mean,
  and the privacy spent reported with each round.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from coordinator import dp
from coordinator.robust import NormBound
from models.maths.state_norms import State, clip_scale, l2_norm, without_running_stats
from protocol.tensors import PayloadError


class UpdateFilter(Protocol):
    allows_leave_out: bool  # may the quality gate re-form a round's mean without some of its updates?

    def bound(self) -> float: ...
    def screen(self, norm: float) -> None: ...
    def weight(self, n_samples: int, cap: int) -> float: ...
    def prepare(self, delta: State, norm: float | None = None) -> tuple[State, float]: ...
    def on_mean(self, mean_delta: State, n_updates: int, sampling_rate: float) -> tuple[State, dict, float]: ...
    def record(self, norms: list[float]) -> None: ...


class NormBoundFilter:
    allows_leave_out = True

    def __init__(self, norms: NormBound, action: str = "clip"):
        """`action`: clip | reject (checked with the run's settings, `coordinator.settings`)."""
        self.norms, self.action = norms, action

    def bound(self) -> float:
        """Fixed for the length of a round: the history only grows when a round completes."""
        return self.norms.bound

    def screen(self, norm: float) -> None:
        """Refuse an update above the bound when the action is reject (clip keeps it, scaled down)."""
        if norm > self.norms.bound and self.action == "reject":
            raise PayloadError(f"update norm {norm:.4g} exceeds the bound {self.norms.bound:.4g}")

    def weight(self, n_samples: int, cap: int) -> float:
        """The self-reported sample count, capped by what the device registered: it cannot outweigh its data."""
        return float(min(n_samples, cap))

    def prepare(self, delta: State, norm: float | None = None) -> tuple[State, float]:
        """The delta as it enters the combination, and the factor that clips it to the bound (applied while
        folding: no copy)."""
        return delta, clip_scale(l2_norm(delta) if norm is None else norm, self.bound())

    def on_mean(self, mean_delta: State, n_updates: int, sampling_rate: float) -> tuple[State, dict, float]:
        """(the mean as aggregated, metrics, the norm of any noise added: the step check allows for it)."""
        return mean_delta, {}, 0.0

    def record(self, norms: list[float]) -> None:
        self.norms.record(norms)


class DPFedAvg:
    allows_leave_out = False  # the noise is calibrated to the round's n: a mean without some updates is not private

    def __init__(self, inner: UpdateFilter, clip: float, noise: float, delta: float,
                 past_rates: Callable[[], list[float]]):
        """`past_rates`: the sampling rates of the rounds completed so far, for the accountant."""
        self.inner, self.clip, self.noise, self.delta, self.past_rates = inner, clip, noise, delta, past_rates

    def bound(self) -> float:
        return self.clip

    def screen(self, norm: float) -> None:
        self.inner.screen(norm)

    def weight(self, n_samples: int, cap: int) -> float:
        """Every device weighs the same: the noise is calibrated to one clipped update in n."""
        return 1.0

    def prepare(self, delta: State, norm: float | None = None) -> tuple[State, float]:
        """Running statistics dropped here too (a device's word is not enough), then clipped to C."""
        delta = without_running_stats(delta)
        return delta, clip_scale(l2_norm(delta), self.clip)

    def on_mean(self, mean_delta: State, n_updates: int, sampling_rate: float) -> tuple[State, dict, float]:
        noisy = dp.add_noise(mean_delta, n_updates, self.noise, self.clip)
        n_params = sum(int(v.size) for v in noisy.values())
        spent = dp.epsilon(self.past_rates() + [sampling_rate], self.noise, self.delta)
        noise_norm = dp.noise_norm(n_params, n_updates, self.noise, self.clip)
        metrics = {"dp_q": sampling_rate, "dp_noise_multiplier": self.noise, "dp_clip": self.clip,
                   "dp_delta": self.delta, "dp_epsilon": spent if math.isfinite(spent) else None,  # JSON has no inf
                   "dp_noise_norm": noise_norm}
        return noisy, metrics, 2.0 * noise_norm

    def record(self, norms: list[float]) -> None:
        self.inner.record(norms)


def update_filter(norms: NormBound, action: str, dp_clip: float | None, dp_noise: float, dp_delta: float,
                  past_rates: Callable[[], list[float]]) -> UpdateFilter:
    """The run's filter: the norm bound, wrapped by DP-FedAvg when a clipping norm is set."""
    bounded = NormBoundFilter(norms, action)
    return bounded if dp_clip is None else DPFedAvg(bounded, dp_clip, dp_noise, dp_delta, past_rates)
