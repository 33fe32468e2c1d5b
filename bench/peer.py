"""The peer people compare us with: the `face_recognition` package (dlib HOG detector + ResNet encoder).

Installed with --no-deps by `make bench-device`; `bench.device` times it, `bench.verify_quality` scores it.
"""
from __future__ import annotations

import importlib.resources
import sys
import types

import numpy as np


def load_face_recognition():
    """Import face_recognition; its models package still calls pkg_resources, gone from new setuptools."""
    if "pkg_resources" not in sys.modules:
        try:
            import pkg_resources  # noqa: F401
        except ImportError:
            shim = types.ModuleType("pkg_resources")
            shim.resource_filename = lambda package, name: str(importlib.resources.files(package) / name)
            sys.modules["pkg_resources"] = shim
    import face_recognition

    return face_recognition


def peer_per_frame(fr, templates: np.ndarray, frame_rgb: np.ndarray) -> float | None:
    boxes = fr.face_locations(frame_rgb)
    if not boxes:
        return None
    enc = fr.face_encodings(frame_rgb, boxes[:1])[0]
    return float(np.min(fr.face_distance(templates, enc)))


def peer_embeddings(fr, crops: np.ndarray) -> np.ndarray:
    """dlib encodings of our 128 px crops, the face box being the crop less its 20% margin."""
    inner = (18, 110, 110, 18)  # top, right, bottom, left
    return np.stack([fr.face_encodings(np.ascontiguousarray(c), [inner])[0] for c in crops])


def euclidean(emb: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    return np.linalg.norm(emb[pairs[:, 0]] - emb[pairs[:, 1]], axis=1)
