"""One interface for "face crops -> embeddings", whether the model is a checkpoint or an .onnx.

Evaluation code takes an `Embedder` and never cares which; torch is imported only for checkpoints.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from models.faces.preprocess import to_input
from models.networks.mirror import MIRRORED, averaged


class Embedder(Protocol):
    input_size: int

    def embed(self, crops: np.ndarray, batch_size: int = 64) -> np.ndarray: ...


class TorchEmbedder:
    """A FaceModel (or a bare FaceEmbedder) in eval mode; generic Theta(x) or personalised [Theta, Pi] embeddings,
    of each face alone (what training and the benches measure) or averaged with its mirror (what its ONNX export
    computes: `models.networks.mirror`)."""

    input_size = 128

    def __init__(self, model, personalised: bool = False, mirror: bool = False):
        import torch

        self._torch = torch
        self.model = model.eval()
        self.personalised, self.mirror = personalised, mirror
        if personalised and getattr(model, "dfc", None) is None:
            raise ValueError("this checkpoint has no DFC branch, so it has no personalised embedding")

    def embed(self, crops: np.ndarray, batch_size: int = 64) -> np.ndarray:
        torch = self._torch
        x = to_input(crops, self.input_size)
        fn = self.model.embed_personalised if self.personalised else getattr(self.model, "embed", self.model)
        run = (lambda batch: averaged(fn, batch)) if self.mirror else fn
        with torch.inference_mode():
            out = [run(torch.from_numpy(x[i:i + batch_size])).numpy() for i in range(0, len(x), batch_size)]
        return np.concatenate(out).astype(np.float32)


def load_embedder(path: str | Path, personalised: bool = False, threads: int | None = None) -> Embedder:
    """An .onnx file runs in ONNX Runtime, as it was built; a .safetensors file is a face embedder (the shipped one,
    or what `ffr pretrain` wrote) and anything else an ffr checkpoint, each embedding as its ONNX export would
    (mirror-averaged by default), so one model scores the same in whichever form it is given. Each refuses a file
    it cannot use in one line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".onnx":
        return _onnx(path, threads)
    if suffix == ".safetensors":
        return _safetensors(path, personalised)
    from models.networks.face_model import load_checkpoint

    model, _ = load_checkpoint(path)
    return TorchEmbedder(model, personalised, mirror=MIRRORED)


def _onnx(path: Path, threads: int | None) -> Embedder:
    from models.runtime import OnnxEmbedder

    try:
        return OnnxEmbedder(path, threads)
    except ValueError:
        raise
    except Exception as exc:  # ONNX Runtime's own errors (InvalidProtobuf, Fail, ...) share no base class
        raise ValueError(f"{path} is not a usable ONNX model: {str(exc).strip().splitlines()[0]}") from None


def _safetensors(path: Path, personalised: bool) -> Embedder:
    from models.networks.face_weights import checked_embedder

    if personalised:
        raise ValueError(f"{path} is a face embedder alone: it has no DFC branch, so no personalised embedding")
    return TorchEmbedder(checked_embedder(path), mirror=MIRRORED)
