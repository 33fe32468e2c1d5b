"""Error feedback for lossy update codecs: what a round could not send is sent later.

EF (Seide et al., "1-bit SGD", Interspeech 2014; Karimireddy et al., "Error Feedback Fixes
SignSGD", ICML 2019): the device sends C(delta + e) and keeps e <- (delta + e) - C(delta + e).
The residual e is the device's own (it derives from its data), so it lives in the device home and
never travels. It is dropped when the codec or the model's layout changes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from protocol.codecs import LOSSY, encode_update
from protocol.tensors import EncodedTensors

State = dict[str, np.ndarray]


def compensate(delta: State, residual: State | None) -> State:
    """delta + e over floating tensors (integer buffers are sent as they are)."""
    if not residual:
        return delta
    return {k: (v + residual[k] if k in residual else v) for k, v in delta.items()}


def new_residual(sent: State, received: State) -> State:
    """e = what was meant to be sent minus what the receiver reconstructs (floating tensors only)."""
    return {k: (np.asarray(v, np.float32) - received[k]).astype(np.float32)
            for k, v in sent.items() if np.asarray(v).dtype.kind == "f"}


class ErrorFeedback:
    """The device's residual for one codec, kept in a safetensors file."""

    def __init__(self, path: Path):
        self.path = path

    def load(self, codec: str, delta: State) -> State | None:
        if codec not in LOSSY or not self.path.exists():
            return None
        try:
            residual = load_file(str(self.path))
        except Exception:  # noqa: BLE001 - a damaged residual only costs what it held
            return None
        meta_ok = self._codec_file().exists() and self._codec_file().read_text() == codec
        same = meta_ok and all(k in delta and residual[k].shape == np.shape(delta[k]) for k in residual)
        return residual if same else None

    def encode(self, delta: State, codec: str, topk_fraction: float) -> EncodedTensors:
        """Encode delta + residual and keep the new residual (lossy codecs); fp16/fp32 carry none."""
        target = compensate(delta, self.load(codec, delta))
        encoded, received = encode_update(target, codec, topk_fraction)
        if codec in LOSSY:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            save_file(new_residual(target, received), str(self.path))
            self._codec_file().write_text(codec)
        else:
            self.path.unlink(missing_ok=True)
        return encoded

    def _codec_file(self) -> Path:
        return self.path.with_suffix(".codec")
