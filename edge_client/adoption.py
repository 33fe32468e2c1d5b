"""The device's adoption check: a new global model is scored on the device's own people before it verifies with it.

The coordinator's quality gate can be off, fooled by its own faces, or the coordinator itself can be
wrong; the device is the one that opens the door. So before a device lets a new global model (or
anything trained from it) decide a match, it scores the model on faces only it holds: its enrolled
people (genuine pairs) and public negatives (`models.evaluation.separation`), against the last model
it adopted, on face pairs and on faces against each person's template (what its door decides on). When the new
model would accept clearly more impostors at the old threshold, in all or for one person or one pair, or separates
its people clearly worse, the device keeps its last good model and reports only that fact (one
number in its next update's metrics: no score, no embedding).

It judges against two references: the last model it adopted, and the first (`models/anchor.safetensors`), so that
rounds each within the bar cannot drift past it together (an insider who scales its updates to pass each round's
check). Both hashes are kept in the home (`models/adopted.json`, `models/anchor.json`) beside their weights and
sealed in the device's settings.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from models.evaluation import separation
from models.evaluation.separation import FaceSet, Scores, SeparationSettings, Verdict, door_scores

log = logging.getLogger("edge_client")
ADOPTED_METRIC = "global_adopted"  # 1: the announced model passed the device's check, 0: it kept its last
ADOPTED_FILE = "adopted.safetensors"  # its hash is kept in the device's sealed settings
ANCHOR_FILE = "anchor.safetensors"  # the first model the device adopted; its hash sealed as well


# a device has few impostor pairs: its operating point is measured at 1e-2 and judged with more slack than the
# coordinator's larger set; `limit`: the device's own faces scored, at most
ADOPTION = SeparationSettings(far=1e-2, far_ratio=3.0, auc_margin=0.02, limit=160)
PUBLIC_IMAGES = 80  # public negatives added to them, at most


def check_faces(images: np.ndarray, labels: np.ndarray, public: np.ndarray | None,
                settings: SeparationSettings = ADOPTION, seed: int = 0) -> FaceSet | None:
    """The device's people (at most `settings.limit`, every person kept with two or more) and up to PUBLIC_IMAGES
    public negatives, each its own person; None when there is no impostor pair to judge by."""
    rng = np.random.default_rng(seed)
    people = [rng.permutation(np.flatnonzero(labels == k)) for k in np.unique(labels)]
    per_person = max(2, settings.limit // max(1, len(people)))
    own = np.sort(np.concatenate([p[:per_person] for p in people if len(p) >= 2] or [np.zeros(0, int)]))
    parts, ids = [images[own]], [labels[own].astype(np.int64)]
    if public is not None and len(public):
        chosen = rng.choice(len(public), min(PUBLIC_IMAGES, len(public)), replace=False)
        extra = public[chosen]
        if extra.shape[1:] != images.shape[1:]:
            import cv2

            extra = np.stack([cv2.resize(x, images.shape[1:3][::-1], interpolation=cv2.INTER_AREA) for x in extra])
        parts.append(extra)
        ids.append(int(labels.max(initial=0)) + 1 + np.arange(len(extra)))  # nobody's people: one each
    faces, names = np.concatenate(parts), np.concatenate(ids)
    if len(faces) < 3 or len(np.unique(names)) < 2 or len(own) < 2:
        return None
    return FaceSet(np.ascontiguousarray(faces), names)


def door_verdict(reference: tuple[Scores, Scores], candidate: tuple[Scores, Scores],
                 settings: SeparationSettings = ADOPTION) -> Verdict:
    """The device's bar on face pairs, then on faces against its enrolled people's templates."""
    return separation.door_verdict(reference, candidate, settings)


class Adoption:
    """The last model this device adopted and the first (the anchor), weights and hashes in `folder`, and the check
    against both. `sealed`: the hashes the device's sealed settings hold for them (edge_client.recognizer.Settings,
    file name -> sha256), so that a file swapped on disk cannot become the reference a poisoned model is judged
    against."""

    def __init__(self, folder: Path, settings: SeparationSettings = ADOPTION, sealed: dict[str, str] | None = None):
        self.folder, self.settings, self.sealed = Path(folder), settings, sealed

    def last(self) -> tuple[str, dict[str, np.ndarray]] | None:
        """(sha256, state) of the last adopted model; None before the first, or when its file does not match."""
        return self._load(ADOPTED_FILE)

    def anchor(self) -> tuple[str, dict[str, np.ndarray]] | None:
        """(sha256, state) of the first model this device adopted: each step may be small, the whole run is judged
        against this one."""
        return self._load(ANCHOR_FILE)

    def seals(self) -> dict[str, str]:
        """File name -> sha256 of the references on disk, for the device's sealed settings."""
        return {name: ref[0] for name in (ADOPTED_FILE, ANCHOR_FILE) if (ref := self._load(name)) is not None}

    def judge(self, sha: str, payload: bytes, state: dict[str, np.ndarray], faces: FaceSet | None) -> Verdict:
        """Adopt the announced model (and remember it) unless it is clearly worse on `faces` than the last one, or
        than the first one this device adopted."""
        last, anchor = self.last(), self.anchor()
        for name, ref in ((ADOPTED_FILE, last), (ANCHOR_FILE, anchor)):
            sealed = (self.sealed or {}).get(name)
            if self.sealed is not None and sealed is not None and (ref is None or ref[0] != sealed):
                return Verdict(False, f"the {name} in {self.folder} is not the one this device sealed (changed "
                                      "outside ffr-edge); adopting nothing until it is restored", {})
        if anchor is None and last is not None:  # a home from before the anchor: its last model starts the budget
            self._remember(ANCHOR_FILE, last[0], (self.folder / ADOPTED_FILE).read_bytes())
            anchor = last
        if last is not None and last[0] == sha:
            return Verdict(True, "", {})
        verdict = Verdict(True, "", {})
        if faces is not None and last is not None:
            candidate = door_scores(state, faces)
            verdict = door_verdict(door_scores(last[1], faces), candidate, self.settings)
            if verdict.ok and anchor[0] != last[0]:  # the whole run's move, once it is more than one step
                anchored = door_verdict(door_scores(anchor[1], faces), candidate, self.settings)
                if not anchored.ok:
                    return Verdict(False, f"against the first model this device adopted: {anchored.reason}",
                                   anchored.metrics)
            if not verdict.ok:
                return verdict
        self._remember(ADOPTED_FILE, sha, payload)
        if anchor is None:
            self._remember(ANCHOR_FILE, sha, payload)
        return verdict

    def _load(self, name: str) -> tuple[str, dict[str, np.ndarray]] | None:
        """(sha256, state) of a reference file whose bytes match its record; None when missing or not matching."""
        from safetensors.numpy import load_file

        from protocol.tensors import sha256_hex

        weights, record = self.folder / name, (self.folder / name).with_suffix(".json")
        if not (record.exists() and weights.exists()):
            return None
        try:
            sha = json.loads(record.read_text())["sha256"]
            data = weights.read_bytes()
            if sha256_hex(data) != sha:
                log.warning("%s in %s does not match its hash; judging from scratch", name, self.folder)
                return None
            state = load_file(str(weights))
            return sha, {k: v.astype(np.float32) if v.dtype.kind == "f" else v for k, v in state.items()}
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _remember(self, name: str, sha: str, payload: bytes) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        weights, record = self.folder / name, (self.folder / name).with_suffix(".json")
        tmp = weights.with_suffix(".tmp")
        tmp.write_bytes(payload)
        tmp.replace(weights)
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps({"sha256": sha}))
        tmp.replace(record)
