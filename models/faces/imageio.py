"""Read face images of any common format as RGB uint8 arrays.

One unreadable file must never end a run, so readers raise `UnreadableImage` and the
callers that walk datasets turn it into a warning that names the file.
"""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".pgm", ".ppm", ".pbm", ".pnm", ".gif", ".bmp", ".tif", ".tiff", ".webp"}
)


class UnreadableImage(Exception):
    """A file that is not an image OpenCV can decode (corrupt, truncated, wrong type)."""


def is_image_file(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS and not path.name.startswith(".")


def read_rgb(path: str | Path) -> np.ndarray:
    """Decode `path` to an HxWx3 RGB uint8 array; grey images are replicated to 3 channels."""
    path = Path(path)
    try:
        data = np.fromfile(path, dtype=np.uint8)  # fromfile + imdecode copes with non-ASCII paths
    except OSError as exc:
        raise UnreadableImage(f"{path}: {exc.strerror or exc}") from exc
    image = cv2.imdecode(data, cv2.IMREAD_COLOR) if data.size else None
    if image is None and path.suffix.lower() == ".gif":
        image = _first_gif_frame(path)
    if image is None:
        raise UnreadableImage(f"{path}: not a decodable image")
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def _first_gif_frame(path: Path) -> np.ndarray | None:
    """OpenCV builds without a GIF codec still read GIFs through the video backend."""
    capture = cv2.VideoCapture(str(path))
    try:
        ok, frame = capture.read()
    finally:
        capture.release()
    return frame if ok else None


def write_image(path: str | Path, rgb: np.ndarray) -> None:
    """Write an RGB array with the format given by the suffix."""
    path = Path(path)
    grey_only = path.suffix.lower() in (".pgm", ".pbm")
    pixels = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY if grey_only else cv2.COLOR_RGB2BGR)
    ok, encoded = cv2.imencode(path.suffix, pixels)
    if not ok:
        raise ValueError(f"cannot encode an image as {path.suffix}")
    encoded.tofile(path)
