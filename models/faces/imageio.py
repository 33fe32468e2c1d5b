"""Read face images of any common format as RGB uint8 arrays.

One unreadable file must never end a run, so readers raise `UnreadableImage` and the
callers that walk datasets turn it into a warning that names the file. An image is a file an
attacker may have written: its dimensions are read from its header and it is refused above
`MAX_PIXELS` before anything is decoded (a 243 KB PNG can declare 9 GB of pixels); OpenCV's own
limit is lowered to the same figure (in `models/__init__`) for the formats the header reader does not know.
"""
from __future__ import annotations

import struct
from pathlib import Path

import cv2
import numpy as np

from models import MAX_IMAGE_PIXELS as MAX_PIXELS  # 40 megapixels: any camera photo, at most 120 MB decoded

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".png", ".pgm", ".ppm", ".pbm", ".pnm", ".gif", ".bmp", ".tif", ".tiff", ".webp"}
)


class UnreadableImage(Exception):
    """A file that is not an image OpenCV can decode (corrupt, truncated, wrong type)."""


def is_image_file(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS and not path.name.startswith(".")


def header_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG, JPEG, GIF, BMP, PNM or WebP header, without decoding; None for other formats."""
    try:
        if data[:8] == b"\x89PNG\r\n\x1a\n":
            return struct.unpack(">II", data[16:24])
        if data[:6] in (b"GIF87a", b"GIF89a"):
            return struct.unpack("<HH", data[6:10])
        if data[:2] == b"BM":
            width, height = struct.unpack("<ii", data[18:26])
            return abs(width), abs(height)
        if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            kind = data[12:16]
            if kind == b"VP8X":
                return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
            if kind == b"VP8L":
                bits = int.from_bytes(data[21:25], "little")
                return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
            if kind == b"VP8 ":
                width, height = struct.unpack("<HH", data[26:30])
                return width & 0x3FFF, height & 0x3FFF
        if data[:1] == b"P" and data[1:2] in b"123456":
            fields = data[2:256].split(b"#")[0].split()
            return int(fields[0]), int(fields[1])
        if data[:2] == b"\xff\xd8":
            return _jpeg_size(data)
    except (struct.error, ValueError, IndexError):
        return (0, 0)  # a header too short or garbled to read: nothing decodable either
    return None


def _jpeg_size(data: bytes) -> tuple[int, int]:
    i = 2
    while i + 9 < len(data):
        if data[i] != 0xFF:
            i += 1
            continue
        marker = data[i + 1]
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        length = struct.unpack(">H", data[i + 2:i + 4])[0]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a start-of-frame segment
            height, width = struct.unpack(">HH", data[i + 5:i + 9])
            return width, height
        i += 2 + length
    return (0, 0)


REDUCED_JPEG = {2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4, 8: cv2.IMREAD_REDUCED_COLOR_8}


def check_dimensions(data: bytes, name: str) -> int:
    """Refuse an image whose header declares more than MAX_PIXELS, before it is decoded; except a JPEG, which
    libjpeg decodes straight at 1/2, 1/4 or 1/8 scale (a 50 MP phone photo is a face photo too): returns the
    scale to decode at (1: as it is)."""
    size = header_size(data)
    if size is None or size[0] * size[1] <= MAX_PIXELS:
        return 1
    if data[:2] == b"\xff\xd8":
        for factor in REDUCED_JPEG:
            if (size[0] // factor) * (size[1] // factor) <= MAX_PIXELS:
                return factor
    raise UnreadableImage(f"{name}: {size[0]} x {size[1]} pixels declared, above the limit of {MAX_PIXELS:,} "
                          "(refused before decoding)")


def read_rgb(path: str | Path) -> np.ndarray:
    """Decode `path` to an HxWx3 RGB uint8 array; grey images are replicated to 3 channels."""
    path = Path(path)
    try:
        data = np.fromfile(path, dtype=np.uint8)  # fromfile + imdecode copes with non-ASCII paths
    except OSError as exc:
        raise UnreadableImage(f"{path}: {exc.strerror or exc}") from exc
    scale = check_dimensions(data[:65536].tobytes(), str(path))
    if is_truncated_jpeg(data):  # libjpeg would decode the top and grey out the rest, with one anonymous warning
        raise UnreadableImage(f"{path}: truncated JPEG (the file ends before its end-of-image marker)")
    image = cv2.imdecode(data, REDUCED_JPEG.get(scale, cv2.IMREAD_COLOR)) if data.size else None
    if image is None and path.suffix.lower() == ".gif":
        image = _first_gif_frame(path)
    if image is None:
        raise UnreadableImage(f"{path}: not a decodable image")
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


MAX_JPEG_SEGMENTS = 4096  # real headers hold a few dozen segments


def is_truncated_jpeg(data: np.ndarray) -> bool:
    """A JPEG whose image data runs to the end of the file without its end-of-image marker (FF D9).

    The header segments are walked to the first scan (an EXIF thumbnail's own markers live inside a
    segment and are skipped); after it, FF is always stuffed (FF 00) or a restart marker, so a real
    FF D9 must follow. Bytes after the marker (phones append trailers) are fine.
    """
    n = int(data.size)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return False
    pos, segments = 2, 0
    while pos + 4 <= n and segments < MAX_JPEG_SEGMENTS:  # a hostile header of a million markers stays cheap
        segments += 1
        if data[pos] != 0xFF:
            return False  # not a well-formed header: the decoder says what it makes of it
        marker = int(data[pos + 1])
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:
            pos += 2
            continue
        length = (int(data[pos + 2]) << 8) | int(data[pos + 3])
        pos += 2 + length
        if marker == 0xDA:  # start of scan: the end-of-image marker must follow somewhere
            body = data[min(pos, n):]
            ff = np.flatnonzero(body[:-1] == 0xFF)
            return not bool(np.any(body[ff + 1] == 0xD9))
    return pos + 4 > n  # the file ends inside its header (past the segment cap: the decoder judges it)


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
