"""Frames in, usable face crops out: camera, video file or images through OpenCV, then a quality gate.

Crops are aligned onto the ArcFace five-point template when YuNet found the face (the model
was trained on such crops); with Haar they are squares around the box.

A frame is refused, with the reason, when it has no face, several faces, a face too small to
recognise, or a face too blurred (variance of the Laplacian of the crop, the usual focus measure).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from models.faces.detect import Box, FaceDetector, HaarDetector, YuNetDetector, face_crop, find_yunet_model
from models.faces.imageio import MAX_PIXELS, UnreadableImage, is_image_file, read_rgb


class SourceError(ValueError):
    """The camera, video or image cannot be read."""


@dataclass
class Frame:
    name: str
    bgr: np.ndarray | None
    problem: str | None = None  # an image in a folder that could not be read: said, counted, not silently dropped


def frames(camera: int | None = None, video: Path | None = None, images: Path | None = None,
           max_frames: int = 300) -> Iterator[Frame]:
    """Frames from exactly one source, read through OpenCV."""
    if sum(x is not None for x in (camera, video, images)) != 1:
        raise SourceError("give exactly one of --camera INDEX, --video FILE or --images PATH")
    if images is not None:
        yield from _images(Path(images), max_frames)
        return
    if camera is not None and camera < 0:  # OpenCV's "any camera" index; with none attached it crashed the process
        raise SourceError(f"--camera is a camera's index, 0 or more (got {camera})")
    if video is not None and Path(video).is_dir():
        raise SourceError(f"{video} is a folder: give a video file, or --images for a folder of images")
    if video is not None and not Path(video).is_file():
        raise SourceError(f"video file not found: {video}")
    capture = _open_quietly(int(camera) if camera is not None else str(video))
    what = f"camera {camera}" if camera is not None else f"video {video}"
    try:
        if not capture.isOpened():
            raise SourceError(
                f"no camera at index {camera}" if camera is not None else f"cannot read video file {video}"
            )
        width, height = (int(capture.get(p)) for p in (cv2.CAP_PROP_FRAME_WIDTH, cv2.CAP_PROP_FRAME_HEIGHT))
        if width * height > MAX_PIXELS:  # from the container's header, before a frame is decoded
            raise SourceError(f"{what}: {width} x {height} frames, above the limit of {MAX_PIXELS:,} pixels")
        n = 0
        while n < max_frames:
            ok, bgr = capture.read()
            if not ok or bgr is None:
                if n == 0:
                    raise SourceError(f"{what} gave no frames")
                return
            yield Frame(f"{what} frame {n}", bgr)
            n += 1
    finally:
        capture.release()


def _open_quietly(source: int | str) -> cv2.VideoCapture:
    """Open a camera or video without OpenCV's own WARN/ERROR lines: the caller says what went wrong, once."""
    os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")  # FFmpeg's own decoder lines too (read when it starts)
    level = cv2.utils.logging.getLogLevel()
    cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_SILENT)
    try:
        return cv2.VideoCapture(source)
    finally:
        cv2.utils.logging.setLogLevel(level)


def _images(path: Path, max_frames: int) -> Iterator[Frame]:
    if not path.exists():
        raise SourceError(f"image path not found: {path}")
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if is_image_file(p))
    if not files:
        raise SourceError(f"no image files in {path}")
    readable = 0
    for file in files[:max_frames]:
        try:
            bgr = cv2.cvtColor(read_rgb(file), cv2.COLOR_RGB2BGR)  # header checked against MAX_PIXELS first
        except UnreadableImage as exc:
            if len(files) == 1:
                raise SourceError(f"cannot read image file {exc}") from None
            yield Frame(str(file), None, str(exc).removeprefix(f"{file}: "))
            continue
        readable += 1
        yield Frame(str(file), bgr)
    if readable == 0:
        raise SourceError(f"none of the image files in {path} could be read")


@dataclass(frozen=True)
class FaceQuality:
    """What a frame's face must meet to be enrolled or verified (not the coordinator's model gate,
    `coordinator.quality_gate`)."""

    min_face_px: int = 48          # face box side in the frame
    min_sharpness: float = 15.0    # variance of the Laplacian of the 128 px grey crop
    margin: float = 0.2
    size: int = 128
    other_face_ratio: float = 0.4  # a second face this large (side, vs the largest) makes the frame ambiguous


@dataclass
class FaceCheck:
    crop: np.ndarray | None        # RGB uint8 (size, size, 3) when accepted
    reason: str | None             # why the frame was refused
    box: tuple[int, int, int, int] | None = None
    sharpness: float = 0.0
    aligned: bool = False          # warped onto the five-point template (YuNet), not a square crop (Haar)
    landmarks: tuple[float, ...] | None = None  # YuNet's five (x, y) points in the frame


def sharpness(rgb_crop: np.ndarray) -> float:
    return float(cv2.Laplacian(cv2.cvtColor(rgb_crop, cv2.COLOR_RGB2GRAY), cv2.CV_64F).var())


def every_face(bgr: np.ndarray, detector: FaceDetector, gate: FaceQuality) -> list[FaceCheck]:
    """Each face in a photo, largest first, checked for size and sharpness on its own (a group photo answered per
    face, as face_recognition does): accepted ones carry their crop, refused ones say why."""
    rgb = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
    checks = []
    for face in sorted(detector.detect(rgb), key=lambda b: -b.area):
        box, side = (int(face.x), int(face.y), int(face.w), int(face.h)), max(face.w, face.h)
        if side < gate.min_face_px:
            checks.append(FaceCheck(None, f"face too small ({int(side)} px, under {gate.min_face_px} px)", box))
            continue
        crop = face_crop(rgb, face, gate.size, 0.0 if detector.name == "none" else gate.margin)
        sharp = sharpness(crop)
        if sharp < gate.min_sharpness:
            checks.append(FaceCheck(None, f"face too blurred (sharpness {sharp:.1f} < {gate.min_sharpness:g})",
                                    box, sharp))
            continue
        checks.append(FaceCheck(crop, None, box, sharp, face.landmarks is not None, face.landmarks))
    return checks


def check_face(bgr: np.ndarray, detector: FaceDetector, gate: FaceQuality, live: bool = True) -> FaceCheck:
    """The one face of a frame, or why it is refused; `live`: a camera, so the refusal says what the person in front
    of it can do (a photo file cannot come closer)."""
    rgb = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
    boxes = sorted(detector.detect(rgb), key=lambda b: -b.area)
    if not boxes:
        return FaceCheck(None, "no face found")
    face = boxes[0]
    side = max(face.w, face.h)
    box = (int(face.x), int(face.y), int(face.w), int(face.h))
    others = [b for b in boxes[1:] if max(b.w, b.h) >= gate.other_face_ratio * side]
    if others:
        return FaceCheck(None, f"{len(others) + 1} faces in the frame; only one person may be in view", box)
    if side < gate.min_face_px:
        return FaceCheck(None, f"face too small ({int(side)} px, under {gate.min_face_px} px)"
                               + ("; come closer" if live else ""), box)
    margin = 0.0 if detector.name == "none" else gate.margin  # an aligned crop is taken whole
    crop = face_crop(rgb, face, gate.size, margin)  # aligned on the five landmarks when YuNet found it
    sharp = sharpness(crop)
    if sharp < gate.min_sharpness:
        return FaceCheck(None, f"face too blurred (sharpness {sharp:.1f} < {gate.min_sharpness:g})"
                               + ("; hold still" if live else ""),
                         box, sharp)
    return FaceCheck(crop, None, box, sharp, face.landmarks is not None, face.landmarks)


class AlignedCrops:
    """`--detector none`: every image is already one aligned face crop (as `ffr train` and `ffr eval` read them)."""

    name = "none"

    def detect(self, rgb: np.ndarray) -> list[Box]:
        h, w = rgb.shape[:2]
        side = min(h, w)
        return [Box((w - side) / 2.0, (h - side) / 2.0, side, side)]


def device_detector(name: str = "auto", yunet_model: Path | None = None, max_side: int = 320) -> FaceDetector:
    """YuNet when its model file is available (far better than Haar at rejecting crowds), else Haar.

    Frames are shrunk to `max_side` before detection: faces at arm's length stay well above
    the minimum size and detection costs a quarter of what it does at 640 px.
    """
    if name == "none":
        return AlignedCrops()
    model = yunet_model or (find_yunet_model() if name in ("auto", "yunet") else None)
    if name == "yunet" and model is None:
        raise SourceError("--detector yunet needs its .onnx file (--yunet-model PATH or $FFR_YUNET_MODEL)")
    if name in ("auto", "yunet") and model is not None:
        return YuNetDetector(model, max_side=max_side)
    return HaarDetector(max_side=max_side)
