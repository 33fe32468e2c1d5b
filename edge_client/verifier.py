"""The device's decision, in one place: a photo's faces -> quality check -> embeddings -> scores against the enrolled
people's templates -> an answer at the device's threshold (and its liveness check, when one ran).

`ffr device` (verify, identify, watch) and the Python API (`edge_client.api.Device`) find their frames and print or
return what this decides; neither compares a score with a threshold itself. Which model and threshold a device holds
after a round is `edge_client.verifier_choice`'s policy; this module decides with whatever is installed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_client.capture import FaceCheck, FaceQuality, every_face
from edge_client.recognizer import Recognizer
from edge_client.vault import Person

GIVEN = "given with --threshold"  # the threshold note of a call that set its own


@dataclass(frozen=True)
class Answer:
    """One probe's answer: who it is (None: nobody enrolled reaches the threshold, or the liveness check failed),
    its score against `closest` (the nearest enrolled person whatever the score) and the threshold it was decided
    at."""

    name: str | None
    score: float
    closest: str
    threshold: float

    @property
    def match(self) -> bool:
        return self.name is not None


def probe_scores(faces: np.ndarray, templates: np.ndarray) -> np.ndarray:
    """A probe's score against each template (the rows of `templates`, or one template): the mean over its faces
    of their cosine to it. Calibration is set on its single-face case, so a threshold means the same for one face
    or several."""
    return (faces @ np.atleast_2d(templates).T).mean(0)


def templates_of(people: list[Person]) -> np.ndarray:
    """The people's templates as rows, in `people`'s order: what every score against several people is taken on."""
    return np.stack([p.template for p in people])


class Verifier:
    """Decides at the device's calibrated threshold, raised for a person whom strangers resemble
    (`edge_client.person_threshold`), or at `threshold` for everyone when a call gives its own."""

    def __init__(self, recognizer: Recognizer, threshold: float | None = None):
        self.recognizer = recognizer
        self.threshold = recognizer.threshold if threshold is None else float(threshold)
        self.threshold_note = recognizer.threshold_note if threshold is None else GIVEN
        self._calibration = recognizer.settings.calibration if threshold is None else None

    def threshold_for(self, template: np.ndarray) -> float:
        """The threshold a score against this template is decided at."""
        if self._calibration is None:
            return self.threshold
        return float(self._calibration.thresholds_for(template)[0])

    def verify(self, embeddings: np.ndarray, person: Person, live: bool | None = None) -> Answer:
        """Is this probe (one or more faces of one person) `person`? `live` False refuses whatever the score."""
        score = float(probe_scores(embeddings, person.template)[0])
        return self._answer(person, score, live)

    def identify(self, embeddings: np.ndarray, people: list[Person], live: bool | None = None) -> Answer:
        """Which enrolled person is this probe (one or more faces of one person), if anyone?"""
        scores = self.scores(embeddings, people)
        best = int(np.argmax(scores))
        return self._answer(people[best], float(scores[best]), live)

    def each(self, embeddings: np.ndarray, people: list[Person]) -> list[Answer]:
        """Each face on its own (a group photo answered face by face, as face_recognition does): one product with the
        templates for all of them, as `watch` needs on every frame."""
        if not len(embeddings):
            return []
        scores = embeddings @ templates_of(people).T
        best = np.argmax(scores, axis=1)
        return [self._answer(people[b], float(row[b]), None) for b, row in zip(best, scores)]

    def count_matches(self, faces: np.ndarray, template: np.ndarray) -> int:
        """How many of these faces, each on its own, the template accepts (enrolment checks a new template so)."""
        return int(np.sum(faces @ template > self.threshold_for(template))) if len(faces) else 0

    def scores(self, embeddings: np.ndarray, people: list[Person]) -> np.ndarray:
        """The probe's score against each person, in `people`'s order."""
        return probe_scores(embeddings, templates_of(people))

    def _answer(self, closest: Person, score: float, live: bool | None) -> Answer:
        """The one comparison every answer comes from: above the person's threshold, not at it."""
        threshold = self.threshold_for(closest.template)
        accepted = score > threshold and live is not False
        return Answer(closest.name if accepted else None, score, closest.name, threshold)


def usable_faces(bgr: np.ndarray, detector, gate: FaceQuality, recognizer: Recognizer
                 ) -> tuple[list[FaceCheck], np.ndarray]:
    """Every face in a photo, largest first, each checked on its own, and the embeddings of those that passed (in the
    order of the passing checks)."""
    checks = every_face(bgr, detector, gate)
    crops = [c.crop for c in checks if c.crop is not None]
    return checks, (recognizer.embed(np.stack(crops)) if crops else np.zeros((0, 0), np.float32))
