"""Face crops -> decisions on the device: the current ONNX model, templates, threshold, calibration.

Only onnxruntime, OpenCV and numpy run here. Templates remember the hash of the model that
made them; when federated training (or `install-model`) delivers a new model they are
recomputed from the encrypted crops before anything is compared.

Every file that decides a match is authenticated with the store's key (`edge_client.vault`):
`device.json` (the threshold and its calibration, and the hash of each model this device
installed) carries an HMAC that the store's sealed manifest also records, and a model file is
used only when its sha256 is the one sealed when it was installed. An edited threshold, a
swapped model or a rolled-back settings file is refused with a clear error, never used.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from edge_client.home import DeviceHome
from edge_client.person_threshold import person_thresholds, stranger_spread
from edge_client.vault import Person, Vault, VaultError, new_person
from models.evaluation.separation import leave_one_out_scores
from models.evaluation.thresholds import gaussian_tail, threshold_at_far
from models.runtime import OnnxEmbedder
from protocol.training_parts import is_real

log = logging.getLogger(__name__)

DEFAULT_THRESHOLD = 0.5  # cosine; only until `ffr device calibrate` has run


def current_model(home: DeviceHome, vault: Vault) -> Path:
    """The model the device verifies with: the one its sealed settings name (the last installed, or the one a round
    chose, `edge_client.verifier_choice`), else, in a home from before that was recorded, the newer file.

    A home with no model yet gets the shipped face-pretrained embedder (built as ONNX without torch),
    so a new device verifies faces before it has joined any federation.
    """
    found = [p for p in (home.personalised_onnx, home.generic_onnx) if p.is_file()]
    if not found:
        return install_default_model(home, vault)
    chosen = Settings.load(home, vault).verifier
    named = [p for p in found if p.name == chosen]
    return named[0] if named else max(found, key=lambda p: p.stat().st_mtime_ns)


def install_default_model(home: DeviceHome, vault: Vault) -> Path:
    from models.networks.face_weights import FaceWeightsError, write_default_onnx

    try:
        path = write_default_onnx(home.generic_onnx)
    except FaceWeightsError as exc:
        raise FileNotFoundError(f"no model in {home.root} and the default one cannot be built ({exc}): install one "
                                f"with `ffr device install-model --home {home.root} --model MODEL.onnx`") from None
    seal_model(home, vault, path)
    log.debug("installed the shipped face-pretrained model into %s", path)  # the command says so itself
    return path


class ModelFileError(ValueError):
    """A file given to install that is not an ffr-edge face model."""


def install_model(home: DeviceHome, vault: Vault, model: Path | None) -> tuple[Path, str]:
    """Install a model into the home and verify with it from now on: the shipped one (None), an exported ONNX file
    (generic or personalised, by what it says it is) or a coordinator's released global model (a backbone
    state dict, `vNNNNN.safetensors`, built as ONNX without torch); (where it went, what kind it is)."""
    if model is None:
        return install_default_model(home, vault), "generic (shipped face-pretrained)"
    if not model.is_file():
        raise FileNotFoundError(f"model not found: {model}")
    if model.suffix == ".safetensors":
        return _released_onnx(model, home, vault), "generic (released global model)"
    try:
        kind = OnnxEmbedder(model).info.kind
    except Exception as exc:  # noqa: BLE001 - any failure to load means it cannot be installed
        raise ModelFileError(f"{model} is not a usable ffr-edge ONNX model: {exc}") from None
    target = home.personalised_onnx if kind == "personalised" else home.generic_onnx
    tmp = target.with_suffix(".tmp")
    shutil.copyfile(model, tmp)
    tmp.replace(target)
    seal_model(home, vault, target)
    return target, kind


def _released_onnx(weights: Path, home: DeviceHome, vault: Vault) -> Path:
    """The released weights built as the home's generic ONNX model (numpy and onnx: no torch), then sealed."""
    from models.networks.face_weights import FaceWeightsError, write_default_onnx

    building = home.generic_onnx.with_suffix(".building.onnx")
    try:
        path = write_default_onnx(building, weights)
    except Exception as exc:  # noqa: BLE001 - any failure to read it (safetensors' own errors included) is one line
        building.unlink(missing_ok=True)
        reason = str(exc) if isinstance(exc, FaceWeightsError) else f"{type(exc).__name__}: {str(exc)[:160]}"
        raise ModelFileError(f"{weights} is not an ffr-edge face model (a coordinator's vNNNNN.safetensors or the "
                             f"shipped weights): {reason}") from None
    path.replace(home.generic_onnx)
    seal_model(home, vault, home.generic_onnx)
    return home.generic_onnx


def seal_model(home: DeviceHome, vault: Vault, path: Path) -> str:
    """Record the hash of a model this device just installed in the sealed settings, and verify with it from now
    on; its sha256."""
    settings = Settings.load(home, vault)
    settings.models[path.name] = file_sha256(path)
    settings.verifier = path.name
    settings.save(home, vault)
    return settings.models[path.name]


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def normalise(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def template_of(faces: np.ndarray) -> np.ndarray:
    """A person's template: the normalised mean of their face embeddings, what every decision scores against."""
    return normalise(faces.mean(0))


@dataclass
class Calibration:
    threshold: float
    far_target: float
    expected_frr: float
    measurable: bool              # enough impostor pairs to measure the target FAR
    genuine_pairs: int
    impostor_pairs: int
    model_sha256: str
    capture_shift: float = 0.0    # how far the public faces' scores were moved up (`capture_shift`)
    stranger_mean: list[float] | None = None        # the public faces' embeddings: mean and covariance, from which
    stranger_cov: list[list[float]] | None = None   # each person's own threshold (`edge_client.person_threshold`)
    shift_floor: float | None = None  # the least the public faces' scores are moved up on this set (`verifier_choice`)

    def thresholds_for(self, templates: np.ndarray) -> np.ndarray:
        """The threshold each template (one per row, or one) is decided at: the device's, raised for a person whom
        the public faces resemble; the device's alone for a calibration made without public faces."""
        templates = np.atleast_2d(templates)
        if self._spread is None or templates.shape[1] != len(self._spread[0]):
            return np.full(len(templates), self.threshold)  # none kept, or kept for a model of another width
        return person_thresholds(templates, *self._spread, self.capture_shift, self.far_target, self.threshold)

    @cached_property
    def _spread(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The kept mean and covariance as arrays, made once (a `watch` decides on every frame)."""
        if self.stranger_mean is None or self.stranger_cov is None:
            return None
        return np.asarray(self.stranger_mean, np.float64), np.asarray(self.stranger_cov, np.float64)


@dataclass
class Settings:
    """Non-secret but decisive device settings (`device.json` in the home), sealed with the store's key."""

    calibration: Calibration | None = None
    models: dict[str, str] = field(default_factory=dict)  # model file name -> sha256 when this device installed it
    verifier: str | None = None  # the model file decisions use (None: a home from before it was recorded)
    public_set: str | None = None  # sha256 of the public set the last round's calibration took strangers from

    @classmethod
    def load(cls, home: DeviceHome, vault: Vault) -> Settings:
        path, sealed = home.root / "device.json", vault.manifest().get("settings_mac")
        if not path.exists():
            if sealed is not None:
                raise VaultError(f"{path} is missing but the store sealed one; refusing to decide without it "
                                 "(run `ffr device calibrate` and `ffr device install-model` again)")
            return cls()
        try:
            raw = json.loads(path.read_text())
            mac = raw.pop("mac")
            body = _canonical(raw)
            settings = cls(_checked(Calibration(**raw["calibration"])) if raw.get("calibration") else None,
                           {str(k): str(v) for k, v in raw.get("models", {}).items()},
                           str(raw["verifier"]) if raw.get("verifier") is not None else None,
                           str(raw["public_set"]) if raw.get("public_set") is not None else None)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise VaultError(f"{path} is damaged or was not written by ffr-edge; refusing to decide with it") from None
        if not hmac.compare_digest(str(mac), vault.mac(body)) or mac != sealed:
            raise VaultError(f"{path} was changed outside ffr-edge (its seal does not match); refusing to decide with "
                             "it (run `ffr device calibrate` again)")
        return settings

    def save(self, home: DeviceHome, vault: Vault) -> None:
        raw = asdict(self)
        mac = vault.mac(_canonical(raw))
        tmp = home.root / "device.json.tmp"
        tmp.write_text(json.dumps({**raw, "mac": mac}, indent=1))
        tmp.replace(home.root / "device.json")
        vault.seal_settings(mac)


def _checked(cal: Calibration) -> Calibration:
    """The calibration as read, refused (ValueError) when the strangers' spread is not a mean of d numbers and a d x d
    covariance, or its shift floor is no cosine difference: every decision would fail on it (or let anyone in)."""
    if cal.shift_floor is not None and not (is_real(cal.shift_floor) and 0 <= cal.shift_floor <= 2):
        raise ValueError("the calibration's shift floor is not a cosine difference")  # a number within 2, nothing else
    if cal.stranger_mean is not None or cal.stranger_cov is not None:
        mean, cov = np.asarray(cal.stranger_mean, np.float64), np.asarray(cal.stranger_cov, np.float64)
        if mean.ndim != 1 or cov.shape != (len(mean), len(mean)) or not (np.isfinite(mean).all()
                                                                         and np.isfinite(cov).all()):
            raise ValueError("the strangers' spread in the calibration has the wrong shape")
    return cal


def _canonical(raw: dict) -> bytes:
    return json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()


class Recognizer:
    def __init__(self, home: DeviceHome, vault: Vault, threads: int | None = 1):
        self.home, self.vault = home, vault
        self.model_path = current_model(home, vault)
        self.model_sha256 = file_sha256(self.model_path)
        self.settings = Settings.load(home, vault)
        if self.settings.models.get(self.model_path.name) != self.model_sha256:
            raise VaultError(f"model file {self.model_path} is not the one this device installed (its sha256 does not "
                             "match the sealed one); refusing to verify with it: install a model again with "
                             "`ffr device install-model`")
        self.embedder = OnnxEmbedder(self.model_path, threads)

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
        return f"calibrated for FAR {cal.far_target:g}" + (
            ", raised for each person whom strangers resemble" if cal.stranger_mean is not None else "")

    def embed(self, crops: np.ndarray) -> np.ndarray:
        return normalise(self.embedder.embed(crops))

    def template(self, crops: np.ndarray) -> np.ndarray:
        return template_of(self.embed(crops))

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

    def people(self, damaged: list[str] | None = None) -> list[Person]:
        """Everyone enrolled, templates under the current model; see `Vault.people` for `damaged`."""
        return [self.refresh(p) for p in self.vault.people(damaged)]

    def person(self, name: str) -> Person:
        return self.refresh(self.vault.get(name))


def calibration_scores(embeddings: list[np.ndarray], strangers: np.ndarray | None = None,
                       templates: np.ndarray | None = None, min_shift: float = 0.0
                       ) -> tuple[np.ndarray, np.ndarray, float]:
    """Scores of the statistic a decision uses: a face against a person's template (`Recognizer.template`, the
    normalised mean of their faces). Genuine: each face against its own person's template made without it;
    impostor: each face against every other person's template, and each of `strangers` (faces of nobody the device
    knows: public negatives) against every template, moved to the device's own capture (`capture_shift`).
    Face-to-face scores run lower than face-to-template ones, so a threshold set on them would accept more
    impostors than it promises. A probe's score is the mean over its faces, never above its highest face, so one
    face per score is the conservative side. `templates` (one row per person, in order): the templates the door
    scores against, made from all of a person's enrolled faces; a template of few faces lies further from every
    face than one of many, so impostor scores against it run low (default: each person's `embeddings`).
    Returns (genuine, impostor, the shift the strangers' scores were moved by: at least `min_shift`)."""
    if templates is None:
        templates = np.stack([template_of(e) for e in embeddings]) if embeddings else np.zeros((0, 0))
    genuine, own = [], []
    for i, faces in enumerate(embeddings):
        if len(faces) >= 2:
            genuine.append(leave_one_out_scores(faces))
        own.extend(faces @ t for j, t in enumerate(templates) if j != i)
    impostor, shift = np.concatenate(own) if own else np.zeros(0), 0.0
    if strangers is not None and len(strangers) and len(templates):
        public = (strangers @ templates.T).ravel()
        shift = max(min_shift, capture_shift(impostor, public))
        impostor = np.concatenate([impostor, public + shift])
    return np.concatenate(genuine) if genuine else np.zeros(0), impostor, shift


MEDIAN_EFFICIENCY = float(np.sqrt(np.pi / 2))  # a sample median's standard error over the mean's, normal scores


def capture_shift(own: np.ndarray, public: np.ndarray) -> float:
    """How far to move the public faces' impostor scores up to where the device's own people score against each
    other: public faces come from another camera and crop than the strangers at the door, and score lower against
    its templates (10 CelebA devices, CelebA-HQ public faces: by 0.02-0.07; a threshold set on them let in 4x the
    promised FAR, moved 1.1x, `bench/results/personalisation_door.md`). Their many scores give the tail's shape, the
    device's own impostor scores its place; never moved down. Measured under a model fitted on the device's own
    people it comes out too small, as those people were pushed apart: a personalised model is given the global
    model's shift as `min_shift`, and every model the shift first measured on the public set, before the device's
    updates went into the global model (`edge_client.verifier_choice.shift_floor`).

    The place is the difference of medians plus one standard error of the device's median: with a few people it
    rests on a few dozen scores, and since the FAR above a threshold is convex in it, an error either way lets in
    more on average than it keeps out (200 simulated devices of 3 people: 1.4x the promised FAR with the medians
    alone; `bench/results/door_far.md`)."""
    if len(own) == 0 or len(public) == 0:
        return 0.0
    standard_error = MEDIAN_EFFICIENCY * float(np.std(own)) / np.sqrt(len(own))
    return max(0.0, float(np.median(own) - np.median(public)) + standard_error)


def calibrate(embeddings: list[np.ndarray], far: float, model_sha256: str, strangers: np.ndarray | None = None,
              templates: np.ndarray | None = None, min_shift: float = 0.0) -> Calibration:
    """The threshold for a false-accept rate of `far` on the device's own people (and `strangers`: faces of
    nobody it knows), and the false-reject rate expected there. Needs two people with two or more faces each.
    With fewer than 1/far impostor scores the rate cannot be counted: the threshold is then the higher of the
    highest impostor score and the fitted normal's tail at `far`, never only the highest seen (a few people's
    97th percentile). With `strangers`, it also keeps their embeddings' mean and covariance, from which each person
    gets a threshold of their own (`edge_client.person_threshold`), and the expected false-reject rate is counted at
    each person's."""
    keep = [i for i, e in enumerate(embeddings) if len(e) >= 2]
    if len(keep) < 2:
        raise ValueError("calibration needs at least two people with at least two face images each "
                         "(enrol more people, or add --data DIR)")
    genuine, impostor, shift = calibration_scores([embeddings[i] for i in keep], strangers,
                                                  None if templates is None else templates[keep], min_shift)
    threshold, measurable = threshold_at_far(impostor, far)
    if not measurable:
        threshold = max(threshold, gaussian_tail(impostor, far))
    cal = Calibration(threshold, far, 0.0, measurable, len(genuine), len(impostor), model_sha256, shift)
    if strangers is not None and len(strangers) >= 2:
        mean, cov = stranger_spread(strangers)
        cal.stranger_mean, cal.stranger_cov = _kept(mean).tolist(), _kept(cov).tolist()
    kept = np.stack([template_of(embeddings[i]) for i in keep]) if templates is None else templates[keep]
    each = np.repeat(cal.thresholds_for(kept), [len(embeddings[i]) for i in keep])  # genuine's order: by person
    cal.expected_frr = float(np.mean(genuine <= each))
    return cal


def _kept(values: np.ndarray) -> np.ndarray:
    """As the sealed settings keep them: 7 significant digits (the decision is made on exactly what is kept)."""
    return np.vectorize(lambda v: float(f"{v:.7g}"), otypes=[float])(values)
