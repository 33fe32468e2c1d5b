"""Aggregation strategies: pure functions over backbone deltas (numpy state dicts).

Updates are folded into a running weighted sum as they arrive (`RunningMean`), so memory
stays O(model size) however many devices report. A strategy then turns the global model
and the mean delta into the next global model.

- FedAvg (McMahan et al., AISTATS 2017): w <- w + eta * sum_k n_k d_k / sum_k n_k.
- FedProx (Li et al., MLSys 2020): the same on the server; its proximal term lives on devices.
- FedAvgM (Hsu et al., 2019, arXiv:1909.06335): v <- beta v + mean delta; w <- w + eta v.
- PFM (FedFace, Liu et al.; `models.maths.pfm`): FedAvg, and the global momentum M = (w_old - w_new) / eta
  that devices apply at every local step of the next round (the server never applies it).

A strategy is a small class of settings, built from a run's settings by its own `from_settings` (what it
reads is its own business: `strategy_for` looks the class up by the strategy of the round configuration's method,
`protocol.methods`, whose settings also tell devices what to do), with the hooks the engine calls: `aggregate`,
`step_scale` (how far one round may move the model, per unit of update norm) and `broadcast_state`. It holds no
state: `aggregate(global, mean, state) -> (model, state)` is a pure function of its arguments, and a strategy that
keeps server state between rounds (`stateful`: FedAvgM's velocity, PFM's momentum) hands it back for the engine to
store, persist and, where devices need it (`broadcast_state`), publish beside the model. Trial aggregations (the
gate's leave-out) are then
just calls: nothing to save and restore around them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np

from models.maths.pfm import global_momentum
from protocol.codecs import Decoded

if TYPE_CHECKING:
    from coordinator.settings import RoundSettings

State = dict[str, np.ndarray]


@dataclass
class RunningMean:
    """Weighted mean of deltas, folded in one update at a time: memory is one model however many arrive.

    Floating tensors accumulate in float32 in place, in one vector (the updates themselves travel as fp16
    or coarser, so float32's rounding, at most about n * 6e-8 relative after n updates, is far below theirs);
    integer buffers accumulate in float64, unclipped.
    """

    total: State = field(default_factory=dict)
    weight: float = 0.0
    count: int = 0
    _flat: np.ndarray | None = field(default=None, repr=False)     # the floats' accumulator, one vector
    _scratch: np.ndarray | None = field(default=None, repr=False)  # reused: no page faults per update
    _layout: tuple[str, ...] = field(default=(), repr=False)       # the floats, in `_flat`'s order
    _counters: list[str] = field(default_factory=list, repr=False)  # integer buffers, in float64

    def add(self, delta: State, weight: float, scale: float = 1.0) -> None:
        """Fold in weight * scale * delta, counting `weight` (scale: a norm clip applied on the fly)."""
        if weight <= 0:
            raise ValueError("an update needs a positive weight (its number of samples)")
        self._fold(delta, weight, scale)
        self.weight += weight
        self.count += 1

    def reweight(self, delta: State, old: float, new: float) -> None:
        """Change the weight of an update already added (a weight capped once the round's median is known)."""
        if new <= 0 or old <= 0:
            raise ValueError("an update needs a positive weight (its number of samples)")
        self._fold(delta, new - old)
        self.weight += new - old

    def _fold(self, delta: State, weight: float, scale: float = 1.0) -> None:
        if self.total and set(delta) != set(self.total):
            raise ValueError("update tensors differ from the ones already aggregated")
        if not self.total:
            self._allocate(delta)
        factor = np.float32(weight * scale)
        if self._flat is not None and isinstance(delta, Decoded) and delta.layout == self._layout:
            np.multiply(delta.flat, factor, out=self._scratch)  # every float in two single-threaded passes
            self._flat += self._scratch
        else:
            for name in self._layout:
                scaled = self._scratch[:self.total[name].size].reshape(self.total[name].shape)
                np.multiply(delta[name], factor, out=scaled, casting="unsafe")
                self.total[name] += scaled
        for name in self._counters:  # integer buffers, in float64: tiny, and counters are not clipped
            self.total[name][...] = self.total[name] + weight * np.asarray(delta[name], np.float64)

    def _allocate(self, delta: State) -> None:
        """The accumulator, laid out like a decoded update when the first one is (`protocol.codecs.Decoded`):
        then each later update folds in as one vector."""
        floats = (list(delta.layout) if isinstance(delta, Decoded) else
                  [k for k, v in delta.items() if np.asarray(v).dtype.kind == "f"])
        sizes = [int(np.size(delta[k])) for k in floats]
        self._flat = np.zeros(sum(sizes), np.float32)
        self._scratch = np.empty_like(self._flat)
        self._layout = tuple(floats)
        start = 0
        for name, size in zip(floats, sizes):
            self.total[name] = self._flat[start:start + size].reshape(np.shape(delta[name]))
            start += size
        self._counters = [k for k in delta if k not in self.total]
        for name in self._counters:
            self.total[name] = np.zeros(np.shape(delta[name]), np.float64)

    def mean(self) -> State:
        if self.count == 0:
            raise ValueError("no updates to aggregate")
        return {name: value / value.dtype.type(self.weight) for name, value in self.total.items()}


def apply_delta(global_state: State, delta: State, scale: float = 1.0) -> State:
    """w + scale * delta, keeping each tensor's dtype (integer buffers are rounded)."""
    out = {}
    for name, value in global_state.items():
        step = value.astype(np.float64) + scale * delta[name]
        cast = (
            step.astype(value.dtype) if np.issubdtype(value.dtype, np.floating) else np.rint(step).astype(value.dtype)
        )
        out[name] = np.asarray(cast)  # 0-d results come back as numpy scalars otherwise
    return out


class Strategy(Protocol):
    name: str
    server_lr: float
    stateful: ClassVar[bool]

    @classmethod
    def from_settings(cls, settings: RoundSettings) -> Strategy: ...
    def aggregate(self, global_state: State, mean_delta: State, state: State | None = None
                  ) -> tuple[State, State | None]: ...
    def step_scale(self) -> float: ...
    def broadcast_state(self, state: State | None) -> State | None: ...


def capped_weights(weights: list[float], factor: float) -> list[float]:
    """Each weight capped at `factor` x the median: a device that registered a huge data set still cannot
    outweigh the round (its registered size is its own claim)."""
    cap = factor * float(np.median(weights))
    return [min(w, cap) for w in weights]


@dataclass
class FedAvg:
    server_lr: float = 1.0
    name: str = "fedavg"
    stateful: ClassVar[bool] = False  # no server state between rounds

    @classmethod
    def from_settings(cls, settings: RoundSettings) -> FedAvg:
        """The strategy a run's settings ask for, with the parameters that are its own."""
        return cls()

    def aggregate(self, global_state: State, mean_delta: State, state: State | None = None
                  ) -> tuple[State, State | None]:
        """(the next global model, the server state after this round): here w + eta * mean and no state."""
        return apply_delta(global_state, mean_delta, self.server_lr), None

    def step_scale(self) -> float:
        """The most one round moves the model per unit of (clipped) mean update norm."""
        return self.server_lr

    def broadcast_state(self, state: State | None) -> State | None:
        """The part of the server state the devices need with the model (None: the model alone)."""
        return None


@dataclass
class FedProx(FedAvg):
    mu: float = 0.01
    name: str = "fedprox"

    @classmethod
    def from_settings(cls, settings: RoundSettings) -> FedProx:
        return cls(mu=settings.training.method.prox_mu)


@dataclass
class FedAvgM(FedAvg):
    momentum: float = 0.9
    name: str = "fedavgm"
    stateful: ClassVar[bool] = True  # the server velocity v

    @classmethod
    def from_settings(cls, settings: RoundSettings) -> FedAvgM:
        return cls(momentum=settings.server_momentum)

    def step_scale(self) -> float:
        """Server momentum sums up to 1 / (1 - beta) rounds' steps."""
        return self.server_lr / max(1e-6, 1 - self.momentum)

    def aggregate(self, global_state: State, mean_delta: State, state: State | None = None
                  ) -> tuple[State, State | None]:
        velocity = ({k: v.copy() for k, v in mean_delta.items()} if state is None else
                    {k: self.momentum * state[k] + mean_delta[k] for k in mean_delta})
        return apply_delta(global_state, velocity, self.server_lr), velocity


@dataclass
class PFM(FedAvg):
    """FedFace's Partially Federated Momentum (Algorithm 1): aggregate like FedAvg (eq. 4), then estimate the
    global momentum from the model's change (eq. 5-6) for the devices to apply locally next round."""

    lr: float = 1e-4          # eta: the devices' learning rate this round (M is measured in its units)
    beta: float = 0.9
    name: str = "pfm"
    stateful: ClassVar[bool] = True  # the global momentum M, sent to devices with the model

    @classmethod
    def from_settings(cls, settings: RoundSettings) -> PFM:
        return cls(lr=settings.training.optimisation.lr, beta=settings.training.method.pfm_beta)

    def broadcast_state(self, state: State | None) -> State | None:
        return state

    def aggregate(self, global_state: State, mean_delta: State, state: State | None = None
                  ) -> tuple[State, State | None]:
        new = apply_delta(global_state, mean_delta, 1.0)
        return new, global_momentum(global_state, new, self.lr)


# one class per name of protocol.methods.ALGORITHMS (the one list; a new strategy is named there first)
STRATEGIES = {"fedavg": FedAvg, "fedprox": FedProx, "fedavgm": FedAvgM, "pfm": PFM}


def make_strategy(name: str, **options) -> Strategy:
    return _strategy_class(name)(**options)


def strategy_for(settings: RoundSettings) -> Strategy:
    """The aggregation of the method a run's round configuration names (`training.method.strategy`), with its own
    parameters."""
    return _strategy_class(settings.training.method.strategy).from_settings(settings)


def _strategy_class(name: str) -> type[FedAvg]:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]
