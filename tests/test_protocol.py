"""Wire protocol: tensors as safetensors, chunking, signed envelopes, and refusals with reasons."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from protocol import SCHEMA_VERSION
from protocol.auth import AuthError, ReplayGuard, Signer
from protocol.chunks import Reassembler, from_bytes, split, to_bytes
from protocol.messages import Ack, Hello, MessageError, TrainingConfig, UpdateHeader, open_envelope, parse, seal
from protocol.tensors import PayloadError, decode, encode, sha256_hex
from protocol.training_parts import PART_NAMES


def _state():
    rng = np.random.default_rng(0)
    return {"backbone.w": rng.normal(size=(64, 32)).astype(np.float32),
            "backbone.bn.num_batches_tracked": np.array(7, dtype=np.int64)}


def test_tensors_roundtrip_fp32_exactly_and_fp16_closely():
    state = _state()
    expected = {k: v.shape for k, v in state.items()}
    exact = decode(*(lambda e: (e.data, e.sha256))(encode(state, "fp32")), expected)
    assert np.array_equal(exact["backbone.w"], state["backbone.w"])
    half = encode(state, "fp16")
    assert len(half.data) < len(encode(state, "fp32").data)
    back = decode(half.data, half.sha256, expected)
    assert back["backbone.w"].dtype == np.float32 and np.allclose(back["backbone.w"], state["backbone.w"], atol=2e-3)
    assert back["backbone.bn.num_batches_tracked"] == 7
    assert b"pickle" not in half.data and half.data[8:9] == b"{"  # safetensors: length + JSON header


@pytest.mark.parametrize("mutate, reason", [
    (lambda s: {**s, "head.weight": np.zeros(3, np.float32)}, "names differ"),
    (lambda s: {k: v for k, v in s.items() if k != "backbone.w"}, "names differ"),
    (lambda s: {**s, "backbone.w": np.zeros((32, 64), np.float32)}, "shape"),
    (lambda s: {**s, "backbone.w": np.full((64, 32), np.nan, np.float32)}, "NaN or Inf"),
    (lambda s: {**s, "backbone.w": np.full((64, 32), np.inf, np.float32)}, "NaN or Inf"),
])
def test_bad_tensors_are_refused_with_a_reason(mutate, reason):
    expected = {k: v.shape for k, v in _state().items()}
    bad = encode(mutate(_state()), "fp32")
    with pytest.raises(PayloadError, match=reason):
        decode(bad.data, bad.sha256, expected)


def test_corrupted_or_non_safetensors_payloads_are_refused():
    good = encode(_state())
    with pytest.raises(PayloadError, match="sha256"):
        decode(good.data[:-10], good.sha256)
    import hashlib

    junk = b"\x80\x04 pickled things"
    with pytest.raises(PayloadError, match="not a safetensors"):
        decode(junk, hashlib.sha256(junk).hexdigest())


def test_chunks_reassemble_in_any_order_with_duplicates():
    payload = np.random.default_rng(1).bytes(10_000)
    chunks = split("t1", payload, chunk_bytes=1024 + 512)
    assert len(chunks) == 10 and all(len(c.data) <= 1024 for c in chunks)
    frames = [to_bytes(c) for c in chunks]
    assert all(len(f) <= 1024 + 512 for f in frames), "a framed chunk fits the broker's message limit"
    order = [3, 0, 9, 3, 1, 2, 5, 4, 8, 7, 0]  # 6 is still missing, 3 and 0 come twice
    assembler = Reassembler.for_chunk(from_bytes(frames[order[0]]))
    for i in order:
        assert assembler.add(from_bytes(frames[i])) is None
    assert assembler.missing == [6]
    assert assembler.add(from_bytes(frames[6])) == payload


def test_chunk_faults_are_refused():
    payload = b"x" * 3000
    chunks = split("t1", payload, chunk_bytes=1512)
    assembler = Reassembler.for_chunk(chunks[0])
    other = split("t2", payload, chunk_bytes=1512)[1]
    with pytest.raises(PayloadError, match="does not belong"):
        assembler.add(other)
    assembler.add(chunks[0])
    tampered = type(chunks[0])(**{**chunks[0].__dict__, "data": b"y" * 1000})
    with pytest.raises(PayloadError, match="different bytes"):
        assembler.add(tampered)
    corrupt = type(chunks[1])(**{**chunks[1].__dict__, "data": b"z" * 1000})
    assembler.add(corrupt)
    with pytest.raises(PayloadError, match="corrupted"):
        assembler.add(chunks[2])
    with pytest.raises(PayloadError, match="exceeds"):
        Reassembler.for_chunk(chunks[0], max_bytes=100)
    with pytest.raises(PayloadError, match="malformed"):
        from_bytes(b"\x00\x00\x00\x05{bad}")


def _hello(signer: Signer, n_images: int = 30) -> Hello:
    return Hello(n_identities=3, n_images=n_images, public_key=signer.public_hex)


def test_signed_envelopes_and_every_refusal():
    signer, other = Signer.generate(), Signer.generate()
    guard = ReplayGuard()
    raw = seal("dev-1", 1, _hello(signer), signer)
    assert open_envelope(raw, signer.public_hex, guard).body.n_images == 30
    with pytest.raises(MessageError, match="replay"):
        open_envelope(raw, signer.public_hex, guard)
    with pytest.raises(MessageError, match="bad signature"):
        open_envelope(seal("dev-1", 2, _hello(signer), other), signer.public_hex, guard)
    tampered = json.loads(seal("dev-1", 3, _hello(signer), signer))
    tampered["body"]["n_images"] = 3000
    with pytest.raises(MessageError, match="bad signature"):
        open_envelope(json.dumps(tampered).encode(), signer.public_hex, guard)
    readdressed = json.loads(seal("dev-1", 3, Ack(of="update", round_id=1), signer, to="dev-1"))
    readdressed["to"] = "dev-2"  # an ack for one device replayed into another's inbox
    with pytest.raises(MessageError, match="bad signature"):
        open_envelope(json.dumps(readdressed).encode(), signer.public_hex)
    with pytest.raises(MessageError, match="invalid message"):
        open_envelope(b"{not json", signer.public_hex, guard)
    wrong_version = json.loads(seal("dev-1", 4, _hello(signer), signer))
    wrong_version["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(MessageError, match="schema version"):
        open_envelope(json.dumps(wrong_version).encode(), signer.public_hex, guard)
    unknown_type = json.loads(seal("dev-1", 5, _hello(signer), signer))
    unknown_type["body"] = {"type": "images", "pixels": [1, 2, 3]}
    with pytest.raises(MessageError, match="invalid message"):
        open_envelope(json.dumps(unknown_type).encode(), signer.public_hex, guard)


def test_sequence_numbers_cannot_be_burnt_far_ahead():
    guard = ReplayGuard()
    now_ms = int(time.time() * 1000)
    with pytest.raises(AuthError, match="too far ahead"):
        guard.accept("dev-1", 2 ** 53, now_ms)
    guard.accept("dev-1", now_ms, now_ms)
    assert guard.resume_point("dev-1") == now_ms


@pytest.mark.parametrize("raw, reason", [
    (b'{"schema_version":2,"sender":"d","seq":1,"sent_at":1,"signature":"' + "\u00e9".encode() * 64 + b'",'
     b'"body":{"type":"heartbeat"}}', "invalid message"),                                   # non-ASCII signature
    (b'{"schema_version":2,"sender":"d","seq":9223372036854775808,"sent_at":1,"signature":"' + b"0" * 128 + b'",'
     b'"body":{"type":"heartbeat"}}', "invalid message"),                                   # seq >= 2^63
    (b'{"schema_version":2,"sender":"d","seq":1,"sent_at":Infinity,"signature":"' + b"0" * 128 + b'",'
     b'"body":{"type":"heartbeat"}}', "invalid message"),                                   # non-finite
    (b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}", "exceeds"),                        # deep nesting, too large
    (b'{"a":' + b"[" * 5000 + b"]" * 5000 + b"}", "invalid message"),                      # deep nesting
    (b"\xff\xfe" * 10, "invalid message"),                                                 # not even text
])
def test_hostile_envelopes_are_refused_by_schema(raw, reason):
    with pytest.raises(MessageError, match=reason):
        parse(raw)


def test_hostile_hello_and_update_fields_are_bounded():
    signer = Signer.generate()
    with pytest.raises(ValueError):
        Hello(n_identities=1, n_images=2 ** 63, public_key=signer.public_hex)
    with pytest.raises(ValueError):
        UpdateHeader(round_id=1, base_version=0, n_samples=2 ** 63, transfer_id="t", payload_sha256="0" * 64,
                     payload_bytes=10)
    with pytest.raises(ValueError):
        TrainingConfig(epochs=10 ** 6)
    with pytest.raises(ValueError):
        TrainingConfig(batch_size=10 ** 6)


@pytest.mark.parametrize("header, reason", [
    (b'{"transfer_id":"t","index":Infinity,"count":1,"total_bytes":1,"sha256":"' + b"0" * 64 + b'"}', "malformed"),
    (b"[" * 1000, "out of range|flat"),
    (b'{"transfer_id":"t","index":0,"count":10000000,"total_bytes":10,"sha256":"' + b"0" * 64 + b'"}', "out of range"),
    (b'{"transfer_id":"t","index":1.5,"count":2,"total_bytes":10,"sha256":"' + b"0" * 64 + b'"}', "integers"),
    (b'{"transfer_id":"' + b"x" * 200 + b'","index":0,"count":1,"total_bytes":1,"sha256":"' + b"0" * 64 + b'"}',
     "transfer_id"),
])
def test_hostile_chunk_headers_are_refused(header, reason):
    with pytest.raises(PayloadError, match=reason):
        from_bytes(len(header).to_bytes(4, "big") + header + b"data")


def test_float64_payloads_are_refused():
    from safetensors.numpy import save

    data = save({"w": np.full((2, 2), 1e300, dtype=np.float64)})
    with pytest.raises(PayloadError, match="float16 or float32"):
        decode(data, sha256_hex(data))


def test_update_header_validates_its_fields():
    with pytest.raises(ValueError):
        UpdateHeader(round_id=0, base_version=0, n_samples=0, transfer_id="", payload_sha256="nothex", payload_bytes=0)


def test_a_receiver_with_a_newer_schema_still_verifies_an_older_sender():
    """The signature covers the fields as received, not as this side would re-serialise them: a field added
    later with a default (here: dropped from the sent message, as an older sender would send it) verifies."""
    signer = Signer.generate()
    from protocol.messages import RoundAnnouncement

    body = RoundAnnouncement(round_id=1, model_version=0, model_sha256="0" * 64, model_bytes=1, model_chunks=1,
                             total_rounds=1, deadline_unix=1e9, config=TrainingConfig(), participants=["a"])
    sent = json.loads(seal("coordinator", 1, body, signer))
    del sent["body"]["config"]["dp_clip"]  # an older coordinator never had this field
    fields = {k: v for k, v in sent.items() if k != "signature"}
    sent["signature"] = signer.sign(fields)
    envelope = open_envelope(json.dumps(sent).encode(), signer.public_hex)
    assert envelope.body.config.dp_clip is None


def _place(config: dict, fields: dict) -> None:
    """Each field where today's round configuration keeps it: at the top, or in its part (`optimisation`, `model`,
    `transport`, `public_set`, `method`), so a hostile value meets that field's own bound rather than the refusal of an
    unknown field; a value of `_GONE` takes the field out."""
    for key, value in fields.items():
        parts = (*PART_NAMES, "public_set", "method")
        part = next((p for p in parts if isinstance(config.get(p), dict) and key in config[p]), None)
        holder = config[part] if part else config
        if value is _GONE:
            del holder[key]
        else:
            holder[key] = value


_GONE = object()


@pytest.mark.parametrize("fields", [
    {"url": "file:///etc/passwd"},
    {"url": "ftp://host/public-set"},
    {"url": "http://host/public set"},
    {"url": "http://host/\npublic-set"},
    {"url": "http://" + "a" * 600},
    {"sha256": "A" * 64},
    {"sha256": "0" * 63},
    {"size_bytes": 0},
    {"size_bytes": 1 << 40},
    {"size_bytes": 1.5},
    {"url": None},      # the three come together
    {"sha256": _GONE},
    {"size_bytes": _GONE},
    {"public_set_url": "http://10.0.0.1:8080/public-set"},  # format 1's name, unknown in format 2
    {"imprint_head": "yes please"},
])
def test_hostile_public_set_fields_in_a_round_announcement_are_refused(fields):
    from protocol.messages import RoundAnnouncement

    good = {"url": "http://10.0.0.1:8080/public-set", "sha256": "ab" * 32, "size_bytes": 123456}
    body = RoundAnnouncement(round_id=1, model_version=0, model_sha256="0" * 64, model_bytes=1, model_chunks=1,
                             total_rounds=1, deadline_unix=1e9, config=TrainingConfig(public_set=good),
                             participants=["a"])
    envelope = json.loads(seal("coordinator", 1, body, Signer.generate()))
    assert parse(json.dumps(envelope).encode()).body.config.public_set.size_bytes == 123456
    _place(envelope["body"]["config"], fields)
    with pytest.raises(MessageError):
        parse(json.dumps(envelope).encode())


def _method_of(fields: dict):
    """The method whose settings hold these fields (each meets its own bound, not an unknown field's refusal)."""
    from protocol.methods import HFMAML, PFM

    return HFMAML() if any(k.startswith("maml_") or k == "embedding_reg" for k in fields) else PFM()


@pytest.mark.parametrize("fields, where", [
    ({"momentum_sha256": None}, "body"),           # the three come together
    ({"momentum_chunks": None}, "body"),
    ({"momentum_sha256": "xyz"}, "body"),
    ({"momentum_bytes": 0}, "body"),
    ({"momentum_bytes": 1 << 40}, "body"),
    ({"momentum_chunks": -1}, "body"),
    ({"pfm_beta": 1.0}, "config"),                 # momentum that never decays
    ({"pfm_beta": -0.5}, "config"),
    ({"name": "fedsgd"}, "config"),              # a method no one knows
    ({"maml_beta": 0.0}, "config"),
    ({"maml_delta": 5.0}, "config"),
    ({"embedding_reg": -1.0}, "config"),
    ({"codec": "zip"}, "config"),
    ({"topk_fraction": 0.0}, "config"),
])
def test_hostile_method_fields_in_a_round_announcement_are_refused(fields, where):
    from protocol.messages import RoundAnnouncement

    body = RoundAnnouncement(round_id=1, model_version=0, model_sha256="0" * 64, model_bytes=1, model_chunks=1,
                             total_rounds=1, deadline_unix=1e9, config=TrainingConfig(method=_method_of(fields)),
                             participants=["a"], momentum_sha256="ab" * 32, momentum_bytes=10, momentum_chunks=1)
    envelope = json.loads(seal("coordinator", 1, body, Signer.generate()))
    assert parse(json.dumps(envelope).encode()).body.momentum_bytes == 10
    if where == "body":
        envelope["body"].update(fields)
    else:
        _place(envelope["body"]["config"], fields)
    with pytest.raises(MessageError):
        parse(json.dumps(envelope).encode())
