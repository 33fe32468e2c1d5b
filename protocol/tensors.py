"""Backbone tensors on the wire: safetensors bytes (never pickle), fp16 or fp32, with a sha256.

Decoding validates against the names, shapes and dtypes the receiver expects and refuses
NaN/Inf, so a malformed or malicious update can never reach aggregation.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

WIRE_DTYPES = {"fp16": np.float16, "fp32": np.float32}


class PayloadError(ValueError):
    """A tensor payload that must be refused; the message is the reason sent back."""


@dataclass(frozen=True)
class EncodedTensors:
    data: bytes
    sha256: str
    dtype: str


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def encode(tensors: dict[str, np.ndarray], dtype: str = "fp16") -> EncodedTensors:
    """Floating tensors are cast to the wire dtype; integer buffers keep their own type."""
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"unknown wire dtype {dtype!r}; choose fp16 or fp32")
    # copy(order="C"), not ascontiguousarray: the latter turns 0-d buffers into shape (1,)
    cast = {k: (v.astype(WIRE_DTYPES[dtype]) if np.issubdtype(v.dtype, np.floating) else v).copy(order="C")
            for k, v in tensors.items()}
    data = save(cast, metadata={"ffr.dtype": dtype})
    return EncodedTensors(data, sha256_hex(data), dtype)


def check_sha256(data: bytes, sha256: str) -> None:
    if sha256_hex(data) != sha256:
        raise PayloadError("payload sha256 does not match (corrupted or truncated)")


def load_checked(data: bytes, sha256: str) -> dict[str, np.ndarray]:
    """The payload's tensors as sent, once its sha256 matches and it parses as safetensors; PayloadError otherwise."""
    check_sha256(data, sha256)
    try:
        return load(data)
    except (SafetensorError, ValueError) as exc:
        raise PayloadError(f"not a safetensors payload: {exc}") from exc


def decode(data: bytes, sha256: str, expected: dict[str, tuple[int, ...]] | None = None,
           expected_kinds: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """Bytes -> float32 (or integer) arrays, after checking hash, names, shapes, dtypes and finiteness.

    `expected_kinds` maps names to numpy dtype kinds ('f' floating, 'i' integer) of the model.
    """
    tensors = load_checked(data, sha256)
    if expected is not None:
        _check_layout(tensors, expected)
    for name, kind in (expected_kinds or {}).items():
        actual = tensors[name].dtype
        if (kind == "f") != np.issubdtype(actual, np.floating):
            raise PayloadError(
                f"tensor {name} has dtype {actual}, expected a {'floating' if kind == 'f' else 'integer'} type"
            )
    out = {}
    for name, value in tensors.items():
        if np.issubdtype(value.dtype, np.floating):
            if value.dtype not in (np.float16, np.float32):
                raise PayloadError(f"tensor {name} is {value.dtype}; only float16 or float32 travel on the wire")
            value = finite_float32(name, value)
        out[name] = value
    return out


def finite_float32(name: str, value: np.ndarray) -> np.ndarray:
    """fp16/fp32 -> float32, refusing NaN and Inf (fp16's Inf and NaN stay Inf and NaN in float32, where
    numpy's check is vectorised)."""
    value = value.astype(np.float32, copy=False)
    if not np.isfinite(value).all():
        raise PayloadError(f"tensor {name} holds NaN or Inf")
    return value


def _check_layout(tensors: dict[str, np.ndarray], expected: dict[str, tuple[int, ...]]) -> None:
    unknown, missing = sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors))
    if unknown or missing:
        raise PayloadError(f"tensor names differ from the model: unknown {unknown[:3]}, missing {missing[:3]}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise PayloadError(f"tensor {name} has shape {tuple(tensors[name].shape)}, expected {tuple(shape)}")
