"""What a device's door does with a model: the threshold it calibrates, its people's TAR there, and strangers' FAR.

A ROC over a device's pairs chooses its threshold on the strangers themselves; a device cannot. After each round it
calibrates on the share of its images the personalised branch was not fitted on (`check_split`) and on the public
faces it was served, moved to its own capture (`edge_client.recognizer.calibrate`), promises a FAR, and verifies with
the personalised model only where that keeps more of its people than the global one, beyond chance
(`verifier_choice.preferred`).
This module scores that door as it would stand: its people's test images against their templates, and images of
people of no device against every template, at the threshold the device set.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edge_client.recognizer import calibrate, normalise, template_of
from edge_client.verifier_choice import DEFAULT_FAR, check_split, preferred
from fleet.data import TEST, TRAIN, FleetData
from models.evaluation.bootstrap import rate_interval
from models.faces.splits import relabel

Embedder = Callable[[np.ndarray], np.ndarray]  # images -> embeddings (any scale)


@dataclass
class DoorFaces:
    """A device's faces as its door meets them; people numbered 0..n-1 in `labels` and `test_labels` alike."""

    images: np.ndarray            # the images the device holds (its templates are made from all of them)
    labels: np.ndarray
    judged: np.ndarray | None     # mask of those the calibration is made on (None: all)
    tests: np.ndarray             # its people's later photos
    test_labels: np.ndarray
    strangers: np.ndarray         # photos of people of no device
    public: np.ndarray | None     # the public faces it calibrates on (None: a device with no public set)
    stranger_labels: np.ndarray | None = None  # who each stranger's photo is, to tell a look-alike from many


def door_faces(data: FleetData, client: int, strangers: np.ndarray, public: np.ndarray | None,
               seed: int) -> DoorFaces:
    """A simulated device's faces: its training images (judged share by `check_split` with `seed`), its people's
    test images, and the photos `strangers` (indices into `data.crops`) of people of no device."""
    train = data.union(TRAIN, [client])
    people = np.unique(train.labels)
    crops = relabel(train, people)
    test = np.flatnonzero(data.client_mask(client, TEST))
    test = test[np.isin(data.crops.labels[test], people)]
    return DoorFaces(crops.images, crops.labels, check_split(crops.labels, seed), data.crops.images[test],
                     np.searchsorted(people, data.crops.labels[test]), data.crops.images[strangers], public,
                     data.crops.labels[strangers])


def door(embedder: Embedder, faces: DoorFaces, far: float = DEFAULT_FAR, min_shift: float = 0.0) -> dict | None:
    """The door a model gives: calibrated at `far` as the device calibrates (`min_shift`: the global model's capture
    shift, a personalised model's floor), then TAR on the test photos and FAR on the strangers' photos at each
    person's threshold, with its 95% interval over the strangers (`far_interval`,
    `models.evaluation.bootstrap.rate_interval`). None when the device cannot calibrate (fewer than two people with
    two judged images)."""
    def embed(images: np.ndarray) -> np.ndarray:
        return normalise(embedder(images))

    mine = embed(faces.images)
    people = np.arange(int(faces.labels.max()) + 1) if len(faces.labels) else np.zeros(0, int)
    judged = np.ones(len(faces.labels), bool) if faces.judged is None else faces.judged
    templates = np.stack([template_of(mine[faces.labels == p]) for p in people])
    public = embed(faces.public) if faces.public is not None and len(faces.public) else None
    try:
        cal = calibrate([mine[judged & (faces.labels == p)] for p in people], far, "", public, templates, min_shift)
    except ValueError:
        return None
    own = np.sum(embed(faces.tests) * templates[faces.test_labels], axis=1) if len(faces.tests) else np.zeros(0)
    strangers = embed(faces.strangers) @ templates.T if len(faces.strangers) else np.zeros((0, len(people)))
    each = cal.thresholds_for(templates)  # each person's own, as the device decides (`edge_client.person_threshold`)
    above = strangers > each
    out = {"threshold": cal.threshold, "tar_promised": 1 - cal.expected_frr,
           "tar": float(np.mean(own > each[faces.test_labels])) if len(own) else None,
           "far": float(above.mean()) if above.size else None, "false_accepts": int(above.sum()),
           "far_promised": far, "capture_shift": cal.capture_shift, "measurable": cal.measurable,
           "genuine_pairs": cal.genuine_pairs}
    if faces.stranger_labels is not None and above.size:
        out["far_interval"] = rate_interval(above.sum(1), np.full(len(above), above.shape[1]), faces.stranger_labels)
    if faces.stranger_labels is not None and above.any():
        _, who = np.unique(faces.stranger_labels, return_inverse=True)
        out["top_stranger_share"] = float(np.bincount(who, weights=above.sum(1)).max() / above.sum())
    return out


def device_doors(models: dict[str, Embedder], faces: DoorFaces, far: float = DEFAULT_FAR) -> dict:
    """Each model's door, and the one the device verifies with: `global`, or `personalised` where that keeps more
    of its judged people (`verifier_choice.preferred`). `models`: `start` and `global`, `personalised` optional.
    The later models' capture shift is at least the start model's, which the device measured first on the public
    set (`verifier_choice.shift_floor`)."""
    doors: dict[str, dict] = {}
    if "start" in models and (d := door(models["start"], faces, far)) is not None:
        doors["start"] = d
    first = doors["start"]["capture_shift"] if "start" in doors else 0.0  # its round-1 shift: the device's floor
    if "global" in models and (d := door(models["global"], faces, far, first)) is not None:
        doors["global"] = d
    if "personalised" in models and "global" in doors:
        floor = doors["global"]["capture_shift"]
        if (d := door(models["personalised"], faces, far, floor)) is not None:
            doors["personalised"] = d
    if "global" in doors:
        tar = {name: doors[name]["tar_promised"] for name in ("global", "personalised") if name in doors}
        judged = min(doors[name]["genuine_pairs"] for name in tar)  # the same judged faces for both
        doors["chosen"] = preferred(tar, faces.public is not None and len(faces.public) > 0, judged)
    return doors


def over_promise(door: dict, times: float = 2.0) -> tuple[bool, bool]:
    """Whether a door's FAR on strangers is over `times` its promise, and whether it is over it beyond its interval
    over the strangers (`far_interval`: not one look-alike's luck)."""
    limit = times * door["far_promised"]
    over = door.get("far") is not None and door["far"] > limit
    return over, over and bool(door.get("far_interval")) and door["far_interval"][0] > limit


def door_means(rows: dict[str, dict]) -> dict:
    """Over devices, for each model and for the one each device verifies with (`chosen`): mean TAR of its people,
    mean and worst FAR on strangers, the devices over twice the promised FAR (`over_2x`) and those of them over it
    beyond their interval over strangers (`beyond_2x`: not one look-alike's luck), and how many devices chose the
    personalised model."""
    def means(doors: list[dict]) -> dict:
        tar = [d["tar"] for d in doors if d.get("tar") is not None]
        far = [d["far"] for d in doors if d.get("far") is not None]
        over = [over_promise(d) for d in doors]
        return {"devices": len(doors), "tar": float(np.mean(tar)) if tar else None,
                "far": float(np.mean(far)) if far else None, "far_worst": max(far) if far else None,
                "over_2x": sum(o for o, _ in over), "beyond_2x": sum(b for _, b in over)}

    out = {name: means([r[name] for r in rows.values() if name in r]) for name in ("start", "global", "personalised")}
    out["chosen"] = means([r[r["chosen"]] for r in rows.values() if "chosen" in r])
    out["chosen"]["personalised"] = sum(r.get("chosen") == "personalised" for r in rows.values())
    return out
