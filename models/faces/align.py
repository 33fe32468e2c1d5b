"""Five-point face alignment: landmarks -> similarity transform -> the standard ArcFace crop.

Every modern face recogniser (ArcFace, SFace, ours) is trained on faces warped so that the
eyes, nose tip and mouth corners land on one fixed template; a recogniser fed loose square
crops loses much of its accuracy. The template is ArcFace's 112x112 one (Deng et al.,
CVPR 2019, `insightface`'s `arcface_dst`), scaled to the model's input size.
"""
from __future__ import annotations

import cv2
import numpy as np

TEMPLATE_SIZE = 112
# right eye, left eye (as seen in the image: the subject's right eye is on the left),
# nose tip, right and left mouth corners; YuNet returns its landmarks in this order.
ARCFACE_TEMPLATE = np.array([[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366],
                             [41.5493, 92.3655], [70.7299, 92.2041]], dtype=np.float64)


def template(size: int = TEMPLATE_SIZE) -> np.ndarray:
    """The five template points for a `size` x `size` crop."""
    return ARCFACE_TEMPLATE * (size / TEMPLATE_SIZE)


def similarity_transform(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """The 2x3 least-squares similarity (rotation, uniform scale, translation) taking src to dst.

    Umeyama, "Least-squares estimation of transformation parameters between two point
    patterns", PAMI 1991, eq. 40-42 (no reflection).
    """
    src, dst = np.asarray(src, np.float64), np.asarray(dst, np.float64)
    mu_s, mu_d = src.mean(0), dst.mean(0)
    s0, d0 = src - mu_s, dst - mu_d
    cov = d0.T @ s0 / len(src)
    u, sigma, vt = np.linalg.svd(cov)
    sign = np.eye(2)
    if np.linalg.det(u) * np.linalg.det(vt) < 0:
        sign[1, 1] = -1.0
    rotation = u @ sign @ vt
    scale = np.trace(np.diag(sigma) @ sign) / max(s0.var(0).sum(), 1e-12)
    matrix = np.zeros((2, 3))
    matrix[:, :2] = scale * rotation
    matrix[:, 2] = mu_d - scale * rotation @ mu_s
    return matrix


def align_face(image: np.ndarray, landmarks: np.ndarray, size: int = 128) -> np.ndarray:
    """Warp `image` so that the five `landmarks` (5x2, image pixels) land on the template."""
    matrix = similarity_transform(np.asarray(landmarks).reshape(5, 2), template(size))
    return cv2.warpAffine(image, matrix, (size, size), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)


def apply_transform(matrix: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Points (N,2) through a 2x3 affine matrix."""
    points = np.asarray(points, np.float64).reshape(-1, 2)
    return points @ matrix[:, :2].T + matrix[:, 2]
