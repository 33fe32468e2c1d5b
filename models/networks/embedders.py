"""One interface for "face crops -> embeddings", whether the model is a checkpoint or an .onnx.

Evaluation code takes an `Embedder` and never cares which; torch is imported only for checkpoints.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from models.faces.preprocess import to_input


class Embedder(Protocol):
    input_size: int

    def embed(self, crops: np.ndarray, batch_size: int = 64) -> np.ndarray: ...


class TorchEmbedder:
    """A FaceModel (or a bare FaceEmbedder) in eval mode; generic Theta(x) or personalised [Theta, Pi] embeddings."""

    input_size = 128

    def __init__(self, model, personalised: bool = False):
        import torch

        self._torch = torch
        self.model = model.eval()
        self.personalised = personalised
        if personalised and getattr(model, "dfc", None) is None:
            raise ValueError("this checkpoint has no DFC branch, so it has no personalised embedding")

    def embed(self, crops: np.ndarray, batch_size: int = 64) -> np.ndarray:
        torch = self._torch
        x = to_input(crops, self.input_size)
        fn = self.model.embed_personalised if self.personalised else getattr(self.model, "embed", self.model)
        with torch.inference_mode():
            out = [fn(torch.from_numpy(x[i:i + batch_size])).numpy() for i in range(0, len(x), batch_size)]
        return np.concatenate(out).astype(np.float32)


def load_embedder(path: str | Path, personalised: bool = False, threads: int | None = None) -> Embedder:
    """An .onnx file runs in ONNX Runtime; anything else is read as an ffr checkpoint."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if path.suffix.lower() == ".onnx":
        from models.runtime import OnnxEmbedder

        return OnnxEmbedder(path, threads)
    from models.networks.face_model import load_checkpoint

    model, _ = load_checkpoint(path)
    return TorchEmbedder(model, personalised)
