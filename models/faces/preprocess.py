"""Face crop -> network input, in numpy so the torch trainer and the ONNX device path agree.

The design: 128x128 RGB, scaled to [-1, 1] ((x/255 - 0.5) / 0.5), NCHW float32.
"""
from __future__ import annotations

import cv2
import numpy as np

INPUT_SIZE = 128
MEAN = 0.5
STD = 0.5


def to_input(crops: np.ndarray, size: int = INPUT_SIZE) -> np.ndarray:
    """(H,W,3) or (N,H,W,3) RGB uint8 crops -> (N,3,size,size) float32 in [-1, 1]."""
    batch = crops[None] if crops.ndim == 3 else crops
    if batch.ndim != 4 or batch.shape[-1] != 3:
        raise ValueError(f"expected RGB crops shaped (N,H,W,3), got {crops.shape}")
    if batch.shape[1:3] != (size, size):
        # INTER_AREA to shrink; to enlarge (112 px aligned sets -> 128) bilinear, as in training (INTER_AREA
        # would act like nearest-neighbour there)
        interpolation = cv2.INTER_AREA if batch.shape[1] > size else cv2.INTER_LINEAR
        batch = np.stack([cv2.resize(c, (size, size), interpolation=interpolation) for c in batch])
    x = batch.astype(np.float32) / 255.0
    x = (x - MEAN) / STD
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
