"""The device from Python: enrol, verify, identify, compare, watch, calibrate and install a model, as `ffr device`
does them (onnxruntime, OpenCV, numpy; no torch). Images are file paths or BGR arrays (as OpenCV reads them).

    from edge_client.api import Device, compare

    door = Device("~/.ffr-device")
    door.enrol("alice", ["alice1.jpg", "alice2.jpg", "alice3.jpg"])
    for face in door.identify("group.jpg"):
        print(face.name, face.score, face.box)
    print(door.verify("alice", "selfie.jpg").match)
    print(compare("passport.jpg", "selfie.jpg").score)
    door.calibrate(far=1e-3, public_set="public.safetensors")  # the threshold for 1 stranger in 1,000

Every answer carries its score, the threshold it was decided at and the face's box; the same checks as the CLI
refuse a face too small or too blurred (`FaceError`). The same seals guard the home (a swapped model or an edited
threshold raises `VaultError`).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_client.capture import FaceQuality, device_detector, every_face, frames
from edge_client.door_calibration import calibrate_door
from edge_client.home import DeviceHome
from edge_client.recognizer import DEFAULT_THRESHOLD, Calibration, Recognizer, install_default_model, install_model
from edge_client.vault import Vault, check_person_name
from edge_client.verifier import Verifier

Image = str | Path | np.ndarray


class FaceError(ValueError):
    """No usable face where one was needed (none found, too small, too blurred)."""


@dataclass(frozen=True)
class Face:
    """One face's answer: who (or None: nobody enrolled reaches the threshold), its score, and where it is."""

    name: str | None
    score: float
    threshold: float
    box: tuple[int, int, int, int]
    landmarks: tuple[float, ...] | None

    @property
    def match(self) -> bool:
        return self.name is not None


def _bgr(image: Image) -> np.ndarray:
    if isinstance(image, np.ndarray):
        return image
    if not Path(image).expanduser().is_file():
        raise FaceError(f"image file not found: {image}")
    (frame,) = list(frames(images=Path(image).expanduser(), max_frames=1)) or [None]
    if frame is None or frame.bgr is None:
        raise FaceError(f"{image}: {getattr(frame, 'problem', None) or 'not an image OpenCV can read'}")
    return frame.bgr


class Device:
    """A device's home (created when missing; the shipped model installed on first use when it has none)."""

    def __init__(self, home: str | Path, detector: str = "auto", min_face: int = 48, min_sharpness: float = 15.0):
        self.home = DeviceHome(Path(home).expanduser())
        self.vault = Vault.open(self.home.root / "store")
        self.detector = device_detector(detector)
        self.gate = FaceQuality(min_face_px=min_face, min_sharpness=min_sharpness)

    @property
    def recognizer(self) -> Recognizer:
        """Read afresh each call: a round of `ffr edge run` may have installed a new model meanwhile."""
        if not self.home.generic_onnx.exists() and not self.home.personalised_onnx.exists():
            install_default_model(self.home, self.vault)
        return Recognizer(self.home, self.vault)

    def faces(self, image: Image) -> list[tuple[np.ndarray, tuple, tuple | None]]:
        """(crop, box, landmarks) of every usable face, largest first."""
        return [(c.crop, c.box, c.landmarks) for c in every_face(_bgr(image), self.detector, self.gate)
                if c.crop is not None]

    def enrol(self, name: str, images: Iterable[Image]) -> int:
        """Enrol (or replace) `name` from the largest face of each image; the number of faces kept."""
        crops = [found[0][0] for image in images if (found := self.faces(image))]
        if not crops:
            raise FaceError(f"no usable face in the images given for {name!r}")
        with self.home.writing(wait_s=30.0):
            self.recognizer.enrol(check_person_name(name), np.stack(crops))
        return len(crops)

    def people(self) -> list[str]:
        return sorted(self.vault.names())

    def remove(self, name: str) -> None:
        with self.home.writing(wait_s=30.0):
            self.vault.remove(name)

    def identify(self, image: Image, threshold: float | None = None) -> list[Face]:
        """Every face in the image, each identified (name None: unknown)."""
        verifier = Verifier(self.recognizer, threshold)
        people = verifier.recognizer.people()
        if not people:
            raise ValueError("nobody is enrolled on this device")
        found = self.faces(image)
        if not found:
            return []
        answers = verifier.each(verifier.recognizer.embed(np.stack([f[0] for f in found])), people)
        return [Face(a.name, a.score, a.threshold, box, marks) for (_, box, marks), a in zip(found, answers)]

    def verify(self, name: str, image: Image, threshold: float | None = None) -> Face:
        """Is the largest face in the image `name`?"""
        verifier = Verifier(self.recognizer, threshold)
        person = verifier.recognizer.person(name)
        found = self.faces(image)
        if not found:
            raise FaceError(f"no usable face in {image if not isinstance(image, np.ndarray) else 'the image'}")
        crop, box, marks = found[0]
        answer = verifier.verify(verifier.recognizer.embed(crop[None]), person)
        return Face(answer.name, answer.score, answer.threshold, box, marks)

    def calibrate(self, far: float = 1e-3, public_set: str | Path | None = None, force: bool = False) -> Calibration:
        """Set the threshold for false-accept rate `far` on the enrolled people and strangers' faces (`public_set`,
        else the one the last round calibrated on), as `ffr device calibrate` does; a calibration that would refuse
        too many genuine faces or that sees one person under two names raises ValueError unless `force`."""
        with self.home.writing(wait_s=30.0):
            recognizer = self.recognizer
            door = calibrate_door(self.home, recognizer, far, public_set=None if public_set is None
                                  else Path(public_set).expanduser())
            if door.problems and not force:
                raise ValueError(f"calibration not applied: {'; '.join(door.problems)} ({door.line})")
            recognizer.settings.calibration = door.calibration
            recognizer.settings.save(self.home, self.vault)
        return door.calibration

    def install_model(self, model: str | Path | None = None) -> Path:
        """Verify with `model` from now on: an exported ONNX file, a coordinator's released `vNNNNN.safetensors`, or
        (None) the shipped model; the enrolled people's templates follow it. Where it was installed."""
        with self.home.writing(wait_s=30.0):
            target, _ = install_model(self.home, self.vault, None if model is None else Path(model).expanduser())
            self.recognizer.people()  # templates recomputed with the new model now, not on the next answer
        return target

    def watch(self, camera: int | None = None, video: str | Path | None = None,
              threshold: float | None = None) -> Iterator[list[Face]]:
        """Every frame's faces, identified, as they come (`ffr device watch` debounces them into comings and goings)."""
        for frame in frames(camera, None if video is None else Path(video), None, 10 ** 12):
            yield self.identify(frame.bgr, threshold) if frame.bgr is not None else []


@dataclass(frozen=True)
class Comparison:
    """The two faces' cosine score and the threshold; `faces`: each image's largest face (box, aligned) and how many
    faces it held."""

    score: float
    threshold: float
    faces: tuple[dict, dict]

    @property
    def same_person(self) -> bool:
        return self.score > self.threshold


def compare(image1: Image, image2: Image, threshold: float = DEFAULT_THRESHOLD, model: str | Path | None = None,
            detector: str = "auto", gate: FaceQuality | None = None, threads: int | None = None) -> Comparison:
    """1:1 on two images without a home (DeepFace.verify's job): the largest face of each (a group photo is answered
    for it), the shipped model or `model` (an ONNX file)."""
    import tempfile
    from dataclasses import replace

    from models.networks.face_weights import write_default_onnx
    from models.runtime import OnnxEmbedder

    finder, crops, faces = device_detector(detector), [], []
    gate = replace(gate or FaceQuality(), other_face_ratio=float("inf"))
    for image in (image1, image2):
        checks = every_face(_bgr(image), finder, gate)
        usable = [c for c in checks if c.crop is not None]
        if not usable:
            what = image if not isinstance(image, np.ndarray) else "an image"
            raise FaceError(f"{what}: {checks[0].reason if checks else 'no face found'}")
        crops.append(usable[0].crop)
        faces.append({"faces_found": len(checks), "box": list(usable[0].box), "aligned": usable[0].aligned})
    with tempfile.TemporaryDirectory(prefix="ffr-compare-") as tmp:
        path = Path(model) if model is not None else write_default_onnx(Path(tmp) / "shipped.onnx")
        emb = OnnxEmbedder(path, threads).embed(np.stack(crops))
    emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    return Comparison(float(emb[0] @ emb[1]), threshold, (faces[0], faces[1]))
