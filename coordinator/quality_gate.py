"""The quality gate: a candidate global model is scored on faces the coordinator holds before it is published.

One admitted device can poison from inside every bound (the collapse attack, `fleet.attacks`): its update
is clipped and capped, yet it can still pull every embedding together, so that devices' calibrated
thresholds accept every impostor. The engine's norm and step checks cannot see that; the faces can.
Before publishing, the engine hands the gate the current model and the candidate; the gate scores both
on its faces (`models.evaluation.separation`: the false-accept rate at the current model's threshold,
and the AUC) and says why the candidate must not be published, which rolls the round back. The same bar is
held against the anchor, the model the run started from (model v0): each round may move within the bar, but
not the run as a whole, so an insider cannot drift past it a step at a time.

The faces: the public set the coordinator serves (`--public-set`), or any folder the operator names
(`--gate-data`: one folder per person gives TAR/FAR over labelled pairs; a flat folder of unlabelled
faces still shows a collapse as impostor scores rising). They never leave the coordinator, and no
device's data is involved. Without either, stand-in faces (`stand_in_faces`): SYNTHETIC people drawn from a seed
only the coordinator's state holds. They show a collapse or a drift of every score, not how real people are kept
apart, so on them the gate only judges the step the operator set (`--server-step`) and never chooses one.
Torch-free: the backbone runs as ONNX built from the state dict.
"""
from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from coordinator.server_step import STEPS, WHOLE, Judged, best_step, point
from models.evaluation.separation import FaceSet, Scores, SeparationSettings, Verdict, door_scores, door_verdict

log = logging.getLogger("coordinator")


GateSettings = SeparationSettings  # the gate's bar: the spec's defaults
Scored = tuple[Scores, Scores]  # a model's (face-pair, face-to-template) scores on the gate's faces
TEMPLATES = "its people's templates (identity canaries)"
STAND_IN_PEOPLE, STAND_IN_IMAGES = 40, 10  # 400 faces (the bar's default limit): 78,000 impostor pairs
JUDGED_KEPT = 16  # candidates' verdicts kept against one current model (a round judges at most len(STEPS) + 1)
SEED_FILE = "gate_faces.seed"  # in the coordinator's state: the stand-in faces stay the same across restarts


@dataclass
class GateSetup:
    """The quality gate as a command sets it up (`ffr coordinator serve`, `ffr fleet simulate`): the faces it judges
    on (`--gate-data`; None: the command's own default source), whether it is off (`--no-gate`) and its bar."""

    data: str | Path | None = None
    off: bool = False
    bar: GateSettings = field(default_factory=GateSettings)


@dataclass
class QualityGate:
    """Scores candidates on fixed faces against two references: the current model (its scores kept per version) and
    the anchor, the model the run started from, so that steps each within the bar cannot add up past it. On labelled
    faces each person is also enrolled as a device would enrol them, and every other face probes their template
    (identity canaries: one person pulled onto another crosses there before their face pairs do), the bar held on
    both as a device's adoption check holds it (`models.evaluation.separation.door_verdict`). `scorer`: the scores of
    a state on the faces (`door_scores`; a test's stand-in for a pull no real update can be made to show)."""

    faces: FaceSet
    settings: GateSettings = field(default_factory=GateSettings)
    source: str = ""
    steps: tuple[float, ...] = STEPS  # the server steps it may choose among (`coordinator.server_step`)
    scorer: Callable[[dict[str, np.ndarray], FaceSet, int | None], Scored] = door_scores
    _current: tuple[str, Scored] | None = None
    _anchor: Scored | None = None
    _judged: dict[bytes, Judged] = field(default_factory=dict)  # against the current scores, by the candidate's content

    def anchor_on(self, start_state: Callable[[], dict[str, np.ndarray] | None]) -> None:
        """Fix the anchor (loaded and scored once; nothing to anchor on when it cannot be loaded)."""
        if self._anchor is None and (state := start_state()) is not None:
            self._anchor = self.scorer(state, self.faces, self.settings.threads)
            self._judged.clear()  # judged without it

    def check(self, current_state: dict[str, np.ndarray], current_sha: str,
              candidate_state: dict[str, np.ndarray]) -> tuple[str, dict]:
        """('' or why the candidate must not be published, the figures behind it for the round's record). A gate that
        may not take the whole step (stand-in faces) judges the candidate as far as it would publish it."""
        reach = WHOLE if WHOLE in self.steps else max(self.steps)
        if reach != WHOLE:
            candidate_state = point(current_state, candidate_state, reach)
        judged = self._judge(self._current_scores(current_state, current_sha), candidate_state)
        return judged.problem, judged.metrics

    def step(self, current_state: dict[str, np.ndarray], current_sha: str, aggregate: dict[str, np.ndarray],
             limit: float = WHOLE) -> tuple[dict[str, np.ndarray] | None, str, dict]:
        """The server's step towards the aggregate, at most `limit` of it: the point that separates these faces best
        among those that pass (`coordinator.server_step`); (None, why, figures) when none does."""
        current = self._current_scores(current_state, current_sha)
        return best_step(current_state, aggregate, lambda state: self._judge(current, state), self.steps, limit)

    def start_figures(self) -> dict:
        """The anchor's AUC on these faces, for each round's record: start against now."""
        return {} if self._anchor is None else {"gate_auc_start": self._anchor[0].auc}

    def _current_scores(self, state: dict[str, np.ndarray], sha: str) -> Scored:
        if self._current is None or self._current[0] != sha:
            self._current = (sha, self.scorer(state, self.faces, self.settings.threads))
            self._judged.clear()
        return self._current[1]

    def _judge(self, current: Scored, candidate_state: dict[str, np.ndarray]) -> Judged:
        """The bar against the current model, then the same bar against the anchor (the run's whole budget)."""
        key = state_digest(candidate_state)  # `check`'s candidate, judged again among `step`'s points
        if key in self._judged:
            return self._judged[key]
        if len(self._judged) >= JUDGED_KEPT:  # rounds rolled back keep the current model: forget, not grow
            self._judged.clear()
        candidate = self.scorer(candidate_state, self.faces, self.settings.threads)
        verdict = door_verdict(current, candidate, self.settings, TEMPLATES)
        metrics = {f"gate_{k}": v for k, v in verdict.metrics.items()}
        problem = "" if verdict.ok else f"quality gate: {verdict.reason}"
        if self._anchor is not None:
            anchored: Verdict = door_verdict(self._anchor, candidate, self.settings, TEMPLATES)
            metrics.update({f"gate_anchor_{prefix}{name}": anchored.metrics[f"{prefix}{k}"]
                            for prefix in ("", "template_") for name, k in
                            (("threshold", "threshold"), ("far_start", "far_current"),
                             ("far_candidate", "far_candidate"), ("far_limit", "far_limit"))
                            if f"{prefix}{k}" in anchored.metrics})
            if not problem and not anchored.ok:
                problem = f"quality gate, against the model the run started from: {anchored.reason}"
        self._judged[key] = Judged(candidate[0].auc, problem, metrics)
        return self._judged[key]

    @classmethod
    def from_path(cls, path: Path, settings: GateSettings | None = None) -> QualityGate:
        settings = settings or GateSettings()
        return cls(load_faces(Path(path), settings.limit, settings.seed), settings, str(path))


def state_digest(state: dict[str, np.ndarray]) -> bytes:
    """What a state dict holds (names, dtypes, shapes, values), in 16 bytes: the same point built twice is one."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        array = np.ascontiguousarray(state[name])
        digest.update(f"{name}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.data)
    return digest.digest()


def stand_in_faces(state: Path) -> FaceSet:
    """SYNTHETIC people (`models.faces.synthetic`) for a coordinator given no faces: drawn from a random seed kept in
    its state folder (mode 0600), so no device knows which faces, and a restart judges on the same ones."""
    import secrets

    from models.faces.synthetic import generate
    from protocol.auth import write_secret

    path = Path(state) / SEED_FILE
    if not path.is_file():
        write_secret(path, str(secrets.randbits(31)))
    try:
        seed = int(path.read_text().strip())
    except ValueError:
        raise ValueError(f"{path} is damaged (not a seed); delete it to draw new stand-in faces") from None
    images, labels = generate(STAND_IN_PEOPLE, STAND_IN_IMAGES, seed=seed, size=112)
    return FaceSet(images, labels)


def load_faces(path: Path, limit: int, seed: int = 0) -> FaceSet:
    """A public set file (`models.public_set`) or a folder of aligned crops (flat, or one folder per person),
    at most `limit` images chosen by the seed; each person of a labelled folder keeps at least two images."""
    from models.public_set import PublicSetError, identity_labels, load_public_set

    if path.is_file():
        try:
            public = load_public_set(path)
        except PublicSetError as exc:
            raise ValueError(f"--gate-data: {exc}") from None
        images, labels = public.images, public.labels
    elif path.is_dir():
        from models.training.distill_data import list_images, load_crops

        files = list_images([path])
        labels_all = identity_labels(files, path)
        chosen = _sample(len(files), labels_all, limit, seed)
        images, kept, _ = load_crops([files[i] for i in chosen], 112, progress=False)
        position = {files[i]: i for i in chosen}
        labels = None if labels_all is None else labels_all[[position[f] for f in kept]]
    else:
        raise ValueError(f"--gate-data not found: {path}")
    chosen = _sample(len(images), labels, limit, seed)
    return FaceSet(np.ascontiguousarray(images[chosen]), None if labels is None else labels[chosen])


def _sample(n: int, labels: np.ndarray | None, limit: int, seed: int) -> np.ndarray:
    """Up to `limit` indices; for labelled sets whole pairs of a person, so that genuine pairs exist."""
    rng = np.random.default_rng(seed)
    if n <= limit:
        return np.arange(n)
    if labels is None:
        return np.sort(rng.choice(n, limit, replace=False))
    per_person = max(2, limit // max(1, len(np.unique(labels))))
    chosen = [rng.permutation(np.flatnonzero(labels == k))[:per_person] for k in np.unique(labels)]
    return np.sort(np.concatenate(chosen))[:limit] if chosen else np.arange(0)
