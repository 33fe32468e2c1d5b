"""The face-pretrained embedder this project ships: one fp16 safetensors file and its model card.

`models/weights/face_embedder.safetensors` is the MobileNetV2-128 embedder distilled from SFace
by `ffr pretrain` (see MODEL_CARD.md beside it). It is every run's default starting point
(`--init face`). Reading it needs safetensors and numpy only, so the coordinator can start
round 0 from it without torch; torch is imported only where a torch module is built.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from models.networks.mirror import MIRRORED
from models.networks.pretrained import sha256_of as file_sha256

WEIGHTS_DIR = Path(__file__).resolve().parents[1] / "weights"
SHIPPED_WEIGHTS = WEIGHTS_DIR / "face_embedder.safetensors"
MODEL_CARD = WEIGHTS_DIR / "MODEL_CARD.md"
# sha256 of SHIPPED_WEIGHTS: a test pins it, and loading refuses a file that differs.
SHIPPED_SHA256 = "399c63575c0ba23324471413f19a5b252f9aec9865a07a74e1f78bba5338de6f"
SHAREABLE_PREFIX = "backbone."
INITS = ("face", "imagenet", "none")


class FaceWeightsError(ValueError):
    """The shipped weights are missing or are not the file this release was made with."""


def shipped_weights(check: bool = True) -> Path:
    """The face embedder's weights: $FFR_FACE_WEIGHTS when set (the user's own file, taken as it is), else
    the shipped file, after checking its sha256 against the one recorded in this module."""
    if os.environ.get("FFR_FACE_WEIGHTS"):
        path = Path(os.environ["FFR_FACE_WEIGHTS"])
        if not path.is_file():
            raise FaceWeightsError(f"FFR_FACE_WEIGHTS names a missing file: {path}")
        return path
    if not SHIPPED_WEIGHTS.is_file():
        raise FaceWeightsError(f"the face-pretrained weights are missing: {SHIPPED_WEIGHTS} "
                               "(reinstall ffr-edge, or use --init imagenet)")
    if check and file_sha256(SHIPPED_WEIGHTS) != SHIPPED_SHA256:
        raise FaceWeightsError(f"{SHIPPED_WEIGHTS}: sha256 differs from the recorded {SHIPPED_SHA256[:16]}...")
    return SHIPPED_WEIGHTS


def read_embedder_numpy(path: Path | None = None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Embedder state (float32 / int64 numpy, keys as in FaceEmbedder.state_dict()) and the file's metadata. A
    coordinator's released model (`coordinator/models/vNNNNN.safetensors`: the same tensors, each key under
    `backbone.`) reads the same."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    path = Path(path) if path else shipped_weights()
    with safe_open(str(path), framework="numpy") as fh:
        metadata = dict(fh.metadata() or {})
    state = {k: (v.astype(np.float32) if np.issubdtype(v.dtype, np.floating) else v)
             for k, v in load_file(str(path)).items()}
    if state and all(k.startswith(SHAREABLE_PREFIX) for k in state):
        state = {k.removeprefix(SHAREABLE_PREFIX): v for k, v in state.items()}
    return state, metadata


def check_face_init(width_mult: float, embedding_dim: int) -> None:
    if width_mult != 1.0 or embedding_dim != 128:
        raise ValueError("the face-pretrained weights are MobileNetV2 width 1.0 with a 128-d embedding; "
                         "use --init imagenet or none for other shapes")


def face_global_state(path: Path | None = None) -> dict[str, np.ndarray]:
    """Round 0's shared embedder from the shipped weights, keyed `backbone.*` (numpy only, no torch)."""
    state, _ = read_embedder_numpy(path)
    return {f"{SHAREABLE_PREFIX}{k}": v for k, v in state.items()}


def save_embedder(path: Path, model, metadata: dict[str, str] | None = None) -> Path:
    """A FaceEmbedder's state as fp16 safetensors (integer buffers kept), written atomically."""
    from safetensors.numpy import save_file

    state = {}
    for key, value in model.state_dict().items():
        value = value.detach().cpu().contiguous()  # a channels_last weight is otherwise written in memory order
        state[key] = value.float().numpy().astype(np.float16) if value.is_floating_point() else value.numpy()
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    save_file(state, str(tmp), metadata={"format": "ffr-embedder", "embedding_dim": "128", "input_size": "128",
                                         **(metadata or {})})
    tmp.replace(path)
    return path


def load_face_embedder(path: Path | None = None):
    """A torch FaceEmbedder with the shipped (or given) weights."""
    import torch

    from models.networks.backbone import FaceEmbedder

    state, _ = read_embedder_numpy(path)
    model = FaceEmbedder(128, 1.0, pretrained=False)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    return model


def checked_embedder(path: Path):
    """A face embedder file from anywhere (a run folder, a user's download) as a torch FaceEmbedder in eval mode,
    refused in one line (ValueError) unless it is the shipped architecture, every tensor the shipped shape and every
    float finite: the file is read as if an attacker wrote it."""
    try:
        state, _ = read_embedder_numpy(path)
        model = load_face_embedder(path)
    except Exception as exc:  # safetensors' and load_state_dict's own errors name what is wrong
        raise ValueError(f"{path} is not a MobileNetV2-128 face embedder: "
                         f"{str(exc).strip().splitlines()[0]}") from None
    bad = [k for k, v in state.items() if np.issubdtype(v.dtype, np.floating) and not np.isfinite(v).all()]
    if bad:
        raise ValueError(f"{path} holds non-finite values in {bad[0]}")
    return model.eval()


def write_default_onnx(out: Path, weights: Path | None = None, mirror: bool = MIRRORED) -> Path:
    """The face embedder as a device-ready ONNX file, built from the weights with numpy and onnx (no torch):
    the shipped ones, or `weights` (a coordinator's released model, `vNNNNN.safetensors`, is one); mirror-averaged
    unless `mirror` says otherwise (`models.networks.mirror`)."""
    import onnx

    from models.networks.embedder_onnx import build_embedder_onnx

    weights = shipped_weights() if weights is None else Path(weights)
    state, metadata = read_embedder_numpy(weights)
    proto = build_embedder_onnx(state, {"source": "face-pretrained embedder", "weights": weights.name,
                                        "weights_sha256": file_sha256(weights), "teacher": metadata.get("teacher", "")},
                                mirror=mirror)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".onnx.tmp")
    onnx.save(proto, str(tmp))
    tmp.replace(out)
    return out
