"""The round engine: a state machine over rounds, with no I/O of its own.

    waiting --(enough devices, not paused)--> open --(all in, or deadline)--> [validating] --> aggregated --> waiting
                                                                                              (or rolled back)
    ... until `rounds` have finished: then the final model is released to every device.

The MQTT connection and the clock are injected (`publish`, `now`), so the same engine runs under the service,
in tests, and in the fleet simulator, which all drive it through the same small API: `on_message`, `tick`,
`pause` / `resume`, `open_round`, `close_round`, `round_view`, `status`, `admit`. The work of each state lives
with a collaborator: `DeviceSessions` (admission, signatures, sequence numbers), `UpdateIntake` (headers, chunks,
verified deltas), the update filter (`coordinator.update_filters`: norm bound, DP-FedAvg), `ValidationPhase`
(FedFace's Federated Validation), `RoundAggregator` (combine, strategy step, checks, quality gate) and
`ModelBroadcast` (retained chunks). Every message from the network is treated as written by an attacker: any
failure (even an unexpected exception) is logged, counted and stored, never allowed to stop the engine. Everything
the coordinator sends is signed with its Ed25519 key, which devices pin when they are admitted.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from coordinator.aggregation import Strategy, capped_weights  # noqa: F401 - capped_weights re-exported
from coordinator.broadcast import ModelBroadcast
from coordinator.engine_view import EngineView
from coordinator.robust import NormBound, l2_norm
from coordinator.round_aggregation import RoundAggregator
from coordinator.round_state import OpenRound, RoundView
from coordinator.sessions import COORDINATOR, DeviceSessions, Sender
from coordinator.settings import ROUND_TIMEOUT_S, RoundSettings  # noqa: F401 - re-exported
from coordinator.store import Store
from coordinator.update_filters import update_filter
from coordinator.update_intake import UpdateIntake
from coordinator.validation import FederatedValidation
from coordinator.validation_round import NoValidation, ValidationPhase
from protocol import topics
from protocol.auth import Signer, new_token
from protocol.codecs import layout
from protocol.messages import (
    Ack,
    Error,
    Heartbeat,
    Hello,
    MessageError,
    ModelRelease,
    Registered,
    RoundAnnouncement,
    UpdateHeader,
    ValidationScore,
    seal,
)
from protocol.tensors import PayloadError

if TYPE_CHECKING:
    from coordinator.quality_gate import QualityGate

log = logging.getLogger("coordinator")
Publish = Callable[[str, bytes, bool], None]


class Engine:
    def __init__(self, store: Store, strategy: Strategy, settings: RoundSettings, publish: Publish,
                 initial_model: Callable[[], dict[str, np.ndarray]], signer: Signer,
                 now: Callable[[], float] = time.time, gate: QualityGate | None = None):
        """`gate`: scores each candidate global model on the coordinator's faces before it is published
        (coordinator.quality_gate); None publishes whatever passes the numeric checks."""
        self.store, self.settings, self.publish, self.now, self.signer = store, settings, publish, now, signer
        self.lock = threading.RLock()
        self._running = True
        self.current: OpenRound | None = None
        self._seq = int(time.time() * 1000)
        self._rng = random.Random(settings.seed)
        self.handled = self.rejected = self.handler_errors = 0
        if store.latest_model() is None:
            store.save_model(0, initial_model(), None)
        self.version, self.global_state, self.global_sha = store.latest_model()
        robust = store.robust_state()
        self.sessions = DeviceSessions(store, now, settings.errors_per_minute)
        self.keys, self.images, self.validators = self.sessions.keys, self.sessions.images, self.sessions.validators
        self.guard = self.sessions.guard
        # the bound's history is persisted with every completed round: a restart must not reopen the ceiling
        self.norms = NormBound(ceiling=settings.norm_ceiling * l2_norm(self.global_state), factor=settings.norm_factor,
                               history=list(robust.get("norm_history", [])))
        self.filter = update_filter(self.norms, settings.norm_action, settings.training.dp_clip, settings.dp_noise,
                                    settings.dp_delta, self._past_sampling_rates)
        model_layout = layout(self.global_state)  # fixed for the run: what every update must match
        self.aggregator = RoundAggregator(settings, store, model_layout, self.filter, strategy, gate)
        self.intake = UpdateIntake(settings, store, model_layout, self.filter, self._tell, self.images,
                                   self.aggregator.screen.observe)
        self.broadcast = ModelBroadcast(publish, settings.model_dtype, settings.training.transport.chunk_bytes)
        self.fv = FederatedValidation(settings.fv_candidates, settings.fv_phi, settings.fv_epsilon, settings.seed,
                                      dict(robust.get("fv_factors", {})))
        self.validation = ValidationPhase(self.fv, self.broadcast, self._tell, settings.weight_factor,
                                          settings.fv_timeout_s) if settings.fv else NoValidation()
        # the strategy's server state between rounds (FedAvgM's velocity, PFM's global momentum; None for the rest)
        self.server_state = store.load_strategy_state() if strategy.stateful else None
        self.view = EngineView(self)  # what readers (the simulator) may see of this engine, as values
        self._publish_model()
        self._resume_open_round()
        self._release_if_finished()  # a coordinator restarted after its last round releases the final model again

    @property
    def strategy(self) -> Strategy:
        return self.aggregator.strategy

    @strategy.setter
    def strategy(self, strategy: Strategy) -> None:
        self.aggregator.strategy = strategy

    # the API the service and the simulator drive -----------------------------------------------------------
    @property
    def running(self) -> bool:
        """Whether rounds start by themselves (`tick`); an open round always runs to its end."""
        return self._running

    def pause(self) -> None:
        with self.lock:
            self._running = False

    def resume(self) -> None:
        with self.lock:
            self._running = True

    def open_round(self) -> RoundView | None:
        """Open the next round now, paused or not (the simulator's turn-taking); the open round, if any."""
        with self.lock:
            if self.current is None and self.store.finished_rounds() < self.settings.rounds:
                self._maybe_start_round()
            return self.round_view()

    def close_round(self, round_id: int) -> bool:
        """Give up waiting on round `round_id`'s missing devices: it closes at the next tick. False: not open."""
        with self.lock:
            if self.current is None or self.current.round_id != round_id:
                return False
            self.current.deadline = min(self.current.deadline, self.now())
            return True

    def round_view(self) -> RoundView | None:
        with self.lock:
            return None if self.current is None else RoundView.of(self.current)

    def admit(self, device_id: str) -> str:
        """A one-time admission token for `device_id` (see coordinator.admission)."""
        token = new_token()
        self.store.admit(device_id, token)
        return token

    @property
    def finished(self) -> bool:
        return self.current is None and self.store.finished_rounds() >= self.settings.rounds

    # outgoing ---------------------------------------------------------------------------------------------
    def _send(self, topic: str, body, retain: bool = False, to: str | None = None) -> None:
        self._seq += 1
        self.publish(topic, seal(COORDINATOR, self._seq, body, self.signer, to), retain)

    def _tell(self, device_id: str, body) -> None:
        self._send(topics.device(device_id, "inbox"), body, to=device_id)

    def _publish_model(self) -> None:
        self.broadcast.publish_model(self.version, self.global_state, self.strategy.broadcast_state(self.server_state))

    def _announce(self, body) -> None:
        self._send(topics.round_announcements(), body, retain=True)

    def _announcement(self, current: OpenRound) -> RoundAnnouncement:
        return RoundAnnouncement(round_id=current.round_id, model_version=self.version, config=self.settings.training,
                                 total_rounds=self.settings.rounds, deadline_unix=current.deadline,
                                 participants=current.participants, **self.broadcast.announcement_fields())

    def _release(self) -> ModelRelease:
        model = self.broadcast.model
        return ModelRelease(model_version=self.version, model_sha256=model.sha256, model_bytes=model.size,
                            model_chunks=model.chunks, config=self.settings.training)

    # incoming ---------------------------------------------------------------------------------------------
    def on_message(self, topic: str, payload: bytes) -> None:
        """Handle one message from the broker. Nothing a sender does can make this raise."""
        parts = topic.split("/")
        if len(parts) < 5 or parts[:3] != ["ffr", "v1", "devices"]:
            return
        sender, leaf = Sender(parts[3][:64]), "/".join(parts[4:])[:32]
        with self.lock:
            self.handled += 1
            try:
                if leaf == "update/chunks":
                    self.intake.on_chunk(self.current, sender.device_id, payload)
                elif leaf in ("hello", "heartbeat", "update", "score"):
                    self._on_envelope(sender, leaf, payload)
                elif leaf != "inbox":
                    raise MessageError(f"unknown topic leaf {leaf!r}")
            except (MessageError, PayloadError, ValueError) as exc:
                self._reject(sender, topic, str(exc))
            except Exception as exc:  # noqa: BLE001 - a bug must cost one message, never the loop
                self.handler_errors += 1
                log.exception("unexpected error handling a message from %s on %s", sender.device_id, topic[:160])
                self._reject(sender, topic, f"internal error: {type(exc).__name__}")

    def _reject(self, sender: Sender, topic: str, reason: str) -> None:
        self.rejected += 1
        reason = reason[:300]
        log.warning("rejected message from %s on %s: %s", sender.device_id, topic[:160], reason)
        self.store.record_rejection(sender.device_id, topic, reason)
        if self.sessions.may_explain(sender):
            self._tell(sender.device_id, Error(reason=reason, round_id=self.current.round_id if self.current else None,
                                               resume_seq=sender.resume_seq,
                                               code="admission" if sender.refused_admission else None))

    def _on_envelope(self, sender: Sender, leaf: str, payload: bytes) -> None:
        envelope, admitted = self.sessions.open(sender, payload)
        device_id, body = sender.device_id, envelope.body
        if admitted:
            self._tell(device_id, Registered(device_id=device_id))
            self._announce_to_late_joiner(device_id)
            return
        if leaf != body.type:
            raise MessageError(f"a {body.type!r} message does not belong on {leaf!r}")
        if isinstance(body, UpdateHeader):
            self.intake.on_header(self.current, device_id, body)
        elif isinstance(body, ValidationScore):
            self.validation.on_score(self.current, device_id, body)
        elif isinstance(body, Hello):
            self.sessions.hello(device_id, body)
            self._tell(device_id, Ack(of="hello") if body.token_proof is None else Registered(device_id=device_id))
            self._announce_to_late_joiner(device_id)
        elif isinstance(body, Heartbeat):  # a signed word on its state ("final v3": it took the final model)
            self.sessions.states[device_id] = body.state
        else:
            raise MessageError(f"devices may not send {body.type!r} messages")

    def _announce_to_late_joiner(self, device_id: str) -> None:
        if self.current is not None and device_id in self.current.participants:
            self._announce(self._announcement(self.current))
        elif self.finished:  # a device that comes back after the last round gets the final model
            self._announce(self._release())

    # rounds -----------------------------------------------------------------------------------------------
    def tick(self) -> None:
        """Start a round when enough devices are registered; close one at quorum or deadline."""
        with self.lock:
            if self.current is None:
                if self._running and self.store.finished_rounds() < self.settings.rounds:
                    self._maybe_start_round()
            else:
                self._maybe_close_round()

    def _maybe_start_round(self) -> None:
        devices = sorted(set(self.keys) - self.validators)  # FV's validators score; they are not asked to train
        if len(devices) < self.settings.min_clients:
            return
        k = max(self.settings.min_clients, int(round(self.settings.fraction * len(devices))))
        participants = sorted(self._rng.sample(devices, min(k, len(devices))))
        round_id = self.store.next_round_id()
        deadline = self.now() + self.settings.round_timeout_s
        self.current = OpenRound(round_id, self.version, participants, deadline)
        self.store.open_round(round_id, self.version, deadline, participants)
        self._announce(self._announcement(self.current))
        log.info("round %d: announced to %s (model v%d)", round_id, ", ".join(participants), self.version)

    def _resume_open_round(self) -> None:
        """After a crash: resume the open round with its durable updates when it trains the current model."""
        row = self.store.open_round_row()
        if row is None:
            return
        if row["base_version"] != self.version:
            self.store.abort_open_rounds("coordinator restarted after the model moved on")
            return
        self.current = OpenRound(row["round_id"], row["base_version"], row["participants"],
                                 max(row["deadline"], self.now() + 60.0))
        self.intake.restore(self.current, self.aggregator.load_delta)
        log.warning("resuming: round %d was open at shutdown; %d update(s) already received are kept",
                    self.current.round_id, len(self.current.done))
        self._announce(self._announcement(self.current))

    def _maybe_close_round(self) -> None:
        current = self.current
        if not (current.done == set(current.participants) or self.now() >= current.deadline):
            return
        if self.validation.holding(current, self.now()):
            return
        mean_delta = self.validation.release(current)
        dropped = len(current.participants) - len(current.done)
        enough = len(current.done) >= min(self.settings.min_clients, len(current.participants)) and current.done
        if enough and mean_delta is None and self.validation.hold(current, self.aggregator.load_delta,
                                                                  self.global_state, self.validators, self.now()):
            return
        if enough:
            self._aggregate(current, dropped, mean_delta)
        else:
            self.store.close_round(current.round_id, "failed", None, len(current.done), dropped, {},
                                   f"deadline passed with {len(current.done)} of {len(current.participants)} updates")
            log.warning("round %d failed: only %d updates by the deadline", current.round_id, len(current.done))
        self.current = None
        self._announce(Ack(of=f"round-{current.round_id}-closed"))
        self._release_if_finished()

    def _release_if_finished(self) -> None:
        """After the last round: the final model, retained, so devices that took part and those that connect later
        all fetch it (its chunks stay published)."""
        if self.finished:
            self._announce(self._release())
            log.info("finished: model v%d released to every device", self.version)

    def _past_sampling_rates(self) -> list[float]:
        """DP's sampling rate of every completed round so far, for the privacy accountant."""
        return [r["metrics"]["dp_q"] for r in self.store.rounds()
                if r["status"] == "completed" and "dp_q" in r["metrics"]]

    def _aggregate(self, current: OpenRound, dropped: int, mean_delta: dict[str, np.ndarray] | None = None) -> None:
        """The aggregator's outcome made durable: a new version published, or the round rolled back with why."""
        outcome = self.aggregator.run(current, self.global_state, self.global_sha,
                                      len(current.participants) / max(1, len(self.keys)), mean_delta,
                                      self.server_state)
        self.store.drop_updates(current.round_id)
        done = len(current.done)
        if outcome.problem:
            self.store.close_round(current.round_id, "rolled_back", None, done, dropped, outcome.metrics,
                                   outcome.problem)
            log.error("round %d rolled back: %s; model v%d stays current", current.round_id, outcome.problem,
                      self.version)
            return
        bound = self.filter.bound()
        self.filter.record([min(current.norms[d], bound) for d in outcome.kept])
        self.version += 1
        self.global_sha = self.store.save_model(self.version, outcome.state, current.round_id)
        self.global_state, self.server_state = outcome.state, outcome.server_state
        if self.strategy.stateful:
            self.store.save_strategy_state(self.server_state)
        self.store.save_robust_state({"norm_history": self.norms.history, "fv_factors": self.fv.factors})
        self.store.close_round(current.round_id, "completed", self.version, done, dropped, outcome.metrics)
        self.broadcast.retract_model(self.version - 1)
        self._publish_model()
        log.info("round %d: aggregated %d updates (%d dropped) into model v%d", current.round_id, done, dropped,
                 self.version)

    def status(self, with_ids: bool = False) -> dict:
        """The engine's state; device ids only for authenticated callers."""
        with self.lock:
            state = "finished" if self.finished else "running" if self._running else "stopped"
            status = {"model_version": self.version, "model_sha256": self.global_sha,
                      "completed_rounds": self.store.completed_rounds(), "target_rounds": self.settings.rounds,
                      "finished_rounds": self.store.finished_rounds(), "training": self._running and not self.finished,
                      "state": state, "messages_handled": self.handled, "messages_rejected": self.rejected,
                      "handler_errors": self.handler_errors, "combine": self.settings.combine, "open_round": None}
            if self.current is not None:
                status["open_round"] = {"round_id": self.current.round_id,
                                        "n_participants": len(self.current.participants),
                                        "n_received": len(self.current.done), "deadline_unix": self.current.deadline}
                if with_ids:
                    status["open_round"].update(participants=self.current.participants,
                                                received=sorted(self.current.done))
            return status
