"""What readers (the simulator, the API, the dashboard) see of a running engine, as values: its status, the round
log, the model registry, the devices and the refusals, the current norm bound and the wire size of the published
model. Never the engine's collaborators or their dicts, so a reader cannot change the engine by accident, and the
engine can reorganise them freely. Commands (pause, resume) and writes (an evaluation) go to the engine or the
service, not through here."""
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

    def status(self, with_ids: bool = False) -> dict: ...


class EngineView:
    def __init__(self, engine: Readable):
        self._engine = engine

    def status(self, with_ids: bool = False) -> dict:
        """The engine's state in one document (model version and hash, round, counts; device ids with `with_ids`)."""
        return self._engine.status(with_ids=with_ids)

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

    def devices(self) -> list[dict]:
        """Every device seen, with its last contact and rounds joined."""
        return self._engine.store.devices()

    def admitted_never_seen(self) -> list[dict]:
        return self._engine.store.admitted_never_seen()

    def dropped_rounds(self) -> dict[str, int]:
        """Per device, the rounds it joined and did not finish."""
        return self._engine.store.dropped_rounds()

    def rejections(self, offset: int, limit: int) -> list[dict]:
        return self._engine.store.rejections(offset, limit)

    def count_rejections(self) -> int:
        return self._engine.store.count_rejections()

    def evaluations(self) -> list[dict]:
        return self._engine.store.evaluations()

    def models(self) -> list[dict]:
        """The registry's released versions (metadata, not weights)."""
        return self._engine.store.models()

    def model_file(self, version: int) -> bytes | None:
        """A released version's file as it is served, or None where there is no such version."""
        return self._engine.store.model_bytes(version)

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
