"""The federation's trust chain, attack by attack, against the real round engine.

The engine is driven with real signed messages and chunk frames through `on_message`, the
same entry point paho calls; only the broker is left out, so each attack is exact and fast.
The broker's own part (ACLs) and the device's (pinned coordinator key) run over Mosquitto.
"""
from __future__ import annotations

import json
import threading
import time
import tracemalloc

import numpy as np
import pytest
from conftest import device_datasets

from coordinator import store as store_module
from coordinator.aggregation import make_strategy
from coordinator.engine import Engine, RoundSettings
from coordinator.robust import clip_to_norm, combine, l2_norm, multi_krum_indices
from coordinator.store import Store
from protocol import topics
from protocol.auth import Signer, token_proof
from protocol.chunks import split, to_bytes
from protocol.messages import (
    Ack,
    Heartbeat,
    Hello,
    RoundAnnouncement,
    TrainingConfig,
    UpdateHeader,
    open_envelope,
    seal,
)
from protocol.tensors import encode, sha256_hex

RNG = np.random.default_rng(0)
GLOBAL = {"backbone.w": RNG.normal(size=(64, 32)).astype(np.float32),
          "backbone.b": RNG.normal(size=(32,)).astype(np.float32),
          "backbone.bn.num_batches_tracked": np.array(5, dtype=np.int64)}


class Harness:
    """A coordinator engine whose published messages are kept, and devices that speak to it."""

    def __init__(self, tmp, min_clients: int = 3, training: TrainingConfig | None = None, **settings):
        self.sent: list[tuple[str, bytes]] = []
        self.signer = Signer.generate()
        self.tmp = tmp
        # the whole step and no screen: these tests check the aggregation's arithmetic (the gateless quarter step
        # and the screen have their own tests)
        training = training or TrainingConfig(epochs=1)
        screen = "none" if training.dp_clip is None else None
        self.settings = RoundSettings(min_clients=min_clients, rounds=5, training=training,
                                      **{"server_step": 1.0, "screen": screen, **settings})
        self.engine = self._engine()

    def _engine(self, strategy: str = "fedavg") -> Engine:
        return Engine(Store(self.tmp / "state"), make_strategy(strategy), self.settings,
                      lambda topic, payload, retain: self.sent.append((topic, payload)), lambda: dict(GLOBAL),
                      self.signer)

    def inbox(self, device_id: str) -> list:
        return [open_envelope(p, self.signer.public_hex).body for t, p in self.sent
                if t == topics.device(device_id, "inbox")]

    def open_round(self):
        self.engine.tick()
        assert self.engine.current is not None
        return self.engine.current


class Dev:
    def __init__(self, h: Harness, device_id: str, n_images: int = 20):
        self.h, self.id, self.n_images = h, device_id, n_images
        self.signer, self.seq = Signer.generate(), int(time.time() * 1000)
        self.token = h.engine.admit(device_id)

    def envelope(self, body, seq: int | None = None, signer: Signer | None = None) -> bytes:
        self.seq += 1
        return seal(self.id, self.seq if seq is None else seq, body, signer or self.signer, to="coordinator")

    def raw(self, leaf: str, payload: bytes) -> None:
        self.h.engine.on_message(topics.device(self.id, leaf), payload)

    def send(self, leaf: str, body, **kw) -> bytes:
        payload = self.envelope(body, **kw)
        self.raw(leaf, payload)
        return payload

    def hello(self, proof: bool = True, key: Signer | None = None) -> Hello:
        key = key or self.signer
        return Hello(n_identities=2, n_images=self.n_images, public_key=key.public_hex,
                     token_proof=token_proof(self.token, self.id, key.public_hex) if proof else None)

    def join(self) -> Dev:
        self.send("hello", self.hello())
        assert self.id in self.h.engine.keys, self.h.engine.store.rejections()[-3:]
        return self

    def upload(self, delta: dict, n_samples: int = 20, dtype: str = "fp32") -> None:
        current = self.h.engine.current
        enc = encode(delta, dtype) if isinstance(delta, dict) else delta
        header = UpdateHeader(round_id=current.round_id, base_version=current.base_version, n_samples=n_samples,
                              transfer_id=f"{self.id}-{current.round_id}-{enc.sha256[:8]}",
                              payload_sha256=enc.sha256, payload_bytes=len(enc.data))
        self.send("update", header)
        for chunk in split(header.transfer_id, enc.data, 64 * 1024):
            self.raw("update/chunks", to_bytes(chunk))


def honest_delta(seed: int, scale: float = 0.01) -> dict:
    rng = np.random.default_rng(seed)
    return {k: (rng.normal(size=v.shape) * scale + scale).astype(np.float32) if v.dtype.kind == "f"
            else np.array(1, dtype=np.int64) for k, v in GLOBAL.items()}


# admission and keys ------------------------------------------------------------------------------------------------

def test_hellos_without_a_valid_admission_create_nothing_and_get_no_reply(tmp_path):
    h = Harness(tmp_path)
    for i in range(300):  # a flood of strangers
        stranger = Signer.generate() if i < 3 else h.signer
        hello = Hello(n_identities=1, n_images=1, public_key=stranger.public_hex,
                      token_proof=None if i % 2 else "ab" * 32)
        h.engine.on_message(topics.device(f"ghost{i}", "hello"),
                            seal(f"ghost{i}", 1, hello, stranger, to="coordinator"))
    admitted = Dev(h, "dev1")
    admitted.send("hello", admitted.hello(proof=False))  # admitted, but not yet registered: needs its proof
    forged = Dev(h, "dev2")
    forged.token = "cd" * 32  # the wrong token
    forged.send("hello", forged.hello())
    assert h.engine.store.devices() == [] and h.engine.keys == {}
    # no stranger is answered; a device the operator admitted hears (signed) that its credential is refused, and stops
    told = [t for t in h.sent if "/inbox" in t[0]]
    assert sorted(t[0] for t in told) == [topics.device("dev1", "inbox"), topics.device("dev2", "inbox")], told
    assert all(open_envelope(payload, h.signer.public_hex).body.code == "admission" for _, payload in told)
    reasons = [r["reason"] for r in h.engine.store.rejections()]
    assert len(reasons) == 302 and all("not admitted" in r or "unknown device" in r for r in reasons), reasons[:5]


def test_admission_tokens_are_one_time_bound_to_a_key_and_never_sent(tmp_path):
    h = Harness(tmp_path)
    dev = Dev(h, "dev1")
    hello = dev.envelope(dev.hello())
    thief = Signer.generate()
    stolen = json.loads(hello)  # a listener copies the proof into a hello for its own key
    stolen["body"]["public_key"] = thief.public_hex
    stolen["seq"] += 1
    fields = {k: v for k, v in stolen.items() if k != "signature"}
    stolen["signature"] = thief.sign(fields)
    dev.raw("hello", json.dumps(stolen).encode())
    assert "dev1" not in h.engine.keys, "a proof is bound to the key it was made for"
    dev.raw("hello", hello)
    assert h.engine.keys["dev1"] == dev.signer.public_hex
    assert dev.token not in b"".join(hello + p for _, p in h.sent).decode(errors="replace"), "the token never travels"
    again = Signer.generate()
    dev.send("hello", dev.hello(key=again), signer=again)
    assert h.engine.keys["dev1"] == dev.signer.public_hex, "a used token admits no second key"
    dev.token = h.engine.admit("dev1")  # the operator re-admits (e.g. the device lost its home)
    dev.send("hello", dev.hello(key=again), signer=again)
    assert h.engine.keys["dev1"] == again.public_hex
    dev.send("heartbeat", Heartbeat())  # signed by the old key: no longer this device
    assert "bad signature" in h.engine.store.rejections()[-1]["reason"]


def test_a_device_that_never_heard_its_registration_is_answered_again_not_locked_out(tmp_path):
    """The coordinator spends the one-time token on the first hello; a device that stops (or loses the reply)
    before Registered arrives says hello again under the same key and must get Registered again."""
    h = Harness(tmp_path)
    dev = Dev(h, "dev1")
    first = dev.send("hello", dev.hello())
    assert h.engine.keys["dev1"] == dev.signer.public_hex and h.engine.store.admission_token("dev1") is None
    replies = len(h.inbox("dev1"))
    dev.send("hello", dev.hello())  # same key, the spent token's proof: the answer again, nothing else changes
    assert [b.type for b in h.inbox("dev1")[replies:]] == ["registered"]
    assert h.engine.keys["dev1"] == dev.signer.public_hex and len(h.engine.store.devices()) == 1
    dev.raw("hello", first)  # a recorded copy of the first hello is a replay
    assert "replayed" in h.engine.store.rejections()[-1]["reason"]
    answered = len(h.inbox("dev1"))
    forger = Signer.generate()  # the registered key is public, and so is a proof seen on the wire
    dev.send("hello", dev.hello(), signer=forger)
    assert "bad signature" in h.engine.store.rejections()[-1]["reason"]
    assert len(h.inbox("dev1")) == answered, "a forger is not answered"


def test_only_each_heard_device_s_own_signed_word_ends_the_wait_for_the_final_model(tmp_path):
    """`coordinator serve --exit-when-done` stays up until every device heard from says (signed) it took the final
    model: a forged word, another device's, a stranger's or one about an older model does not count."""
    h = Harness(tmp_path, min_clients=2)
    a, b = Dev(h, "a").join(), Dev(h, "b").join()
    Dev(h, "c")  # admitted, never heard from: nobody waits for it
    sessions = h.engine.sessions
    assert sessions.awaiting("final v1") == ["a", "b"]
    a.send("heartbeat", Heartbeat(state="final v1"))
    b.send("heartbeat", Heartbeat(state="final v1"), signer=Signer.generate())  # not b's key: refused
    a.raw("heartbeat", b.envelope(Heartbeat(state="final v1")))                 # b's word on a's topic: refused
    b.send("heartbeat", Heartbeat(state="final v0"))                            # not the final model
    assert sessions.awaiting("final v1") == ["b"]
    b.send("heartbeat", Heartbeat(state="final v1"))
    assert sessions.awaiting("final v1") == []


def test_replays_are_refused_and_sequence_numbers_cannot_be_burnt(tmp_path):
    h = Harness(tmp_path)
    dev = Dev(h, "dev1").join()
    beat = dev.send("heartbeat", Heartbeat())
    dev.raw("heartbeat", beat)
    assert "replayed" in h.engine.store.rejections()[-1]["reason"]
    dev.send("heartbeat", Heartbeat(), seq=2 ** 53)  # far in the future
    assert "too far ahead" in h.engine.store.rejections()[-1]["reason"]
    error = h.inbox("dev1")[-1]
    assert error.type == "error" and error.resume_seq == h.engine.guard.resume_point("dev1")
    dev.seq = error.resume_seq  # what the edge client does with the coordinator's signed answer
    before = len(h.engine.store.rejections())
    dev.send("heartbeat", Heartbeat())
    assert len(h.engine.store.rejections()) == before, "the device is back without an operator"


# one message must not make the coordinator deaf --------------------------------------------------------------------

def test_every_single_message_crash_is_survived_and_the_round_completes(tmp_path):
    h = Harness(tmp_path)
    devs = [Dev(h, f"dev{i}").join() for i in range(3)]
    current = h.open_round()
    good = json.loads(devs[0].envelope(Heartbeat()))
    hostile = {
        "heartbeat": [
            json.dumps({**good, "signature": "\u00e9" * 128}).encode(),
            json.dumps({**good, "seq": 2**63}).encode(),
            b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            b"\xff" * 1000,
            b"",
        ],
        "hello": [
            seal(
                "newbie", 1, Hello(n_identities=1, n_images=1, public_key=devs[0].signer.public_hex), devs[0].signer
            ).replace(b'"n_images":1', b'"n_images":9223372036854775808')
        ],
        "update": [
            json.dumps(
                {
                    **good,
                    "body": {
                        "type": "update",
                        "round_id": 1,
                        "base_version": 0,
                        "n_samples": 2**63,
                        "transfer_id": "t",
                        "payload_sha256": "0" * 64,
                        "payload_bytes": 1,
                    },
                }
            ).encode()
        ],
        "update/chunks": [
            (60).to_bytes(4, "big") + b'{"transfer_id":"t","index":Infinity,"count":1,"total_bytes":1}',
            (100_000).to_bytes(4, "big") + b"[" * 100_000,
            (80).to_bytes(4, "big")
            + b'{"transfer_id":"t","index":0,"count":10000000,"total_bytes":10000000,"sha256":1}',
            b"\x00",
        ],
    }
    for leaf, payloads in hostile.items():
        for payload in payloads:
            devs[1].raw(leaf, payload)
    assert h.engine.handler_errors == 0
    assert len(h.engine.store.rejections()) == sum(len(p) for p in hostile.values())
    for i, dev in enumerate(devs):
        dev.upload(honest_delta(i))
    h.engine.tick()
    assert h.engine.store.rounds()[0]["status"] == "completed" and h.engine.version == 1
    assert current.round_id == 1


def test_refusals_are_told_only_to_authenticated_senders_and_rate_limited(tmp_path):
    h = Harness(tmp_path, errors_per_minute=5)
    dev = Dev(h, "dev1").join()
    for _ in range(20):
        dev.send("heartbeat", Heartbeat(), signer=Signer.generate())  # forged: not answered
    assert [b for b in h.inbox("dev1") if b.type == "error"] == []
    for _ in range(50):
        dev.send("update", UpdateHeader(round_id=7, base_version=0, n_samples=1, transfer_id="t",
                                        payload_sha256="0" * 64, payload_bytes=1))
    errors = [b for b in h.inbox("dev1") if b.type == "error"]
    assert len(errors) == 5 and "round 7 is not open" in errors[0].reason


def test_rejection_records_are_truncated_capped_and_paged(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "MAX_REJECTIONS", 200)
    h = Harness(tmp_path)
    for i in range(1500):
        h.engine.on_message(f"ffr/v1/devices/{'x' * 5000}/{'y' * 5000}", b"z" * 10)
    stored = h.engine.store.count_rejections()
    assert stored <= 200 + 500, stored
    page = h.engine.store.rejections(offset=10, limit=50)
    assert len(page) == 50 and all(len(r["topic"]) <= 160 and len(r["sender"]) <= 64 for r in page)


def test_transfer_state_is_bounded(tmp_path):
    h = Harness(tmp_path)
    devs = [Dev(h, f"dev{i}").join() for i in range(3)]
    current = h.open_round()
    payload = b"q" * 2048
    for i in range(3000):  # chunks with unique transfer ids and no signed header
        devs[0].raw("update/chunks", to_bytes(split(f"junk{i}", payload, 4096)[0]))
    assert len(current.refused_transfers) <= 1024 and current.transfers == {}
    tracemalloc.start()  # what a declared size costs is memory, measured as such (no wall clock: load must not fail it)
    try:
        header = UpdateHeader(round_id=1, base_version=0, n_samples=1, transfer_id="huge", payload_sha256="0" * 64,
                              payload_bytes=2 ** 31 - 1)
        devs[1].send("update", header)
        assert "exceeds" in h.engine.store.rejections()[-1]["reason"]
        header_json = json.dumps({"transfer_id": "huge", "index": 5, "count": 1 << 20, "total_bytes": 1 << 30,
                                  "sha256": "0" * 64}).encode()
        devs[1].raw("update/chunks", len(header_json).to_bytes(4, "big") + header_json + b"x")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert current.transfers == {} and peak < 16 * 2 ** 20  # a 2 GiB update and a 1 GiB transfer declared, nothing held


# poisoning --------------------------------------------------------------------------------------------------------

def _round_with(tmp_path, combine_rule: str, attack: str | None) -> tuple[dict, Harness]:
    h = Harness(tmp_path / f"{combine_rule}-{attack}", min_clients=5, combine=combine_rule)
    devs = [Dev(h, f"dev{i}").join() for i in range(5)]
    h.open_round()
    for i, dev in enumerate(devs[:4]):
        dev.upload(honest_delta(i))
    honest = honest_delta(4)
    if attack is None:
        devs[4].upload(honest)
    elif attack == "scaled":
        devs[4].upload({k: v * 1000 if v.dtype.kind == "f" else v for k, v in honest.items()})
    elif attack == "wipe":
        devs[4].upload({k: -v if v.dtype.kind == "f" else np.array(0) for k, v in GLOBAL.items()}, n_samples=10 ** 15)
    elif attack == "sign-flip":
        devs[4].upload({k: -10 * v if v.dtype.kind == "f" else v for k, v in honest.items()})
    h.engine.tick()
    return h.engine.global_state, h


@pytest.mark.parametrize("rule", ["mean", "trimmed-mean", "median", "krum"])
@pytest.mark.parametrize("attack", ["scaled", "wipe", "sign-flip"])
def test_one_poisoned_update_cannot_move_the_model_far(tmp_path, rule, attack):
    clean, _ = _round_with(tmp_path, rule, None)
    poisoned, h = _round_with(tmp_path, rule, attack)
    assert h.engine.store.rounds()[0]["status"] == "completed"
    step = l2_norm({k: clean[k] - GLOBAL[k] for k in ("backbone.w", "backbone.b")})
    harm = l2_norm({k: poisoned[k] - clean[k] for k in ("backbone.w", "backbone.b")})
    # FedAvg with clipping bounds the harm by the norm bound; the robust rules nearly remove it
    limit = (1.0 if rule == "mean" else 0.5) * max(step, 1e-9) * (5 if rule == "mean" else 1)
    assert harm <= limit, (rule, attack, harm, step)
    assert l2_norm({k: poisoned[k] for k in ("backbone.w", "backbone.b")}) > 0.9 * l2_norm(GLOBAL), "not wiped"


def test_self_reported_sample_counts_are_capped_by_the_registration(tmp_path):
    h = Harness(tmp_path, min_clients=2)
    small, big = Dev(h, "small", n_images=10).join(), Dev(h, "big", n_images=10).join()
    h.open_round()
    small.upload(honest_delta(0), n_samples=10)
    big.upload(honest_delta(1), n_samples=10 ** 15)
    assert h.engine.current.weights == {"small": 10.0, "big": 10.0}


def test_float64_and_overflowing_payloads_are_refused(tmp_path):
    from safetensors.numpy import save

    from protocol.tensors import EncodedTensors

    h = Harness(tmp_path, min_clients=1)
    dev = Dev(h, "dev1").join()
    h.open_round()
    data = save({k: (np.full(v.shape, 1e300) if v.dtype.kind == "f" else v) for k, v in GLOBAL.items()})
    dev.upload(EncodedTensors(data, sha256_hex(data), "fp64"))
    assert "float16 or float32" in h.engine.store.rejections()[-1]["reason"]
    assert "dev1" not in h.engine.current.done


def test_a_new_model_that_fails_its_checks_is_rolled_back(tmp_path):
    h = Harness(tmp_path, min_clients=1)
    dev = Dev(h, "dev1").join()
    h.open_round()
    dev.upload(honest_delta(0))

    from coordinator.aggregation import FedAvg

    class Broken(FedAvg):  # a fake strategy: the only way to produce a non-finite model past the update checks
        def aggregate(self, global_state, delta, state=None):
            return {k: v * np.nan if v.dtype.kind == "f" else v for k, v in global_state.items()}, None

    h.engine.strategy = Broken()
    h.engine.tick()
    row = h.engine.store.rounds()[0]
    assert (row["status"], h.engine.version) == ("rolled_back", 0) and "NaN" in row["reason"]


def test_robust_rules_on_known_values():
    deltas = [{"w": np.array([1.0, 2.0])}, {"w": np.array([1.2, 2.2])}, {"w": np.array([0.8, 1.8])},
              {"w": np.array([100.0, -100.0])}]
    assert np.allclose(combine(deltas, [1] * 4, "median")["w"], [1.1, 1.9])
    assert np.allclose(combine(deltas, [1] * 4, "trimmed-mean", trim=0.25)["w"], [1.1, 1.9])
    assert multi_krum_indices(deltas, byzantine=1) == [0, 1, 2]
    assert np.allclose(combine(deltas, [1, 1, 1, 1000], "mean")["w"], (np.array([3.0, 6.0]) + [1e5, -1e5]) / 1003)
    clipped, norm = clip_to_norm({"w": np.array([3.0, 4.0])}, 1.0)
    assert norm == 5.0 and np.allclose(clipped["w"], [0.6, 0.8])


def test_an_acknowledged_update_survives_a_crash_and_the_round_resumes(tmp_path):
    h = Harness(tmp_path, min_clients=2)
    first, second = Dev(h, "dev1").join(), Dev(h, "dev2").join()
    h.open_round()
    first.upload(honest_delta(0))
    assert any(b.type == "ack" and b.of == "update" for b in h.inbox("dev1"))
    h.engine.store.db.close()
    h.engine = h._engine()  # the process died; a new one starts on the same state
    assert h.engine.current is not None and h.engine.current.done == {"dev1"}
    second.h = h
    second.upload(honest_delta(1))
    h.engine.tick()
    assert h.engine.store.rounds()[0]["status"] == "completed" and h.engine.version == 1


# over Mosquitto: the device's pinned key, the broker's ACLs -------------------------------------------------------

def _pinned_device(tmp_path, mosquitto):
    """A real device pinned to a coordinator key, and a broker client that can publish anything to it."""
    from edge_client.daemon import EdgeDevice
    from protocol.credential import Credential
    from protocol.transport import BrokerAddress, make_client

    coordinator, attacker = Signer.generate(), Signer.generate()
    credential = Credential(device_id="dev1", token="0" * 64, coordinator_public_key=coordinator.public_hex,
                            broker=mosquitto.url)
    device = EdgeDevice(credential, device_datasets(tmp_path / "data", 1, 2, 3)[0], tmp_path / "home",
                        export_onnx=False)
    device.start()
    client = make_client("attacker", BrokerAddress.parse(mosquitto.url))
    client.connect("127.0.0.1", mosquitto.port)
    client.loop_start()
    return coordinator, attacker, device, client


def test_device_drops_coordinator_messages_not_signed_by_the_pinned_key(tmp_path, mosquitto):
    coordinator, attacker, device, client = _pinned_device(tmp_path, mosquitto)
    try:
        def announce(round_id: int, signer: Signer) -> bytes:
            return seal("coordinator", round_id, RoundAnnouncement(
                round_id=round_id, model_version=0, model_sha256="0" * 64, model_bytes=10, model_chunks=1,
                total_rounds=5, deadline_unix=time.time() + 600, config=TrainingConfig(), participants=["dev1"]),
                signer)

        time.sleep(1.0)
        for payload, topic in (
            (announce(2, attacker), topics.round_announcements()),
            (announce(3, attacker).replace(b'"signature":"', b'"signature":"0'), topics.round_announcements()),
            (seal("coordinator", 9, Ack(of="update", round_id=2), attacker, to="dev1"), topics.device("dev1", "inbox")),
            (
                seal("coordinator", 10, Ack(of="update", round_id=2), coordinator, to="dev2"),
                topics.device("dev1", "inbox"),
            ),
        ):
            client.publish(topic, payload, qos=1).wait_for_publish(5)
        deadline = time.monotonic() + 10
        while device.dropped_messages < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert device.dropped_messages >= 4 and device.queued_rounds == set() and device.acked == {}
        client.publish(topics.round_announcements(), announce(4, coordinator), qos=1).wait_for_publish(5)
        deadline = time.monotonic() + 10
        while 4 not in device.queued_rounds and time.monotonic() < deadline:
            time.sleep(0.1)
        assert device.queued_rounds == {4}, "a genuine announcement is queued (the check is not vacuous)"
    finally:
        client.publish(topics.round_announcements(), b"", qos=1, retain=True)
        client.loop_stop()
        device.stop()


def test_broker_acls_keep_each_device_to_its_own_topics(tmp_path):
    from coordinator.service import Service, ServiceConfig
    from protocol.transport import BrokerAddress, make_client

    service = Service(ServiceConfig(state=tmp_path / "state", init="none"),
                      RoundSettings(rounds=1, min_clients=5, training=TrainingConfig(width_mult=0.25)))
    try:
        alice, bob = service.admit("alice"), service.admit("bob")
        seen: list[str] = []

        def connect(credential, name):
            address = BrokerAddress.parse(service.broker_url, credential.broker_username if credential else None,
                                          credential.broker_password if credential else None)
            client = make_client(name, address)
            ready = threading.Event()
            client.on_connect = lambda c, u, f, rc, p: ready.set() if not rc.is_failure else None
            client.on_message = lambda c, u, m: seen.append(f"{name}:{m.topic}")
            client.connect(address.host, address.port)
            client.loop_start()
            return client, ready.wait(5)

        anonymous, ok = connect(None, "anon")
        assert not ok, "the embedded broker refuses anonymous clients"
        anonymous.loop_stop()
        a, ok_a = connect(alice, "alice")
        b, ok_b = connect(bob, "bob")
        assert ok_a and ok_b
        b.subscribe([(topics.device("alice", "inbox"), 1), (topics.device("alice", "update/chunks"), 1),
                     (topics.device("alice", "hello"), 1), ("ffr/v1/devices/#", 1)])
        time.sleep(0.5)
        signer = Signer.generate()
        hello = Hello(n_identities=1, n_images=1, public_key=signer.public_hex,
                      token_proof=token_proof(alice.token, "alice", signer.public_hex))
        a.publish(topics.device("alice", "hello"), seal("alice", 1, hello, signer, to="coordinator"), qos=1)
        a.publish(topics.device("alice", "update/chunks"), to_bytes(split("t", b"secret delta")[0]), qos=1)
        b.publish(topics.device("alice", "heartbeat"), b"bob pretending to be alice", qos=1)
        deadline = time.monotonic() + 10
        while "alice" not in service.engine.keys and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        assert "alice" in service.engine.keys, "alice's own topics work"
        assert not [s for s in seen if s.startswith("bob:")], f"bob read another device's traffic: {seen}"
        assert not [r for r in service.engine.store.rejections() if "pretending" in r["reason"]
                    or r["topic"].endswith("alice/heartbeat")], "bob cannot publish as alice"
        for client in (a, b):
            client.loop_stop()
            client.disconnect()
    finally:
        service.close()


@pytest.mark.parametrize("credential_broker, ca_pem, ca_file", [
    ("mqtts://coordinator.example:8883", None, None),   # the credential names a TLS broker
    ("mqtt://coordinator.example:1883", "PEM", None),   # ... or carries the broker's CA
    ("mqtt://coordinator.example:1883", None, "ca.pem"),  # `ffr edge run --ca-file` was given
])
def test_a_device_never_downgrades_to_plain_mqtt(tmp_path, capsys, credential_broker, ca_pem, ca_file):
    """A `--broker mqtt://...` override must not send a TLS device's login and updates in the clear: `ffr edge run`
    refuses in one line before connecting (nothing listens at the address; the refusal comes first)."""
    from ffr.cli import main
    from models.faces.synthetic import write_dataset
    from protocol.auth import Signer
    from protocol.credential import Credential

    path = tmp_path / "device.credential"
    Credential(device_id="dev1", token="0" * 64, coordinator_public_key=Signer.generate().public_hex,
               broker=credential_broker, broker_username="dev1", broker_password="secret", ca_pem=ca_pem).save(path)
    data = write_dataset(tmp_path / "data", n_identities=2, n_images=2, seed=1)
    argv = ["-q", "edge", "run", "--credential", str(path), "--data", str(data), "--home", str(tmp_path / "home"),
            "--broker", "mqtt://127.0.0.1:1", "--detector", "none"]
    assert main([*argv, *(["--ca-file", ca_file] if ca_file else [])]) == 2
    err = capsys.readouterr().err.strip()
    assert "is plain MQTT but" in err and "unencrypted" in err and len(err.splitlines()) == 1, err
    assert "secret" not in err
    from edge_client.link import refuse_plaintext
    from protocol.transport import BrokerAddress

    refuse_plaintext(BrokerAddress.parse("mqtts://127.0.0.1:8883"), Credential.load(path), ca_file)  # TLS: fine


def test_tls_broker_with_a_generated_ca(tmp_path):
    """`--tls`: the embedded broker speaks only TLS, with a CA from the state folder that the credential carries."""
    import ssl

    from coordinator.service import Service, ServiceConfig
    from protocol.transport import BrokerAddress, make_client

    service = Service(ServiceConfig(state=tmp_path / "state", init="none", tls=True),
                      RoundSettings(rounds=1, min_clients=5, training=TrainingConfig(width_mult=0.25)))
    try:
        assert service.broker_url.startswith("mqtts://") and service.mqtt_state() in ("connected", "disconnected")
        credential = service.admit("alice")
        assert credential.ca_pem and "BEGIN CERTIFICATE" in credential.ca_pem
        ca = tmp_path / "ca.pem"
        ca.write_text(credential.ca_pem)
        assert (tmp_path / "state" / "tls" / "broker.key").stat().st_mode & 0o077 == 0

        def connects(url: str, ca_file: str | None) -> bool:
            address = BrokerAddress.parse(url, credential.broker_username, credential.broker_password)
            client = make_client(None, address, ca_file)
            ok = threading.Event()
            client.on_connect = lambda c, u, f, rc, p: ok.set() if not rc.is_failure else None
            try:
                client.connect(address.host, address.port)
            except (ssl.SSLError, OSError):
                return False
            client.loop_start()
            result = ok.wait(5)
            client.loop_stop()
            client.disconnect()
            return result

        assert connects(service.broker_url, str(ca)), "a device with the credential's CA connects"
        assert not connects(service.broker_url.replace("mqtts://", "mqtt://"), None), "plain MQTT is refused"
        other = tmp_path / "other-ca.pem"
        from coordinator.tls import ensure_broker_tls

        other.write_bytes(ensure_broker_tls(tmp_path / "elsewhere")["ca"].read_bytes())
        assert not connects(service.broker_url, str(other)), "a broker certificate from another CA is refused"
        deadline = time.monotonic() + 10
        while service.mqtt_state() != "connected" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert service.mqtt_state() == "connected", "the coordinator itself speaks TLS to its broker"
    finally:
        service.close()


# differential privacy (DP-FedAvg) ----------------------------------------------------------------------------------

def test_dp_noise_has_the_calibrated_scale_and_epsilon_behaves():
    from coordinator import dp

    zero = {"w": np.zeros(200_000), "n": np.array(3, dtype=np.int64)}
    noisy = dp.add_noise(zero, n_updates=10, noise_multiplier=2.0, clip=0.5, rng=np.random.default_rng(0))
    assert abs(float(noisy["w"].std()) - 2.0 * 0.5 / 10) < 0.002 and noisy["n"] == 3
    assert dp.epsilon([0.1] * 10, 1.0, 1e-5) < dp.epsilon([0.1] * 20, 1.0, 1e-5), "more rounds spend more"
    assert dp.epsilon([0.1] * 10, 2.0, 1e-5) < dp.epsilon([0.1] * 10, 1.0, 1e-5), "more noise spends less"
    assert dp.epsilon([0.1] * 10, 0.0, 1e-5) == float("inf") and dp.epsilon([], 1.0, 1e-5) == 0.0


def test_dp_fedavg_round_clips_weighs_equally_adds_noise_and_reports_epsilon(tmp_path):
    h = Harness(tmp_path, min_clients=3, dp_noise=1.0, training=TrainingConfig(epochs=1, dp_clip=0.05))
    devs = [Dev(h, f"dev{i}").join() for i in range(3)]
    h.open_round()
    announcement = [open_envelope(p, h.signer.public_hex).body for t, p in h.sent if t == topics.round_announcements()]
    assert announcement[-1].config.dp_clip == 0.05, "devices are told to clip"
    for i, dev in enumerate(devs):
        dev.upload(honest_delta(i), n_samples=5 + 100 * i)
    assert set(h.engine.current.weights.values()) == {1.0}
    h.engine.tick()
    row = h.engine.store.rounds()[0]
    assert row["status"] == "completed", row["reason"]
    metrics = row["metrics"]
    assert metrics["clipped_updates"] == 3 and metrics["norm_bound"] == 0.05
    assert 0 < metrics["dp_epsilon"] < float("inf") and metrics["dp_q"] == 1.0
    step = {k: h.engine.global_state[k] - GLOBAL[k] for k in ("backbone.w", "backbone.b")}
    assert l2_norm(step) > 0.05, "the noise is there: the step is longer than any clipped update"


def test_no_device_outweighs_the_round_by_claiming_a_huge_data_set():
    from coordinator.engine import capped_weights

    assert capped_weights([100, 120, 80, 10_000_000], 3.0) == [100, 120, 80, 3 * 110.0]


def test_a_model_with_negative_batchnorm_variance_is_rolled_back(tmp_path):
    """Found by bench.robust: clipped, scaled updates averaged in can leave a BatchNorm variance below zero,
    a finite model whose every embedding is NaN. It must not be published."""
    state = dict(GLOBAL)
    state["backbone.bn.running_var"] = np.full(8, 0.01, dtype=np.float32)

    class Harness2(Harness):
        def _engine(self, strategy: str = "fedavg") -> Engine:
            return Engine(Store(self.tmp / "state"), make_strategy(strategy), self.settings,
                          lambda topic, payload, retain: self.sent.append((topic, payload)), lambda: dict(state),
                          self.signer)

    h = Harness2(tmp_path, min_clients=1)
    dev = Dev(h, "dev1").join()
    h.open_round()
    delta = {k: np.zeros_like(v, dtype=np.float32) if v.dtype.kind == "f" else np.array(0) for k, v in state.items()}
    delta["backbone.bn.running_var"] = np.full(8, -0.02, dtype=np.float32)
    dev.upload(delta)
    h.engine.tick()
    row = h.engine.store.rounds()[0]
    assert (
        (row["status"], h.engine.version) == ("rolled_back", 0)
        and "BatchNorm" in row["reason"]
        and "negative" in row["reason"]
    )


def test_dp_leaves_batchnorm_statistics_alone():
    """Noise on a running variance can make it negative (found by bench.robust); under DP they are not shared."""
    from coordinator import dp

    delta = {"bn.running_var": np.zeros(1000), "bn.weight": np.zeros(1000)}
    noisy = dp.add_noise(delta, 2, 1.0, 1.0, np.random.default_rng(0))
    assert np.all(noisy["bn.running_var"] == 0) and noisy["bn.weight"].std() > 0.1


def test_device_takes_a_final_model_release_only_from_the_pinned_coordinator(tmp_path, mosquitto):
    from protocol.messages import ModelRelease

    coordinator, attacker, device, client = _pinned_device(tmp_path, mosquitto)
    release = ModelRelease(model_version=7, model_sha256="0" * 64, model_bytes=10, model_chunks=1,
                           config=TrainingConfig())
    try:
        time.sleep(1.0)
        forged = seal("coordinator", 1, release, attacker)  # a release of a model the attacker chose
        malformed = seal("coordinator", 2, release, coordinator).replace(b'"model_chunks":1', b'"model_chunks":0')
        for payload in (forged, malformed):
            client.publish(topics.round_announcements(), payload, qos=1).wait_for_publish(5)
        deadline = time.monotonic() + 10
        while device.dropped_messages < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert device.dropped_messages >= 2 and device.released is None and device.jobs.empty()
        assert not device.finished.is_set()
    finally:
        client.publish(topics.round_announcements(), b"", qos=1, retain=True)
        client.loop_stop()
        device.stop()


def test_the_engine_keeps_the_strategys_server_state_across_rounds_and_restarts(tmp_path):
    """Strategies are pure (`aggregate(global, mean, state) -> (model, state)`): FedAvgM's velocity lives in the
    engine, is the round's mean after the first round, is stored with the model and read back by a new engine."""
    h = Harness(tmp_path, min_clients=1)
    h.engine = h._engine("fedavgm")
    assert h.engine.server_state is None
    dev = Dev(h, "dev1").join()
    h.open_round()
    delta = honest_delta(0)
    dev.upload(delta)
    h.engine.tick()
    assert h.engine.version == 1, h.engine.store.rounds()
    velocity = h.engine.server_state
    assert set(velocity) == set(delta)
    np.testing.assert_allclose(velocity["backbone.w"], delta["backbone.w"], rtol=1e-3, atol=1e-6)
    restarted = h._engine("fedavgm")
    assert all(np.array_equal(restarted.server_state[k], velocity[k]) for k in velocity)
    assert h._engine("fedavg").server_state is None  # a stateless strategy keeps none
