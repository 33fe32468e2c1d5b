"""protocol.safetensors_view reads update payloads in place: it must accept what the safetensors library writes,
give the same tensors as the library's own loader, and refuse every hostile header the library refuses."""
from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors import SafetensorError
from safetensors.numpy import load, save

from protocol import safetensors_view
from protocol.tensors import PayloadError

RNG = np.random.default_rng(0)
TENSORS = {"a.weight": RNG.normal(size=(4, 3)).astype(np.float16), "b.bias": RNG.normal(size=5).astype(np.float32),
           "c.q": RNG.integers(-127, 127, size=(2, 6)).astype(np.int8), "d.count": np.array(7, np.int64),
           "e.mask": RNG.integers(0, 255, size=9).astype(np.uint8), "f.empty": np.zeros((0, 3), np.float16)}


# refused here, accepted by the library: a repeated key (json keeps the last), a dtype numpy cannot hold, and
# fields the format does not define (the library ignores them)
STRICTER = ("duplicate key", "bfloat16", "extra field")


def _with_header(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _valid() -> tuple[dict, bytes]:
    """A library-written payload's header (as a dict) and its data section."""
    payload = save(TENSORS, metadata={"ffr.codec": "fp16"})
    n = struct.unpack("<Q", payload[:8])[0]
    return json.loads(payload[8:8 + n]), payload[8 + n:]


def test_same_tensors_as_the_librarys_loader():
    payload = save(TENSORS, metadata={"ffr.codec": "fp16"})
    view = safetensors_view.read(payload)
    assert dict(view.metadata) == {"ffr.codec": "fp16"}
    reference = load(payload)
    assert set(view.entries) == set(reference)
    for name, value in reference.items():
        got = view.array(name)
        assert got.dtype == value.dtype and got.shape == value.shape and np.array_equal(got, value)
        assert not got.flags.writeable, "a view into the payload, never a writable alias"


def test_span_joins_tensors_that_lie_back_to_back():
    payload = save({"x": np.arange(4, dtype=np.float16), "y": np.arange(4, 7, dtype=np.float16),
                    "z": np.ones(2, np.float32)})
    view = safetensors_view.read(payload)
    assert np.array_equal(view.span(["x", "y"], np.dtype(np.float16)), np.arange(7, dtype=np.float16))
    assert view.span(["y", "x"], np.dtype(np.float16)) is None, "out of order: no single run"
    assert view.span(["x", "z"], np.dtype(np.float16)) is None, "another dtype: no single run"


def _mutations():
    header, data = _valid()
    first = sorted(k for k in header if k != "__metadata__")[0]

    def changed(name, **fields):
        return _with_header({**header, name: {**header[name], **fields}}, data)

    a = header["a.weight"]["data_offsets"]
    return [
        ("short", b"\x01\x02"),
        ("header length past the end", struct.pack("<Q", 10 ** 6) + b"{}"),
        ("huge header length", struct.pack("<Q", 2 ** 63) + b"{}" + data),
        ("not an object", _with_header([], data)),  # type: ignore[arg-type]
        ("not JSON", struct.pack("<Q", 5) + b"{nope" + data),
        ("not UTF-8", struct.pack("<Q", 4) + b"{\xff\xfe}" + data),
        ("unknown dtype", changed(first, dtype="F128")),
        ("bfloat16", changed(first, dtype="BF16")),
        ("negative shape", changed("b.bias", shape=[-5])),
        ("float shape", changed("b.bias", shape=[5.0])),
        ("shape not matching bytes", changed("b.bias", shape=[6])),
        ("offsets reversed", changed("a.weight", data_offsets=[a[1], a[0]])),
        ("offsets not a pair", changed("a.weight", data_offsets=[a[0]])),
        ("missing field", _with_header({**header, "b.bias": {"dtype": "F32", "shape": [5]}}, data)),
        ("extra field", changed("b.bias", extra=1)),
        ("metadata not strings", _with_header({**header, "__metadata__": {"k": 1}}, data)),
        ("trailing bytes", _with_header(header, data + b"\0" * 8)),
        ("truncated data", _with_header(header, data[:-4])),
        ("overlap", changed("a.weight", data_offsets=[0, a[1] - a[0]]) if a[0] else
         changed("b.bias", data_offsets=[0, 20])),
        ("duplicate key", struct.pack("<Q", 0) + b""),  # replaced below: json.dumps cannot write duplicates
    ]


@pytest.mark.parametrize("case", [m[0] for m in _mutations()])
def test_hostile_headers_are_refused_where_the_library_refuses_them(case):
    payload = dict(_mutations())[case]
    if case == "duplicate key":
        header, data = _valid()
        raw = json.dumps(header).encode()
        entry = json.dumps(header["b.bias"]).encode()
        raw = raw[:-1] + b', "b.bias": ' + entry + b"}"
        payload = struct.pack("<Q", len(raw)) + raw + data
    with pytest.raises(PayloadError, match="not a safetensors payload"):
        safetensors_view.read(payload)
    if case not in STRICTER:
        with pytest.raises((SafetensorError, ValueError)):
            load(payload)


def test_random_corruption_is_refused_or_reads_exactly_as_the_library_does():
    """Byte flips anywhere in the header: whatever the reader accepts, the library loads to the same tensors."""
    payload = save(TENSORS)
    n = struct.unpack("<Q", payload[:8])[0]
    rng = np.random.default_rng(3)
    accepted = 0
    for _ in range(400):
        data = bytearray(payload)
        for position in rng.integers(0, 8 + n, size=rng.integers(1, 3)):
            data[position] = rng.integers(0, 256)
        data = bytes(data)
        try:
            view = safetensors_view.read(data)
        except PayloadError:
            continue
        accepted += 1
        reference = load(data)
        assert set(view.entries) == set(reference)
        assert all(np.array_equal(view.array(k), v) and view.array(k).dtype == v.dtype for k, v in reference.items())
    assert accepted > 0, "some flips (inside names or padding) leave a valid payload"


def test_a_cached_header_is_still_checked_against_each_payloads_length():
    """Headers are cached by their bytes (every device of a round sends the same one); the cache must not let a
    payload with the same header but other data through."""
    payload = save(TENSORS)
    safetensors_view.read(payload)
    with pytest.raises(PayloadError, match="do not end where the payload does"):
        safetensors_view.read(payload + b"\0\0")
    with pytest.raises(PayloadError, match="do not end where the payload does"):
        safetensors_view.read(payload[:-1])
