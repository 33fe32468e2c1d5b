"""Hostile traffic against a live coordinator over Mosquitto while an honest round is open.

python -m bench.fuzz --out bench/results [--messages 100000]

Families (drawn in turn): random bytes; mutated valid signed JSON; wrong types; huge fields;
absurd chunk headers; non-finite numbers; deep nesting; huge integers; forged signatures;
replays of captured messages. They go to the attacker's own topics and to the honest
devices' topics (the broker here has no ACLs: the worst case). Reported: messages per
second handled, how many were refused with a reason, unexpected handler errors (must be 0),
the coordinator's RSS before and after, and whether the honest round completed.
`tests/test_fuzz.py` runs the same with 10,000 messages.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from protocol import topics
from protocol.auth import Signer
from protocol.messages import Heartbeat, Hello, UpdateHeader, seal

# the honest devices' step: small enough that the quality gate on its stand-in faces never refuses it, so the
# round's outcome says what the hostile traffic did (at 1e-3, 1 round in 30 lost 0.018 stand-in AUC: rolled back)
HONEST_LR = 1e-4
GATE_AUC = ("gate_auc_current", "gate_auc_candidate")
FAMILIES = ("random_bytes", "mutated_json", "wrong_types", "huge_fields", "chunk_headers", "non_finite",
            "deep_nesting", "huge_integers", "forged_signature", "replay")


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Hostile:
    """Generates hostile (leaf, payload) pairs from one admitted attacker and its captured messages."""

    def __init__(self, device_id: str, signer: Signer, seed: int = 0):
        self.id, self.signer, self.rng = device_id, signer, random.Random(seed)
        self.seq = int(time.time() * 1000)
        self.captured: list[bytes] = []

    def _valid(self) -> bytes:
        """A well-formed signed message (hostile families then break it)."""
        self.seq += 1
        body = self.rng.choice([Heartbeat(), Hello(n_identities=1, n_images=5, public_key=self.signer.public_hex),
                                UpdateHeader(round_id=1, base_version=0, n_samples=5, transfer_id="t",
                                             payload_sha256="0" * 64, payload_bytes=10)])
        return seal(self.id, self.seq, body, self.signer, to="coordinator")

    def capture(self) -> bytes:
        """A genuine heartbeat, to be sent once and kept for replaying."""
        self.seq += 1
        raw = seal(self.id, self.seq, Heartbeat(), self.signer, to="coordinator")
        self.captured.append(raw)
        return raw

    def message(self, family: str) -> tuple[str, bytes]:
        r = self.rng
        if family == "random_bytes":
            return r.choice(["hello", "heartbeat", "update", "update/chunks"]), r.randbytes(r.randint(0, 4096))
        if family == "mutated_json":
            raw = bytearray(self._valid())
            for _ in range(r.randint(1, 8)):
                at = r.randrange(len(raw))
                raw[at] = (raw[at] + r.randint(1, 255)) % 256  # always a different byte
            return "heartbeat", bytes(raw)
        envelope = json.loads(self._valid())
        if family == "wrong_types":
            key = r.choice(["seq", "sent_at", "sender", "body", "signature", "schema_version"])
            envelope[key] = r.choice([[], {}, "x", None, True, [1, 2], {"a": 1}])
            return "heartbeat", json.dumps(envelope).encode()
        if family == "huge_fields":
            key = r.choice(["sender", "signature", "to"])
            envelope[key] = "A" * r.choice([1000, 100_000, 1_000_000])
            return "heartbeat", json.dumps(envelope).encode()
        if family == "chunk_headers":
            header = {"transfer_id": r.choice(["t", "x" * 300, "", 5]), "index": r.choice([0, -1, 10 ** 30, 1.5]),
                      "count": r.choice([1, 0, 10 ** 7, 2 ** 63]), "total_bytes": r.choice([1, 10 ** 12, -5]),
                      "sha256": r.choice(["0" * 64, "zz", None])}
            text = json.dumps(header).encode()
            if r.random() < 0.3:
                text = text.replace(b"0,", b"Infinity,", 1)
            size = len(text) if r.random() < 0.8 else r.choice([0, 2 ** 31, 10 ** 6])
            return "update/chunks", size.to_bytes(4, "big") + text + r.randbytes(64)
        if family == "non_finite":
            text = json.dumps(envelope).replace(f'"sent_at": {envelope["sent_at"]}',
                                                f'"sent_at": {r.choice(["NaN", "Infinity", "-Infinity", "1e400"])}')
            return "heartbeat", text.encode()
        if family == "deep_nesting":
            depth = r.choice([300, 5000, 50_000])
            return r.choice(["heartbeat", "hello"]), b'{"body":' + b"[" * depth + b"]" * depth + b"}"
        if family == "huge_integers":
            envelope[r.choice(["seq", "schema_version"])] = r.choice([2 ** 63, 2 ** 64 + 1, -(2 ** 63) - 1, 10 ** 400])
            return "heartbeat", json.dumps(envelope).encode()
        if family == "forged_signature":
            envelope["signature"] = f"{r.getrandbits(512):0128x}"
            return "heartbeat", json.dumps(envelope).encode()
        if family == "replay":
            if not self.captured:
                raise RuntimeError("capture() some genuine messages before replaying")
            return "heartbeat", r.choice(self.captured)
        raise ValueError(family)


def attack(engine, publish, targets: list[str], hostile: Hostile, n: int, batch: int = 500,
           timeout_s: float = 600.0) -> dict:
    """Send `n` hostile messages (`publish(topic, payload)`), pacing on the engine; returns the figures."""
    rejected_before, handled_before, rss_before = engine.rejected, engine.handled, rss_mb()
    started = time.perf_counter()
    per_family = dict.fromkeys(FAMILIES, 0)
    for i in range(n):
        family = FAMILIES[i % len(FAMILIES)]
        leaf, payload = hostile.message(family)
        per_family[family] += 1
        publish(topics.device(hostile.rng.choice(targets), leaf), payload)
        if (i + 1) % batch == 0:  # let the coordinator catch up: measure its rate, not the broker's queue
            deadline = time.monotonic() + timeout_s
            while engine.handled - handled_before < i + 1 - batch // 10 and time.monotonic() < deadline:
                time.sleep(0.01)
    deadline = time.monotonic() + timeout_s
    while engine.handled - handled_before < n and time.monotonic() < deadline:
        time.sleep(0.01)
    seconds = time.perf_counter() - started
    last, quiet_since = engine.handled, time.monotonic()  # honest traffic counts too: wait for the queue to drain
    while time.monotonic() - quiet_since < 2.0 and time.monotonic() < deadline:
        time.sleep(0.1)
        if engine.handled != last:
            last, quiet_since = engine.handled, time.monotonic()
    return {"messages": n, "seconds": round(seconds, 2), "messages_per_s": round(n / seconds),
            "handled": engine.handled - handled_before, "rejected": engine.rejected - rejected_before,
            "handler_errors": engine.handler_errors, "rss_before_mb": round(rss_before, 1),
            "rss_after_mb": round(rss_mb(), 1), "per_family": per_family}


def synthetic_device_data(root: Path, n_devices: int, ids_per_device: int = 2, images: int = 4) -> list[Path]:
    """Disjoint SYNTHETIC people per honest device."""
    import shutil

    from models.faces.datasets import SYNTHETIC_MARKER
    from models.faces.synthetic import identity_name, write_dataset

    full = write_dataset(root / "all", n_devices * ids_per_device, images, seed=7)
    out = []
    for d in range(n_devices):
        data = root / f"device{d}"
        data.mkdir(parents=True)
        for i in range(d * ids_per_device, (d + 1) * ids_per_device):
            shutil.copytree(full / identity_name(i), data / identity_name(i))
        (data / SYNTHETIC_MARKER).write_text((full / SYNTHETIC_MARKER).read_text())
        out.append(data)
    return out


def fuzz_live(tmp: Path, broker_url: str, n: int, round_timeout_s: float = 900.0) -> dict:
    """A coordinator, two honest devices and one admitted attacker on `broker_url` (no ACLs: the worst
    case); `n` hostile messages while round 1 is open; then wait for the honest round to complete."""
    from coordinator.engine import RoundSettings
    from coordinator.service import Service, ServiceConfig
    from edge_client.daemon import EdgeDevice
    from protocol.auth import token_proof
    from protocol.messages import TrainingConfig
    from protocol.transport import BrokerAddress, make_client

    service = Service(ServiceConfig(state=tmp / "state", broker=broker_url),
                      RoundSettings(rounds=1, min_clients=2, round_timeout_s=round_timeout_s,
                                    training=TrainingConfig(epochs=1, batch_size=8, lr=HONEST_LR)))
    service.engine.pause()
    devices = [EdgeDevice(service.admit(f"device{d}"), data, tmp / f"home{d}", export_onnx=False)
               for d, data in enumerate(synthetic_device_data(tmp / "data", 2))]
    address = BrokerAddress.parse(broker_url)
    attacker = make_client("mallory", address)
    attacker.connect(address.host, address.port)
    attacker.loop_start()
    try:
        for device in devices:
            device.start()
        _wait(lambda: len(service.engine.view.registered()) == 2, 60, "the honest devices' registration")
        service.engine.resume()
        _wait(lambda: service.engine.round_view() is not None, 30, "round 1 to open")
        # the attacker is admitted after the round opened, so the honest round does not wait for it
        credential, signer = service.admit("mallory"), Signer.generate()
        hello = Hello(n_identities=1, n_images=5, public_key=signer.public_hex,
                      token_proof=token_proof(credential.token, "mallory", signer.public_hex))
        attacker.publish(topics.device("mallory", "hello"), seal("mallory", 1, hello, signer, to="coordinator"), qos=1)
        _wait(lambda: len(service.engine.view.registered()) == 3, 30, "the attacker's registration")
        hostile = Hostile("mallory", signer)
        for _ in range(20):  # genuine messages the attacker will replay (sent once, accepted, not counted)
            attacker.publish(topics.device("mallory", "heartbeat"), hostile.capture(), qos=1)
        time.sleep(1.0)
        figures = attack(service.engine, lambda t, p: attacker.publish(t, p, qos=1),
                         ["mallory", "device0", "device1", "nobody"], hostile, n)
        _wait(lambda: service.engine.view.status()["completed_rounds"] == 1 or service.engine.round_view() is None,
              round_timeout_s, "the honest round")
        row = service.engine.view.rounds()[0]
        figures.update(honest_round=row["status"], honest_updates=row["n_updates"], honest_reason=row["reason"] or "",
                       honest_gate_auc={k: row["metrics"][k] for k in GATE_AUC if k in row["metrics"]},
                       coordinator_mqtt=service.mqtt_state())
        return figures
    finally:
        attacker.loop_stop()
        attacker.disconnect()
        for device in devices:
            device.stop()
        service.close()


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def main(argv=None) -> int:
    import tempfile

    from bench.common import write_results
    from coordinator.broker import EmbeddedBroker

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--messages", type=int, default=100_000)
    args = parser.parse_args(argv)
    with EmbeddedBroker() as broker, tempfile.TemporaryDirectory() as tmp:
        figures = fuzz_live(Path(tmp), broker.url, args.messages)
    per_family = figures.pop("per_family")
    write_results(args.out, "fuzz", {"per_family": per_family}, [figures],
                  "Hostile traffic against a live coordinator while an honest round is open",
                  "python -m bench.fuzz " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0 if figures["honest_round"] == "completed" and figures["handler_errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
