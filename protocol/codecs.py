"""Update codecs: how a backbone delta is compressed into safetensors bytes, and checked on the way back.

The round configuration names the codec every device must use, and the device names it again in
its signed update header, so a payload is only ever decoded by the codec it was written with.

- `fp32`, `fp16`: every floating tensor cast (fp16: 1/2 of fp32's bytes).
- `int8`: symmetric 8-bit quantisation, one scale per output channel for weights (per tensor for
  vectors): about 1/4 of fp32's bytes.
- `topk`: the `fraction` largest-magnitude coordinates of all weights together, as fp16 values
  and their positions (Aji & Heafield, "Sparse Communication for Distributed Gradient Descent",
  EMNLP 2017). Positions travel in whichever form is smaller: int32 indices (4 bytes per kept
  coordinate) or a bitmask over all coordinates (1 bit each), the mask once more than 1/32 is kept.
  15 % keeps about 1/8.8 of fp32's bytes, 5 % about 1/15.
Both lossy codecs are meant to run with error feedback on the device (`edge_client.error_feedback`,
Seide et al. 2014; Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019): what a round
could not send is added to the next round's delta. BatchNorm's running statistics always travel
dense in fp16: a sparsified or coarsely quantised variance could turn negative on aggregation.

Decoding is the attacker-facing side: hash, names, shapes, dtypes, finiteness, index ranges and
ordering are all checked before a single value reaches aggregation (`PayloadError` otherwise).
It is also the coordinator's hot path, so it reads the payload in place (`protocol.safetensors_view`)
and treats it as a few long runs, not 318 small tensors: one conversion, one finiteness check, and
a `Decoded` whose floats lie in one vector that norms and folds read in one pass each.
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
from safetensors.numpy import save

from protocol import safetensors_view
from protocol.safetensors_view import SafetensorsView
from protocol.tensors import EncodedTensors, PayloadError, check_sha256, sha256_hex

CODECS = ("fp16", "fp32", "int8", "topk")
CODEC_METADATA = "ffr.codec"  # the payload's safetensors metadata key that names its codec
LOSSY = ("int8", "topk")
DENSE_SUFFIXES = ("running_mean", "running_var")  # floating buffers that always travel dense in fp16
SCALE_SUFFIX = ":scale"
TOPK_INDICES, TOPK_MASK, TOPK_VALUES = "topk:indices", "topk:mask", "topk:values"
INT8_MAX = 127.0
TOPK_FRACTION = 0.15  # top-k's default share of coordinates: with the bitmask, about 1/8.8 of fp32's bytes

State = dict[str, np.ndarray]
Shapes = dict[str, tuple[int, ...]]
Kinds = dict[str, str]  # name -> 'f' (floating) or 'i' (integer)


# -- encoding (the device's side) ---------------------------------------------------------------------------

def encode_update(
    delta: State, codec: str = "fp16", topk_fraction: float = TOPK_FRACTION
) -> tuple[EncodedTensors, State]:
    """The payload, and the dense delta the receiver will reconstruct from it (for error feedback)."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    if codec in ("fp16", "fp32"):
        wire = {k: _cast(v, np.float16 if codec == "fp16" else np.float32) for k, v in delta.items()}
    elif codec == "int8":
        wire = _int8_tensors(delta)
    else:
        wire = _topk_tensors(delta, topk_fraction)
    data = save(wire, metadata={CODEC_METADATA: codec})
    shapes = {k: tuple(np.shape(v)) for k, v in delta.items()}
    kinds = {k: np.asarray(v).dtype.kind for k, v in delta.items()}
    return EncodedTensors(data, sha256_hex(data), codec), _reconstruct(
        safetensors_view.read(data), codec, shapes, kinds
    )


def _cast(value: np.ndarray, dtype) -> np.ndarray:
    """Floating tensors to `dtype`; integer buffers keep their own type. copy(order="C") keeps 0-d shapes."""
    value = np.asarray(value)
    return (value.astype(dtype) if value.dtype.kind == "f" else value).copy(order="C")


def _is_dense(name: str, value: np.ndarray) -> bool:
    return name.endswith(DENSE_SUFFIXES) or np.asarray(value).ndim == 0


def _int8_tensors(delta: State) -> State:
    wire = {}
    for name, value in delta.items():
        value = np.asarray(value)
        if value.dtype.kind != "f" or _is_dense(name, value):
            wire[name] = _cast(value, np.float16)
            continue
        rows = value.reshape(value.shape[0], -1) if value.ndim >= 2 else value.reshape(1, -1)
        scale = (np.abs(rows).max(axis=1) / INT8_MAX).astype(np.float32)
        safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
        wire[name] = np.clip(np.rint(rows / safe[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8).reshape(value.shape)
        wire[name + SCALE_SUFFIX] = scale
    return wire


def layout(state: State) -> tuple[Shapes, Kinds]:
    """Names -> shapes and -> kinds of a model: what `decode_update` checks an update against."""
    return ({k: tuple(v.shape) for k, v in state.items()},
            {k: "f" if np.issubdtype(v.dtype, np.floating) else "i" for k, v in state.items()})


def sparse_names(shapes: Shapes, kinds: Kinds) -> list[str]:
    """The tensors top-k sparsifies, in the order their coordinates are concatenated (both sides agree)."""
    return sorted(
        k for k, shape in shapes.items() if kinds[k] == "f" and not (k.endswith(DENSE_SUFFIXES) or shape == ())
    )


def _topk_tensors(delta: State, fraction: float) -> State:
    if not 0.0 < fraction <= 1.0:
        raise ValueError("topk_fraction must lie in (0, 1]")
    shapes = {k: tuple(np.shape(v)) for k, v in delta.items()}
    kinds = {k: np.asarray(v).dtype.kind for k, v in delta.items()}
    names = sparse_names(shapes, kinds)
    flat = (
        np.concatenate([np.asarray(delta[k], np.float32).ravel() for k in names]) if names else np.zeros(0, np.float32)
    )
    k = min(flat.size, max(1, int(round(fraction * flat.size))))
    indices = np.sort(np.argpartition(np.abs(flat), flat.size - k)[flat.size - k:]).astype(np.int32)
    wire = {TOPK_VALUES: flat[indices].astype(np.float16)}
    if 4 * k > (flat.size + 7) // 8:  # a bit per coordinate is fewer bytes than 4 per kept one
        kept = np.zeros(flat.size, np.uint8)
        kept[indices] = 1
        wire[TOPK_MASK] = np.packbits(kept)
    else:
        wire[TOPK_INDICES] = indices
    for name in delta:
        if name not in names:
            wire[name] = _cast(delta[name], np.float16)
    return wire


# -- decoding (the coordinator's side) ----------------------------------------------------------------------

class Decoded(dict):
    """A decoded update, name -> array, whose floating tensors are all views into `flat` (one float32 vector in
    the order `layout`): `models.maths.state_norms.l2_norm` and `coordinator.aggregation.RunningMean` then read it in
    one pass instead of one call per tensor. Read-only by contract: a changed entry would not change `flat`
    (transformations such as clipping build a plain dict)."""

    def __init__(self, tensors: State, flat: np.ndarray, layout: tuple[str, ...]):
        super().__init__(tensors)
        self.flat, self.layout = flat, layout


def payload_codec(data: bytes) -> str:
    """The codec a payload names in its own metadata (fp16 when it names none): how an update stored after its
    checks is decoded again, even by a coordinator restarted with another codec. `decode_verified` refuses a
    payload sent as any other codec, so a stored update names the codec it was checked as."""
    return _named_codec(safetensors_view.read(data))


def _named_codec(wire: SafetensorsView) -> str:
    return wire.metadata.get(CODEC_METADATA, "fp16")


def decode_update(data: bytes, sha256: str, codec: str, shapes: Shapes, kinds: Kinds,
                  into: Staging | None = None) -> Decoded:
    """Payload bytes -> the dense delta (float32, integer buffers as sent), or PayloadError with the reason.

    With `into`, the floats are written into its reused tensors: the result is only valid until the next
    update is decoded into the same staging."""
    check_sha256(data, sha256)
    return decode_verified(data, codec, shapes, kinds, into)


def decode_verified(data: bytes, codec: str, shapes: Shapes, kinds: Kinds, into: Staging | None = None) -> Decoded:
    """`decode_update` for bytes already matched to their signed sha256 -- what `protocol.chunks.Reassembler`
    returns, or an update the coordinator stored after checking it -- so the payload is not hashed twice
    (about 3 ms of a 5 MB update); every other check runs as in `decode_update`."""
    if codec not in CODECS:
        raise PayloadError(f"unknown codec {codec!r}")
    wire = safetensors_view.read(data)
    _check_names(wire, _wire_names(codec, shapes, kinds, TOPK_MASK in wire.entries))
    named = _named_codec(wire)
    if named != codec:  # else it passes its checks as one codec and is decoded again later as another
        raise PayloadError(f"the payload names codec {named[:16]!r} but was sent as {codec!r}")
    return _reconstruct(wire, codec, shapes, kinds, into)


def _wire_names(codec: str, shapes: Shapes, kinds: Kinds, masked: bool = False) -> set[str]:
    """The tensor names a payload must hold exactly; top-k's positions are indices or a mask, never both."""
    if codec in ("fp16", "fp32"):
        return set(shapes)
    if codec == "int8":
        return set(shapes) | {k + SCALE_SUFFIX for k, s in shapes.items() if kinds[k] == "f" and not _dense_name(k, s)}
    return (set(shapes) - set(sparse_names(shapes, kinds))) | {TOPK_MASK if masked else TOPK_INDICES, TOPK_VALUES}


def _dense_name(name: str, shape: tuple[int, ...]) -> bool:
    return name.endswith(DENSE_SUFFIXES) or shape == ()


def _check_names(wire: SafetensorsView, expected: set[str]) -> None:
    unknown, missing = sorted(set(wire.entries) - expected), sorted(expected - set(wire.entries))
    if unknown or missing:
        raise PayloadError(f"tensor names differ from the model: unknown {unknown[:3]}, missing {missing[:3]}")


class Staging:
    """Float32 tensors an update is decoded into, allocated once and reused for every update, so decoding
    allocates (and page-faults) nothing per update.

    Every floating tensor is a view into one vector, `flat`, laid out in the order the codec's payload stores
    them (safetensors writes tensors by dtype, then by name): fp16 and fp32 send every float by name, so the
    whole payload converts in one call; int8 and top-k send their coded tensors (`sparse_names`) apart from the
    dense rest, so those come first, contiguous (`coded`), and top-k's coordinates scatter straight into place.
    A layout that does not match costs speed, never correctness: runs are found from the header."""

    def __init__(self, shapes: Shapes, kinds: Kinds, codec: str = "fp16"):
        self.lossy = codec in LOSSY
        coded = sparse_names(shapes, kinds) if self.lossy else []
        coded_set = set(coded)
        self.layout = tuple(coded + sorted(k for k in shapes if kinds[k] == "f" and k not in coded_set))
        sizes = [int(np.prod(shapes[k], dtype=np.int64)) for k in self.layout]
        self.flat = np.empty(int(sum(sizes)), np.float32)
        self.tensors: State = {}
        self.offsets: dict[str, int] = {}
        start = 0
        for name, size in zip(self.layout, sizes):
            self.tensors[name], self.offsets[name] = self.flat[start:start + size].reshape(shapes[name]), start
            start += size
        self.coded_names, self.coded = coded, self.flat[:sum(sizes[:len(coded)])]
        # int8's per-row scales: how many coordinates each row of the coded tensors holds, in `coded` order
        rows = np.array([_rows(shapes[k]) for k in coded], np.int64)
        self.row_lengths = np.repeat(np.array(sizes[:len(coded)], np.int64) // np.maximum(rows, 1), rows)

    def region(self, names: list[str]) -> np.ndarray:
        """The part of `flat` that holds `names` (consecutive in `layout`)."""
        return self.flat[self.offsets[names[0]]:self.offsets[names[-1]] + self.tensors[names[-1]].size]


def _reconstruct(wire: SafetensorsView, codec: str, shapes: Shapes, kinds: Kinds, into: Staging | None = None
                 ) -> Decoded:
    """The dense delta, written into `into` (a fresh one when not given or laid out for another codec)."""
    if into is None or into.lossy != (codec in LOSSY):
        into = Staging(shapes, kinds, codec)
    entries = wire.entries
    for name, shape in shapes.items():
        if name in entries:  # top-k's sparse tensors travel as values and positions, not by name
            _check_shape(name, entries[name].shape, shape)
    out: State = {}
    for name in shapes:
        if kinds[name] == "i":
            value = wire.array(name)
            if value.dtype.kind not in "iu":
                raise PayloadError(f"tensor {name} has dtype {value.dtype}, expected an integer type")
            out[name] = value
    coded = into.coded_names
    plain = list(into.layout[len(coded):])
    if plain:
        _read_floats(wire, plain, into.region(plain))
    if codec == "int8" and coded:
        _dequantise(wire, coded, into)
    elif codec == "topk":
        _densify(wire, into.coded)
    out.update(into.tensors)
    return Decoded(out, into.flat, into.layout)


def _check_shape(name: str, actual: tuple[int, ...], shape: tuple[int, ...]) -> None:
    if tuple(actual) != tuple(shape):
        raise PayloadError(f"tensor {name} has shape {tuple(actual)}, expected {tuple(shape)}")


def _read_floats(wire: SafetensorsView, names: list[str], out: np.ndarray) -> None:
    """fp16/fp32 tensors `names` -> `out` (float32, their concatenation), refusing other dtypes, NaN and Inf.
    When their bytes lie back to back (as safetensors writes them), one conversion and one check do it all."""
    dtypes, entries = set(), wire.entries
    for name in names:
        dtype = entries[name].dtype
        if dtype.kind != "f":
            raise PayloadError(f"tensor {name} has dtype {dtype}, expected a floating type")
        if dtype not in (np.float16, np.float32):
            raise PayloadError(f"tensor {name} is {dtype}; only float16 or float32 travel on the wire")
        dtypes.add(dtype)
    run = wire.span(names, dtypes.pop()) if len(dtypes) == 1 else None
    if run is not None:
        _to_float32(run, out)
    else:
        start = 0
        for name in names:
            value = wire.array(name).reshape(-1)
            _to_float32(value, out[start:start + value.size])
            start += value.size
    if not np.isfinite(out).all():
        bad = next(n for n, part in _split(out, names, wire) if not np.isfinite(part).all())
        raise PayloadError(f"tensor {bad} holds NaN or Inf")


def _split(flat: np.ndarray, names: list[str], wire: SafetensorsView):
    """(name, its part of `flat`) for tensors laid end to end (only to name the culprit of a refusal)."""
    start = 0
    for name in names:
        size = int(np.prod(wire.entries[name].shape, dtype=np.int64))
        yield name, flat[start:start + size]
        start += size


def _to_float32(value: np.ndarray, out: np.ndarray) -> None:
    """A flat fp16 or fp32 array -> flat float32 `out`, exactly."""
    if value.dtype == np.float16 and value.size:
        _half_to_float(value.view(np.uint16), out)
    else:
        np.copyto(out, value)


# every float16 bit pattern's float32 value (256 KB, stays in cache): numpy's own float16 cast is scalar code
# that slows about 4x on subnormals, which small update deltas are full of (46% of a 1e-4-scale delta);
# looking the bits up is exact and costs the same for every value (2.4 M values, 46% subnormal: 32 ms -> 4 ms)
with np.errstate(invalid="ignore"):  # the NaN bit patterns: arm64's cast warns "invalid value" on them (issue 49)
    HALF_TO_FLOAT = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


@functools.cache
def _torch_half_to_float():
    """torch's float16 -> float32 copy when torch is installed (the coordinator's extra does not require it):
    vectorised F16C conversion in hardware, exact and as fast on subnormals (2.4 M values: 0.23 ms against the
    table's 4 ms on an idle machine); None without torch."""
    try:
        import torch
    except ImportError:
        return None

    def convert(bits: np.ndarray, out: np.ndarray) -> None:
        with warnings.catch_warnings():  # torch warns that a read-only array could be written; it only reads it
            warnings.simplefilter("ignore", UserWarning)
            source = torch.from_numpy(bits.view(np.int16))
        torch.from_numpy(out).copy_(source.view(torch.float16))
    return convert


def _half_to_float(bits: np.ndarray, out: np.ndarray) -> None:
    """float16 bit patterns (uint16, 1-D) -> float32 `out` (1-D, C-contiguous), exactly. torch is looked for on
    first use, not at import: importing it costs a second."""
    fast = _torch_half_to_float()
    if fast is not None:
        fast(bits, out)
    else:  # mode="wrap": a uint16 index is always inside the table, so numpy may skip its bounds check
        np.take(HALF_TO_FLOAT, bits, out=out, mode="wrap")


def _dequantise(wire: SafetensorsView, names: list[str], into: Staging) -> None:
    """int8 tensors and their per-row float32 scales -> `into.coded`. The int8 bytes (back to back, as safetensors
    writes them) convert in one call, the scales are checked together and applied as one vector of per-coordinate
    factors: a loop over 160 tensors of small rows cost 3x more."""
    entries, scale_names = wire.entries, [name + SCALE_SUFFIX for name in names]
    for name, scale_name in zip(names, scale_names):
        entry, scale = entries[name], entries[scale_name]
        if entry.dtype != np.int8:
            raise PayloadError(f"tensor {name} is {entry.dtype}; int8 sends int8")
        rows = _rows(entry.shape)
        if scale.dtype != np.float32 or scale.shape != (rows,):
            raise PayloadError(f"tensor {scale_name} must be float32 of shape ({rows},)")
    run = wire.span(names, np.dtype(np.int8))
    if run is None or (run.size and run.min() == -128):
        for name in names:  # slower, and names the culprit
            q = wire.array(name)
            if q.size and q.min() == -128:
                raise PayloadError(f"tensor {name} holds -128, outside the symmetric int8 range")
            np.copyto(into.tensors[name].reshape(-1), q.reshape(-1))
    else:
        np.copyto(into.coded, run)  # int8 -> float32 unbuffered: ~4x a mixed-type ufunc
    scales = wire.span(scale_names, np.dtype(np.float32))
    if scales is None:
        scales = np.concatenate([wire.array(n) for n in scale_names])
    if not np.isfinite(scales).all() or (scales < 0).any():
        bad = next(n for n in scale_names if not np.isfinite(wire.array(n)).all() or (wire.array(n) < 0).any())
        raise PayloadError(f"tensor {bad} holds a negative or non-finite scale")
    into.coded *= np.repeat(scales, into.row_lengths)


def _rows(shape: tuple[int, ...]) -> int:
    """int8's scale count: one per output channel of a weight, one for a vector."""
    return shape[0] if len(shape) >= 2 else 1


def _densify(wire: SafetensorsView, flat: np.ndarray) -> None:
    """Scatter the top-k coordinates into `flat` (zeroed first) after checking every position and value."""
    values = wire.array(TOPK_VALUES)
    if values.ndim != 1:
        raise PayloadError("top-k values must be a vector")
    if values.size > flat.size:
        raise PayloadError(f"top-k sends {values.size} coordinates of a model with {flat.size}")
    positions = (_mask_positions(wire.array(TOPK_MASK), flat.size) if TOPK_MASK in wire.entries
                 else _index_positions(wire.array(TOPK_INDICES), flat.size))
    if positions.size != values.size:
        raise PayloadError("top-k positions and values must be the same length")
    checked = np.empty(values.shape, np.float32)
    _read_floats(wire, [TOPK_VALUES], checked)
    flat.fill(0.0)
    flat[positions] = checked


def _index_positions(indices: np.ndarray, size: int) -> np.ndarray:
    if indices.dtype != np.int32 or indices.ndim != 1:
        raise PayloadError("top-k indices must be an int32 vector")
    if indices.size and (indices[0] < 0 or indices[-1] >= size or (np.diff(indices) <= 0).any()):
        raise PayloadError("top-k indices must be strictly increasing and inside the model")
    return indices


def _mask_positions(mask: np.ndarray, size: int) -> np.ndarray:
    """The packed bitmask (numpy's big-endian bit order) -> the indices of its set bits (scattering through
    indices is faster than through a boolean mask: 2.4 M coordinates, 15 % set, 1.6 ms against 7.0 ms)."""
    if mask.dtype != np.uint8 or mask.shape != ((size + 7) // 8,):
        raise PayloadError(f"top-k mask must be uint8 of shape ({(size + 7) // 8},), one bit per coordinate")
    bits = np.unpackbits(mask).view(np.bool_)  # 0/1 bytes; numpy finds set bools 6x faster than set uint8s
    if bits[size:].any():
        raise PayloadError("top-k mask sets bits past the model's last coordinate")
    return np.flatnonzero(bits[:size])
