"""Coordinator + edge devices over a real Mosquitto broker: rounds, privacy audit, personalised models."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from conftest import device_datasets
from safetensors.numpy import load

from coordinator.engine import RoundSettings
from coordinator.service import Service, ServiceConfig
from edge_client.daemon import EdgeDevice
from edge_client.vault import Vault
from models.evaluation.metrics import verification_report
from models.faces.crops import CropConfig, crop_index
from models.faces.datasets import load_index
from models.runtime import OnnxEmbedder
from protocol.chunks import Reassembler, from_bytes
from protocol.messages import TrainingConfig
from protocol.transport import BrokerAddress, make_client

# at the default lr: devices train with BatchNorm frozen, and at 1e-3 a few people lift every score enough that
# the devices' own adoption check refuses the global model (kept: that check is right to)
TRAINING = TrainingConfig(epochs=1, batch_size=8, lr=1e-4)
# the audited fleet runs FedFR's local objective, so the audit covers what a public set could leak
FEDFR = TrainingConfig(epochs=1, batch_size=8, lr=1e-4, hard_negatives=True, t_hn=-1.0, contrastive=True,
                       dfc_weight=10.0, dfc_steps=50)


class Recorder:
    """Subscribes to every topic and keeps every byte the broker carries."""

    def __init__(self, url: str):
        self.messages: list[tuple[str, bytes]] = []
        self.lock = threading.Lock()
        address = BrokerAddress.parse(url)
        self.client = make_client("traffic-audit", address)
        ready = threading.Event()
        self.client.on_connect = lambda c, u, f, rc, p: (c.subscribe("#", qos=1), ready.set())
        self.client.on_message = lambda c, u, m: self._keep(m.topic, bytes(m.payload))
        self.client.connect(address.host, address.port)
        self.client.loop_start()
        assert ready.wait(10)
        time.sleep(0.3)

    def _keep(self, topic: str, payload: bytes) -> None:
        with self.lock:
            self.messages.append((topic, payload))

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def run_fleet(tmp: Path, broker_url: str | None, rounds: int = 2, n_devices: int = 3,
              training: TrainingConfig = TRAINING, public_set: Path | None = None):
    datasets = device_datasets(tmp / "data", n_devices, ids_per_device=3, images=5)
    service = Service(ServiceConfig(state=tmp / "state", broker=broker_url),
                      RoundSettings(rounds=rounds, min_clients=n_devices, round_timeout_s=300, training=training))
    devices = [EdgeDevice(service.admit(f"device{d}"), data, tmp / f"home{d}", public_set=public_set)
               for d, data in enumerate(datasets)]
    for device in devices:
        device.start()
    try:
        wait_for(lambda: service.finished, 400, f"{rounds} federated rounds")
        for device in devices:
            assert device.finished.wait(120), f"{device.device_id} did not finish its last round"
    finally:
        for device in devices:
            device.stop()
        service.close()
    return service, devices, datasets


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, mosquitto):
    from models.faces.synthetic import write_dataset
    from models.public_set import build_public_set

    tmp = tmp_path_factory.mktemp("fleet")
    public = write_dataset(tmp / "public_faces", n_identities=6, n_images=4, seed=99)  # nobody's people
    build_public_set(public, tmp / "public.safetensors")
    recorder = Recorder(mosquitto.url)
    service, devices, datasets = run_fleet(tmp, mosquitto.url, training=FEDFR, public_set=tmp / "public.safetensors")
    time.sleep(0.5)
    recorder.close()
    return service, devices, datasets, recorder.messages


def test_rounds_advance_the_global_model(fleet):
    service, devices, _, _ = fleet
    store = service.engine.store
    assert service.engine.version == 2 and [m["version"] for m in store.models()] == [0, 1, 2]
    rounds = store.rounds()
    assert [(r["round_id"], r["status"], r["n_updates"], r["n_dropped"]) for r in rounds] == \
        [(1, "completed", 3, 0), (2, "completed", 3, 0)]
    assert {d["device_id"]: d["rounds_joined"] for d in store.devices()} == {f"device{i}": 2 for i in range(3)}
    assert store.rejections() == []
    for device in devices:
        log = device.home.rounds_log()
        assert [e["round_id"] for e in log] == [1, 2] and all(e["acked"] for e in log)
        assert all(e["hn_fraction"] == 1.0 for e in log), "t_HN = -1: every public face is a hard negative"
        assert log[0]["con_loss"] == pytest.approx(0, abs=1e-5) and log[1]["con_loss"] != 0, \
            "round 2's contrastive term has a previous local model to push away from"
        assert device.home.signing_key.stat().st_mode & 0o077 == 0


def test_every_device_gets_the_final_model_and_the_coordinator_says_finished(fleet):
    service, devices, _, _ = fleet
    status = service.engine.status()
    assert status["state"] == "finished" and status["training"] is False and status["model_version"] == 2
    for device in devices:  # the model of the last round, not the one each device trained on in it (v1)
        adopted = json.loads((device.home.root / "models" / "adopted.json").read_text())
        assert adopted["sha256"] == service.engine.broadcast.model.sha256 and device.released == 2


def test_each_device_personalised_model_verifies_its_own_people(fleet):
    from edge_client.recognizer import Settings, current_model, file_sha256

    _, devices, datasets, _ = fleet
    for device, data in zip(devices, datasets):
        model = device.home.personalised_onnx
        vault = Vault.open(device.home.root / "store")
        # the device verifies with the better of the global and its personalised model, recalibrated for it
        settings, chosen = Settings.load(device.home, vault), current_model(device.home, vault)
        assert chosen.name == settings.verifier and chosen in (model, device.home.generic_onnx)
        assert settings.calibration.model_sha256 == file_sha256(chosen)
        assert all(e["verifier"].startswith("own people TAR ") and " at FAR 0.001 with the " in e["verifier"]
                   for e in device.home.rounds_log())
        embedder = OnnxEmbedder(model)
        assert embedder.info.kind == "personalised"
        crops = crop_index(load_index(data), CropConfig(detector="none"), use_cache=False, progress=False)
        report = verification_report(embedder.embed(crops.images), crops.labels)
        assert report["auc"] > 0.6, (device.device_id, report)


ALLOWED_BODY_TYPES = {"hello", "registered", "heartbeat", "round", "release", "update", "ack", "error"}


def test_traffic_audit_only_backbone_tensors_leave_devices(fleet):
    service, _, _, messages = fleet
    backbone_names = set(service.engine.global_state)
    assert backbone_names and all(n.startswith("backbone.") for n in backbone_names)
    transfers: dict[str, Reassembler] = {}
    payloads: list[bytes] = []
    kinds = set()
    for topic, payload in messages:
        assert topic.startswith("ffr/v1/"), topic
        if not payload:
            continue
        if topic.endswith("/chunks") or "/chunks/" in topic:  # raw tensor bytes: checked once reassembled
            chunk = from_bytes(payload)
            assembler = transfers.setdefault(chunk.transfer_id, Reassembler.for_chunk(chunk))
            done = assembler.add(chunk)
            if done is not None:
                payloads.append(done)
            kinds.add("tensors")
            continue
        assert b"\x89PNG" not in payload and b"\xff\xd8\xff" not in payload, f"image bytes on {topic}"
        assert b"head." not in payload and b"dfc." not in payload, f"private parameters on {topic}"
        envelope = json.loads(payload)
        assert set(envelope) == {"schema_version", "sender", "to", "seq", "sent_at", "body", "signature"}
        assert envelope["body"]["type"] in ALLOWED_BODY_TYPES
        kinds.add(envelope["body"]["type"])
        assert len(envelope["signature"]) == 128, "every message, both ways, is signed (Ed25519)"
        body = json.dumps(envelope["body"])
        assert "token" not in envelope["body"] and "key\"" not in body.replace("public_key", ""), \
            "no secret key or admission token crosses the broker"
        if envelope["sender"] != "coordinator":  # the coordinator may name the public set it serves; devices
            assert not any(word in body.replace("public_key", "") for word in ("hn_", "neg_loss", "public")), \
                f"something about D_g on {topic}"
    assert {"hello", "registered", "round", "update", "ack", "tensors"} <= kinds
    assert len(payloads) == 3 * 2 + 3  # 6 device updates + 3 global models
    for data in payloads:
        assert not data.startswith((b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"BM")), "an image file as payload"
        tensors = load(data)
        assert set(tensors) == backbone_names, "a payload held something other than the backbone"
        for name, value in tensors.items():  # and each has exactly the backbone tensor's shape
            assert value.shape == service.engine.global_state[name].shape, name


def test_the_same_run_through_the_embedded_broker(tmp_path):
    service, devices, _ = run_fleet(tmp_path, broker_url=None, rounds=1, n_devices=2)
    assert service.broker_url.startswith("mqtt://127.0.0.1:")
    assert service.engine.version == 1 and service.engine.store.rounds()[0]["status"] == "completed"
    assert service.broker.process.poll() is not None, "the embedded broker is stopped with the service"
