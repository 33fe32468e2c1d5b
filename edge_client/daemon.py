"""`ffr edge run`: the device daemon. Joins with its credential, then trains one round per announcement.

The device in parts: its session with the coordinator (`edge_client.link`: broker, signatures, admission,
uploads), the round runner (`edge_client.round_runner`: fetch, upload, ack) and the round's work
(`edge_client.round_work`: adoption check, local algorithm, export; in a child process per round unless
`in_process`, `edge_client.child_work`), the local algorithms (`edge_client.local_algorithms`), the exporter
(`edge_client.exporter`) and, for
FedFace's validators, `edge_client.validator`. This class wires them and routes the coordinator's signed
messages to them. Training settings outside the protocol's bounds are refused by schema.

Threads: paho's network thread only routes messages; a worker thread does the rounds (download, train,
upload), so a long local epoch never stalls the connection.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import signal
import sys
import threading
import time
from functools import cached_property
from pathlib import Path

from edge_client.child_work import ChildWork
from edge_client.device_faces import DeviceFaces
from edge_client.home import DeviceHome
from edge_client.link import CoordinatorLink, load_credential
from edge_client.memory import release_memory
from edge_client.public_set import DevicePublicSet
from edge_client.round_runner import RoundRunner
from edge_client.validator import Validator
from models.faces.crops import CropConfig, FaceCrops, decoded_crops, resolve_detector
from models.faces.datasets import load_index
from protocol.credential import Credential
from protocol.messages import Ack, Heartbeat, ModelRelease, RoundAnnouncement, TrainingConfig, ValidationRequest

log = logging.getLogger("edge_client")


class EdgeDevice:
    def __init__(self, credential: Credential | Path | str, data: Path | None, home: Path, detector: str | None = None,
                 broker: str | None = None, ca_file: str | None = None, export_onnx: bool = True, seed: int = 0,
                 crop_cache: Path | None = None, public_set: Path | None = None,
                 validation: Path | FaceCrops | None = None, in_process: bool = True):
        """`public_set`: FedFR's D_g (models.public_set), read when a round asks for hard negatives.
        `validation`: this device's private validation images (a folder, or crops): it then scores FedFace's
        candidate models (Federated Validation) and sends only the score. `data` None: the people enrolled in the
        home's store (`edge_client.enrolled_faces`), read again for every round. No image is read here: the faces
        are decoded on first use (`prepare`, or `start`). `in_process` False: each round's torch work runs in a child
        process (`edge_client.child_work`; `ffr edge run`), so that the idle daemon never holds torch."""
        self.credential = load_credential(credential)
        self.device_id, self.home = self.credential.device_id, DeviceHome(home)
        self._data, self._detector, self._validation = None if data is None else Path(data), detector, validation
        self.faces = DeviceFaces(self._data, detector, crop_cache or self.home.root / "crops", self.home)
        self.last_config = TrainingConfig()
        self.jobs: queue.Queue[RoundAnnouncement | ModelRelease | None] = queue.Queue()
        self.queued_rounds: set[int] = set()  # an announcement can arrive twice (retained + re-sent on hello)
        self.released: int | None = None  # the final model version being (or already) taken
        self.done_rounds = {e["round_id"] for e in self.home.rounds_log()}
        self.failed_rounds: dict[int, str] = {}
        self.stop_event = threading.Event()
        self.finished = threading.Event()
        self.link = CoordinatorLink(self.credential, self.home, self._on_body, self._hello_facts, broker, ca_file)
        public = DevicePublicSet(public_set, self.home.root / "public", self.device_id)
        self.rounds = RoundRunner(self.link, self.home, self._round_work(public, seed, in_process), public, export_onnx,
                                  lambda: not self.jobs.empty(), self.stop_event)
        self.validator: Validator | None = None

    def _round_work(self, public: DevicePublicSet, seed: int, in_process: bool):
        """The round's torch side: here (with the `outgoing` seam), or in a child process per round (the update as
        trained: a subclass that overrides `outgoing` must train in process)."""
        if in_process:
            from edge_client.round_work import RoundWork

            return RoundWork(self.home, lambda: self.crops, public, seed, self.device_id, self.outgoing)
        if type(self).outgoing is not EdgeDevice.outgoing:
            raise ValueError(f"{type(self).__name__} overrides `outgoing`: it trains in process")
        return ChildWork(self.home, self.faces, public, seed, self.device_id, self.stop_event)

    @property
    def crops(self) -> FaceCrops:
        """The faces a round trains on (`edge_client.device_faces`)."""
        return self.faces.crops

    @cached_property
    def validation_crops(self) -> FaceCrops | None:
        if self._validation is None or isinstance(self._validation, FaceCrops):
            return self._validation
        config = self.faces.crop_config if self._data is not None else CropConfig(detector=resolve_detector(
            self._detector, load_index(self._validation)), fallback_center=True)
        return decoded_crops(load_index(self._validation), config, self.faces.crop_cache,
                             self.home.root / "validation", min_images=2)

    def prepare(self) -> None:
        """Decode the device's faces (and validation faces) now: a bad data folder is said before connecting."""
        _ = self.crops, self.validation_crops

    # running ----------------------------------------------------------------
    def start(self) -> None:
        self.prepare()
        if self.validation_crops is not None:
            self.validator = Validator(self.device_id, self.validation_crops, self.link.downloads.fetch,
                                       self.link.send, lambda: self.last_config)
            self.validator.start(self.stop_event)
        self.link.start()
        self.worker = threading.Thread(target=self._work, name=f"edge-{self.device_id}", daemon=True)
        self.worker.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.jobs.put(None)
        if self.validator is not None:
            self.validator.stop()
        if hasattr(self, "worker"):
            self.worker.join(timeout=30)
        self.link.stop()

    def outgoing(self, delta: dict, n_samples: int, global_state: dict) -> tuple[dict, int]:
        """The update as sent: as trained. The one seam a fleet experiment's attacker overrides (fleet.attacks)."""
        return delta, n_samples

    # what the session reports -----------------------------------------------
    @property
    def registered(self) -> threading.Event:
        return self.link.registered

    @property
    def dropped_messages(self) -> int:
        return self.link.dropped_messages

    @property
    def acked(self) -> dict[int, threading.Event]:
        return self.rounds.acked

    @property
    def model(self):
        return self.rounds.model

    def _hello_facts(self) -> dict:
        return {"n_identities": len(self.crops.identities), "n_images": len(self.crops),
                "validator": self.validation_crops is not None}

    def _on_body(self, body) -> None:
        """A signed message for the device (the session's own are handled by the link)."""
        if isinstance(body, ValidationRequest) and self.validator is not None:
            self.validator.requests.put(body)
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
            self.rounds.on_ack(body.round_id)

    def _work(self) -> None:
        while not self.stop_event.is_set():
            job = self.jobs.get()
            if job is None or self.stop_event.is_set():
                return
            if isinstance(job, ModelRelease):
                self._take_release(job)
            elif job.round_id not in self.done_rounds and time.time() <= job.deadline_unix:
                self._run_round(job)
            else:  # a stale or repeated announcement: nothing was allocated
                continue
            release_memory()  # an idle daemon holds its imports, not its last round's peak

    def _run_round(self, job: RoundAnnouncement) -> None:
        try:
            self.rounds.run(job)
            self.done_rounds.add(job.round_id)  # last: whoever waits on it finds the round logged
        except Exception as exc:  # noqa: BLE001 - one failed round must not kill the daemon
            self.failed_rounds[job.round_id] = f"{type(exc).__name__}: {exc}"
            self.queued_rounds.discard(job.round_id)  # the coordinator's next announcement may retry it
            if self.stop_event.is_set():
                log.info("%s: round %d left unfinished: the device is stopping", self.device_id, job.round_id)
            else:
                log.exception("%s: round %d failed", self.device_id, job.round_id)

    def _take_release(self, release: ModelRelease) -> None:
        if self.rounds.adopt_release(release):  # taken (adopted, or refused by this device's own check)
            sent = self.link.send("heartbeat", Heartbeat(state=f"final v{release.model_version}"))
            with contextlib.suppress(RuntimeError, ValueError):  # no broker now: the coordinator's grace ends it
                sent.wait_for_publish(5)
            self.finished.set()  # a coordinator with --exit-when-done waits for this word before stopping
        else:
            self.released = None


def run(credential: Path, data: Path | None, home: Path, until_finished: bool = False, in_process: bool = False,
        **options) -> int:
    DeviceHome(home).hold_daemon()  # one daemon per home: two would replay each other's sequence numbers forever
    device = EdgeDevice(credential, data, home, in_process=in_process, **options)
    if threading.current_thread() is threading.main_thread():  # a service manager's stop: the same clean end
        signal.signal(signal.SIGTERM, lambda *_: device.stop_event.set())
    device.start()
    faces = device.crops
    source = "enrolled" if data is None else f"in {data}"
    print(f"edge device {device.device_id}: {len(faces)} face images of {len(faces.identities)} people {source}; "
          f"broker {device.link.address}; home {home}; coordinator key {device.link.coordinator_key[:16]}...",
          flush=True)
    try:
        while not device.stop_event.is_set() and device.link.cannot_join is None:
            if until_finished and device.finished.wait(0.5):
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        device.stop()
    if device.link.cannot_join is not None:
        print(f"edge device {device.device_id}: cannot join: {device.link.cannot_join}", file=sys.stderr, flush=True)
        return 2
    print(f"edge device {device.device_id}: stopped", flush=True)
    return 0
