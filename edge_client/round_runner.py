"""One federated round on a device, its network side: fetch the announced model, hand it to the round's work (judge,
train, encode: `edge_client.round_work`), send the update, await the ack, then have the models exported.

An update is written to the device's home before it is sent and deleted only when acknowledged, so a
dropped connection resumes it instead of losing it. Nothing here imports torch: `ffr edge run` runs the work in a
child process per round (`edge_client.child_work`), a simulation in its own.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from edge_client.adoption import ADOPTED_METRIC
from edge_client.home import DeviceHome
from edge_client.link import CoordinatorLink
from edge_client.public_set import DevicePublicSet
from protocol import topics
from protocol.messages import ModelRelease, RoundAnnouncement, UpdateHeader

log = logging.getLogger("edge_client")


@dataclass(frozen=True)
class Trained:
    """A round's update as it is sent (encoded), and what the round's log says about it: what the work gives back
    (defined here, torch-free, so that a daemon reading it from its child imports no torch)."""

    data: bytes
    sha256: str
    n_samples: int
    metrics: dict        # sent with the update
    private_metrics: dict  # kept in the device's round log only
    momentum_tensors: int  # PFM's global momentum tensors received


class RoundRunner:
    def __init__(self, link: CoordinatorLink, home: DeviceHome, work, public: DevicePublicSet, export_onnx: bool,
                 superseded: Callable[[], bool], stop: threading.Event):
        """`work`: the round's torch side (`edge_client.round_work.RoundWork`, or `edge_client.child_work.ChildWork`
        for the same in a child process); `superseded()`: whether a newer job waits, and `stop` whether the daemon
        is stopping (either way an ack is no longer awaited)."""
        self.link, self.home, self.device_id = link, home, link.device_id
        self.work, self.public, self.export_onnx = work, public, export_onnx
        self._superseded, self.stop = superseded, stop
        self.adopted = True  # whether the round's global model passed the device's adoption check
        self.acked: dict[int, threading.Event] = {}

    @property
    def model(self):
        """The device's model after its last round (None while the work runs in a child process)."""
        return self.work.model

    # the round ---------------------------------------------------------------
    def run(self, job: RoundAnnouncement) -> None:
        if not self.link.registered.wait(30):
            raise RuntimeError("not registered with the coordinator")
        started = time.perf_counter()
        self.link.drop_stale_pending(job.round_id)
        self.public.fetch(job.config)  # strangers' faces for the adoption check and the calibration, too
        with self.work.session():
            self.adopted = self.work.judge(job, self.fetch_model(job))
            momentum = self._fetch_momentum(job) if job.config.method.strategy == "pfm" else None
            fetched = time.perf_counter()
            trained = self.work.train(job, momentum)
            timing = {"fetch_seconds": fetched - started, "train_seconds": time.perf_counter() - fetched}
            acked, upload_seconds = self._upload(job, trained, {**trained.metrics, **timing})
            chosen = None
            if self.export_onnx and self.adopted:  # a model the device's check refused never verifies a face here
                chosen = self.work.export(job)
        self.home.log_round({"round_id": job.round_id, "base_version": job.model_version, "acked": acked,
                             "adopted": self.adopted, "bytes_sent": len(trained.data), **timing,
                             "upload_seconds": upload_seconds, "verifier": chosen,
                             "global_momentum_tensors": trained.momentum_tensors,
                             **trained.metrics, **trained.private_metrics})
        log.info("%s: round %d: picked; model v%d fetched in %.1f s; trained %d samples in %.1f s (loss %.3f); "
                 "sent %.2f MB; %s; %s", self.device_id, job.round_id, job.model_version, timing["fetch_seconds"],
                 trained.n_samples, timing["train_seconds"], trained.metrics.get("train_loss", float("nan")),
                 len(trained.data) / 1e6, "acked" if acked else "not acked (kept to resend)",
                 "adopted" if self.adopted else "kept the last good model (this device's check refused it)")
        if chosen:
            log.info("%s: round %d: %s", self.device_id, job.round_id, chosen)

    def _upload(self, job: RoundAnnouncement, trained: Trained, metrics: dict) -> tuple[bool, float]:
        """Keep the encoded update on disk, send it, await the ack."""
        cfg = job.config
        header = UpdateHeader(round_id=job.round_id, base_version=job.model_version, n_samples=trained.n_samples,
                              transfer_id=f"{self.device_id}-r{job.round_id}-{trained.sha256[:12]}",
                              payload_sha256=trained.sha256, payload_bytes=len(trained.data), codec=cfg.transport.codec,
                              metrics={**metrics, ADOPTED_METRIC: float(self.adopted)})
        payload_path, header_path = self.home.pending_paths(job.round_id)
        payload_path.write_bytes(trained.data)
        header_path.write_text(json.dumps({"header": header.model_dump(), "chunk_bytes": cfg.transport.chunk_bytes}))
        uploading = time.perf_counter()
        self.link.send_update(header, trained.data, cfg.transport.chunk_bytes)
        acked = self._await_ack(job, header, trained.data)
        if acked:
            payload_path.unlink(missing_ok=True)
            header_path.unlink(missing_ok=True)
        return acked, time.perf_counter() - uploading

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
                self.link.send_update(header, data, job.config.transport.chunk_bytes)
                last_sent = time.monotonic()
        return True

    # models ------------------------------------------------------------------
    def fetch_model(self, job: RoundAnnouncement | ModelRelease) -> bytes:
        """The announced model's bytes, from the device's cache when it already holds that version (a resent or
        resumed round), else downloaded; refused unless its sha256 is the announced one. The work judges it (the
        device's adoption check, `edge_client.adoption`) before anything trained from it may verify a face."""
        payload = self.home.cached_model(job.model_version, job.model_sha256)
        if payload is None:
            payload = self.link.downloads.fetch(topics.model_chunks(job.model_version), f"model-{job.model_version}",
                                                job.model_sha256, job.model_bytes, f"model v{job.model_version}")
            self.home.cache_model(job.model_version, job.model_sha256, payload)
        return payload

    def _fetch_momentum(self, job: RoundAnnouncement) -> bytes | None:
        """PFM's global momentum for the announced version (None before the first aggregation); the work checks
        its tensors against the model's."""
        if job.momentum_sha256 is None:
            return None
        return self.link.downloads.fetch(topics.momentum_chunks(job.model_version), f"momentum-{job.model_version}",
                                         job.momentum_sha256, job.momentum_bytes, f"momentum v{job.model_version}")

    def adopt_release(self, release: ModelRelease) -> bool:
        """The federation's final model: fetched, checked like every global model, and (if it passes) what this
        device verifies with from now on (its own DFC branch on top). One log line says which; False if it could
        not be taken (the release is retained: the next connection tries again)."""
        try:
            self.public.fetch(release.config)
            with self.work.session():
                self.adopted = self.work.judge(release, self.fetch_model(release))
                chosen = self.work.export(release, trained=False) if self.adopted and self.export_onnx else None
            log.info("%s: final model v%d %s%s", self.device_id, release.model_version,
                     "adopted" if self.adopted else "refused by this device's check; keeping the last good model",
                     f"; {chosen}" if chosen else "")
        except Exception as exc:  # noqa: BLE001 - a failed fetch must not kill the daemon; the release is retained
            log.error("%s: could not take the final model v%d: %s", self.device_id, release.model_version, exc)
            return False
        return True
