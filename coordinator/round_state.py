"""One open round's state: who was asked, what has arrived, and the running mean folded so far.

The engine owns it; the intake, the aggregation and Federated Validation read and fill it in turn.
Nothing outside the coordinator changes it (the simulator and the service drive the engine's methods).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from coordinator.aggregation import RunningMean
from protocol.chunks import Reassembler
from protocol.messages import UpdateHeader


@dataclass
class Validation:
    """One round's Federated Validation: the candidates sent to the validators and the scores back."""

    devices: list[str]
    base: np.ndarray                 # the devices' FedAvg weights
    current: np.ndarray              # the current weighting over them
    candidates: list[np.ndarray]
    requested: set[str]
    deadline: float
    chunks: list[int]                # retained chunk count of each candidate's model, to clear afterwards
    means: list[dict]                # each candidate's mean delta: the adopted one is their blend, no re-read
    scores: dict[str, dict[int, float]] = field(default_factory=dict)

    def complete(self) -> bool:
        return all(len(self.scores.get(v, {})) == len(self.candidates) for v in self.requested)


@dataclass
class OpenRound:
    round_id: int
    base_version: int
    participants: list[str]
    deadline: float
    headers: dict[str, UpdateHeader] = field(default_factory=dict)
    transfers: dict[str, Reassembler] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    weights: dict[str, float] = field(default_factory=dict)
    norms: dict[str, float] = field(default_factory=dict)
    sketches: dict[str, np.ndarray] = field(default_factory=dict)  # each update's direction (update_screen.sketch)
    scales: dict[str, float] = field(default_factory=dict)  # the screen's clip of each admitted update (1 if absent)
    metrics: dict[str, dict] = field(default_factory=dict)
    bytes_received: int = 0
    refused_transfers: OrderedDict = field(default_factory=OrderedDict)
    running: RunningMean = field(default_factory=RunningMean)  # the plain mean, folded in as updates arrive
    validation: Validation | None = None  # FV in progress: candidates sent, scores coming in
    validation_metrics: dict = field(default_factory=dict)
    fold_seconds: float = 0.0


@dataclass(frozen=True)
class RoundView:
    """What the service, the simulator and the dashboard may see of the open round (a copy)."""

    round_id: int
    participants: list[str]
    received: list[str]
    deadline: float

    @classmethod
    def of(cls, current: OpenRound) -> RoundView:
        return cls(current.round_id, list(current.participants), sorted(current.done), current.deadline)
