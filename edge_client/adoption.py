"""The device's adoption check: a new global model is scored on the device's own people before it verifies with it.

The coordinator's quality gate can be off, fooled by its own faces, or the coordinator itself can be
wrong; the device is the one that opens the door. So before a device lets a new global model (or
anything trained from it) decide a match, it scores the model on faces only it holds: its enrolled
people (genuine pairs) and public negatives (`models.evaluation.separation`), against the last model
it adopted. When the new model would accept clearly more impostors at the old threshold, or separates
its people clearly worse, the device keeps its last good model and reports only that fact (one
number in its next update's metrics: no score, no embedding).

The last adopted model's hash is kept in the home (`models/adopted.json`) beside its weights.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from models.evaluation.separation import FaceSet, SeparationSettings, Verdict, score

log = logging.getLogger("edge_client")
ADOPTED_METRIC = "global_adopted"  # 1: the announced model passed the device's check, 0: it kept its last
ADOPTED_FILE = "adopted.safetensors"  # its hash is kept in the device's sealed settings


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


class Adoption:
    """The last model this device adopted (weights and hash in `folder`), and the check against it. `sealed`: the
    hash the device's sealed settings hold for it (edge_client.recognizer.Settings), so that a file swapped on
    disk cannot become the reference a poisoned model is judged against."""

    def __init__(self, folder: Path, settings: SeparationSettings = ADOPTION, sealed: str | None = None):
        self.folder, self.settings, self.sealed = Path(folder), settings, sealed
        self.weights, self.record = self.folder / "adopted.safetensors", self.folder / "adopted.json"

    def last(self) -> tuple[str, dict[str, np.ndarray]] | None:
        """(sha256, state) of the last adopted model; None before the first, or when its file does not match."""
        from safetensors.numpy import load_file

        from protocol.tensors import sha256_hex

        if not (self.record.exists() and self.weights.exists()):
            return None
        try:
            sha = json.loads(self.record.read_text())["sha256"]
            data = self.weights.read_bytes()
            if sha256_hex(data) != sha:
                log.warning("the last adopted model in %s does not match its hash; judging from scratch", self.folder)
                return None
            return sha, {k: v.astype(np.float32) if v.dtype.kind == "f" else v
                         for k, v in load_file(str(self.weights)).items()}
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def judge(self, sha: str, payload: bytes, state: dict[str, np.ndarray], faces: FaceSet | None) -> Verdict:
        """Adopt the announced model (and remember it) unless it is clearly worse on `faces` than the last one."""
        last = self.last()
        if self.sealed is not None and (last is None or last[0] != self.sealed):
            return Verdict(False, f"the last adopted model in {self.folder} is not the one this device sealed "
                                  "(changed outside ffr-edge); adopting nothing until it is restored", {})
        if last is not None and last[0] == sha:
            return Verdict(True, "", {})
        if last is not None and faces is not None:
            verdict = self.settings.judge(score(last[1], faces), score(state, faces))
            if not verdict.ok:
                return verdict
        else:
            verdict = Verdict(True, "", {})
        self._remember(sha, payload)
        return verdict

    def _remember(self, sha: str, payload: bytes) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.weights.with_suffix(".tmp")
        tmp.write_bytes(payload)
        tmp.replace(self.weights)
        tmp = self.record.with_suffix(".tmp")
        tmp.write_text(json.dumps({"sha256": sha}))
        tmp.replace(self.record)
