"""Liveness by challenge (`edge_client.liveness`), measured: attack clips made from enrolled people's still photos,
and live clips, through the same landmark detector the device uses (YuNet).

    python -m bench.liveness --out bench/results [--data DIR] [--people 60] [--trials 5]

For each person and trial, a random two-turn challenge (seeded) and
  - **printed photo** (attack): the person's most frontal photo as a flat print held up to the camera: moved,
    turned in its plane (up to 25 degrees), brought closer and further, and tilted in perspective about a random
    axis (up to 45 degrees), smoothly over 120 frames;
  - **two photos shown in turn** (attack): prints of the person turned each way, held up one after the other in the
    asked order. This is the limit of a challenge of turns: photos of the turns themselves pass it;
  - **live** (bona fide): the person's most frontal photo, then their most turned photo, or its mirror image, on the
    asked side: a real head's 3D turn, as far as the person's photos turn (they were not taken as deliberate turns:
    a person whose photos turn less than the bar fails here, and that is most of this BPCER).
APCER (attacks accepted) per attack kind and BPCER (live clips refused), ISO/IEC 30107-3's terms.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import cv2
import numpy as np

from bench.common import face_set, result_name, write_results
from edge_client.capture import device_detector
from edge_client.liveness import MOVES, TURN, follow, new_challenge, yaw

FRAME = (480, 640)


def _canvas(photo: np.ndarray) -> np.ndarray:
    """A camera-like frame with the photo in the middle, as large as fits (as tests/test_device.py's frames)."""
    scale = min(FRAME[1] / photo.shape[1], FRAME[0] / photo.shape[0], 3.0)
    image = cv2.resize(photo, None, fx=scale, fy=scale, interpolation=cv2.INTER_LINEAR)
    canvas = np.full((*FRAME, 3), 96, np.uint8)
    h, w = image.shape[:2]
    y0, x0 = (FRAME[0] - h) // 2, (FRAME[1] - w) // 2
    canvas[y0:y0 + h, x0:x0 + w] = image
    return canvas


def printed(frame: np.ndarray, t: float, axis: float, tilt: float) -> np.ndarray:
    """The frame as a flat print at time t in [0, 1]: moved, turned in plane, scaled, tilted in perspective."""
    h, w = frame.shape[:2]
    angle = 25 * np.sin(2 * np.pi * t)
    scale = 1 + 0.3 * np.sin(4 * np.pi * t)
    centre = (w / 2 + 60 * np.sin(2 * np.pi * t + 1), h / 2 + 40 * np.cos(2 * np.pi * t))
    affine = cv2.getRotationMatrix2D(centre, angle, scale)
    moved = cv2.warpAffine(frame, affine, (w, h), borderValue=(96, 96, 96))
    phi = np.radians(tilt * np.sin(np.pi * t))  # the print turned away about an axis at angle `axis` in its plane
    along, across = np.array([np.cos(axis), np.sin(axis)]), np.array([-np.sin(axis), np.cos(axis)])
    corners = np.float32([[0, 0], [w, 0], [w, h], [0, h]])
    centred = corners - [w / 2, h / 2]
    a, c = centred @ along, centred @ across
    depth, f = c * np.sin(phi), 800.0  # the across-axis part leaves the plane; a pinhole camera at f pixels
    projected = (np.outer(a, along) + np.outer(c * np.cos(phi), across)) * (f / (f + depth))[:, None]
    warp = cv2.getPerspectiveTransform(corners, np.float32(projected + [w / 2, h / 2]))
    return cv2.warpPerspective(moved, warp, (w, h), borderValue=(96, 96, 96))


def landmarks_of(detector, frames: list[np.ndarray]) -> list:
    out = []
    for frame in frames:
        boxes = detector.detect(cv2.cvtColor(frame, cv2.COLOR_BGR2RGB))
        out.append(max(boxes, key=lambda b: b.area).landmarks if boxes else None)
    return out


def person_poses(detector, photos: list[Path]) -> list[tuple[float, np.ndarray]]:
    """(yaw, camera frame) of each photo the detector finds landmarks in."""
    poses = []
    for path in photos:
        frame = _canvas(cv2.imread(str(path)))
        (marks,) = landmarks_of(detector, [frame])
        if marks is not None:
            poses.append((yaw(marks), frame))
    return poses


def turned(poses: list[tuple[float, np.ndarray]], side: str) -> np.ndarray:
    """The person turned to `side` as far as their photos go: the most turned photo, mirrored if it turns the
    other way (a mirror image of a real head's turn is a real head's turn the other way)."""
    value, frame = max(poses, key=lambda p: abs(p[0]))
    return frame if np.sign(value) == MOVES[side] else frame[:, ::-1].copy()


def trial(detector, poses, challenge: list[str], rng: np.random.Generator) -> dict[str, bool]:
    """Whether each clip passes the challenge."""
    frontal = min(poses, key=lambda p: abs(p[0]))[1]
    axis, tilt = rng.uniform(0, np.pi), rng.uniform(15, 45)
    prints = [printed(frontal, i / 119, axis, tilt) for i in range(120)]
    shown = [frontal] * 5 + [f for side in challenge for f in [turned(poses, side)] * 10 + [frontal] * 5]
    live = [frontal] * 5 + [f for side in challenge for f in [turned(poses, side)] * 3 + [frontal] * 3]
    # the "two photos" attack: prints of the turned photos, i.e. the same frames as the live clip's turns, flat
    flat = [printed(f, 0.0, axis, 0.0) for f in shown]
    return {"printed photo": follow(challenge, landmarks_of(detector, prints)).passed,
            "two photos shown in turn": follow(challenge, landmarks_of(detector, flat)).passed,
            "live": follow(challenge, landmarks_of(detector, live)).passed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path,
                   help="photos, one folder per person (default: $FFR_FACES_DIR/celeba_subset: in-the-wild photos, "
                        "many turned)")
    p.add_argument("--people", type=int, default=60, help="people tried, at most (default 60)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", type=result_name, default="liveness")
    p.add_argument("--trials", type=int, default=5, help="challenges per person (default 5)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    data = face_set(args.data)
    if data is None:
        return 2
    detector, rng, pick = device_detector("auto"), np.random.default_rng(args.seed), random.Random(args.seed)
    outcomes: dict[str, list[bool]] = {"printed photo": [], "two photos shown in turn": [], "live": []}
    people = sorted(p for p in Path(data).iterdir() if p.is_dir())[:args.people]
    for person in people:
        poses = person_poses(detector, sorted(f for f in person.iterdir() if f.is_file()))
        if len(poses) < 2:
            continue
        for _ in range(args.trials):
            for kind, passed in trial(detector, poses, new_challenge(pick), rng).items():
                outcomes[kind].append(passed)
    rows = [{"clips": kind, "n": len(v), "accepted": int(np.sum(v)),
             "rate": (f"APCER {np.mean(v):.3f}" if kind != "live" else f"BPCER {1 - np.mean(v):.3f}")}
            for kind, v in outcomes.items()]
    result = {"people": len(people), "trials": args.trials, "turn": TURN,
              "apcer": {k: float(np.mean(v)) for k, v in outcomes.items() if k != "live"},
              "bpcer": float(1 - np.mean(outcomes["live"]))}
    command = "python -m bench.liveness " + " ".join(sys.argv[1:] if argv is None else argv)
    write_results(args.out, args.name, result, rows, f"Liveness by challenge on {Path(data).name}: attacks from "
                  f"still photos and live clips, {args.trials} challenges per person", command)
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
