"""Face crops -> decisions on the device: the current ONNX model, templates, threshold, calibration.

Only onnxruntime, OpenCV and numpy run here. Templates remember the hash of the model that
made them; when federated training (or `install-model`) delivers a new model they are
recomputed from the encrypted crops before anything is compared.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edge_client.home import DeviceHome
from edge_client.vault import Person, Vault, new_person
from models.evaluation.thresholds import threshold_at_far
from models.runtime import OnnxEmbedder

log = logging.getLogger(__name__)

DEFAULT_THRESHOLD = 0.5  # cosine; only until `ffr device calibrate` has run


def current_model(home: DeviceHome) -> Path:
    """The most recently delivered model: personalised or generic, whichever is newer.

    A home with no model yet gets the shipped face-pretrained embedder (built as ONNX without torch),
    so a new device verifies faces before it has joined any federation.
    """
    found = [p for p in (home.personalised_onnx, home.generic_onnx) if p.is_file()]
    if not found:
        return install_default_model(home)
    return max(found, key=lambda p: p.stat().st_mtime_ns)


def install_default_model(home: DeviceHome) -> Path:
    from models.face_weights import FaceWeightsError, write_default_onnx

    try:
        path = write_default_onnx(home.generic_onnx)
    except FaceWeightsError as exc:
        raise FileNotFoundError(f"no model in {home.root} and the default one cannot be built ({exc}): install one "
                                f"with `ffr device install-model --home {home.root} --model MODEL.onnx`") from None
    log.info("installed the shipped face-pretrained model into %s", path)
    return path


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def normalise(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


@dataclass
class Calibration:
    threshold: float
    far_target: float
    expected_frr: float
    measurable: bool              # enough impostor pairs to measure the target FAR
    genuine_pairs: int
    impostor_pairs: int
    model_sha256: str


@dataclass
class Settings:
    """Non-secret device settings (`device.json` in the home)."""

    calibration: Calibration | None = None

    @classmethod
    def load(cls, home: DeviceHome) -> "Settings":
        path = home.root / "device.json"
        if not path.exists():
            return cls()
        raw = json.loads(path.read_text())
        return cls(Calibration(**raw["calibration"]) if raw.get("calibration") else None)

    def save(self, home: DeviceHome) -> None:
        tmp = home.root / "device.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(home.root / "device.json")


class Recognizer:
    def __init__(self, home: DeviceHome, vault: Vault, threads: int | None = 1):
        self.home, self.vault = home, vault
        self.model_path = current_model(home)
        self.model_sha256 = file_sha256(self.model_path)
        self.embedder = OnnxEmbedder(self.model_path, threads)
        self.settings = Settings.load(home)

    @property
    def threshold(self) -> float:
        return self.settings.calibration.threshold if self.settings.calibration else DEFAULT_THRESHOLD

    @property
    def threshold_note(self) -> str:
        cal = self.settings.calibration
        if cal is None:
            return "uncalibrated default; run `ffr device calibrate`"
        if cal.model_sha256 != self.model_sha256:
            return "calibrated for an older model; run `ffr device calibrate` again"
        return f"calibrated for FAR {cal.far_target:g}"

    def embed(self, crops: np.ndarray) -> np.ndarray:
        return normalise(self.embedder.embed(crops))

    def template(self, crops: np.ndarray) -> np.ndarray:
        return normalise(self.embed(crops).mean(0))

    def enrol(self, name: str, crops: np.ndarray) -> Person:
        person = new_person(name, crops, self.template(crops), self.model_sha256)
        self.vault.put(person)
        return person

    def refresh(self, person: Person) -> Person:
        """Recompute a template made with another model (and store it), so scores are always comparable."""
        if person.model_sha256 != self.model_sha256:
            person.template, person.model_sha256 = self.template(person.crops), self.model_sha256
            self.vault.put(person)
        return person

    def people(self) -> list[Person]:
        return [self.refresh(p) for p in self.vault.people()]

    def person(self, name: str) -> Person:
        return self.refresh(self.vault.get(name))


def calibration_scores(embeddings: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Genuine scores within each person's embeddings and impostor scores across people."""
    genuine, impostor = [], []
    for i, a in enumerate(embeddings):
        sim = a @ a.T
        genuine.append(sim[np.triu_indices(len(a), 1)])
        for b in embeddings[i + 1:]:
            impostor.append((a @ b.T).ravel())
    return np.concatenate(genuine), np.concatenate(impostor) if impostor else np.zeros(0)


def calibrate(embeddings: list[np.ndarray], far: float, model_sha256: str) -> Calibration:
    """The threshold for a false-accept rate of `far` on the device's own people, and the
    false-reject rate expected there. Needs two people with two or more faces each."""
    usable = [e for e in embeddings if len(e) >= 2]
    if len(usable) < 2:
        raise ValueError("calibration needs at least two people with at least two face images each "
                         "(enrol more people, or add --data DIR)")
    genuine, impostor = calibration_scores(usable)
    threshold, measurable = threshold_at_far(impostor, far)
    return Calibration(threshold, far, float(np.mean(genuine <= threshold)), measurable, len(genuine),
                       len(impostor), model_sha256)
