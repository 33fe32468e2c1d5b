"""On-device inference: ONNX Runtime + OpenCV + numpy, and nothing else (no torch).

An exported model carries its own preprocessing metadata (`ffr.*` keys), so a device
needs only the .onnx file to turn a face crop into an embedding.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from models.faces.preprocess import to_input

METADATA_PREFIX = "ffr."


@dataclass(frozen=True)
class ModelInfo:
    kind: str                 # "generic" or "personalised"
    input_size: int
    mean: float
    std: float
    color: str
    embedding_dim: int
    extra: dict
    mirror: bool = False      # each face averaged with its mirror inside the graph (`models.networks.mirror`)


def read_model_info(session: ort.InferenceSession) -> ModelInfo:
    meta = session.get_modelmeta().custom_metadata_map
    if f"{METADATA_PREFIX}input_size" not in meta:
        raise ValueError("this ONNX file has no ffr preprocessing metadata; export it with `ffr export`")
    get = lambda key: meta[f"{METADATA_PREFIX}{key}"]  # noqa: E731
    extra = json.loads(meta.get(f"{METADATA_PREFIX}extra", "{}"))
    return ModelInfo(get("kind"), int(get("input_size")), float(get("mean")), float(get("std")), get("color"),
                     int(get("embedding_dim")), extra, meta.get(f"{METADATA_PREFIX}mirror") == "averaged")


class OnnxEmbedder:
    """Face crops (N,H,W,3 RGB uint8) -> L2-normalised embeddings, with ONNX Runtime on the CPU."""

    def __init__(self, model: str | Path, threads: int | None = None):
        model = Path(model)
        if not model.is_file():
            raise FileNotFoundError(f"ONNX model not found: {model}")
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
        self.info = read_model_info(self.session)
        if self.info.mean != 0.5 or self.info.std != 0.5 or self.info.color != "RGB":
            raise ValueError(f"{model}: unsupported preprocessing {self.info}")
        self.input_name = self.session.get_inputs()[0].name

    @property
    def input_size(self) -> int:
        return self.info.input_size

    def embed(self, crops: np.ndarray, batch_size: int = 64) -> np.ndarray:
        x = to_input(crops, self.info.input_size)
        out = [self.session.run(None, {self.input_name: x[i:i + batch_size]})[0] for i in range(0, len(x), batch_size)]
        return np.concatenate(out).astype(np.float32)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))
