"""Export a trained model to one self-contained ONNX file a device can run with onnxruntime.

Two kinds: `generic` (the shared embedder Theta) and `personalised` (Theta followed by the
device's DFC branch, output [Theta, Pi] (and Omega's posteriors, if on) normalised: `models.networks.dfc`).
Either kind averages each face with its mirror by default (`models.networks.mirror`), as the torch-free build does.
The batch axis is dynamic and the preprocessing is written into the file's metadata (`ffr.*`), read by `models.runtime`.
"""
from __future__ import annotations

import io
import json
import logging
import threading
import warnings
from pathlib import Path

import onnx
import torch
from torch import nn

from models.faces.preprocess import INPUT_SIZE, MEAN, STD
from models.networks.face_model import FaceModel
from models.networks.mirror import MIRRORED, averaged
from models.runtime import METADATA_PREFIX

OPSET = 17
_EXPORT_LOCK = threading.Lock()  # torch's exporters keep global state: one export at a time per process


class _Exported(nn.Module):
    """The model's generic or personalised embedding, of each image alone or averaged with its mirror."""

    def __init__(self, model: FaceModel, personalised: bool, mirror: bool):
        super().__init__()
        self.model, self.mirror = model, mirror
        self.embed = model.embed_personalised if personalised else model.embed

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return averaged(self.embed, image) if self.mirror else self.embed(image)


def export_onnx(model: FaceModel, out: str | Path, personalised: bool = False, extra: dict | None = None,
                mirror: bool = MIRRORED) -> Path:
    """Write `out` (a single .onnx file, weights inside) and return its path."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if personalised and model.dfc is None:
        raise ValueError("this model has no DFC branch; export the generic embedder or train with DFC")
    wrapper = _Exported(model, personalised, mirror).eval()
    proto = _to_onnx(wrapper)
    with torch.no_grad():  # a personalised width depends on the people its branch was fitted for, if they vote
        dim = int(wrapper(torch.zeros(1, 3, INPUT_SIZE, INPUT_SIZE)).shape[1])
    metadata = {"kind": "personalised" if personalised else "generic", "input_size": INPUT_SIZE,
                "mean": MEAN, "std": STD, "color": "RGB", "layout": "NCHW", "embedding_dim": dim,
                "normalised": "l2", "mirror": "averaged" if mirror else "none", "extra": json.dumps(extra or {})}
    for key, value in metadata.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = f"{METADATA_PREFIX}{key}", str(value)
    onnx.checker.check_model(proto)
    tmp = out.with_suffix(".onnx.tmp")
    onnx.save(proto, tmp)
    tmp.replace(out)
    return out


def _to_onnx(wrapper: nn.Module) -> onnx.ModelProto:
    """TorchScript exporter first (about 6x faster to export than dynamo here); dynamo if it fails."""
    example = torch.zeros(2, 3, INPUT_SIZE, INPUT_SIZE)
    with _EXPORT_LOCK, warnings.catch_warnings(), _quiet_exporter():
        warnings.simplefilter("ignore")
        try:
            buffer = io.BytesIO()
            torch.onnx.export(
                wrapper,
                (example,),
                buffer,
                dynamo=False,
                input_names=["image"],
                output_names=["embedding"],
                dynamic_axes={"image": {0: "batch"}, "embedding": {0: "batch"}},
                opset_version=OPSET,
            )
            return onnx.load_from_string(buffer.getvalue())
        except Exception:  # noqa: BLE001 - the legacy exporter is deprecated; fall back to the supported one
            batch = torch.export.Dim("batch", min=1, max=4096)
            program = torch.onnx.export(wrapper, (example,), dynamo=True, external_data=False, verbose=False,
                                        input_names=["image"], output_names=["embedding"],
                                        dynamic_shapes={"image": {0: batch}}, opset_version=OPSET, optimize=True)
            return program.model_proto


class _quiet_exporter:
    """The dynamo exporter logs every step at INFO; a CLI user only needs errors."""

    def __enter__(self):
        self._levels = {}
        for name in ("torch.onnx", "torch.export", "onnxscript", "torch._dynamo"):
            logger = logging.getLogger(name)
            self._levels[name] = logger.level
            logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
