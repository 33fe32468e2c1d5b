"""The round engine: admission, rounds, update intake and aggregation, with no I/O of its own.

The MQTT connection and the clock are injected (`publish`, `now`), so the same engine runs
under the service, in tests, and in the fleet simulator. Every message from the network is
treated as written by an attacker: it is parsed against bounded schemas, authenticated
against the sender's own public key, and any failure (even an unexpected exception) is
logged, counted and stored, never allowed to stop the engine. Only an authenticated sender
is told why, and at a limited rate. Everything the coordinator sends is signed with its
Ed25519 key, which devices pin when they are admitted.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from coordinator.aggregation import RunningMean, Strategy, apply_delta
from coordinator.validation import FederatedValidation, choose
from coordinator.robust import COMBINERS, NormBound, combine, l2_norm
from models.state_norms import clip_scale
from coordinator.store import Store
from protocol import topics
from protocol.auth import Signer, proof_matches
from protocol.chunks import Reassembler, from_bytes, split, to_bytes
from protocol.messages import (Ack, Envelope, Error, Heartbeat, Hello, MessageError, ModelRelease, Registered,
                               RoundAnnouncement,
                               TrainingConfig, UpdateHeader, ValidationRequest, ValidationScore, authenticate, parse,
                               seal)
from protocol.codecs import Staging, decode_verified, layout, payload_codec
from protocol.tensors import PayloadError, encode

if TYPE_CHECKING:
    from coordinator.quality_gate import QualityGate

log = logging.getLogger("coordinator")
Publish = Callable[[str, bytes, bool], None]
SENDER = "coordinator"
VARIANCE_SLACK = 1e-6  # BatchNorm's eps is 1e-5: a variance this far below zero is rounding, not an attack


ROUND_TIMEOUT_S = 3600.0  # devices on phones train when they can; the simulator's rounds take turns on a few cores


@dataclass
class RoundSettings:
    rounds: int = 10
    min_clients: int = 2
    fraction: float = 1.0
    round_timeout_s: float = ROUND_TIMEOUT_S
    training: TrainingConfig = field(default_factory=TrainingConfig)
    max_update_bytes: int = 64 * 1024 * 1024
    max_inflight_bytes: int = 1024 * 1024 * 1024  # all half-received updates together
    seed: int = 0
    combine: str = "mean"          # mean | trimmed-mean | median | krum (coordinator.robust)
    trim: float = 0.2              # trimmed mean: fraction dropped at each end
    byzantine: int | None = None   # Krum's f; default (n - 3) // 2
    norm_factor: float = 3.0       # an update may be at most this x the median recent update norm
    norm_ceiling: float = 0.1      # ... and never above this fraction of the global model's norm
    norm_action: str = "clip"      # clip | reject an update above the bound
    weight_factor: float = 3.0     # no update weighs more than this x the round's median weight
    errors_per_minute: int = 30    # replies to one device that explain a refusal
    dp_noise: float = 0.0          # DP-FedAvg noise multiplier z (needs training.dp_clip); 0: no noise
    dp_delta: float = 1e-5         # the delta at which epsilon is reported
    model_dtype: str = "fp16"      # the global model on the wire: fp16 (half the bytes) or fp32
    fv: bool = False               # FedFace's Federated Validation (coordinator.validation) when validators are online
    fv_candidates: int = 3         # T
    fv_phi: float = 0.01           # eq. 13's smoothing rate
    fv_epsilon: float = 1e-3       # eq. 8, and the margin a candidate must win by
    fv_timeout_s: float = 120.0    # how long validators have to score a round's candidates

    def __post_init__(self):
        """Settings that cannot work are refused here, named as `ffr coordinator serve` spells them."""
        checks = [(self.rounds >= 1, f"--rounds must be at least 1 (got {self.rounds})"),
                  (self.min_clients >= 1, f"--min-clients must be at least 1 (got {self.min_clients})"),
                  (0 < self.fraction <= 1, f"--fraction must be in (0, 1] (got {self.fraction:g})"),
                  (self.round_timeout_s > 0, f"--round-timeout must be positive (got {self.round_timeout_s:g})"),
                  (0 <= self.trim < 0.5, f"--trim must be in [0, 0.5) (got {self.trim:g})"),
                  (self.norm_factor > 0 and self.norm_ceiling > 0, "--norm-factor and --norm-ceiling must be positive"),
                  (self.dp_noise >= 0, f"--dp-noise must not be negative (got {self.dp_noise:g})"),
                  (self.fv_timeout_s > 0 and self.fv_candidates >= 2, "--fv-timeout must be positive and "
                                                                       "--fv-candidates at least 2")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


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
    metrics: dict[str, dict] = field(default_factory=dict)
    bytes_received: int = 0
    refused_transfers: OrderedDict = field(default_factory=OrderedDict)
    running: RunningMean = field(default_factory=RunningMean)  # the plain mean, folded in as updates arrive
    validation: "Validation | None" = None  # FV in progress: candidates sent, scores coming in
    validation_metrics: dict = field(default_factory=dict)
    fold_seconds: float = 0.0


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


class Engine:
    def __init__(self, store: Store, strategy: Strategy, settings: RoundSettings, publish: Publish,
                 initial_model: Callable[[], dict[str, np.ndarray]], signer: Signer,
                 now: Callable[[], float] = time.time, gate: "QualityGate | None" = None):
        """`gate`: scores each candidate global model on the coordinator's faces before it is published
        (coordinator.quality_gate); None publishes whatever passes the numeric checks."""
        if settings.combine not in COMBINERS:
            raise ValueError(f"unknown combination rule {settings.combine!r}; choose one of {', '.join(COMBINERS)}")
        if settings.fv and settings.combine != "mean":
            raise ValueError("Federated Validation weighs a mean: use the mean combination rule with it")
        if settings.model_dtype not in ("fp16", "fp32"):
            raise ValueError("model_dtype must be fp16 or fp32")
        if settings.norm_action not in ("clip", "reject"):
            raise ValueError("norm_action must be clip or reject")
        if settings.dp_noise > 0 and settings.training.dp_clip is None:
            raise ValueError("differential privacy needs a clipping norm (dp_clip) as well as a noise multiplier")
        if settings.training.dp_clip is not None and settings.combine != "mean":
            raise ValueError("DP-FedAvg averages updates: use the mean combination rule with it")
        self.store, self.strategy, self.settings = store, strategy, settings
        self.publish, self.now, self.signer, self.gate = publish, now, signer, gate
        self.lock = threading.RLock()
        self.running = True
        self.current: OpenRound | None = None
        self._seq = int(time.time() * 1000)
        self._rng = random.Random(settings.seed)
        self.handled = 0
        self.rejected = 0
        self.handler_errors = 0
        self._error_times: dict[str, list[float]] = {}
        latest = store.latest_model()
        if latest is None:
            state = initial_model()
            store.save_model(0, state, None)
            latest = store.latest_model()
        self.version, self.global_state, self.global_sha = latest
        if hasattr(strategy, "state"):  # FedAvgM's velocity, PFM's global momentum
            strategy.state = store.load_strategy_state()
        from protocol.auth import ReplayGuard

        self.keys = store.device_keys()
        self.validators: set[str] = set()  # devices that said (signed) they score FV candidates
        self.fv = FederatedValidation(settings.fv_candidates, settings.fv_phi, settings.fv_epsilon, settings.seed,
                                      dict(store.robust_state().get("fv_factors", {})))
        self.images = store.device_images()
        self.guard = ReplayGuard(store.last_seqs())
        # the bound's history is persisted with every completed round: a restart must not reopen the ceiling
        self.norms = NormBound(ceiling=settings.norm_ceiling * l2_norm(self.global_state), factor=settings.norm_factor,
                               history=list(store.robust_state().get("norm_history", [])))
        self._layout = layout(self.global_state)  # fixed for the run: what every update must match
        # every accepted update is decoded into it, laid out as the round's codec sends it (protocol.codecs)
        self._staging = Staging(*self._layout, settings.training.codec)
        self._publish_model()
        self._resume_open_round()
        self._release_if_finished()  # a coordinator restarted after its last round releases the final model again

    # outgoing ---------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _send(self, topic: str, body, retain: bool = False, to: str | None = None) -> None:
        self.publish(topic, seal(SENDER, self._next_seq(), body, self.signer, to), retain)

    def _tell(self, device_id: str, body) -> None:
        self._send(topics.device(device_id, "inbox"), body, to=device_id)

    def _publish_model(self) -> None:
        """The global backbone as retained chunk messages, one topic per chunk, in the wire dtype (fp16 by
        default: half the download; the coordinator keeps the float32 master it adds updates to)."""
        wire = encode(self.global_state, self.settings.model_dtype)
        data, self.wire_sha = wire.data, wire.sha256
        for chunk in split(f"model-{self.version}", data, self.settings.training.chunk_bytes):
            self.publish(f"{topics.model_chunks(self.version)}/{chunk.index}", to_bytes(chunk), True)
        self.model_size = len(data)
        self.model_chunks = -(-len(data) // self.settings.training.chunk_bytes)
        self._publish_momentum()

    def _publish_momentum(self) -> None:
        """PFM: the global momentum for the current version, retained beside the model (fp16 when it fits)."""
        state = getattr(self.strategy, "state", None) if self.strategy.name == "pfm" else None
        self.momentum = None
        if state is None:
            return
        dtype = "fp16" if max(float(np.abs(v).max(initial=0.0)) for v in state.values()) < 6e4 else "fp32"
        wire = encode(state, dtype)
        chunk_bytes = self.settings.training.chunk_bytes
        for chunk in split(f"momentum-{self.version}", wire.data, chunk_bytes):
            self.publish(f"{topics.momentum_chunks(self.version)}/{chunk.index}", to_bytes(chunk), True)
        self.momentum = (wire.sha256, len(wire.data), -(-len(wire.data) // chunk_bytes))

    def _retract_model(self, version: int, n_chunks: int) -> None:
        """Clear a superseded version's retained chunks, so the broker does not keep every model forever."""
        for index in range(n_chunks):
            self.publish(f"{topics.model_chunks(version)}/{index}", b"", True)
        if self.momentum is not None:
            for index in range(self.momentum[2]):
                self.publish(f"{topics.momentum_chunks(version)}/{index}", b"", True)

    # incoming ---------------------------------------------------------------
    def on_message(self, topic: str, payload: bytes) -> None:
        """Handle one message from the broker. Nothing a sender does can make this raise."""
        parts = topic.split("/")
        if len(parts) < 5 or parts[:3] != ["ffr", "v1", "devices"]:
            return
        device_id, leaf = parts[3][:64], "/".join(parts[4:])[:32]
        with self.lock:
            self.handled += 1
            self._authenticated: str | None = None
            self._resume: int | None = None
            try:
                if leaf == "update/chunks":
                    self._on_chunk(device_id, payload)
                elif leaf in ("hello", "heartbeat", "update", "score"):
                    self._on_envelope(device_id, leaf, payload)
                elif leaf != "inbox":
                    raise MessageError(f"unknown topic leaf {leaf!r}")
            except (MessageError, PayloadError, ValueError) as exc:
                self._reject(device_id, topic, str(exc))
            except Exception as exc:  # noqa: BLE001 - a bug must cost one message, never the loop
                self.handler_errors += 1
                log.exception("unexpected error handling a message from %s on %s", device_id, topic[:160])
                self._reject(device_id, topic, f"internal error: {type(exc).__name__}")

    def _reject(self, device_id: str, topic: str, reason: str) -> None:
        self.rejected += 1
        reason = reason[:300]
        log.warning("rejected message from %s on %s: %s", device_id, topic[:160], reason)
        self.store.record_rejection(device_id, topic, reason)
        if self._authenticated == device_id and self._may_explain(device_id):
            self._tell(device_id, Error(reason=reason, round_id=self.current.round_id if self.current else None,
                                        resume_seq=self._resume))

    def _may_explain(self, device_id: str) -> bool:
        """At most `errors_per_minute` error replies to one device: refusals never flood an inbox."""
        now = time.monotonic()
        recent = [t for t in self._error_times.get(device_id, []) if now - t < 60.0]
        allowed = len(recent) < self.settings.errors_per_minute
        self._error_times[device_id] = recent + [now] if allowed else recent
        return allowed

    def _on_envelope(self, device_id: str, leaf: str, payload: bytes) -> None:
        envelope = parse(payload)
        if envelope.sender != device_id:
            raise MessageError(f"sender {envelope.sender!r} does not match the topic's device {device_id!r}")
        if envelope.to not in (None, SENDER):
            raise MessageError("message addressed to someone else")
        body, key = envelope.body, self.keys.get(device_id)
        # an admission hello under the key already registered is no new admission: the device never heard its
        # Registered (it stopped, or the reply was lost) and its one-time token is spent; that key's signature
        # proves it below, and it is answered with Registered again
        if isinstance(body, Hello) and body.token_proof is not None and body.public_key != key:
            self._on_admission_hello(device_id, envelope)
            return
        if key is None:
            raise MessageError(f"unknown device {device_id!r}: it must be admitted (ffr coordinator admit) first")
        self._authenticate(envelope, key)
        self.store.seen(device_id, envelope.seq)
        if leaf != body.type:
            raise MessageError(f"a {body.type!r} message does not belong on {leaf!r}")
        if isinstance(body, UpdateHeader):
            self._on_update_header(device_id, body)
        elif isinstance(body, ValidationScore):
            self._on_score(device_id, body)
        elif isinstance(body, Hello):
            if body.public_key != key:
                raise MessageError("hello with a public key that is not this device's: re-admit the device")
            (self.validators.add if body.validator else self.validators.discard)(device_id)
            self._tell(device_id, Ack(of="hello") if body.token_proof is None else Registered(device_id=device_id))
            self._announce_to_late_joiner(device_id)
        elif not isinstance(body, Heartbeat):
            raise MessageError(f"devices may not send {body.type!r} messages")

    def _authenticate(self, envelope: Envelope, public_key: str) -> None:
        """Signature first (then the sender may be answered), then the sequence number."""
        authenticate(envelope, public_key)
        self._authenticated = envelope.sender
        try:
            self.guard.accept(envelope.sender, envelope.seq, int(self.now() * 1000))
        except ValueError as exc:
            self._resume = self.guard.resume_point(envelope.sender)
            raise MessageError(f"{exc}; number messages above {self._resume}") from None

    def _on_admission_hello(self, device_id: str, envelope: Envelope) -> None:
        """First contact (or re-enrolment): the admission token proves the operator let this device in,
        the signature proves it holds the private half of the key it registers."""
        hello: Hello = envelope.body
        token = self.store.admission_token(device_id)
        if token is None or not proof_matches(token, device_id, hello.public_key, hello.token_proof):
            raise MessageError(f"{device_id!r} is not admitted, or its admission token is wrong or already used")
        authenticate(envelope, hello.public_key)
        self.guard.last_seen.pop(device_id, None)  # a new key starts a new sequence
        self.guard.accept(device_id, envelope.seq, int(self.now() * 1000))
        self.store.register(device_id, hello.public_key, hello.n_images, hello.n_identities)
        self.store.use_admission(device_id)
        self.store.seen(device_id, envelope.seq)
        self.keys[device_id], self.images[device_id] = hello.public_key, hello.n_images
        if hello.validator:
            self.validators.add(device_id)
        self._authenticated = device_id
        log.info("admitted %s (%d identities, %d images)", device_id, hello.n_identities, hello.n_images)
        self._tell(device_id, Registered(device_id=device_id))
        self._announce_to_late_joiner(device_id)

    def _announce_to_late_joiner(self, device_id: str) -> None:
        if self.current is not None and device_id in self.current.participants:
            self._send(topics.round_announcements(), self._announcement(self.current), retain=True)
        elif self.finished:  # a device that comes back after the last round gets the final model
            self._send(topics.round_announcements(), self._release(), retain=True)

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
            if current.headers[device_id].transfer_id in (header.transfer_id, "restored"):
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
                raise MessageError(f"chunk of refused transfer {chunk.transfer_id!r}")
            current.refused_transfers[chunk.transfer_id] = True
            while len(current.refused_transfers) > 1024:
                current.refused_transfers.popitem(last=False)
            raise MessageError(f"chunks of transfer {chunk.transfer_id!r} have no valid signed update header")
        if chunk.sha256 != header.payload_sha256 or chunk.total_bytes != header.payload_bytes:
            raise PayloadError("chunk does not match the signed update header")
        assembler = current.transfers.get(chunk.transfer_id)
        if assembler is None:
            inflight = sum(t.total_bytes for t in current.transfers.values())
            if inflight + chunk.total_bytes > self.settings.max_inflight_bytes:
                raise MessageError("the coordinator is receiving too many updates at once; send again later")
            assembler = current.transfers[chunk.transfer_id] = Reassembler.for_chunk(chunk, self.settings.max_update_bytes)
        try:
            payload = assembler.add(chunk)
        except PayloadError:
            current.transfers.pop(chunk.transfer_id, None)  # start over: the device's resend can still succeed
            raise
        if payload is not None:
            self._accept_update(device_id, header, payload)

    def _accept_update(self, device_id: str, header: UpdateHeader, payload: bytes) -> None:
        """Check the delta (layout, dtype, finite, norm), make it durable, then acknowledge it."""
        current = self.current
        current.transfers.pop(header.transfer_id, None)
        started = time.perf_counter()
        try:
            if header.codec != self.settings.training.codec:
                raise PayloadError(f"update sent with codec {header.codec}; this round takes {self.settings.training.codec}")
            # the reassembler matched these bytes to the signed header's sha256 (chunk.sha256 is checked against it)
            delta = decode_verified(payload, header.codec, *self._layout, into=self._staging)
            norm = l2_norm(delta)
            if not np.isfinite(norm):
                raise PayloadError("update norm overflows")
            if norm > self.norms.bound and self.settings.norm_action == "reject":
                raise PayloadError(f"update norm {norm:.4g} exceeds the bound {self.norms.bound:.4g}")
        except PayloadError as exc:
            self.store.record_update(current.round_id, device_id, header.n_samples, False, str(exc)[:300],
                                     len(payload), header.metrics)
            raise
        weight = self._weight(device_id, header.n_samples)
        self.store.save_update(current.round_id, device_id, payload)
        current.headers[device_id] = header
        current.done.add(device_id)
        current.weights[device_id], current.norms[device_id] = weight, norm
        current.metrics[device_id] = header.metrics
        current.bytes_received += len(payload)
        if self.settings.combine == "mean":
            delta, scale = self._prepared(delta, norm)
            current.running.add(delta, weight, scale)
        current.fold_seconds += time.perf_counter() - started
        self.store.record_update(current.round_id, device_id, header.n_samples, True, "", len(payload),
                                 {**header.metrics, "update_norm": norm, "weight": weight})
        self._tell(device_id, Ack(of="update", round_id=current.round_id))
        log.info("round %d: update from %s (%d samples, weight %.0f, norm %.3g, %d bytes), %d/%d", current.round_id,
                 device_id, header.n_samples, weight, norm, len(payload), len(current.done), len(current.participants))

    def _weight(self, device_id: str, n_samples: int) -> float:
        """The self-reported sample count, capped by what the device registered: it cannot outweigh its data.
        Under DP-FedAvg every device weighs the same (the noise is calibrated to one clipped update in n)."""
        if self.settings.training.dp_clip is not None:
            return 1.0
        cap = max(1, self.images.get(device_id, 1)) * self.settings.training.epochs
        return float(min(n_samples, cap))

    def _resume_open_round(self) -> None:
        """After a crash: resume the open round with its durable updates when it trains the current model."""
        row = self.store.open_round_row()
        if row is None:
            return
        if row["base_version"] != self.version:
            self.store.abort_open_rounds("coordinator restarted after the model moved on")
            return
        current = OpenRound(row["round_id"], row["base_version"], row["participants"],
                            max(row["deadline"], self.now() + 60.0))
        for update in self.store.accepted_updates(current.round_id):
            path = self.store.update_path(current.round_id, update["device_id"])
            if path.exists():
                current.done.add(update["device_id"])
                current.weights[update["device_id"]] = update["metrics"].get("weight", update["n_samples"])
                current.norms[update["device_id"]] = update["metrics"].get("update_norm", 0.0)
                current.metrics[update["device_id"]] = update["metrics"]
                current.bytes_received += update["bytes"] or 0  # the round's cost counts the kept update too
                current.headers[update["device_id"]] = UpdateHeader(
                    round_id=current.round_id, base_version=current.base_version, n_samples=update["n_samples"],
                    transfer_id="restored", payload_sha256="0" * 64, payload_bytes=max(1, update["bytes"] or 1))
                if self.settings.combine == "mean":
                    current.running.add(self._load_delta(current, update["device_id"]), current.weights[update["device_id"]])
        self.current = current
        log.warning("resuming: round %d was open at shutdown; %d update(s) already received are kept",
                    current.round_id, len(current.done))
        self._send(topics.round_announcements(), self._announcement(current), retain=True)

    # rounds -----------------------------------------------------------------
    def tick(self) -> None:
        """Start a round when enough devices are registered; close one at quorum or deadline."""
        with self.lock:
            if self.current is None:
                if self.running and self.store.finished_rounds() < self.settings.rounds:
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
        self._send(topics.round_announcements(), self._announcement(self.current), retain=True)
        log.info("round %d: announced to %s (model v%d)", round_id, ", ".join(participants), self.version)

    def _announcement(self, current: OpenRound) -> RoundAnnouncement:
        config = self.settings.training.model_copy(update=self.strategy.client_config())
        return RoundAnnouncement(round_id=current.round_id, model_version=self.version, model_sha256=self.wire_sha,
                                 model_bytes=self.model_size, model_chunks=self.model_chunks,
                                 total_rounds=self.settings.rounds, deadline_unix=current.deadline, config=config,
                                 participants=current.participants, **self._momentum_fields())

    def _momentum_fields(self) -> dict:
        if self.momentum is None:
            return {}
        sha, size, chunks = self.momentum
        return {"momentum_sha256": sha, "momentum_bytes": size, "momentum_chunks": chunks}

    def admit(self, device_id: str) -> str:
        """A one-time admission token for `device_id` (see coordinator.admission)."""
        from protocol.auth import new_token

        token = new_token()
        self.store.admit(device_id, token)
        return token

    def _maybe_close_round(self) -> None:
        current = self.current
        all_in = current.done == set(current.participants)
        expired = self.now() >= current.deadline
        if not (all_in or expired):
            return
        if current.validation is not None:
            if not (current.validation.complete() or self.now() >= current.validation.deadline):
                return
            mean_delta = self._finish_validation(current)
        else:
            mean_delta = None
        dropped = len(current.participants) - len(current.done)
        enough = len(current.done) >= min(self.settings.min_clients, len(current.participants)) and current.done
        if enough and mean_delta is None and self.settings.fv and self.validators and len(current.done) >= 2:
            self._start_validation(current)
            return
        if enough:
            self._aggregate(current, dropped, mean_delta)
        else:
            self.store.close_round(current.round_id, "failed", None, len(current.done), dropped, {},
                                   f"deadline passed with {len(current.done)} of {len(current.participants)} updates")
            log.warning("round %d failed: only %d updates by the deadline", current.round_id, len(current.done))
        self.current = None
        self._send(topics.round_announcements(), Ack(of=f"round-{current.round_id}-closed"), retain=True)
        self._release_if_finished()

    @property
    def finished(self) -> bool:
        return self.current is None and self.store.finished_rounds() >= self.settings.rounds

    def _release_if_finished(self) -> None:
        """After the last round: the final model, retained, so devices that took part and those that connect later
        all fetch it (its chunks stay published)."""
        if self.finished:
            self._send(topics.round_announcements(), self._release(), retain=True)
            log.info("finished: model v%d released to every device", self.version)

    def _release(self) -> ModelRelease:
        return ModelRelease(model_version=self.version, model_sha256=self.wire_sha, model_bytes=self.model_size,
                            model_chunks=self.model_chunks, config=self.settings.training)

    def _aggregate(self, current: OpenRound, dropped: int, mean_delta: dict[str, np.ndarray] | None = None) -> None:
        """Bound each update's norm, combine them by the run's rule, check the result, then publish it;
        a result that fails its checks is not published and the round is rolled back with the reason."""
        started = time.perf_counter()
        dp_clip = self.settings.training.dp_clip
        bound = self._bound()
        devices = sorted(current.done)
        fresh_mean = mean_delta is None  # FV's blend of weightings is not re-formed without some devices
        mean_delta = self._combine(current, devices) if mean_delta is None else mean_delta
        dp_metrics = {}
        if dp_clip is not None:
            from coordinator import dp

            mean_delta = dp.add_noise(mean_delta, len(devices), self.settings.dp_noise, dp_clip)
            q = len(current.participants) / max(1, len(self.keys))
            rates = [r["metrics"]["dp_q"] for r in self.store.rounds()
                     if r["status"] == "completed" and "dp_q" in r["metrics"]] + [q]
            n_params = sum(int(np.size(v)) for v in mean_delta.values())
            dp_metrics = {"dp_q": q, "dp_noise_multiplier": self.settings.dp_noise, "dp_clip": dp_clip,
                          "dp_delta": self.settings.dp_delta,
                          "dp_epsilon": _finite_or_none(dp.epsilon(rates, self.settings.dp_noise,
                                                                   self.settings.dp_delta)),
                          "dp_noise_norm": dp.noise_norm(n_params, len(devices), self.settings.dp_noise, dp_clip)}
        server_state = getattr(self.strategy, "state", None)
        new_state = self.strategy.aggregate(self.global_state, mean_delta)
        problem = self._check_new_model(new_state, bound, 2.0 * dp_metrics.get("dp_noise_norm", 0.0))
        new_state = _non_negative_variances(new_state)
        gate_metrics = {}
        if not problem and self.gate is not None:
            problem, gate_metrics = self.gate.check(self.global_state, self.global_sha, new_state)
            if problem and fresh_mean and dp_clip is None:  # the round may still be saved without its poisoners
                new_state, problem, gate_metrics = self._without_failing_updates(current, devices, bound, problem,
                                                                                gate_metrics, server_state)
        seconds = time.perf_counter() - started
        metrics = {**dp_metrics, **current.validation_metrics,
                   "aggregation_seconds": seconds, "codec": self.settings.training.codec,
                   "fold_ms_per_update": 1000 * current.fold_seconds / max(1, len(devices)), "bytes_received": current.bytes_received, "norm_bound": bound,
                   "clipped_updates": sum(current.norms[d] > bound for d in devices), "combine": self.settings.combine,
                   **gate_metrics, **_mean_metrics(current.metrics)}
        self.store.drop_updates(current.round_id)
        if problem:
            if hasattr(self.strategy, "state"):
                self.strategy.state = server_state  # the server's momentum forgets the refused round too
            self.store.close_round(current.round_id, "rolled_back", None, len(current.done), dropped, metrics, problem)
            log.error("round %d rolled back: %s; model v%d stays current", current.round_id, problem, self.version)
            return
        self.norms.record([min(current.norms[d], bound) for d in devices])
        self.version += 1
        self.global_sha = self.store.save_model(self.version, new_state, current.round_id)
        self.global_state = new_state
        if hasattr(self.strategy, "state"):
            self.store.save_strategy_state(self.strategy.state)
        self.store.save_robust_state({"norm_history": self.norms.history, "fv_factors": self.fv.factors})
        self.store.close_round(current.round_id, "completed", self.version, len(current.done), dropped, metrics)
        self._retract_model(self.version - 1, self.model_chunks)
        self._publish_model()
        log.info("round %d: aggregated %d updates (%d dropped) into model v%d", current.round_id, len(current.done),
                 dropped, self.version)

    def _without_failing_updates(self, current: OpenRound, devices: list[str], bound: float, problem: str,
                                 metrics: dict, server_state) -> tuple[dict[str, np.ndarray], str, dict]:
        """The gate refused the round's model: leave out, one at a time, the update without which the round's model
        accepts the fewest impostors, until the model passes, for at most half of the round's updates.
        Returns (model, '' or why not, the gate's figures); when no such subset passes, the round rolls back."""
        kept, left_out, first_problem = list(devices), [], problem
        while problem and len(left_out) < len(devices) // 2:
            trials = []
            for device in kept:
                state = self._model_of(current, [d for d in kept if d != device], server_state)
                why, figures = self.gate.check(self.global_state, self.global_sha, state)
                why = self._check_new_model(state, bound) or why
                # FAR saturates at 1 while another poisoner remains: the mean impostor score still ranks them
                trials.append((figures.get("gate_far_candidate", 1.0), figures.get("gate_impostor_mean_candidate", 1.0),
                               device, state, why, figures))
            _, _, device, state, problem, figures = min(trials, key=lambda t: t[:3])
            kept.remove(device)
            left_out.append(device)
            metrics = {**metrics, **figures}
        metrics.update(gate_excluded=len(left_out), gate_excluded_devices=sorted(left_out))
        if problem:
            return self.global_state, first_problem, metrics
        if hasattr(self.strategy, "state"):  # the kept model's momentum step, taken once
            self._model_of(current, kept, server_state)
        log.warning("round %d: quality gate left out %d update(s): %s", current.round_id, len(left_out),
                    ", ".join(sorted(left_out)))
        return state, "", metrics

    def _model_of(self, current: OpenRound, devices: list[str], server_state) -> dict[str, np.ndarray]:
        """The round's model from `devices`' updates alone (the server's state as it was before the round)."""
        if hasattr(self.strategy, "state"):
            self.strategy.state = server_state
        return _non_negative_variances(self.strategy.aggregate(self.global_state, self._combine(current, devices)))

    def _bound(self) -> float:
        """The norm every update is clipped to; fixed for the length of a round (recorded only at aggregation)."""
        return self.norms.bound if self.settings.training.dp_clip is None else self.settings.training.dp_clip

    def _prepared(self, delta: dict[str, np.ndarray], norm: float | None = None) -> tuple[dict[str, np.ndarray], float]:
        """An accepted delta as it enters the combination, and the factor that clips its norm to the bound
        (applied while folding: no copy); under DP its running statistics are dropped first."""
        if self.settings.training.dp_clip is not None:
            from models.state_norms import without_running_stats

            delta, norm = without_running_stats(delta), None  # enforced here too: a device's word is not enough
        return delta, clip_scale(l2_norm(delta) if norm is None else norm, self._bound())

    def _load_delta(self, current: OpenRound, device_id: str) -> dict[str, np.ndarray]:
        """A stored (already validated) update, decoded by the codec it was sent with, prepared for combining.
        The file is read once; its header, parsed here for the codec, is parsed again from protocol's cache."""
        data = self.store.update_path(current.round_id, device_id).read_bytes()
        delta, scale = self._prepared(decode_verified(data, payload_codec(data), *self._layout))
        return delta if scale == 1.0 else {k: (v * scale if v.dtype.kind == "f" else v) for k, v in delta.items()}

    def _combine(self, current: OpenRound, devices: list[str]) -> dict[str, np.ndarray]:
        """The plain mean was folded in as updates arrived (memory O(model)); only the few updates whose weight
        the round's median caps are read again. Robust rules need every update at once (O(n x model))."""
        raw = [current.weights[d] for d in devices]
        weights = capped_weights(raw, self.settings.weight_factor)
        if self.settings.combine == "mean" and set(devices) != current.done:  # a subset: folded again from disk
            mean = RunningMean()
            for device, weight in zip(devices, weights):
                mean.add(self._load_delta(current, device), weight)
            return mean.mean()
        if self.settings.combine == "mean":
            for device, old, new in zip(devices, raw, weights):
                if new != old:
                    current.running.reweight(self._load_delta(current, device), old, new)
            return current.running.mean()
        deltas = [self._load_delta(current, d) for d in devices]
        return combine(deltas, weights, self.settings.combine, self.settings.trim, self.settings.byzantine)

    # Federated Validation (FedFace, Algorithm 2) --------------------------------
    def _start_validation(self, current: OpenRound) -> None:
        """Candidate models from the round's updates under T weightings, published for the validators."""
        devices = sorted(current.done)
        base = np.array(capped_weights([current.weights[d] for d in devices], self.settings.weight_factor))
        weighting = self.fv.current(devices, base)
        candidates = self.fv.draw(weighting, current.round_id)
        deltas = [self._load_delta(current, d) for d in devices]
        deadline = self.now() + self.settings.fv_timeout_s
        chunks, means = [], []
        for t, w in enumerate(candidates, start=1):
            mean = RunningMean()
            for delta, weight in zip(deltas, w):
                mean.add(delta, max(float(weight), 1e-12))
            means.append(mean.mean())
            wire = encode(_applied(self.global_state, means[-1]), self.settings.model_dtype)
            parts = split(f"candidate-{current.round_id}-{t}", wire.data, self.settings.training.chunk_bytes)
            for chunk in parts:
                self.publish(f"{topics.candidate_chunks(current.round_id, t)}/{chunk.index}", to_bytes(chunk), True)
            chunks.append(len(parts))
            for validator in sorted(self.validators):
                self._tell(validator, ValidationRequest(round_id=current.round_id, candidate=t,
                                                        model_sha256=wire.sha256, model_bytes=len(wire.data),
                                                        model_chunks=len(parts), deadline_unix=deadline))
        current.validation = Validation(devices, base, weighting, candidates, set(self.validators), deadline, chunks,
                                        means)
        log.info("round %d: %d candidate weightings sent to %d validator(s)", current.round_id, len(candidates),
                 len(self.validators))

    def _on_score(self, device_id: str, score: ValidationScore) -> None:
        current = self.current
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
        self._tell(device_id, Ack(of="score", round_id=score.round_id))

    def _finish_validation(self, current: OpenRound) -> dict[str, np.ndarray]:
        """Normalise the complete score rows, choose (eq. 12), blend (eq. 13); clear the candidates. Returns the
        round's mean delta under the adopted weighting: the same blend of the current and chosen candidates'
        means (a weighted mean is linear in its weights), so no update is read again."""
        v = current.validation
        rows = [[mine[t] for t in range(1, len(v.candidates) + 1)] for mine in v.scores.values()
                if len(mine) == len(v.candidates)]
        chosen = choose(np.array(rows), self.fv.epsilon) if rows else 0
        weighting = self.fv.adopt(v.devices, v.base, v.current, v.candidates[chosen]) if rows else v.current
        for t, n_chunks in enumerate(v.chunks, start=1):
            for index in range(n_chunks):
                self.publish(f"{topics.candidate_chunks(current.round_id, t)}/{index}", b"", True)
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

    def _check_new_model(self, new_state: dict[str, np.ndarray], bound: float, noise_allowance: float = 0.0) -> str:
        """Why the new global model must not be published ('' when it may)."""
        if any(not np.isfinite(v).all() for v in new_state.values() if np.issubdtype(v.dtype, np.floating)):
            return "the new global model holds NaN or Inf"
        bad_var = [k for k, v in new_state.items() if k.endswith("running_var") and (v < -VARIANCE_SLACK).any()]
        if bad_var:  # BatchNorm divides by sqrt(running_var + eps): a negative variance makes embeddings NaN
            return f"the new global model has negative BatchNorm variances ({bad_var[0]}, ...)"
        step = l2_norm({k: new_state[k].astype(np.float64) - self.global_state[k] for k in new_state
                        if np.issubdtype(new_state[k].dtype, np.floating)})
        # a convex combination of clipped updates stays within the bound; a coordinate-wise rule may leave it by
        # up to sqrt(n) in theory, 2x allows for that in practice; server momentum sums up to 1 / (1 - beta) steps
        spread = 1.0 if self.settings.combine in ("mean", "krum") else 2.0
        limit = bound * spread * getattr(self.strategy, "server_lr", 1.0) / max(1e-6, 1 - getattr(self.strategy, "momentum", 0.0))
        limit += noise_allowance * getattr(self.strategy, "server_lr", 1.0)
        if step > limit * 1.001:
            return f"the new global model moved {step:.4g}, beyond the bound {limit:.4g}"
        return ""

    def status(self, with_ids: bool = False) -> dict:
        """The engine's state; device ids only for authenticated callers."""
        with self.lock:
            status = {"model_version": self.version, "model_sha256": self.global_sha,
                      "completed_rounds": self.store.completed_rounds(), "target_rounds": self.settings.rounds,
                      "finished_rounds": self.store.finished_rounds(),
                      "training": self.running and not self.finished,
                      "state": "finished" if self.finished else "running" if self.running else "stopped",
                      "messages_handled": self.handled, "messages_rejected": self.rejected,
                      "handler_errors": self.handler_errors, "combine": self.settings.combine,
                      "open_round": None}
            if self.current is not None:
                status["open_round"] = {"round_id": self.current.round_id,
                                        "n_participants": len(self.current.participants),
                                        "n_received": len(self.current.done), "deadline_unix": self.current.deadline}
                if with_ids:
                    status["open_round"].update(participants=self.current.participants,
                                                received=sorted(self.current.done))
            return status


def capped_weights(weights: list[float], factor: float) -> list[float]:
    """Each weight capped at `factor` x the median: a device that registered a huge data set still cannot
    outweigh the round (its registered size is its own claim)."""
    cap = factor * float(np.median(weights))
    return [min(w, cap) for w in weights]


def _non_negative_variances(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """fp16 rounding can leave -1e-8 where a BatchNorm variance is 0 (checked before: real negatives roll back)."""
    return {k: (np.maximum(v, 0).astype(v.dtype) if k.endswith("running_var") else v) for k, v in state.items()}


def _finite_or_none(value: float) -> float | None:
    """JSON has no infinity: epsilon without noise is reported as null (no privacy)."""
    return value if np.isfinite(value) else None


def _mean_metrics(per_device: dict[str, dict]) -> dict:
    keys = {k for m in per_device.values() for k in m}
    return {f"mean_{k}": float(np.mean([m[k] for m in per_device.values() if k in m])) for k in sorted(keys)}



def _applied(global_state: dict[str, np.ndarray], mean_delta: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A candidate global model: the current one moved by a weighted mean of the round's updates."""
    return apply_delta(global_state, mean_delta, 1.0)
