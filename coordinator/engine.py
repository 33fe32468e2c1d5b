"""The round engine: registration, rounds, update intake and aggregation, with no I/O of its own.

The MQTT connection and the clock are injected (`publish`, `now`), so the same engine runs
under the service, in tests, and in the fleet simulator. Every refusal is logged, stored,
and, when the sender is known, answered with an `Error` that says why.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from coordinator.aggregation import FedAvgM, RunningMean, Strategy
from coordinator.store import Store
from protocol import topics
from protocol.auth import ReplayGuard, new_device_key
from protocol.chunks import Reassembler, from_bytes, split, to_bytes
from protocol.messages import (Ack, Error, Heartbeat, Hello, MessageError, Registered, RoundAnnouncement,
                               TrainingConfig, UpdateHeader, open_envelope, seal)
from protocol.tensors import PayloadError, decode

log = logging.getLogger("coordinator")
Publish = Callable[[str, bytes, bool], None]
SENDER = "coordinator"


@dataclass
class RoundSettings:
    rounds: int = 10
    min_clients: int = 2
    fraction: float = 1.0
    round_timeout_s: float = 600.0
    training: TrainingConfig = field(default_factory=TrainingConfig)
    max_update_bytes: int = 64 * 1024 * 1024
    seed: int = 0


@dataclass
class OpenRound:
    round_id: int
    base_version: int
    participants: list[str]
    deadline: float
    mean: RunningMean = field(default_factory=RunningMean)
    headers: dict[str, UpdateHeader] = field(default_factory=dict)
    transfers: dict[str, Reassembler] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    metrics: dict[str, dict] = field(default_factory=dict)
    bytes_received: int = 0
    refused_transfers: set[str] = field(default_factory=set)


class Engine:
    def __init__(self, store: Store, strategy: Strategy, settings: RoundSettings, publish: Publish,
                 initial_model: Callable[[], dict[str, np.ndarray]], now: Callable[[], float] = time.time):
        self.store, self.strategy, self.settings = store, strategy, settings
        self.publish, self.now = publish, now
        self.lock = threading.RLock()
        self.running = True
        self.current: OpenRound | None = None
        self._seq = int(time.time() * 1000)
        self._rng = random.Random(settings.seed)
        aborted = store.abort_open_rounds("coordinator restarted mid-round")
        if aborted:
            log.warning("resuming: %d round(s) open at shutdown were aborted; training goes on from the last completed one",
                        aborted)
        latest = store.latest_model()
        if latest is None:
            state = initial_model()
            store.save_model(0, state, None)
            latest = store.latest_model()
        self.version, self.global_state, self.global_sha = latest
        if isinstance(strategy, FedAvgM):
            strategy.velocity = store.load_strategy_state()
        self.guard = ReplayGuard(store.last_seqs())
        self._publish_model()

    # outgoing ---------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _send(self, topic: str, body, retain: bool = False) -> None:
        self.publish(topic, seal(SENDER, self._next_seq(), body, None), retain)

    def _tell(self, device_id: str, body) -> None:
        self._send(topics.device(device_id, "inbox"), body)

    def _publish_model(self) -> None:
        """The global backbone as retained chunk messages, one topic per chunk."""
        data = self.store.model_bytes(self.version)
        for chunk in split(f"model-{self.version}", data, self.settings.training.chunk_bytes):
            self.publish(f"{topics.model_chunks(self.version)}/{chunk.index}", to_bytes(chunk), True)
        self.model_size = len(data)
        self.model_chunks = -(-len(data) // self.settings.training.chunk_bytes)

    def _retract_model(self, version: int, n_chunks: int) -> None:
        """Clear a superseded version's retained chunks, so the broker does not keep every model forever."""
        for index in range(n_chunks):
            self.publish(f"{topics.model_chunks(version)}/{index}", b"", True)

    # incoming ---------------------------------------------------------------
    def on_message(self, topic: str, payload: bytes) -> None:
        parts = topic.split("/")
        if len(parts) < 5 or parts[:3] != ["ffr", "v1", "devices"]:
            return
        device_id, leaf = parts[3], "/".join(parts[4:])
        with self.lock:
            try:
                if leaf == "update/chunks":
                    self._on_chunk(device_id, payload)
                elif leaf in ("hello", "heartbeat", "update"):
                    self._on_envelope(device_id, leaf, payload)
            except (MessageError, PayloadError, ValueError) as exc:
                self._reject(device_id, topic, str(exc))

    def _reject(self, device_id: str, topic: str, reason: str) -> None:
        log.warning("rejected message from %s on %s: %s", device_id, topic, reason)
        self.store.record_rejection(device_id, topic, reason)
        if device_id in self.store.device_keys():
            self._tell(device_id, Error(reason=reason, round_id=self.current.round_id if self.current else None))

    def _on_envelope(self, device_id: str, leaf: str, payload: bytes) -> None:
        keys = self.store.device_keys()
        if leaf == "hello" and device_id not in keys:
            envelope = open_envelope(payload)  # first contact: nothing to verify yet
            if envelope.sender != device_id or not isinstance(envelope.body, Hello):
                raise MessageError("a first hello must come from the device named in its topic")
            self._register(device_id, envelope.body)
            return
        envelope = open_envelope(payload, keys, self.guard)
        if envelope.sender != device_id:
            raise MessageError(f"sender {envelope.sender!r} does not match the topic's device {device_id!r}")
        self.store.seen(device_id, envelope.seq)
        body = envelope.body
        if isinstance(body, UpdateHeader):
            self._on_update_header(device_id, body)
        elif isinstance(body, Hello):
            self._tell(device_id, Ack(of="hello"))
            self._announce_to_late_joiner(device_id)
        elif not isinstance(body, Heartbeat):
            raise MessageError(f"devices may not send {body.type!r} messages")

    def _register(self, device_id: str, hello: Hello) -> None:
        key = new_device_key()
        self.store.register(device_id, key, hello.n_images, hello.n_identities)
        log.info("registered %s (%d identities, %d images)", device_id, hello.n_identities, hello.n_images)
        self._tell(device_id, Registered(device_id=device_id, key=key))

    def _announce_to_late_joiner(self, device_id: str) -> None:
        if self.current is not None and device_id in self.current.participants:
            self._send(topics.round_announcements(), self._announcement(self.current), retain=True)

    def _on_update_header(self, device_id: str, header: UpdateHeader) -> None:
        current = self.current
        if current is None or header.round_id != current.round_id:
            if self.store.update_accepted(header.round_id, device_id):
                self._tell(device_id, Ack(of="update", round_id=header.round_id))  # its ack was lost in transit
                return
            raise MessageError(f"round {header.round_id} is not open")
        if device_id not in current.participants:
            raise MessageError(f"{device_id} was not selected for round {header.round_id}")
        if header.base_version != current.base_version:
            raise MessageError(f"stale base version {header.base_version}; round {current.round_id} "
                               f"trains version {current.base_version}")
        if device_id in current.done:
            if current.headers[device_id].transfer_id == header.transfer_id:
                self._tell(device_id, Ack(of="update", round_id=current.round_id))  # a resend: the ack was lost
                return
            raise MessageError(f"{device_id} already delivered its update for round {current.round_id}")
        if header.payload_bytes > self.settings.max_update_bytes:
            raise MessageError(f"update of {header.payload_bytes} bytes exceeds {self.settings.max_update_bytes}")
        previous = current.headers.get(device_id)
        if previous is not None and previous.transfer_id != header.transfer_id:
            current.transfers.pop(previous.transfer_id, None)  # a new attempt replaces a half-received one
        current.headers[device_id] = header

    def _on_chunk(self, device_id: str, frame: bytes) -> None:
        current = self.current
        if current is None:
            raise MessageError("no round is open")
        chunk = from_bytes(frame)
        header = current.headers.get(device_id)
        if header is None or chunk.transfer_id != header.transfer_id:
            if chunk.transfer_id in current.refused_transfers:
                return  # already refused once: the rest of its chunks are dropped quietly
            current.refused_transfers.add(chunk.transfer_id)
            raise MessageError(f"chunks of transfer {chunk.transfer_id!r} have no valid signed update header")
        if chunk.sha256 != header.payload_sha256 or chunk.total_bytes != header.payload_bytes:
            raise PayloadError("chunk does not match the signed update header")
        assembler = current.transfers.get(chunk.transfer_id)
        if assembler is None:
            assembler = current.transfers[chunk.transfer_id] = Reassembler.for_chunk(chunk, self.settings.max_update_bytes)
        try:
            payload = assembler.add(chunk)
        except PayloadError:
            current.transfers.pop(chunk.transfer_id, None)  # start over: the device's resend can still succeed
            raise
        if payload is not None:
            self._accept_update(device_id, header, payload)

    def _accept_update(self, device_id: str, header: UpdateHeader, payload: bytes) -> None:
        current = self.current
        current.transfers.pop(header.transfer_id, None)
        expected = {k: v.shape for k, v in self.global_state.items()}
        kinds = {k: "f" if np.issubdtype(v.dtype, np.floating) else "i" for k, v in self.global_state.items()}
        try:
            delta = decode(payload, header.payload_sha256, expected, kinds)
        except PayloadError as exc:
            self.store.record_update(current.round_id, device_id, header.n_samples, False, str(exc), len(payload),
                                     header.metrics)
            raise
        current.mean.add(delta, header.n_samples)  # streamed in: the delta itself is dropped right after
        current.done.add(device_id)
        current.metrics[device_id] = header.metrics
        current.bytes_received += len(payload)
        self.store.record_update(current.round_id, device_id, header.n_samples, True, "", len(payload), header.metrics)
        self._tell(device_id, Ack(of="update", round_id=current.round_id))
        log.info("round %d: update from %s (%d samples, %d bytes), %d/%d", current.round_id, device_id,
                 header.n_samples, len(payload), len(current.done), len(current.participants))

    # rounds -----------------------------------------------------------------
    def tick(self) -> None:
        """Start a round when enough devices are registered; close one at quorum or deadline."""
        with self.lock:
            if self.current is None:
                if self.running and self.store.completed_rounds() < self.settings.rounds:
                    self._maybe_start_round()
            else:
                self._maybe_close_round()

    def _maybe_start_round(self) -> None:
        devices = sorted(self.store.device_keys())
        if len(devices) < self.settings.min_clients:
            return
        k = max(self.settings.min_clients, int(round(self.settings.fraction * len(devices))))
        participants = sorted(self._rng.sample(devices, min(k, len(devices))))
        round_id = self.store.next_round_id()
        deadline = self.now() + self.settings.round_timeout_s
        self.current = OpenRound(round_id, self.version, participants, deadline)
        self.store.open_round(round_id, self.version, deadline, participants)
        self._send(topics.round_announcements(), self._announcement(self.current), retain=True)
        log.info("round %d: announced to %s (model v%d)", round_id, ", ".join(participants), self.version)

    def _announcement(self, current: OpenRound) -> RoundAnnouncement:
        config = self.settings.training.model_copy(update=self.strategy.client_config())
        return RoundAnnouncement(round_id=current.round_id, model_version=self.version, model_sha256=self.global_sha,
                                 model_bytes=self.model_size, model_chunks=self.model_chunks,
                                 total_rounds=self.settings.rounds, deadline_unix=current.deadline, config=config,
                                 participants=current.participants)

    def _maybe_close_round(self) -> None:
        current = self.current
        all_in = current.done == set(current.participants)
        expired = self.now() >= current.deadline
        if not (all_in or expired):
            return
        dropped = len(current.participants) - len(current.done)
        if len(current.done) >= min(self.settings.min_clients, len(current.participants)) and current.done:
            self._aggregate(current, dropped)
        else:
            self.store.close_round(current.round_id, "failed", None, len(current.done), dropped, {},
                                   f"deadline passed with {len(current.done)} of {len(current.participants)} updates")
            log.warning("round %d failed: only %d updates by the deadline", current.round_id, len(current.done))
        self.current = None
        self._send(topics.round_announcements(), Ack(of=f"round-{current.round_id}-closed"), retain=True)

    def _aggregate(self, current: OpenRound, dropped: int) -> None:
        started = time.perf_counter()
        new_state = self.strategy.aggregate(self.global_state, current.mean.mean())
        seconds = time.perf_counter() - started
        self.version += 1
        self.global_sha = self.store.save_model(self.version, new_state, current.round_id)
        self.global_state = new_state
        if isinstance(self.strategy, FedAvgM):
            self.store.save_strategy_state(self.strategy.velocity)
        metrics = {"aggregation_seconds": seconds, "bytes_received": current.bytes_received,
                   **_mean_metrics(current.metrics)}
        self.store.close_round(current.round_id, "completed", self.version, len(current.done), dropped, metrics)
        self._retract_model(self.version - 1, self.model_chunks)
        self._publish_model()
        log.info("round %d: aggregated %d updates (%d dropped) into model v%d", current.round_id, len(current.done),
                 dropped, self.version)

    def status(self) -> dict:
        with self.lock:
            return {"model_version": self.version, "model_sha256": self.global_sha,
                    "completed_rounds": self.store.completed_rounds(), "target_rounds": self.settings.rounds,
                    "training": self.running,
                    "open_round": None if self.current is None else {
                        "round_id": self.current.round_id, "participants": self.current.participants,
                        "received": sorted(self.current.done), "deadline_unix": self.current.deadline}}


def _mean_metrics(per_device: dict[str, dict]) -> dict:
    keys = {k for m in per_device.values() for k in m}
    return {f"mean_{k}": float(np.mean([m[k] for m in per_device.values() if k in m])) for k in sorted(keys)}

