"""What the simulator reads of a running engine, as values: the round log, the model registry, the admitted devices,
the current norm bound and the wire size of the published model. Never the engine's collaborators or their dicts,
so a reader cannot change the engine by accident, and the engine can reorganise them freely."""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np

from coordinator.broadcast import ModelBroadcast
from coordinator.robust import NormBound
from coordinator.store import Store


class Readable(Protocol):
    """The parts of `coordinator.engine.Engine` the view reads (typed here, so the view never imports the engine)."""

    store: Store
    keys: dict[str, str]
    lock: AbstractContextManager
    norms: NormBound
    broadcast: ModelBroadcast


class EngineView:
    def __init__(self, engine: Readable):
        self._engine = engine

    def rounds(self) -> list[dict]:
        """Every round so far, oldest first (each a fresh dict)."""
        return self._engine.store.rounds()

    def round(self, round_id: int) -> dict | None:
        return next((r for r in self.rounds() if r["round_id"] == round_id), None)

    def finished_rounds(self) -> int:
        """Rounds that count toward the run's rounds: aggregated or rolled back."""
        return self._engine.store.finished_rounds()

    def update_accepted(self, round_id: int, device_id: str) -> bool:
        return self._engine.store.update_accepted(round_id, device_id)

    def registered(self) -> set[str]:
        """Devices that completed their registration (a public key on record)."""
        with self._engine.lock:
            return set(self._engine.keys)

    def model(self, version: int) -> dict[str, np.ndarray] | None:
        """A released global model's state, read from the registry."""
        return self._engine.store.load_model(version)

    def norm_bound(self) -> float:
        """The update norm bound the next round's updates are held to."""
        with self._engine.lock:
            return float(self._engine.norms.bound)

    def model_bytes(self) -> int:
        """The published global model's size on the wire (its broadcast dtype)."""
        with self._engine.lock:
            return int(self._engine.broadcast.model.size)
