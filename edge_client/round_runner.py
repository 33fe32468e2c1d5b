"""One federated round on a device: fetch the announced model, judge it, train, send the delta, await the ack.

An update is written to the device's home before it is sent and deleted only when acknowledged, so a
dropped connection resumes it instead of losing it. The device's own adoption check (edge_client.adoption)
decides whether a model trained from the round's global one may verify a face here; only its outcome is
reported. The local steps are `edge_client.local_algorithms`', the exports `edge_client.exporter`'s.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import torch
from safetensors.torch import load_file as load_torch

from edge_client.adoption import ADOPTED_METRIC
from edge_client.error_feedback import ErrorFeedback
from edge_client.exporter import export_models
from edge_client.home import DeviceHome
from edge_client.link import CoordinatorLink
from edge_client.local_training import LocalResult, RoundInputs, personalised_global, train_round
from edge_client.public_set import DevicePublicSet
from edge_client.verifier_choice import check_split
from models.maths.state_norms import clip_to_norm, without_running_stats
from models.networks.face_model import (
    FaceModel,
    ModelConfig,
    from_numpy_state,
    load_shareable_state,
    private_state,
    shareable_state,
)
from protocol import topics
from protocol.messages import ModelRelease, RoundAnnouncement, UpdateHeader
from protocol.tensors import PayloadError, decode

log = logging.getLogger("edge_client")

Outgoing = Callable[[dict, int, dict], tuple[dict, int]]


class RoundRunner:
    def __init__(self, link: CoordinatorLink, home: DeviceHome, crops: Callable[[], object],
                 public: DevicePublicSet, seed: int, export_onnx: bool, outgoing: Outgoing,
                 superseded: Callable[[], bool], stop: threading.Event):
        """`crops()`: the device's faces; `outgoing`: the update as sent (the one seam a fleet experiment's
        attacker overrides); `superseded()`: whether a newer job waits, and `stop` whether the daemon is
        stopping (either way an ack is no longer awaited)."""
        self.link, self.home, self.device_id = link, home, link.device_id
        self._crops, self.public, self.seed, self.export_onnx = crops, public, seed, export_onnx
        self._outgoing, self._superseded = outgoing, superseded
        self.model: FaceModel | None = None
        self.adopted = True  # whether the round's global model passed the device's adoption check
        self.acked: dict[int, threading.Event] = {}
        self.stop = stop

    # the round ---------------------------------------------------------------
    def run(self, job: RoundAnnouncement) -> None:
        if not self.link.registered.wait(30):
            raise RuntimeError("not registered with the coordinator")
        started = time.perf_counter()
        self.link.drop_stale_pending(job.round_id)
        self.public.follow(job.config)  # strangers' faces for the adoption check and the calibration, too
        global_state = self.fetch_global(job)
        fetched = time.perf_counter()
        model = self.ensure_model(job)
        result, momentum = self._train(job, model, global_state)
        delta, n_samples = result.delta, result.n_samples
        if job.config.dp_clip is not None:  # DP-FedAvg: the coordinator adds the noise (coordinator.dp)
            delta, _ = clip_to_norm(without_running_stats(delta), job.config.dp_clip)
        delta, n_samples = self._outgoing(delta, n_samples, global_state)
        timing = {"fetch_seconds": fetched - started, "train_seconds": time.perf_counter() - fetched}
        header, acked, sent, upload_seconds = self._upload(job, delta, n_samples, {**result.metrics, **timing})
        chosen = None
        if self.export_onnx and self.adopted:  # a model the device's check refused never verifies a face here
            chosen = self._export(model, global_state, job.config)
        self.home.log_round({"round_id": job.round_id, "base_version": job.model_version, "acked": acked,
                             "adopted": self.adopted, "bytes_sent": sent, **timing, "upload_seconds": upload_seconds,
                             "verifier": chosen,
                             "global_momentum_tensors": len(momentum or {}),
                             **result.metrics, **result.private_metrics})
        log.info("%s: round %d: picked; model v%d fetched in %.1f s; trained %d samples in %.1f s (loss %.3f); "
                 "sent %.2f MB; %s; %s", self.device_id, job.round_id, job.model_version, timing["fetch_seconds"],
                 n_samples, timing["train_seconds"], result.metrics.get("train_loss", float("nan")), sent / 1e6,
                 "acked" if acked else "not acked (kept to resend)",
                 "adopted" if self.adopted else "kept the last good model (this device's check refused it)")
        if chosen:
            log.info("%s: round %d: %s", self.device_id, job.round_id, chosen)

    def _export(self, model: FaceModel, global_state: dict[str, torch.Tensor], config) -> str | None:
        """The device's verifying models from this round: the global one, and its personalised one (the global
        backbone with a DFC branch fitted on its features: measured on 10 CelebA devices, Dirichlet, own people
        against strangers at FAR 1e-3, 0.754 against 0.692 for the local backbone with its branch,
        `bench/results/federation_value_dirichlet.md`); the better one chosen and recalibrated on its faces."""
        crops = self._crops()
        check = check_split(crops.labels, self.seed)  # judged on images the branch was not fitted on
        personal = None
        if model.dfc is not None and config.dfc_steps > 0:
            personal = personalised_global(global_state, crops if check is None else crops.select(~check), config,
                                           self.seed)
        with self.home.writing():  # `ffr device` commands wait meanwhile (one enrolment for verifying and federating)
            return export_models(model, self.home, self.device_id, global_state, crops.images, crops.labels,
                                 self.public.negatives_for_adoption(), personal, check, self.public.sha256)

    def _train(self, job: RoundAnnouncement, model: FaceModel,
               global_state: dict[str, torch.Tensor]) -> tuple[LocalResult, dict | None]:
        """The local algorithm the round names, from the global backbone; the private parts stay in the home."""
        cfg = job.config
        previous = self._private(self.home.local_backbone, shareable_state(model)) if cfg.contrastive else None
        pfm = cfg.algorithm == "pfm"
        momentum = self._fetch_momentum(job, global_state) if pfm else None
        result = train_round(model, self._crops(), global_state, cfg, seed=self.seed + job.round_id,
                             inputs=RoundInputs(self.public.for_round(cfg), previous, momentum))
        self.home.save_tensors(self.home.private_state, private_state(model))
        self.home.save_tensors(self.home.local_backbone, shareable_state(model))  # the personalised model's Theta
        return result, momentum

    def _upload(self, job: RoundAnnouncement, delta: dict, n_samples: int,
                metrics: dict) -> tuple[UpdateHeader, bool, int, float]:
        """Encode (error feedback keeps what a sparse codec left out), keep on disk, send, await the ack."""
        cfg = job.config
        encoded = ErrorFeedback(self.home.codec_residual).encode(delta, cfg.codec, cfg.topk_fraction)
        header = UpdateHeader(round_id=job.round_id, base_version=job.model_version, n_samples=n_samples,
                              transfer_id=f"{self.device_id}-r{job.round_id}-{encoded.sha256[:12]}",
                              payload_sha256=encoded.sha256, payload_bytes=len(encoded.data), codec=cfg.codec,
                              metrics={**metrics, ADOPTED_METRIC: float(self.adopted)})
        payload_path, header_path = self.home.pending_paths(job.round_id)
        payload_path.write_bytes(encoded.data)
        header_path.write_text(json.dumps({"header": header.model_dump(), "chunk_bytes": cfg.chunk_bytes}))
        uploading = time.perf_counter()
        self.link.send_update(header, encoded.data, cfg.chunk_bytes)
        acked = self._await_ack(job, header, encoded.data)
        if acked:
            payload_path.unlink(missing_ok=True)
            header_path.unlink(missing_ok=True)
        return header, acked, len(encoded.data), time.perf_counter() - uploading

    def on_ack(self, round_id: int) -> None:
        self.acked.setdefault(round_id, threading.Event()).set()

    def _await_ack(self, job: RoundAnnouncement, header: UpdateHeader, data: bytes, resend_s: float = 8.0) -> bool:
        """Wait for the coordinator's ack, sending the update again every `resend_s` (the coordinator
        de-duplicates), but not past the deadline nor once a newer round is announced."""
        event = self.acked.setdefault(job.round_id, threading.Event())
        last_sent = time.monotonic()
        while not event.wait(0.5):
            if time.time() > job.deadline_unix or self._superseded() or self.stop.is_set():
                return False
            if time.monotonic() - last_sent > resend_s and self.link.client.is_connected():
                log.info("%s: no ack for round %d yet; sending the update again", self.device_id, job.round_id)
                self.link.send_update(header, data, job.config.chunk_bytes)
                last_sent = time.monotonic()
        return True

    # models ------------------------------------------------------------------
    def fetch_global(self, job: RoundAnnouncement | ModelRelease) -> dict[str, torch.Tensor]:
        """The announced model, from the device's cache when it already holds that version (a resent or resumed
        round), else downloaded; refused unless its sha256 is the announced one. Then judged by the device's
        adoption check (edge_client.adoption) before anything trained from it may verify a face."""
        payload = self.home.cached_model(job.model_version, job.model_sha256)
        if payload is None:
            payload = self.link.downloads.fetch(topics.model_chunks(job.model_version), f"model-{job.model_version}",
                                                job.model_sha256, job.model_bytes, f"model v{job.model_version}")
            self.home.cache_model(job.model_version, job.model_sha256, payload)
        state = decode(payload, job.model_sha256)
        self.adopted = self._adopt(job, payload, state)
        return from_numpy_state(state)

    def _adopt(self, job, payload: bytes, state: dict) -> bool:
        """The device's own check of the announced model on its people and public negatives (only the
        outcome is reported, as one metric of its update)."""
        from edge_client.adoption import Adoption, check_faces
        from edge_client.recognizer import Settings
        from edge_client.vault import Vault

        crops = self._crops()
        faces = check_faces(crops.images, crops.labels, self.public.negatives_for_adoption(), seed=self.seed)
        with self.home.writing():  # the sealed settings are shared with `ffr device` commands
            vault = Vault.open(self.home.root / "store")
            settings = Settings.load(self.home, vault)
            adoption = Adoption(self.home.root / "models", sealed=settings.models)
            verdict = adoption.judge(job.model_sha256, payload, state, faces)
            seals = adoption.seals()  # the references the next model is judged against
            if verdict.ok and any(settings.models.get(name) != sha for name, sha in seals.items()):
                settings.models.update(seals)
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
        payload = self.link.downloads.fetch(topics.momentum_chunks(job.model_version), f"momentum-{job.model_version}",
                                            job.momentum_sha256, job.momentum_bytes, f"momentum v{job.model_version}")
        momentum = decode(payload, job.momentum_sha256)
        for name, value in momentum.items():
            if name not in model or tuple(model[name].shape) != value.shape or value.dtype.kind != "f":
                raise PayloadError(f"momentum tensor {name[:80]} is not one of the model's floating tensors")
        return from_numpy_state(momentum)

    def ensure_model(self, job: RoundAnnouncement | ModelRelease) -> FaceModel:
        """The device's model for this architecture, its private head and DFC branch restored from the home."""
        cfg = job.config
        if self.model is None or self.model.config.dfc != cfg.dfc:
            self.model = FaceModel(ModelConfig(n_classes=len(self._crops().identities),
                                               embedding_dim=cfg.embedding_dim, width_mult=cfg.width_mult,
                                               pretrained=False, dfc=cfg.dfc, dfc_weight=cfg.dfc_weight))
            saved = self._private(self.home.private_state, private_state(self.model))
            if saved is not None:
                self.model.load_state_dict(saved, strict=False)
        return self.model

    def _private(self, path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """A private part this device saved (its head and DFC branch, or its last local backbone) if it matches
        `like` key for key and shape for shape; a damaged or outgrown file is skipped with a warning (the next
        round writes it anew), so one bad file costs that part's personalisation, not every round after it."""
        if not path.exists():
            return None
        try:
            saved = load_torch(str(path))
            if set(saved) == set(like) and all(saved[k].shape == like[k].shape for k in like):
                return saved
            problem = "it does not fit this model"
        except Exception as exc:  # noqa: BLE001 - safetensors says a damaged file many ways
            problem = " ".join(str(exc).split())[:120] or type(exc).__name__
        log.warning("%s: %s is not used (%s); starting that part afresh", self.device_id, path.name, problem)
        return None

    def adopt_release(self, release: ModelRelease) -> bool:
        """The federation's final model: fetched, checked like every global model, and (if it passes) what this
        device verifies with from now on (its own DFC branch on top, `_export`). One log line says which; False if it
        could not be taken (the release is retained: the next connection tries again)."""
        try:
            global_state = self.fetch_global(release)
            chosen = None
            if self.adopted and self.export_onnx:
                model = self.ensure_model(release)
                load_shareable_state(model, global_state)
                chosen = self._export(model, global_state, release.config)
            log.info("%s: final model v%d %s%s", self.device_id, release.model_version,
                     "adopted" if self.adopted else "refused by this device's check; keeping the last good model",
                     f"; {chosen}" if chosen else "")
        except Exception as exc:  # noqa: BLE001 - a failed fetch must not kill the daemon; the release is retained
            log.error("%s: could not take the final model v%d: %s", self.device_id, release.model_version, exc)
            return False
        return True
