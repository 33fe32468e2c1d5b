"""Faults against a live coordinator: bad inputs, a restart mid-round, a device dropping mid-upload."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from conftest import REPO, device_datasets
from test_federated import TRAINING, wait_for

from coordinator.broker import free_port
from coordinator.engine import RoundSettings
from coordinator.service import Service, ServiceConfig
from edge_client.daemon import EdgeDevice
from protocol import topics
from protocol.auth import Signer, token_proof
from protocol.chunks import split, to_bytes
from protocol.credential import Credential
from protocol.messages import Heartbeat, Hello, UpdateHeader, open_envelope, seal
from protocol.tensors import encode
from protocol.transport import BrokerAddress, make_client


class RawDevice:
    """A hand-driven MQTT client speaking the protocol, to send what a real device never would."""

    def __init__(self, url: str, credential: Credential):
        self.credential, self.device_id = credential, credential.device_id
        self.signer, self.seq = Signer.generate(), int(time.time() * 1000)
        self.registered = False
        self.inbox: list[dict] = []
        address = BrokerAddress.parse(url, credential.broker_username, credential.broker_password)
        self.client = make_client(f"raw-{self.device_id}", address)
        ready = threading.Event()
        self.client.on_connect = lambda c, u, f, rc, p: (c.subscribe(topics.device(self.device_id, "inbox"), qos=1),
                                                         ready.set())
        self.client.on_message = self._on_message
        self.client.connect(address.host, address.port)
        self.client.loop_start()
        assert ready.wait(10)
        time.sleep(0.2)

    def _on_message(self, client, userdata, msg) -> None:
        body = open_envelope(msg.payload, self.credential.coordinator_public_key).body
        if body.type == "registered":
            self.registered = True
        self.inbox.append(body.model_dump())

    def hello(self, proof: bool = True) -> Hello:
        return Hello(n_identities=1, n_images=5, public_key=self.signer.public_hex,
                     token_proof=token_proof(self.credential.token, self.device_id, self.signer.public_hex)
                     if proof else None)

    def register(self) -> None:
        self.send("hello", self.hello())
        wait_for(lambda: self.registered, 10, f"{self.device_id} registration")

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def raw(self, leaf: str, payload: bytes, device_id: str | None = None) -> None:
        self.client.publish(topics.device(device_id or self.device_id, leaf), payload, qos=1).wait_for_publish(5)

    def send(self, leaf: str, body, signer: Signer | None = None) -> bytes:
        payload = seal(self.device_id, self.next_seq(), body, signer or self.signer, to="coordinator")
        self.raw(leaf, payload)
        return payload

    def upload(self, header: UpdateHeader, data: bytes, chunk_bytes: int = 256 * 1024, upto: int | None = None) -> None:
        self.send("update", header)
        for chunk in split(header.transfer_id, data, chunk_bytes)[:upto]:
            self.raw("update/chunks", to_bytes(chunk))

    def errors(self) -> list[str]:
        return [m["reason"] for m in self.inbox if m["type"] == "error"]

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def _header(round_id: int, base: int, data: bytes, sha: str, transfer: str, **extra) -> UpdateHeader:
    return UpdateHeader(round_id=round_id, base_version=base, n_samples=5, transfer_id=transfer,
                        payload_sha256=sha, payload_bytes=len(data), **extra)


def _start(tmp: Path, url: str, n_devices: int, rounds: int = 1, timeout: float = 300, **settings):
    service = Service(ServiceConfig(state=tmp / "state", broker=url),
                      RoundSettings(rounds=rounds, min_clients=n_devices, round_timeout_s=timeout, training=TRAINING,
                                    **settings))
    service.engine.pause()  # rounds start when the test says so
    devices = [EdgeDevice(service.admit(f"device{d}"), data, tmp / f"home{d}", export_onnx=False)
               for d, data in enumerate(device_datasets(tmp / "data", n_devices, 2, 4))]
    for device in devices:
        device.start()
    wait_for(lambda: len(service.engine.store.devices()) >= n_devices, 30, "device registration")
    return service, devices


def _stop(service: Service, devices: list[EdgeDevice]) -> None:
    for device in devices:
        device.stop()
    service.close()


def test_bad_inputs_are_rejected_with_reasons_while_a_round_completes(tmp_path, mosquitto):
    service, devices = _start(tmp_path, mosquitto.url, 2, max_update_bytes=8 * 1024 * 1024)
    mallory = RawDevice(mosquitto.url, service.admit("mallory"))
    try:
        mallory.register()
        store = service.engine.store
        # before any round: transport and authentication faults
        mallory.raw("update", b"{this is not json")
        wrong_version = json.loads(seal("mallory", mallory.next_seq(), Heartbeat(), mallory.signer))
        wrong_version["schema_version"] = 99
        mallory.raw("heartbeat", json.dumps(wrong_version).encode())
        mallory.raw("heartbeat", seal("ghost", 1, Heartbeat(), Signer.generate()), device_id="ghost")
        mallory.send("heartbeat", Heartbeat(), signer=Signer.generate())
        replayed = mallory.send("heartbeat", Heartbeat())
        mallory.raw("heartbeat", replayed)
        # one round, in which mallory is a participant
        service.engine.resume()
        wait_for(lambda: service.engine.current is not None, 30, "round 1 to open")
        base = service.engine.version
        zeros = {k: np.zeros_like(v, dtype=np.float32) if v.dtype.kind == "f" else np.zeros_like(v)
                 for k, v in service.engine.global_state.items()}
        good = encode(zeros, "fp16")
        mallory.send("update", _header(99, base, good.data, good.sha256, "t-wrong-round"))
        mallory.send("update", _header(1, base + 5, good.data, good.sha256, "t-stale"))
        oversized = _header(1, base, good.data, good.sha256, "t-big").model_copy(update={"payload_bytes": 100 << 20})
        mallory.send("update", oversized)
        bad_payloads = {
            "t-names": {**zeros, "head.weight": np.zeros((3, 128), np.float32)},
            "t-shapes": {**zeros, "backbone.embedding.weight": np.zeros((7, 7), np.float32)},
            "t-dtype": {
                **zeros,
                "backbone.embedding.weight": np.zeros_like(zeros["backbone.embedding.weight"], np.int32),
            },
            "t-nan": {**zeros, "backbone.bn.weight": np.full_like(zeros["backbone.bn.weight"], np.nan)},
        }
        for transfer, tensors in bad_payloads.items():
            enc = encode(tensors, "fp16")
            mallory.upload(_header(1, base, enc.data, enc.sha256, transfer), enc.data)
            time.sleep(0.3)
        truncated = good.data[: len(good.data) // 2]
        mallory.send("update", _header(1, base, good.data, good.sha256, "t-trunc"))
        mallory.raw("update/chunks", to_bytes(split("t-trunc", truncated, 1 << 30)[0]))
        # same size, the signed hash, other bytes: the reassembler refuses them (the engine then decodes unhashed)
        tampered = bytes([good.data[0] ^ 1]) + good.data[1:]
        mallory.send("update", _header(1, base, good.data, good.sha256, "t-tampered"))
        for chunk in split("t-tampered", tampered, 1 << 20):
            mallory.raw("update/chunks", to_bytes(dataclasses.replace(chunk, sha256=good.sha256)))
        time.sleep(0.3)
        mallory.upload(_header(1, base, good.data, good.sha256, "t-good"), good.data)  # and finally a valid one
        wait_for(lambda: service.finished, 120, "the round to complete")
        reasons = [r["reason"] for r in store.rejections()]
        expected = ["invalid message", "unsupported schema version", "unknown device", "bad signature", "replayed",
                    "round 99 is not open", "stale base version", "exceeds", "tensor names differ", "has shape",
                    "has dtype int32", "NaN or Inf", "does not match the signed update header", "corrupted"]
        for fragment in expected:
            assert any(fragment in r for r in reasons), f"no rejection mentioning {fragment!r} in {reasons}"
        assert any("stale base version" in e for e in mallory.errors()), "the sender is told why"
        round_1 = store.rounds()[0]
        assert round_1["status"] == "completed" and round_1["n_updates"] == 3
        assert service.engine.version == base + 1
        assert all(np.isfinite(v).all() for v in service.engine.global_state.values() if v.dtype.kind == "f")
    finally:
        mallory.close()
        _stop(service, devices)


def test_device_dropping_mid_upload_does_not_block_the_round(tmp_path, mosquitto):
    service, devices = _start(tmp_path, mosquitto.url, 2, timeout=15)
    flaky = RawDevice(mosquitto.url, service.admit("flaky"))
    try:
        flaky.register()
        service.engine.resume()
        wait_for(lambda: service.engine.current is not None, 30, "round 1 to open")
        zeros = {k: np.zeros_like(v) for k, v in service.engine.global_state.items()}
        enc = encode(zeros, "fp16")
        flaky.upload(_header(1, service.engine.version, enc.data, enc.sha256, "t-half"), enc.data,
                     chunk_bytes=64 * 1024, upto=3)
        flaky.close()  # gone, mid-upload
        wait_for(lambda: service.finished, 60, "the round to close without the dropped device")
        round_1 = service.engine.store.rounds()[0]
        assert (round_1["status"], round_1["n_updates"], round_1["n_dropped"]) == ("completed", 2, 1)
        # closed by its deadline, not by the dropped device's half upload: read from the round's record, not a clock
        assert round_1["closed_at"] >= round_1["deadline"]
    finally:
        _stop(service, devices)


def test_coordinator_restart_mid_round_resumes_the_open_round(tmp_path, mosquitto):
    service, devices = _start(tmp_path, mosquitto.url, 2, rounds=1)
    devices[1].stop()  # device1 is away: round 1 can only be completed after the restart
    service.engine.resume()
    wait_for(lambda: service.engine.store.update_accepted(1, "device0"), 120, "device0's update in round 1")
    service.close()  # stopped mid-round 1, one update already acknowledged
    restarted = Service(ServiceConfig(state=tmp_path / "state", broker=mosquitto.url),
                        RoundSettings(rounds=1, min_clients=2, round_timeout_s=300, training=TRAINING))
    back = EdgeDevice(devices[1].credential, tmp_path / "data" / "device1", tmp_path / "home1", export_onnx=False)
    try:
        assert restarted.engine.version == 0 and restarted.engine.current.round_id == 1, "round 1 resumes"
        assert restarted.engine.current.done == {"device0"}, "the update acknowledged before the crash is kept"
        back.start()
        wait_for(lambda: restarted.finished, 180, "the resumed round")
        rounds = restarted.engine.store.rounds()
        assert [(r["round_id"], r["status"], r["base_version"], r["n_updates"]) for r in rounds] == \
            [(1, "completed", 0, 2)]
        assert restarted.engine.version == 1
        kept = [u["bytes"] for u in restarted.engine.store.accepted_updates(1)]
        assert len(kept) == 2 and rounds[0]["metrics"]["bytes_received"] == sum(kept) > 0, \
            "the round's bytes count the update kept across the restart"
    finally:
        back.stop()
        _stop(restarted, devices[:1])


def _get(url: str, token: str | None = None) -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read()


def _status(url: str, method: str = "GET", headers: dict | None = None, data: bytes | None = None) -> int:
    request = urllib.request.Request(url, method=method, headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _health(base: str) -> dict:
    try:
        return json.loads(_get(f"{base}/health"))
    except OSError:  # the HTTP server may still be starting
        return {}


def _serve(tmp_path: Path, port: int, env: dict) -> tuple[subprocess.Popen, str]:
    no_torch = "import sys; sys.modules['torch'] = None; from ffr.cli import main; sys.exit(main(sys.argv[1:]))"
    # the whole step (--server-step 1): the scenario these processes act out (2 people a device at lr 1e-3, each
    # device adopting the final model) was written for it; the gateless quarter step has its own test. --no-gate:
    # 2 people a device pull the embedding together (on the stand-in faces impostors accepted 0.1% -> 71%), which
    # the gate rightly refuses (tests/test_federation_value.py); what is tested here is the processes and the API
    coordinator = subprocess.Popen(
        [sys.executable, "-c", no_torch, "coordinator", "serve", "--rounds", "2", "--min-clients", "2",
         "--state", str(tmp_path / "state"), "--http-port", str(port), "--lr", "1e-3", "--batch-size", "8",
         "--server-step", "1", "--no-gate"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    first = ""
    for _ in range(50):  # log lines may come first
        first = coordinator.stdout.readline()
        if first.startswith("coordinator: broker") or not first:
            break
    assert first.startswith("coordinator: broker mqtt://127.0.0.1:"), first
    return _drained(coordinator), first.split()[2].rstrip(",")


def _drained(proc: subprocess.Popen) -> subprocess.Popen:
    """Read a child's output as it comes (a full pipe would block the child) and keep it in `proc.lines`."""
    proc.lines = []
    threading.Thread(target=lambda: proc.lines.extend(proc.stdout), daemon=True).start()
    return proc


def _wait_or_explain(predicate, timeout: float, what: str, coordinator: subprocess.Popen,
                     edges: list[subprocess.Popen] = ()) -> None:
    try:
        wait_for(predicate, timeout, what)
    except AssertionError as exc:
        tails = [f"--- {name} output (last 40 lines) ---\n" + "".join(proc.lines[-40:])
                 for name, proc in [("coordinator", coordinator)] + [(f"edge {i}", e) for i, e in enumerate(edges)]]
        raise AssertionError("\n".join([str(exc), *tails])) from None


def test_cli_coordinator_and_edge_processes_with_http_api(tmp_path):
    """`ffr coordinator serve` (embedded broker with ACLs, torch blocked: round 0 is the shipped face embedder read
    with safetensors + numpy), `ffr coordinator admit` and two `ffr edge run --credential` processes, as a user runs
    them; the API needs its token; after `kill -9` the coordinator comes back on the same broker port, stops the
    orphaned broker, and the devices finish the run without help."""
    datasets = device_datasets(tmp_path / "data", 2, 2, 4)
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    coordinator, broker = _serve(tmp_path, port, env)
    edges = []
    try:
        token = (tmp_path / "state" / "api-token").read_text().strip()
        assert (tmp_path / "state" / "api-token").stat().st_mode & 0o077 == 0
        assert (tmp_path / "state" / "coordinator.key").stat().st_mode & 0o077 == 0
        for d, data in enumerate(datasets):
            credential = tmp_path / f"dev{d}.credential"
            subprocess.run([sys.executable, "-m", "ffr", "coordinator", "admit", "--state",
                            str(tmp_path / "state"), "--device-id", f"dev{d}", "--out", str(credential)],
                           cwd=REPO, check=True, capture_output=True, env=env)
            assert credential.stat().st_mode & 0o077 == 0
            edges.append(_drained(subprocess.Popen(
                [sys.executable, "-m", "ffr", "edge", "run", "--credential", str(credential), "--data",
                 str(data), "--home", str(tmp_path / f"home{d}"), "--exit-when-done"],
                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)))
        base = f"http://127.0.0.1:{port}"
        _wait_or_explain(lambda: _health(base).get("completed_rounds") == 1, 240, "one round over the CLI",
                         coordinator, edges)
        health = _health(base)
        assert health["mqtt"] == "connected" and "dev0" not in json.dumps(health), "health shows no ids"
        for path in ("/devices", "/rounds", "/rejections", "/model", "/model/1/download", "/status"):
            assert _status(base + path) == 401, f"{path} without the token"
        for path in ("/training/stop", "/training/start"):  # what a cross-site form post can send
            assert _status(base + path, "POST", {"Content-Type": "application/x-www-form-urlencoded"}, b"x=1") == 401
            assert _status(base + path, "POST", {"Authorization": "Bearer wrong"}) == 401
        devices = json.loads(_get(f"{base}/devices", token))
        assert {d["device_id"] for d in devices} == {"dev0", "dev1"}
        assert json.loads(_get(f"{base}/rounds", token))[0]["status"] == "completed"
        assert json.loads(_get(f"{base}/model", token))["version"] >= 1
        from safetensors.numpy import load

        assert all(k.startswith("backbone.") for k in load(_get(f"{base}/model/1/download", token)))
        assert json.loads(_get(f"{base}/rejections?limit=5", token))["limit"] == 5
        assert b"ffr_completed_rounds 1.0" in _get(f"{base}/metrics")
        assert _status(base + "/openapi.json") == 404  # the API map is off unless --api-docs (issue 25)

        # kill -9 mid-run: the embedded broker is orphaned; the restart reclaims its port
        orphan = int((tmp_path / "state" / "broker" / "mosquitto.pid").read_text())
        coordinator.kill()
        coordinator.wait(10)
        assert Path(f"/proc/{orphan}").exists(), "the orphaned broker outlives its coordinator"
        coordinator, again = _serve(tmp_path, port, env)
        assert again == broker, "the restarted coordinator serves on the same broker port"
        assert not Path(f"/proc/{orphan}").exists() or b"mosquitto" not in Path(f"/proc/{orphan}/cmdline").read_bytes()
        _wait_or_explain(lambda: _health(base).get("completed_rounds") == 2, 300, "round 2 after the restart",
                         coordinator, edges)
        for edge in edges:
            assert edge.wait(180) == 0, "".join(edge.lines[-40:])
            said = "".join(edge.lines)  # a device says what it is doing: a line per round, the broker, the end
            assert "round 2: picked; model v1 fetched" in said and "; acked; adopted" in said, said[-2000:]
            # the device decides on the final model by its own check (adopted, or refused: it keeps the last good
            # one); which, depends on how the shipped weights take two 8-image rounds at server step 1, not on the
            # faults this test makes (with the 2026-11-27 weights both devices' checks refuse v1 and v2)
            assert "lost the broker" in said and re.search(r"final model v2 (adopted|refused by this device's check)",
                                                           said), said[-2000:]
        assert (tmp_path / "home0" / "models" / "personalised.onnx").exists()
        from coordinator.store import Store
        from models.networks.face_weights import face_global_state

        start, shipped = Store(tmp_path / "state").load_model(0), face_global_state()
        assert start.keys() == shipped.keys() and all(np.array_equal(start[k], shipped[k]) for k in start)
    finally:
        for proc in edges + [coordinator]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        coordinator.wait(30)


def test_broker_restart_during_upload_is_survived(tmp_path):
    """Devices and coordinator reconnect with backoff; an unacknowledged update is sent again."""
    from coordinator.broker import EmbeddedBroker

    limit = 256 * 1024  # a broker with a small message limit: every frame must fit
    broker = EmbeddedBroker(message_size_limit=limit)
    port = broker.port
    service, devices = _start(tmp_path, broker.url, 2)
    try:
        service.engine.resume()
        pending = tmp_path / "home0" / "pending" / "round1.json"
        wait_for(lambda: devices[0].model is not None, 120, "device0 to have the global model")
        broker.close()  # the network goes away while device0 trains and uploads
        time.sleep(2.0)
        broker = EmbeddedBroker(port=port, message_size_limit=limit)
        wait_for(lambda: service.finished, 120, "the round to complete after the broker came back")
        round_1 = service.engine.store.rounds()[0]
        assert (round_1["status"], round_1["n_updates"]) == ("completed", 2)
        wait_for(lambda: not pending.exists(), 30, "device0 to drop its acknowledged update")
    finally:
        _stop(service, devices)
        broker.close()


def test_device_refuses_a_model_whose_hash_is_not_the_announced_one(tmp_path):
    data = device_datasets(tmp_path / "data", 1, 2, 3)[0]
    credential = Credential(device_id="lonely", token="0" * 64, coordinator_public_key=Signer.generate().public_hex,
                            broker="mqtt://127.0.0.1:1")
    device = EdgeDevice(credential, data, tmp_path / "home")  # never connected
    real = b"the announced model bytes"
    forged = b"some other model of the same size"[: len(real)]
    from protocol.tensors import sha256_hex

    downloads = device.link.downloads
    downloads.expected_transfer = ("model-3", sha256_hex(real), len(real))
    downloads.on_chunk(to_bytes(split("model-3", forged)[0]))
    assert not downloads.downloaded.is_set(), "a chunk with another hash must not be assembled"
    downloads.on_chunk(to_bytes(split("model-3", real)[0]))
    assert downloads.downloaded.is_set() and downloads.model_payload == real


def test_a_device_says_it_is_waiting_for_a_broker_that_is_down(tmp_path):
    from coordinator.admission import admit
    from coordinator.broker import free_port
    from models.faces.synthetic import write_dataset

    credential = tmp_path / "dev.json"
    admit(tmp_path / "state", "dev0", f"mqtt://127.0.0.1:{free_port()}").save(credential)  # nothing listens there
    data = write_dataset(tmp_path / "faces", 2, 2, seed=1)
    edge = _drained(subprocess.Popen([sys.executable, "-m", "ffr", "edge", "run", "--credential", str(credential),
                                      "--data", str(data), "--home", str(tmp_path / "home")],
                                     cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        deadline = time.monotonic() + 60
        while sum("waiting for the broker" in line for line in edge.lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        waits = [line for line in edge.lines if "waiting for the broker" in line]
        assert len(waits) >= 2 and "try 1 failed" in waits[0] and "try 2 failed" in waits[1], "".join(edge.lines)
    finally:
        edge.send_signal(signal.SIGINT)
        edge.wait(30)
