"""Which model a device verifies with after a round, and the threshold it holds for it.

A round leaves a device two candidates: the global model (`generic.onnx`) and its personalised one (its local
backbone with the DFC branch, `personalised.onnx`). The personalised model learnt the device's people, and may also
have learnt to let strangers in, so it is used only when, on the device's people and public negatives (faces of
nobody's people), it keeps more of its people at the device's false-accept rate than the global model does, by more
than chance on the faces judged (`chance`). Whichever is chosen is calibrated again on those same faces
(`edge_client.recognizer.calibrate`, as `ffr device calibrate` sets a threshold), so the FAR the device promises
holds across rounds: the threshold set for the last model is never carried over to the next. The choice is made on
images the personalised branch was not fitted on (`check_split`: a quarter of the images of each person with four or
more): judged on the images it was fitted on, a personalised model looks perfect (TAR 1.000 in a two-device run) and
is always chosen. Where a device has too few images to spare, it is judged on all of them, and must beat the global
model, not tie. Without public negatives (strangers' faces) the personalised model is never chosen: calibrated on
the device's people alone, its threshold let strangers in. The public faces' scores are moved to the device's own
capture (`edge_client.recognizer.capture_shift`) by at least the global model's shift: the personalised model pushed
the device's people apart, so measured on them its shift is too small (10 CelebA devices: strangers let in at 2.8x
the promised FAR with its own shift, 0.7x with the global one's; `bench/results/personalisation_door.md`). The
global model learns the device's people too, from its own updates, round after round, so every model's shift is at
least the one first measured on the same public set (`shift_floor`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_client.home import DeviceHome
from edge_client.recognizer import Calibration, Settings, calibrate, file_sha256, normalise, template_of
from edge_client.vault import Vault
from models.runtime import OnnxEmbedder

log = logging.getLogger("edge_client")
DEFAULT_FAR = 1e-3  # `ffr device calibrate`'s default, for a device that was never calibrated
CHECK_SHARE = 0.25  # of each person's images, kept out of the personalised fit for the choice and its calibration
CHECK_MIN_IMAGES = 4  # a person with fewer keeps them all for the fit (and the choice is made on all images)


def check_split(labels: np.ndarray, seed: int = 0) -> np.ndarray | None:
    """A mask of the images the choice and calibration are made on: CHECK_SHARE of the images of each person with
    CHECK_MIN_IMAGES or more (at least two, so that genuine pairs exist; a person with fewer is fitted on and not
    judged), seeded; None when fewer than two people can spare any (the choice is then made on all images)."""
    people = [rows for k in np.unique(labels) if len(rows := np.flatnonzero(labels == k)) >= CHECK_MIN_IMAGES]
    if len(people) < 2:
        return None
    rng, mask = np.random.default_rng(seed), np.zeros(len(labels), bool)
    for rows in people:
        mask[rng.permutation(rows)[:max(2, round(CHECK_SHARE * len(rows)))]] = True
    return mask


@dataclass
class Choice:
    """The model the device verifies with from now on, its new calibration, and each candidate's share of the
    device's people accepted at that FAR (1 - expected false-reject rate)."""

    model: Path
    calibration: Calibration
    tar: dict[str, float]
    previous: Calibration | None
    note: str = ""

    def line(self) -> str:
        """The device's log line: its people's TAR before and after, at the FAR it promises."""
        cal, before = self.calibration, self.previous
        was = f"{1 - before.expected_frr:.3f}" if before is not None else "n/a (never calibrated)"
        threshold = f"{before.threshold:.3f} -> {cal.threshold:.3f}" if before is not None else f"{cal.threshold:.3f}"
        others = ", ".join(f"{name} {tar:.3f}" for name, tar in self.tar.items())
        return (f"own people TAR {was} -> {1 - cal.expected_frr:.3f} at FAR {cal.far_target:g} with the "
                f"{self.model.stem} model ({others}); threshold {threshold}, recalibrated on "
                f"{cal.genuine_pairs} genuine / {cal.impostor_pairs} impostor scores"
                + ("" if cal.measurable else f" (too few to count a FAR of {cal.far_target:g}: estimated, and on "
                                             "strangers it can be exceeded; a public set gives strangers' faces)")
                + (f"; {self.note}" if self.note else ""))


def calibrated(path: Path, far: float, images: np.ndarray, labels: np.ndarray, negatives: np.ndarray | None,
               judged: np.ndarray | None, min_shift: float = 0.0) -> Calibration:
    """A model calibrated as its door will decide: the judged faces of each person and the public negatives scored
    against templates made from all of the person's faces (`edge_client.recognizer.calibration_scores`; `min_shift`:
    the least the public faces' scores are moved up by, `capture_shift`)."""
    embedder = OnnxEmbedder(path)
    emb = normalise(embedder.embed(images))
    strangers = normalise(embedder.embed(negatives)) if negatives is not None and len(negatives) else None
    people = np.unique(labels)
    templates = np.stack([template_of(emb[labels == k]) for k in people])
    judged = np.ones(len(labels), bool) if judged is None else judged
    return calibrate([emb[judged & (labels == k)] for k in people], far, file_sha256(path), strangers, templates,
                     min_shift)


def global_shift(home: DeviceHome, settings: Settings, far: float, images: np.ndarray, labels: np.ndarray,
                 negatives: np.ndarray) -> float:
    """The installed global model's capture shift on these faces: the floor of a personalised model's (0 where the
    global model is missing, not the one this device installed, or the device has fewer than two people)."""
    generic = home.generic_onnx
    installed = generic.is_file() and settings.models.get(generic.name) == file_sha256(generic)
    if not installed or len(np.unique(labels)) < 2:
        return 0.0
    return calibrated(generic, far, images, labels, negatives, None).capture_shift


def choose(home: DeviceHome, vault: Vault, images: np.ndarray, labels: np.ndarray,
           negatives: np.ndarray | None, judged: np.ndarray | None = None,
           public_sha256: str | None = None) -> Choice | None:
    """Calibrate each exported model on the device's faces (`judged`: a mask of those the personalised branch was
    not fitted on, default all; the templates are made from all), verify with the better one, save both choices in
    the sealed settings. None (nothing changed) when the device has too few people to calibrate on."""
    settings = Settings.load(home, vault)
    previous = settings.calibration
    far = previous.far_target if previous is not None else DEFAULT_FAR
    strangers = negatives is not None and len(negatives) > 0
    floor = shift_floor(settings, public_sha256 if strangers else None)
    candidates = [p for p in (home.generic_onnx, home.personalised_onnx) if p.is_file()]
    calibrations: dict[Path, Calibration] = {}
    for path in candidates:  # the global model first: its capture shift is the personalised one's floor
        shift = calibrations[home.generic_onnx].capture_shift if home.generic_onnx in calibrations else 0.0
        shift = max(shift, floor or 0.0)
        try:
            calibrations[path] = calibrated(path, far, images, labels, negatives, judged, shift)
        except ValueError as exc:
            log.warning("%s: not recalibrated: %s", home.root, exc)
            return None
    if not calibrations:
        return None
    tar = {path.stem: 1 - cal.expected_frr for path, cal in calibrations.items()}
    note = "" if strangers or len(calibrations) == 1 else (
        "the personalised model is not used without strangers' faces to calibrate it on (a public set)")
    judged_scores = min(cal.genuine_pairs for cal in calibrations.values())
    kind = preferred({KINDS[stem]: t for stem, t in tar.items()}, strangers, judged_scores)
    best = home.personalised_onnx if kind == "personalised" else home.generic_onnx
    if kind == "global" and strangers and "personalised" in tar and tar["personalised"] > tar["generic"]:
        note = (f"the personalised model's lead is within chance on {judged_scores} judged scores "
                f"(under {chance(tar['generic'], tar['personalised'], judged_scores):.3f}): the global model is kept")
    if strangers and public_sha256 is not None:  # the floor goes on with the calibration: the first on this set
        measured = calibrations.get(home.generic_onnx, calibrations[best]).capture_shift  # the global model's
        calibrations[best].shift_floor = floor if floor is not None else measured
    settings.verifier, settings.calibration = best.name, calibrations[best]
    settings.public_set = public_sha256 if strangers else None  # the file `ffr device calibrate` may take them from
    settings.save(home, vault)
    return Choice(best, calibrations[best], tar, previous, note)


def shift_floor(settings: Settings, public_sha256: str | None) -> float | None:
    """The least the public faces' scores are moved up by on this device: the capture shift it first measured on the
    public set `public_sha256`, kept with its calibration; None when it has none for that set (never calibrated on
    it, or the set changed): the next calibration's measured shift then becomes the floor.

    Why: the shift belongs to the cameras and crops, but it is measured on the device's own people's scores, and each
    global model the device's updates went into pushes those people apart, so the measured shift falls round by
    round and the threshold with it (two-device `serve` run: dev1's shift 0.033 -> 0.028 -> 0.017, its door's
    strangers let in 0.53% for 0.1% promised; with the floor 0.38%, `bench/results/two_device_serve_shift_floor.md`)."""
    cal = settings.calibration
    if cal is None or public_sha256 is None or settings.public_set != public_sha256:
        return None
    return cal.shift_floor


KINDS = {"generic": "global", "personalised": "personalised"}  # an exported model's file stem, and what it is


def preferred(tar: dict[str, float], strangers: bool, judged: int = 0) -> str:
    """The model a device verifies with, from each candidate's TAR of its people at its FAR (`global`, and
    `personalised` when there is one), each counted on the same `judged` genuine scores: the personalised model must
    beat the global one by more than `chance`, as a tie keeps the model everyone shares (`judged` 0: unknown, any
    lead wins); and never without strangers' faces to calibrate it on, for it learnt to tell this device's people
    apart and its threshold, set on them alone, let in 18% of strangers in a two-device run
    (bench/results/two_device_serve.md)."""
    if "global" not in tar:
        return "personalised"
    if "personalised" not in tar or not strangers:
        return "global"
    lead = tar["personalised"] - tar["global"]
    return "personalised" if lead > chance(tar["global"], tar["personalised"], judged) else "global"


def chance(a: float, b: float, judged: int) -> float:
    """One standard error of the difference of two TARs, each counted on `judged` genuine scores (0 when `judged` is
    unknown): a lead below it is a face or two of a small judged share. Why: on its judged quarter a fleet device
    chose its personalised model by one face (0.732 against 0.718) and then kept 5 points fewer of its people than
    at the start (`bench/results/fleet_simulate_celeba_final_iid.md`, device 9). Scores of both models on the same
    faces are correlated, so this unpaired error errs towards keeping the shared model."""
    if judged <= 0:
        return 0.0
    return math.sqrt(max(a * (1 - a) + b * (1 - b), 0.0) / judged)
