"""Update codecs (fp16, int8, top-k) with error feedback: round trips, bytes, refusals, and a real round."""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load, save

from edge_client.error_feedback import ErrorFeedback
from protocol.auth import Signer
from protocol.codecs import (
    CODECS,
    SCALE_SUFFIX,
    TOPK_INDICES,
    TOPK_MASK,
    TOPK_VALUES,
    decode_update,
    decode_verified,
    encode_update,
    layout,
    payload_codec,
    sparse_names,
)
from protocol.messages import MessageError, UpdateHeader, parse, seal
from protocol.tensors import PayloadError, sha256_hex

RNG = np.random.default_rng(0)
SHAPES = {"conv.weight": (16, 8, 3, 3), "fc.weight": (32, 64), "fc.bias": (32,), "bn.weight": (16,),
          "head.bias": (3,), "bn.running_mean": (16,), "bn.running_var": (16,), "bn.num_batches_tracked": ()}
KINDS = {k: ("i" if k.endswith("num_batches_tracked") else "f") for k in SHAPES}


def delta(seed: int = 0) -> dict[str, np.ndarray]:
    """Heavy-tailed like real updates (a few large coordinates), with an integer counter."""
    rng = np.random.default_rng(seed)
    return {k: (np.array(3, np.int64) if KINDS[k] == "i" else
                (rng.standard_t(3, size=shape) * 1e-3).astype(np.float32)) for k, shape in SHAPES.items()}


def floats(state):
    return np.concatenate([np.asarray(state[k], np.float64).ravel() for k in sorted(SHAPES) if KINDS[k] == "f"])


@pytest.mark.parametrize("codec", CODECS)
def test_round_trip_within_each_codecs_stated_error(codec):
    d = delta()
    encoded, reconstructed = encode_update(d, codec, topk_fraction=0.1)
    out = decode_update(encoded.data, encoded.sha256, codec, SHAPES, KINDS)
    assert set(out) == set(SHAPES) and all(out[k].shape == SHAPES[k] for k in SHAPES)
    assert all(np.array_equal(out[k], reconstructed[k]) for k in SHAPES), "the device's view of what it sent is exact"
    assert int(out["bn.num_batches_tracked"]) == 3
    for name in ("bn.running_mean", "bn.running_var"):  # always dense fp16
        assert np.allclose(out[name], d[name], rtol=1e-3, atol=1e-7)
    if codec == "fp32":
        assert all(np.array_equal(out[k], d[k]) for k in SHAPES)
    elif codec == "fp16":
        assert np.allclose(floats(out), floats(d), rtol=1e-3, atol=1e-7)
    elif codec == "int8":
        for name in ("conv.weight", "fc.weight", "fc.bias", "bn.weight"):
            rows = d[name].reshape(d[name].shape[0], -1) if d[name].ndim >= 2 else d[name].reshape(1, -1)
            half_step = np.abs(rows).max(axis=1, keepdims=True) / 127 / 2
            error = np.abs(out[name].reshape(rows.shape) - rows)
            assert (error <= half_step * (1 + 1e-5) + 1e-12).all(), name
    else:
        sparse = sparse_names(SHAPES, KINDS)
        flat_in = np.concatenate([d[k].ravel() for k in sparse])
        flat_out = np.concatenate([out[k].ravel() for k in sparse])
        kept = np.flatnonzero(flat_out)
        assert len(kept) == round(0.1 * flat_in.size)
        assert np.abs(flat_in[kept]).min() >= np.abs(np.delete(flat_in, kept)).max(), "the largest coordinates"
        assert np.allclose(flat_out[kept], flat_in[kept], rtol=1e-3)


@pytest.mark.parametrize("converter", ["torch", "table"])
def test_fp16_decodes_every_bit_pattern_exactly_and_refuses_nan_and_inf(converter, monkeypatch):
    """Both float16 converters (torch's copy when torch is installed, else the table protocol.codecs.HALF_TO_FLOAT):
    every finite pattern, subnormals included, must give numpy's own cast, and NaN/Inf must still be refused."""
    from protocol import codecs

    calls = []
    fast = codecs._torch_half_to_float()
    assert fast is not None, "the test environment has torch"
    spy = lambda bits, out: (calls.append(bits.size), fast(bits, out))  # noqa: E731 - counts torch's conversions
    monkeypatch.setattr(codecs, "_torch_half_to_float", lambda: spy if converter == "torch" else None)
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = patterns[np.isfinite(patterns)]
    shapes, kinds = {"w": finite.shape}, {"w": "f"}
    data = save({"w": finite})
    out = decode_update(data, sha256_hex(data), "fp16", shapes, kinds)
    assert out["w"].dtype == np.float32 and np.array_equal(out["w"], finite.astype(np.float32))
    assert np.array_equal(np.signbit(out["w"]), np.signbit(finite)), "signed zeros keep their sign"
    assert bool(calls) == (converter == "torch"), "the converter under test did the work"
    for bad in (np.inf, -np.inf, np.nan):
        payload = save({"w": np.where(np.arange(finite.size) == 7, np.float16(bad), finite)})
        with pytest.raises(PayloadError, match="NaN or Inf"):
            decode_update(payload, sha256_hex(payload), "fp16", shapes, kinds)


def test_bytes_per_update_on_the_real_backbone():
    from models.networks.face_model import initial_global_state

    state = initial_global_state(init="none")
    d = {k: (RNG.normal(0, 1e-3, v.shape).astype(np.float32) if v.dtype.kind == "f" else np.zeros_like(v))
         for k, v in state.items()}
    size = {c: len(encode_update(d, c)[0].data) for c in CODECS}
    assert size["fp16"] <= 0.51 * size["fp32"]
    assert size["int8"] <= 0.27 * size["fp32"]
    assert size["topk"] <= size["fp32"] / 8, "the issue's target: at most 1/8 of fp32's bytes"


def test_error_feedback_carries_the_residual_to_the_next_round(tmp_path):
    path = tmp_path / "home" / "private" / "codec_residual.safetensors"
    deltas = [delta(seed) for seed in range(3)]
    received = []
    for d in deltas:  # a fresh object each round: the residual lives on disk, in the device home
        encoded = ErrorFeedback(path).encode(d, "topk", 0.05)
        received.append(decode_update(encoded.data, encoded.sha256, "topk", SHAPES, KINDS))
    residual = load(path.read_bytes())
    assert np.abs(floats(residual)).max() > 0
    # telescoping: everything meant to be sent = everything received + what is still held back
    sent = sum(floats(d) for d in deltas)
    assert np.allclose(sum(floats(r) for r in received) + floats(residual), sent, atol=1e-6)
    # the second round's payload already carries part of the first round's residual
    first_only = decode_update(*_enc(deltas[1]), "topk", SHAPES, KINDS)
    assert not np.allclose(floats(received[1]), floats(first_only))
    # another codec, or a lossless one, starts clean
    assert ErrorFeedback(path).load("int8", deltas[0]) is None
    ErrorFeedback(path).encode(deltas[0], "fp16", 0.05)
    assert not path.exists()


def _enc(d):
    encoded, _ = encode_update(d, "topk", 0.05)
    return encoded.data, encoded.sha256


@pytest.mark.parametrize("codec", CODECS)
def test_a_payload_names_its_codec_and_a_false_name_is_refused_when_decoded(codec):
    encoded, _ = encode_update(delta(), codec, topk_fraction=0.1)
    assert payload_codec(encoded.data) == codec
    tensors = load(encoded.data)
    assert payload_codec(save(tensors)) == "fp16"  # a payload that names no codec
    hostile = save(tensors, metadata={"ffr.codec": "gzip"})
    assert payload_codec(hostile) == "gzip"
    with pytest.raises(PayloadError, match="unknown codec"):
        decode_verified(hostile, payload_codec(hostile), SHAPES, KINDS)


@pytest.mark.parametrize("sent", CODECS)
def test_a_payload_that_names_another_codec_than_it_was_sent_as_is_refused(sent):
    """Hostile: the tensors pass as `sent` (fp16 and fp32 even share their names) but the payload names another
    codec, the one a stored update is decoded by again; accepted, it would decode differently or fail later."""
    encoded, _ = encode_update(delta(), sent, topk_fraction=0.1)
    for named in set(CODECS) - {sent}:
        relabelled = save(load(encoded.data), metadata={"ffr.codec": named})
        with pytest.raises(PayloadError, match=f"names codec '{named}' but was sent as '{sent}'"):
            decode_verified(relabelled, sent, SHAPES, KINDS)
    if sent != "fp16":  # naming none means fp16
        with pytest.raises(PayloadError, match="names codec 'fp16'"):
            decode_verified(save(load(encoded.data)), sent, SHAPES, KINDS)


def _payload(codec: str, mutate, topk_fraction: float = 0.1) -> bytes:
    """A real payload, mutated; top-k at 10 % sends a mask, at 1 % int32 indices ("topk-indices")."""
    if codec == "topk-indices":
        codec, topk_fraction = "topk", 0.01
    encoded, _ = encode_update(delta(), codec, topk_fraction=topk_fraction)
    tensors = load(encoded.data)
    mutate(tensors)
    return save(tensors, metadata={"ffr.codec": codec})


def _set(name, value):
    return lambda t: t.__setitem__(name, value)


MALFORMED = [
    ("int8", lambda t: t.pop("fc.weight" + SCALE_SUFFIX), "names differ"),
    ("int8", _set("fc.weight" + SCALE_SUFFIX, np.full(32, -1.0, np.float32)), "negative or non-finite scale"),
    ("int8", _set("fc.weight" + SCALE_SUFFIX, np.full(32, np.inf, np.float32)), "negative or non-finite scale"),
    ("int8", _set("fc.weight" + SCALE_SUFFIX, np.ones(31, np.float32)), "shape"),
    ("int8", _set("fc.weight", np.full((32, 64), -128, np.int8)), "-128"),
    ("int8", _set("fc.weight", np.zeros((32, 64), np.float32)), "int8 sends int8"),
    ("fp16", _set("fc.weight", np.zeros((32, 64), np.int32)), "expected a floating type"),
    ("int8", _set("extra", np.zeros(1, np.float32)), "names differ"),
    ("topk-indices", _set(TOPK_INDICES, np.array([3, 5], np.int32)), "same length"),
    ("topk-indices", lambda t: t.update({TOPK_INDICES: t[TOPK_INDICES][::-1].copy()}), "strictly increasing"),
    ("topk-indices", lambda t: t.update({TOPK_INDICES: np.zeros_like(t[TOPK_INDICES])}), "strictly increasing"),
    ("topk-indices", lambda t: t.update({TOPK_INDICES: t[TOPK_INDICES] + 10 ** 6}), "inside the model"),
    ("topk-indices", lambda t: t.update({TOPK_INDICES: t[TOPK_INDICES] - 10 ** 6}), "inside the model"),
    ("topk-indices", lambda t: t.update({TOPK_INDICES: t[TOPK_INDICES].astype(np.int64)}), "int32"),
    ("topk-indices", lambda t: t.update({TOPK_VALUES: np.full_like(t[TOPK_VALUES], np.nan)}), "NaN or Inf"),
    ("topk-indices", lambda t: t.update({TOPK_INDICES: np.arange(5000, dtype=np.int32),
                                         TOPK_VALUES: np.zeros(5000, np.float16)}), "coordinates of a model"),
    ("topk-indices", _set(TOPK_MASK, np.zeros(407, np.uint8)), "names differ"),  # both position forms
    ("topk", lambda t: t.pop(TOPK_MASK), "names differ"),
    ("topk", _set(TOPK_INDICES, np.arange(325, dtype=np.int32)), "names differ"),  # both position forms
    ("topk", lambda t: t.update({TOPK_MASK: t[TOPK_MASK][:-1].copy()}), "one bit per coordinate"),
    ("topk", lambda t: t.update({TOPK_MASK: t[TOPK_MASK].astype(np.int8)}), "one bit per coordinate"),
    ("topk", lambda t: t.update({TOPK_MASK: t[TOPK_MASK].reshape(1, -1).copy()}), "one bit per coordinate"),
    ("topk", lambda t: t[TOPK_MASK].__setitem__(-1, 0xFF), "past the model's last coordinate"),  # 3,251 bits
    ("topk", lambda t: t.update({TOPK_MASK: np.full_like(t[TOPK_MASK], 0xFF)}), "past the model's last"),
    ("topk", lambda t: t.update({TOPK_VALUES: t[TOPK_VALUES][:-1].copy()}), "same length"),
    ("topk", lambda t: t.update({TOPK_VALUES: t[TOPK_VALUES].reshape(-1, 1).copy()}), "values must be a vector"),
    ("topk", lambda t: t.update({TOPK_VALUES: np.full_like(t[TOPK_VALUES], np.inf)}), "NaN or Inf"),
    ("topk", _set("conv.weight", np.zeros((16, 8, 3, 3), np.float16)), "names differ"),
    ("fp16", _set("fc.weight", np.full((32, 64), np.inf, np.float16)), "NaN or Inf"),
    ("fp16", _set("fc.weight", np.zeros((32, 64), np.float64)), "float16 or float32"),
    ("fp16", _set("fc.weight", np.zeros((64, 32), np.float16)), "shape"),
    ("fp16", _set("bn.num_batches_tracked", np.array(1.5, np.float32)), "integer type"),
]


@pytest.mark.parametrize("codec,mutate,reason", MALFORMED)
def test_malformed_payloads_are_refused_with_the_reason(codec, mutate, reason):
    data = _payload(codec, mutate)
    with pytest.raises(PayloadError, match=reason):
        decode_update(data, sha256_hex(data), codec.removesuffix("-indices"), SHAPES, KINDS)


@pytest.mark.parametrize("codec,mutate,reason", MALFORMED)
def test_bytes_already_hashed_get_every_other_check(codec, mutate, reason):
    """decode_verified (the coordinator's path after the chunk reassembler matched the signed sha256) skips only
    the hash: a valid payload decodes as decode_update does, and every malformed one is refused the same way."""
    encoded, _ = encode_update(delta(), codec.removesuffix("-indices"), 0.01 if codec.endswith("-indices") else 0.1)
    plain = codec.removesuffix("-indices")
    expected = decode_update(encoded.data, encoded.sha256, plain, SHAPES, KINDS)
    assert all(np.array_equal(v, expected[k]) for k, v in decode_verified(encoded.data, plain, SHAPES, KINDS).items())
    with pytest.raises(PayloadError, match=reason):
        decode_verified(_payload(codec, mutate), plain, SHAPES, KINDS)
    with pytest.raises(PayloadError, match="safetensors"):
        decode_verified(b"\xff" * 64, plain, SHAPES, KINDS)


@pytest.mark.parametrize("fraction,form", [(0.01, TOPK_INDICES), (0.05, TOPK_MASK), (0.5, TOPK_MASK), (1.0, TOPK_MASK)])
def test_topk_sends_positions_in_the_smaller_form_and_both_decode_the_same(fraction, form):
    """Indices cost 4 bytes per kept coordinate, the mask 1 bit per coordinate: the mask from 1/32 kept on."""
    d = delta()
    encoded, reconstructed = encode_update(d, "topk", fraction)
    tensors = load(encoded.data)
    assert form in tensors and ({TOPK_INDICES, TOPK_MASK} - {form}).isdisjoint(tensors)
    flat = np.concatenate([reconstructed[k].ravel() for k in sparse_names(SHAPES, KINDS)])
    kept = np.flatnonzero(flat)
    if form == TOPK_MASK:  # the same coordinates sent as indices decode to the same delta
        tensors.pop(TOPK_MASK)
        tensors[TOPK_INDICES] = kept.astype(np.int32)
        data = save(tensors, metadata={"ffr.codec": "topk"})
        as_indices = decode_update(data, sha256_hex(data), "topk", SHAPES, KINDS)
        assert all(np.array_equal(as_indices[k], reconstructed[k]) for k in SHAPES)
    out = decode_update(encoded.data, encoded.sha256, "topk", SHAPES, KINDS)
    assert all(np.array_equal(out[k], reconstructed[k]) for k in SHAPES)
    assert kept.size == max(1, round(fraction * flat.size)) - np.count_nonzero(tensors[TOPK_VALUES] == 0)


def test_payloads_are_refused_under_another_codec_or_a_wrong_hash():
    encoded, _ = encode_update(delta(), "topk")
    with pytest.raises(PayloadError, match="names differ"):
        decode_update(encoded.data, encoded.sha256, "int8", SHAPES, KINDS)
    with pytest.raises(PayloadError, match="sha256"):
        decode_update(encoded.data, "0" * 64, "topk", SHAPES, KINDS)
    with pytest.raises(PayloadError, match="unknown codec"):
        decode_update(encoded.data, encoded.sha256, "zip", SHAPES, KINDS)
    with pytest.raises(PayloadError, match="safetensors"):
        decode_update(b"\xff" * 64, sha256_hex(b"\xff" * 64), "fp16", SHAPES, KINDS)


def test_an_unknown_codec_in_a_signed_header_is_refused_at_parse():
    signer = Signer.generate()
    header = UpdateHeader(round_id=1, base_version=0, n_samples=1, transfer_id="t", payload_sha256="0" * 64,
                          payload_bytes=1, codec="topk")
    raw = seal("dev", 1, header, signer).replace(b'"codec":"topk"', b'"codec":"gzip"')
    with pytest.raises(MessageError, match="codec"):
        parse(raw)


def test_the_coordinator_refuses_an_update_in_another_codec_than_the_rounds(tmp_path):
    from test_trust import Dev, Harness, honest_delta

    from protocol.messages import TrainingConfig

    h = Harness(tmp_path, min_clients=1, training=TrainingConfig(epochs=1, codec="topk"))
    dev = Dev(h, "dev1").join()
    h.open_round()
    dev.upload(honest_delta(0), dtype="fp16")  # its header says fp16
    assert "codec fp16; this round takes topk" in h.engine.store.rejections()[-1]["reason"]
    assert "dev1" not in h.engine.current.done


def test_the_coordinator_refuses_an_update_whose_payload_names_another_codec(tmp_path):
    """Hostile: the header and tensors say fp16, the payload's metadata int8. A robust rule decodes stored updates
    again by the codec they name, so accepting it would fail the round at aggregation; it is refused on arrival."""
    from test_trust import Dev, Harness, honest_delta

    from protocol.tensors import EncodedTensors, sha256_hex

    h = Harness(tmp_path, min_clients=1, combine="median")
    dev = Dev(h, "dev1").join()
    h.open_round()
    encoded, _ = encode_update(honest_delta(0), "fp16")
    lie = save(load(encoded.data), metadata={"ffr.codec": "int8"})
    dev.upload(EncodedTensors(lie, sha256_hex(lie), "fp16"))
    assert "names codec 'int8' but was sent as 'fp16'" in h.engine.store.rejections()[-1]["reason"]
    assert "dev1" not in h.engine.current.done
    dev.upload(honest_delta(0), dtype="fp16")  # the same delta, honestly labelled, is taken and aggregated
    h.engine.tick()
    assert h.engine.store.rounds()[0]["status"] == "completed", h.engine.store.rejections()


def test_a_topk_round_aggregates_what_the_devices_sent(tmp_path):
    from test_trust import GLOBAL, Dev, Harness, honest_delta

    from protocol.chunks import split, to_bytes
    from protocol.messages import TrainingConfig

    h = Harness(tmp_path, min_clients=2, training=TrainingConfig(epochs=1, codec="topk", topk_fraction=0.25))
    devs = [Dev(h, f"dev{i}").join() for i in range(2)]
    h.open_round()
    current = h.engine.current
    shapes, kinds = layout(GLOBAL)
    received = []
    for i, dev in enumerate(devs):
        encoded, _ = encode_update(honest_delta(i), "topk", 0.25)
        received.append(decode_update(encoded.data, encoded.sha256, "topk", shapes, kinds))
        header = UpdateHeader(round_id=current.round_id, base_version=0, n_samples=20, codec="topk",
                              transfer_id=f"{dev.id}-t", payload_sha256=encoded.sha256, payload_bytes=len(encoded.data))
        dev.send("update", header)
        for chunk in split(header.transfer_id, encoded.data, 64 * 1024):
            dev.raw("update/chunks", to_bytes(chunk))
    h.engine.tick()
    assert h.engine.store.rounds()[0]["status"] == "completed", h.engine.store.rejections()
    expected = GLOBAL["backbone.w"] + (received[0]["backbone.w"] + received[1]["backbone.w"]) / 2
    assert np.allclose(h.engine.global_state["backbone.w"], expected, atol=1e-6)


def test_a_real_round_with_topk_updates_and_error_feedback(tmp_path):
    from test_federated import TRAINING, run_fleet

    from protocol.messages import TrainingConfig

    service, devices, _ = run_fleet(tmp_path, broker_url=None, rounds=2, n_devices=2,
                                    training=TrainingConfig.model_validate({**TRAINING.model_dump(),
                                                                            "transport": {"codec": "topk"}}))
    rounds = service.engine.store.rounds()
    assert [r["status"] for r in rounds] == ["completed", "completed"], service.engine.store.rejections()
    fp32_bytes = sum(v.size * 4 for v in service.engine.global_state.values())
    for device in devices:
        log = device.home.rounds_log()
        assert all(e["acked"] for e in log) and all(e["bytes_sent"] <= fp32_bytes / 8 for e in log)
        assert device.home.codec_residual.exists(), "what topk could not send waits on the device"
    assert rounds[0]["metrics"]["codec"] == "topk"
