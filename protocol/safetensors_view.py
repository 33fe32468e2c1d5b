"""Safetensors bytes read where they lie: the header checked as strictly as the format's own loader, tensors as
read-only numpy views into the payload.

Why not `safetensors.numpy.load`: it copies every tensor out of the payload (2.4 ms for a 4.9 MB update) into
318 separate arrays, each of which then costs a call to convert, check and fold; the coordinator reads every
update once, on its hot path, and the library reads zero-copy only from files. This module reads the same
format (huggingface/safetensors README: 8-byte little-endian header length N, N bytes of JSON, then the data)
and refuses what the reference loader refuses (`Metadata::validate` in safetensors/src/tensor.rs): a header
past the buffer or over the size limit, one that is not a JSON object, unknown dtypes, tensors whose byte
range does not match their shape, and ranges that leave gaps, overlap or do not end at the buffer's end. It
is stricter in three ways: duplicate JSON keys, dtypes numpy cannot hold (BF16, FP8) and fields the format
does not define are refused too.

Every check is against the bytes alone; what a payload must contain (names, shapes, dtypes) is the caller's
business (`protocol.codecs`).
"""
from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from protocol.tensors import PayloadError

ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
MAX_HEADER_BYTES = 1 << 20  # an update's header is ~30 KB; the reference loader allows 100 MB
DTYPES = {name: np.dtype(t) for name, t in [
    ("F64", np.float64), ("F32", np.float32), ("F16", np.float16), ("I64", np.int64), ("I32", np.int32),
    ("I16", np.int16), ("I8", np.int8), ("U64", np.uint64), ("U32", np.uint32), ("U16", np.uint16),
    ("U8", np.uint8), ("BOOL", np.bool_)]}


@dataclass(frozen=True)
class Entry:
    """One tensor: its dtype, shape and absolute byte range [start, end) in the payload."""

    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    """A checked header: `entries` in the order their bytes lie (absolute offsets), `metadata` its string map,
    `end` where the last tensor's bytes end, which must be the payload's length."""

    entries: Mapping[str, Entry]
    metadata: Mapping[str, str]
    end: int


@dataclass(frozen=True)
class SafetensorsView:
    """A checked payload: its bytes and their header."""

    data: bytes
    header: Header

    @property
    def entries(self) -> Mapping[str, Entry]:
        return self.header.entries

    @property
    def metadata(self) -> Mapping[str, str]:
        return self.header.metadata

    def array(self, name: str) -> np.ndarray:
        """The tensor as a read-only view into the payload (a copy only when its bytes are misaligned)."""
        entry = self.entries[name]
        return _array(self.data, entry.dtype, entry.start, entry.end).reshape(entry.shape)

    def span(self, names: list[str], dtype: np.dtype) -> np.ndarray | None:
        """The tensors `names` as one flat view when their bytes lie back to back in that order with `dtype`
        (then one vectorised call can read them all); None otherwise."""
        if not names:
            return None
        table = self.header.entries
        entries = [table[n] for n in names]
        if any(e.dtype != dtype for e in entries) or any(a.end != b.start for a, b in zip(entries, entries[1:])):
            return None
        return _array(self.data, np.dtype(dtype), entries[0].start, entries[-1].end)


def _array(data: bytes, dtype: np.dtype, start: int, end: int) -> np.ndarray:
    array = np.frombuffer(data, dtype, count=(end - start) // dtype.itemsize, offset=start)
    return array if array.flags.aligned else array.copy()


def read(data: bytes, max_header_bytes: int = MAX_HEADER_BYTES) -> SafetensorsView:
    """Parse and check `data`'s header; PayloadError with the reason when the bytes are not a valid payload."""
    if len(data) < 8:
        raise PayloadError("not a safetensors payload: shorter than its 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if n > max_header_bytes:
        raise PayloadError(f"not a safetensors payload: header of {n} bytes exceeds {max_header_bytes}")
    if 8 + n > len(data):
        raise PayloadError("not a safetensors payload: header runs past the end of the payload")
    header = _header(data[8:8 + n])
    if header.end != len(data):
        raise PayloadError("not a safetensors payload: the tensors do not end where the payload does")
    return SafetensorsView(data, header)


@functools.lru_cache(maxsize=8)
def _header(raw: bytes) -> Header:
    """The header's JSON checked. Cached by its bytes: every device of a round sends the same header (same
    model, same codec), so a round parses it once; the result depends on nothing but those bytes."""
    if not raw.startswith(b"{"):
        raise PayloadError("not a safetensors payload: header is not a JSON object")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise PayloadError(f"not a safetensors payload: header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise PayloadError("not a safetensors payload: header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise PayloadError("not a safetensors payload: __metadata__ must map strings to strings")
    base = 8 + len(raw)
    entries = sorted(((name, _entry(name, info, base)) for name, info in header.items()), key=lambda e: e[1].start)
    end = base
    for name, entry in entries:
        if entry.start != end:
            raise PayloadError(f"not a safetensors payload: tensor {name}'s bytes leave a gap or overlap another")
        end = entry.end
    return Header(MappingProxyType(dict(entries)), MappingProxyType(metadata), end)


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """json's object hook: a key given twice is refused (json.loads would keep the last one silently)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate key")
    return obj


def _entry(name: str, info: object, base: int) -> Entry:
    """One header entry checked: a known dtype, a shape of non-negative ints, a byte range its shape fills."""
    if not isinstance(info, dict) or info.keys() != ENTRY_KEYS:
        raise PayloadError(f"not a safetensors payload: tensor {name} needs exactly dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in DTYPES:
        raise PayloadError(f"not a safetensors payload: tensor {name} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise PayloadError(f"not a safetensors payload: tensor {name}'s shape must be non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int and o >= 0 for o in offsets)
            or offsets[1] < offsets[0]):
        raise PayloadError(f"not a safetensors payload: tensor {name}'s data_offsets must be [begin, end]")
    dt = DTYPES[dtype]
    if math.prod(shape) * dt.itemsize != offsets[1] - offsets[0]:
        raise PayloadError(f"not a safetensors payload: tensor {name}'s bytes do not match its shape and dtype")
    return Entry(dt, tuple(shape), base + offsets[0], base + offsets[1])
