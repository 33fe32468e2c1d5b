"""`ffr edge run`: the device daemon. Joins with its credential, then trains one round per announcement.

Trust: the device pins the coordinator's public key from its credential file and drops
every message that is not signed by it (with a log line saying so); it signs its own
messages with a key pair it generated itself, and proves its admission token without
ever sending it. Training settings outside the protocol's bounds are refused by schema.

Threads: paho's network thread only routes messages; a worker thread does the rounds
(download, train, upload), so a long local epoch never stalls the connection. An update is
written to the device's home before it is sent and deleted only when acknowledged, so a
dropped connection resumes it instead of losing it.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import torch
from safetensors.torch import load_file as load_torch

from edge_client.adoption import ADOPTED_METRIC
from edge_client.error_feedback import ErrorFeedback
from edge_client.home import DeviceHome
from edge_client.local_training import LocalObjective, train_round
from edge_client.public_set import fetch_public_set
from models.face_model import (
    FaceModel,
    ModelConfig,
    from_numpy_state,
    load_shareable_state,
    private_state,
    shareable_state,
)
from models.faces.crops import CropConfig, FaceCrops, decoded_crops, resolve_detector
from models.faces.datasets import load_index
from models.public_set import PublicSet, PublicSetError, load_public_set
from models.state_norms import clip_to_norm, without_running_stats
from protocol import topics
from protocol.auth import Signer, token_proof
from protocol.chunks import Reassembler, from_bytes, split, to_bytes
from protocol.credential import Credential
from protocol.messages import (
    Ack,
    Error,
    Hello,
    MessageError,
    ModelRelease,
    Registered,
    RoundAnnouncement,
    TrainingConfig,
    UpdateHeader,
    ValidationRequest,
    ValidationScore,
    open_envelope,
    seal,
)
from protocol.tensors import PayloadError, decode
from protocol.transport import BrokerAddress, make_client

log = logging.getLogger("edge_client")


class EdgeDevice:
    def __init__(self, credential: Credential | Path | str, data: Path, home: Path, detector: str | None = None,
                 broker: str | None = None, ca_file: str | None = None, export_onnx: bool = True, seed: int = 0,
                 crop_cache: Path | None = None, public_set: Path | None = None,
                 validation: Path | FaceCrops | None = None):
        """`public_set`: FedFR's D_g (models.public_set),
        read when a round asks for hard negatives. `validation`: this device's private validation images
        (a folder, or crops): it then scores FedFace's candidate models (Federated Validation) and sends only
        the score."""
        self.public_set_path = None if public_set is None else Path(public_set)
        self._public: PublicSet | None = None
        self._public_sha: str | None = None  # the hash of the coordinator's set held in self._public
        self.credential = credential if isinstance(credential, Credential) else Credential.load(Path(credential))
        self.device_id, self.home = self.credential.device_id, DeviceHome(home)
        self.coordinator_key = self.credential.coordinator_public_key
        self.export_onnx, self.seed = export_onnx, seed
        index = load_index(data)
        config = CropConfig(detector=resolve_detector(detector, index), fallback_center=True)
        self.crops = decoded_crops(index, config, crop_cache or self.home.root / "crops", self.home.root / "crops")
        self.validation_crops = validation if isinstance(validation, FaceCrops) or validation is None else \
            decoded_crops(load_index(validation), config, crop_cache or self.home.root / "crops",
                          self.home.root / "validation", min_images=2)
        self.validations: queue.Queue[ValidationRequest | None] = queue.Queue()
        self.scored: dict[tuple[int, int], float] = {}
        self.last_config = TrainingConfig()
        self._download_lock = threading.Lock()
        self.signer = Signer.load_or_create(self.home.signing_key)
        self._seq = int(time.time() * 1000)
        self.model: FaceModel | None = None
        self.adopted = True  # whether the round's global model passed the device's adoption check
        self.jobs: queue.Queue[RoundAnnouncement] = queue.Queue()
        self.model_topic: str | None = None  # the model download in progress, resubscribed after a reconnect
        self.queued_rounds: set[int] = set()  # an announcement can arrive twice (retained + re-sent on hello)
        self.released: int | None = None  # the final model version being (or already) taken
        self.registered = threading.Event()
        if self.home.registered_with() == (self.coordinator_key, self.credential.token):
            self.registered.set()
        self.acked: dict[int, threading.Event] = {}
        self.download: Reassembler | None = None
        self.expected_transfer: tuple[str, str, int] | None = None
        self.downloaded = threading.Event()
        self.done_rounds = {e["round_id"] for e in self.home.rounds_log()}
        self.failed_rounds: dict[int, str] = {}
        self.last_error: str | None = None
        self.dropped_messages = 0
        self.stop_event = threading.Event()
        self.finished = threading.Event()
        if self.credential.ca_pem and ca_file is None:
            ca_file = str(self.home.write_ca(self.credential.ca_pem))
        address = BrokerAddress.parse(broker or self.credential.broker, self.credential.broker_username,
                                      self.credential.broker_password)
        self.client = make_client(f"ffr-edge-{self.device_id}", address, ca_file)
        self.client.on_connect = self._on_connect
        self.client.on_connect_fail = self._on_connect_fail
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.address = address
        self.broker_failures = 0

    # connection -------------------------------------------------------------
    def start(self) -> None:
        self.client.connect_async(self.address.host, self.address.port, keepalive=30)
        self.client.loop_start()
        self.worker = threading.Thread(target=self._work, name=f"edge-{self.device_id}", daemon=True)
        self.worker.start()
        if self.validation_crops is not None:
            self.validator = threading.Thread(target=self._validate_loop, name=f"validate-{self.device_id}",
                                              daemon=True)
            self.validator.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.jobs.put(None)  # type: ignore[arg-type]
        self.validations.put(None)
        self.worker.join(timeout=30)
        # disconnect first: the network thread then ends at once; stopping the loop first waits out its
        # select() timeout (0.7 s measured with paho 2, per device turn in a fleet)
        self.client.disconnect()
        self.client.loop_stop()

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _send(self, leaf: str, body) -> None:
        self.client.publish(topics.device(self.device_id, leaf),
                            seal(self.device_id, self._next_seq(), body, self.signer, to="coordinator"), qos=1)

    def _hello(self) -> Hello:
        """Until the coordinator has registered this key, prove the admission token (never send it)."""
        proof = None if self.registered.is_set() else token_proof(self.credential.token, self.device_id,
                                                                   self.signer.public_hex)
        return Hello(n_identities=len(self.crops.identities), n_images=len(self.crops),
                     public_key=self.signer.public_hex, token_proof=proof, validator=self.validation_crops is not None)

    def _on_connect_fail(self, client: mqtt.Client, userdata) -> None:
        """The broker cannot be reached: said once per try, with paho's back-off (1 s doubling to 30 s) named."""
        self.broker_failures += 1
        delay = min(30, 2 ** (self.broker_failures - 1))
        log.warning("%s: waiting for the broker at %s (try %d failed; next in about %d s)", self.device_id,
                    self.address, self.broker_failures, delay)

    def _on_disconnect(self, client: mqtt.Client, userdata, flags, reason_code, properties) -> None:
        if not self.stop_event.is_set():
            log.warning("%s: lost the broker at %s (%s); reconnecting", self.device_id, self.address, reason_code)

    def _on_connect(self, client: mqtt.Client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("%s: broker refused the connection: %s", self.device_id, reason_code)
            return
        if self.broker_failures:
            log.info("%s: connected to the broker at %s after %d failed tries", self.device_id, self.address,
                     self.broker_failures)
            self.broker_failures = 0
        client.subscribe([(topics.device(self.device_id, "inbox"), 1), (topics.round_announcements(), 1)])
        if self.model_topic is not None:  # a download the broker's restart cut short: its chunks are retained
            client.subscribe(self.model_topic, qos=1)
        self._send("hello", self._hello())
        if self.registered.is_set():
            self._resend_pending()

    def _on_message(self, client: mqtt.Client, userdata, msg: mqtt.MQTTMessage) -> None:
        try:
            if msg.topic.startswith(f"{topics.PREFIX}/models/"):
                self._on_model_chunk(msg.payload)
                return
            if not msg.payload:
                return  # a cleared retained message
            envelope = open_envelope(msg.payload, self.coordinator_key)
            if envelope.sender != "coordinator" or envelope.to not in (None, self.device_id):
                raise MessageError(f"addressed from {envelope.sender!r} to {envelope.to!r}")
            if msg.topic.endswith("/inbox") and envelope.to != self.device_id:
                raise MessageError("an inbox message not addressed to this device")
            self._on_body(envelope.body)
        except (MessageError, PayloadError, ValueError) as exc:
            self.dropped_messages += 1
            log.warning("%s: dropping a message on %s that is not from the pinned coordinator or is invalid: %s",
                        self.device_id, msg.topic[:120], str(exc)[:200])
        except Exception:  # noqa: BLE001 - nothing on the network may kill paho's thread
            self.dropped_messages += 1
            log.exception("%s: error handling a message on %s", self.device_id, msg.topic[:120])

    def _on_body(self, body) -> None:
        if isinstance(body, Registered) and body.device_id == self.device_id:
            self.home.save_registration(self.coordinator_key, self.credential.token)
            if not self.registered.is_set():
                self.registered.set()
                log.info("%s: admitted by the coordinator", self.device_id)
                self._resend_pending()
        elif isinstance(body, ValidationRequest) and self.validation_crops is not None:
            self.validations.put(body)
        elif isinstance(body, ModelRelease):
            if body.model_version != self.released:
                self.released = body.model_version
                self.jobs.put(body)
        elif isinstance(body, RoundAnnouncement):
            self.last_config = body.config
            fresh = body.round_id not in self.done_rounds and body.round_id not in self.queued_rounds
            if self.device_id in body.participants and fresh and body.deadline_unix > time.time():
                self.queued_rounds.add(body.round_id)
                self.jobs.put(body)
        elif isinstance(body, Ack) and body.of == "update" and body.round_id is not None:
            self.acked.setdefault(body.round_id, threading.Event()).set()
        elif isinstance(body, Error):
            self.last_error = body.reason
            log.warning("%s: coordinator refused a message: %s", self.device_id, body.reason)
            if body.resume_seq is not None:
                self._seq = body.resume_seq  # the coordinator's word (signed): number on from there
                self._send("hello", self._hello())

    # rounds -----------------------------------------------------------------
    def _work(self) -> None:
        while not self.stop_event.is_set():
            job = self.jobs.get()
            if job is None or self.stop_event.is_set():
                return
            if isinstance(job, ModelRelease):
                self._adopt_release(job)
                continue
            if job.round_id in self.done_rounds or time.time() > job.deadline_unix:
                continue
            try:
                self._run_round(job)
            except Exception as exc:  # noqa: BLE001 - one failed round must not kill the daemon
                self.failed_rounds[job.round_id] = f"{type(exc).__name__}: {exc}"
                self.queued_rounds.discard(job.round_id)  # the coordinator's next announcement may retry it
                log.exception("%s: round %d failed", self.device_id, job.round_id)

    def _validate_loop(self) -> None:
        """FedFace's validator: score each candidate model on the private validation images, send the score."""
        while not self.stop_event.is_set():
            request = self.validations.get()
            if request is None or self.stop_event.is_set():
                return
            key = (request.round_id, request.candidate)
            if key in self.scored or time.time() > request.deadline_unix:
                continue
            try:
                self.scored[key] = self._score(request)
                self._send("score", ValidationScore(round_id=request.round_id, candidate=request.candidate,
                                                    score=self.scored[key]))
            except Exception:  # noqa: BLE001 - a failed validation must not stop the validator
                log.exception("%s: could not score candidate %d of round %d", self.device_id, request.candidate,
                              request.round_id)

    def _score(self, request: ValidationRequest) -> float:
        """Verification AUC of the candidate's embedding over every pair of the validation images."""
        from models.face_model import load_shareable_state
        from models.training import verification

        payload = self._download(topics.candidate_chunks(request.round_id, request.candidate),
                                 f"candidate-{request.round_id}-{request.candidate}", request.model_sha256,
                                 request.model_bytes, f"candidate {request.candidate} of round {request.round_id}")
        cfg = self.last_config
        model = FaceModel(ModelConfig(n_classes=1, embedding_dim=cfg.embedding_dim, width_mult=cfg.width_mult,
                                      pretrained=False, dfc=False))
        load_shareable_state(model, from_numpy_state(decode(payload, request.model_sha256)))
        report, _ = verification(model.eval(), self.validation_crops, 100_000, request.round_id)
        return float(min(1.0, max(0.0, report.get("auc") or 0.0)))

    def _fetch_global(self, job: RoundAnnouncement) -> dict[str, torch.Tensor]:
        """The announced model, from the device's cache when it already holds that version (a resent or resumed
        round), else downloaded; refused unless its sha256 is the announced one. Then judged by the device's
        adoption check (edge_client.adoption) before anything trained from it may verify a face."""
        payload = self.home.cached_model(job.model_version, job.model_sha256)
        if payload is None:
            payload = self._download(topics.model_chunks(job.model_version), f"model-{job.model_version}",
                                     job.model_sha256, job.model_bytes, f"model v{job.model_version}")
            self.home.cache_model(job.model_version, job.model_sha256, payload)
        state = decode(payload, job.model_sha256)
        self.adopted = self._adopt(job, payload, state)
        return from_numpy_state(state)

    def _adopt(self, job: RoundAnnouncement, payload: bytes, state: dict) -> bool:
        """The device's own check of the announced model on its people and public negatives (only the
        outcome is reported, as one metric of its update)."""
        from edge_client.adoption import ADOPTED_FILE, Adoption, check_faces
        from edge_client.recognizer import Settings
        from edge_client.vault import Vault

        if self._public is None and self.public_set_path is not None:
            try:
                self._public = load_public_set(self.public_set_path)
            except PublicSetError as exc:
                log.warning("%s: adoption check without public negatives: %s", self.device_id, exc)
        public = self._public.images if self._public is not None else None
        faces = check_faces(self.crops.images, self.crops.labels, public, seed=self.seed)
        vault = Vault.open(self.home.root / "store")
        settings = Settings.load(self.home, vault)
        verdict = Adoption(self.home.root / "models", sealed=settings.models.get(ADOPTED_FILE)).judge(
            job.model_sha256, payload, state, faces)
        if verdict.ok and settings.models.get(ADOPTED_FILE) != job.model_sha256:
            settings.models[ADOPTED_FILE] = job.model_sha256  # the reference the next model is judged against
            settings.save(self.home, vault)
        if not verdict.ok:
            log.warning("%s: keeping the last good model, not v%d: %s", self.device_id, job.model_version,
                        verdict.reason)
        return verdict.ok

    def _fetch_momentum(self, job: RoundAnnouncement, model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """PFM's global momentum for the announced version (None before the first aggregation); its tensors must
        be the model's floating parameters, shape for shape."""
        if job.momentum_sha256 is None:
            return None
        payload = self._download(topics.momentum_chunks(job.model_version), f"momentum-{job.model_version}",
                                 job.momentum_sha256, job.momentum_bytes, f"momentum v{job.model_version}")
        momentum = decode(payload, job.momentum_sha256)
        for name, value in momentum.items():
            if name not in model or tuple(model[name].shape) != value.shape or value.dtype.kind != "f":
                raise PayloadError(f"momentum tensor {name[:80]} is not one of the model's floating tensors")
        return from_numpy_state(momentum)

    def _download(self, topic: str, transfer_id: str, sha256: str, size: int, what: str,
                  timeout: float = 120.0) -> bytes:
        """Retained chunk frames on `topic`/+, each checked against the announced transfer, hash and size."""
        with self._download_lock:  # one transfer at a time: training and validation share the reassembler
            return self._download_locked(topic, transfer_id, sha256, size, what, timeout)

    def _download_locked(self, topic: str, transfer_id: str, sha256: str, size: int, what: str,
                         timeout: float) -> bytes:
        self.download, self.downloaded = None, threading.Event()
        self.expected_transfer = (transfer_id, sha256, size)
        subscription = self.model_topic = f"{topic}/+"
        self.client.subscribe(subscription, qos=1)
        try:
            if not self.downloaded.wait(timeout):
                raise TimeoutError(f"{what} did not arrive within {timeout:.0f} s")
        finally:
            self.model_topic = None
            self.client.unsubscribe(subscription)
        return self.model_payload

    def _on_model_chunk(self, frame: bytes) -> None:
        if not frame or self.downloaded.is_set() or self.expected_transfer is None:
            return
        chunk = from_bytes(frame)
        transfer_id, sha, size = self.expected_transfer
        if chunk.transfer_id != transfer_id or chunk.sha256 != sha or chunk.total_bytes != size:
            log.error("%s: chunk does not match the announced %s; not using it", self.device_id, transfer_id)
            return
        if self.download is None:
            self.download = Reassembler.for_chunk(chunk)
        payload = self.download.add(chunk)
        if payload is not None:
            self.model_payload = payload
            self.downloaded.set()

    def _public_images(self, cfg) -> PublicSet | None:
        """D_g, only when the round samples hard negatives: the operator's `--public-set` file, else the one the
        coordinator announces (fetched once, checked against its signed sha256). Without either, or when the
        fetch fails, the device trains without hard negatives this round and says why."""
        if not cfg.hard_negatives:
            return None
        try:
            if self.public_set_path is not None:
                if self._public is None:
                    self._public = load_public_set(self.public_set_path)
                return self._public
            if cfg.public_set_sha256 is None:
                log.warning("%s: the round asks for hard negatives but neither the coordinator nor --public-set "
                            "gives this device a public set", self.device_id)
                return None
            if self._public_sha != cfg.public_set_sha256:
                path = fetch_public_set(cfg.public_set_url, cfg.public_set_sha256, cfg.public_set_bytes,
                                        self.home.root / "public")
                self._public, self._public_sha = load_public_set(path, cfg.public_set_sha256), cfg.public_set_sha256
            return self._public
        except PublicSetError as exc:
            log.warning("%s: training without hard negatives this round: %s", self.device_id, exc)
            return None

    def _ensure_model(self, job: RoundAnnouncement) -> FaceModel:
        cfg = job.config
        if self.model is None or self.model.config.dfc != cfg.dfc:
            self.model = FaceModel(ModelConfig(n_classes=len(self.crops.identities), embedding_dim=cfg.embedding_dim,
                                               width_mult=cfg.width_mult, pretrained=False, dfc=cfg.dfc,
                                               dfc_weight=cfg.dfc_weight))
            if self.home.private_state.exists():
                saved = load_torch(str(self.home.private_state))
                if set(saved) == set(private_state(self.model)):
                    self.model.load_state_dict(saved, strict=False)
        return self.model

    def _adopt_release(self, release: ModelRelease) -> None:
        """The federation's final model: fetched, checked like every global model, and (if it passes) what this
        device verifies with from now on (its own DFC branch on top). One log line says which."""
        try:
            global_state = self._fetch_global(release)
            if self.adopted and self.export_onnx:
                model = self._ensure_model(release)
                load_shareable_state(model, global_state)
                self._export(model)
            log.info("%s: final model v%d %s", self.device_id, release.model_version,
                     "adopted" if self.adopted else "refused by this device's check; keeping the last good model")
        except Exception as exc:  # noqa: BLE001 - a failed fetch must not kill the daemon; the release is retained
            self.released = None
            log.error("%s: could not take the final model v%d: %s", self.device_id, release.model_version, exc)
            return
        self.finished.set()

    def _run_round(self, job: RoundAnnouncement) -> None:
        if not self.registered.wait(30):
            raise RuntimeError("not registered with the coordinator")
        started = time.perf_counter()
        self._drop_stale_pending(job.round_id)
        global_state = self._fetch_global(job)
        fetched = time.perf_counter()
        model = self._ensure_model(job)
        cfg = job.config
        previous = load_torch(str(self.home.local_backbone)) if cfg.contrastive and self.home.local_backbone.exists() \
            else None
        pfm = cfg.algorithm == "pfm"
        momentum = self._fetch_momentum(job, global_state) if pfm else None
        result = train_round(model, self.crops, global_state, cfg.epochs, cfg.batch_size, cfg.lr,
                             cfg.prox_mu if cfg.algorithm == "fedprox" else 0.0, seed=self.seed + job.round_id,
                             objective=LocalObjective.from_config(cfg), public=self._public_images(cfg),
                             previous_state=previous, pfm_beta=cfg.pfm_beta if pfm else None, pfm_momentum=momentum)
        self.home.save_tensors(self.home.private_state, private_state(model))
        self.home.save_tensors(self.home.local_backbone, shareable_state(model))  # the personalised model's Theta
        delta, n_samples = result.delta, result.n_samples
        if cfg.dp_clip is not None:  # DP-FedAvg: the coordinator adds the noise (coordinator.dp)
            delta, _ = clip_to_norm(without_running_stats(delta), cfg.dp_clip)
        delta, n_samples = self.outgoing(delta, n_samples, global_state)
        encoded = ErrorFeedback(self.home.codec_residual).encode(delta, cfg.codec, cfg.topk_fraction)
        header = UpdateHeader(round_id=job.round_id, base_version=job.model_version, n_samples=n_samples,
                              transfer_id=f"{self.device_id}-r{job.round_id}-{encoded.sha256[:12]}",
                              payload_sha256=encoded.sha256, payload_bytes=len(encoded.data), codec=cfg.codec,
                              metrics={**result.metrics, "fetch_seconds": fetched - started,
                                       "train_seconds": time.perf_counter() - fetched,
                                       ADOPTED_METRIC: float(self.adopted)})
        payload_path, header_path = self.home.pending_paths(job.round_id)
        payload_path.write_bytes(encoded.data)
        header_path.write_text(json.dumps({"header": header.model_dump(), "chunk_bytes": cfg.chunk_bytes}))
        uploading = time.perf_counter()
        self._send_update(header, encoded.data, cfg.chunk_bytes)
        acked = self._await_ack(job, header, encoded.data)
        upload_seconds = time.perf_counter() - uploading
        if acked:
            payload_path.unlink(missing_ok=True)
            header_path.unlink(missing_ok=True)
        if self.export_onnx and self.adopted:  # a model the device's check refused never verifies a face here
            self._export(model)
        self.home.log_round({"round_id": job.round_id, "base_version": job.model_version, "acked": acked,
                             "adopted": self.adopted,
                             "bytes_sent": len(encoded.data), "fetch_seconds": fetched - started,
                             "train_seconds": header.metrics["train_seconds"], "upload_seconds": upload_seconds,
                             "global_momentum_tensors": len(momentum or {}),
                             **result.metrics, **result.private_metrics})
        log.info("%s: round %d: picked; model v%d fetched in %.1f s; trained %d samples in %.1f s (loss %.3f); "
                 "sent %.2f MB; %s; %s", self.device_id, job.round_id, job.model_version, fetched - started,
                 n_samples, header.metrics["train_seconds"], result.metrics.get("train_loss", float("nan")),
                 len(encoded.data) / 1e6, "acked" if acked else "not acked (kept to resend)",
                 "adopted" if self.adopted else "kept the last good model (this device's check refused it)")
        self.done_rounds.add(job.round_id)  # last: whoever waits on it finds the round logged

    def outgoing(self, delta: dict, n_samples: int, global_state: dict) -> tuple[dict, int]:
        """The update as sent: as trained. The one seam a fleet experiment's attacker overrides (fleet.attacks)."""
        return delta, n_samples

    def _await_ack(self, job: RoundAnnouncement, header: UpdateHeader, data: bytes, resend_s: float = 8.0) -> bool:
        """Wait for the coordinator's ack, sending the update again every `resend_s` (the coordinator
        de-duplicates), but not past the deadline nor once a newer round is announced."""
        event = self.acked.setdefault(job.round_id, threading.Event())
        last_sent = time.monotonic()
        while not event.wait(0.5):
            if time.time() > job.deadline_unix or not self.jobs.empty() or self.stop_event.is_set():
                return False
            if time.monotonic() - last_sent > resend_s and self.client.is_connected():
                log.info("%s: no ack for round %d yet; sending the update again", self.device_id, job.round_id)
                self._send_update(header, data, job.config.chunk_bytes)
                last_sent = time.monotonic()
        return True

    def _send_update(self, header: UpdateHeader, data: bytes, chunk_bytes: int) -> None:
        self._send("update", header)
        for chunk in split(header.transfer_id, data, chunk_bytes):
            self.client.publish(topics.device(self.device_id, "update/chunks"), to_bytes(chunk), qos=1)

    def _resend_pending(self) -> None:
        """After a reconnect, send again any update that was never acknowledged."""
        for header_path in sorted((self.home.root / "pending").glob("round*.json")):
            saved = json.loads(header_path.read_text())
            header = UpdateHeader(**saved["header"])
            payload_path = header_path.with_suffix(".safetensors")
            if payload_path.exists():
                log.info("%s: resuming the unacknowledged update of round %d", self.device_id, header.round_id)
                self._send_update(header, payload_path.read_bytes(), saved["chunk_bytes"])

    def _drop_stale_pending(self, current_round: int) -> None:
        """An unacknowledged update of a round that has since closed can never be accepted."""
        for path in (self.home.root / "pending").glob("round*.*"):
            if int(path.stem.removeprefix("round")) < current_round:
                path.unlink(missing_ok=True)

    def _export(self, model: FaceModel) -> None:
        from edge_client.recognizer import seal_model
        from edge_client.vault import Vault
        from models.onnx_export import export_onnx

        vault = Vault.open(self.home.root / "store")
        export_onnx(model, self.home.generic_onnx, personalised=False, extra={"device": self.device_id})
        seal_model(self.home, vault, self.home.generic_onnx)  # `ffr device` verifies only with sealed models
        if model.dfc is not None:  # written last: the newest model is the one `ffr device` verifies with
            export_onnx(model, self.home.personalised_onnx, personalised=True, extra={"device": self.device_id})
            seal_model(self.home, vault, self.home.personalised_onnx)


def run(credential: Path, data: Path, home: Path, until_finished: bool = False, **options) -> int:
    DeviceHome(home).lock()  # one daemon per home: two would replay each other's sequence numbers forever
    device = EdgeDevice(credential, data, home, **options)
    device.start()
    print(f"edge device {device.device_id}: {len(device.crops)} face images of {len(device.crops.identities)} people; "
          f"broker {device.address}; home {home}; coordinator key {device.coordinator_key[:16]}...", flush=True)
    try:
        while not device.stop_event.is_set():
            if until_finished and device.finished.wait(0.5):
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        device.stop()
    return 0
