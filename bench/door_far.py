"""Does a device's door keep the false-accept rate it promises? Many simulated devices, calibrated as a device is.

A device calibrates its threshold on its own people and on public faces of nobody it knows, moved to its own
capture (`edge_client.recognizer.calibrate`); it then promises a FAR (1e-3 unless its owner chose another) to
strangers it has never seen. A handful of devices says little about that promise: one stranger who resembles one
of a device's people moves its FAR by several times (in the two-device `serve` run, 10 of one stranger's 21 photos
matched one enrolled person). So this bench draws many devices of a few people each from a labelled set, holds
out a quarter of each person's images as the door's own test, calibrates on the rest as the device does after a
round (`check_split`, templates from all enrolment images, public faces), and tries every image of people of no
device on each door. Per device size: the FAR it keeps (mean over devices, median, the 90th percentile, the worst),
the share of devices over twice the promise and, on those, the share of their false accepts one stranger made (near
1: a lookalike), and the TAR of its own people at that threshold. The share over twice the promise is also given
beyond each door's 95% interval over its strangers (`fleet.doors`), and for an oracle door: one whose threshold is
set on every other person of the set (the people of no device, no stranger and no public set) against its templates,
so its FAR over all of them is the promise; what it measures on the strangers shows how much of "over 2x" the
sampling of a few dozen strangers makes alone. `--public-people N` serves each device N people of the set instead
of the public faces, as `ffr fleet simulate` does by default. Each door decides as the device does, at each enrolled
person's own threshold (`edge_client.person_threshold`).

    python -m bench.door_far --out bench/results [--people 3 8 20] [--devices 200] [--public-people 12]
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import face_set, faces_dir, result_name, write_results
from edge_client.recognizer import normalise, template_of
from edge_client.verifier_choice import DEFAULT_FAR, check_split
from fleet.doors import DoorFaces, door, over_promise
from models.evaluation.thresholds import threshold_at_far

TEST_SHARE = 0.25  # of each person's images, kept out of enrolment and calibration: the door's own test


@dataclass
class Faces:
    """Unit embeddings of a labelled set and of the public faces, under one model."""

    embeddings: np.ndarray
    labels: np.ndarray
    public: np.ndarray


def one_door(faces: Faces, people: np.ndarray, strangers: np.ndarray, public: np.ndarray, far: float,
             rng: np.random.Generator, others: np.ndarray | None = None) -> dict | None:
    """A device holding `people`: enrolled on three quarters of each person's images, its door (`fleet.doors.door`,
    the embeddings standing in for images) tried on its people's last quarter and on every image of `strangers`;
    with `others` (people of the set in no other role), the oracle door's FAR on the strangers too (`far_oracle`).
    None when it cannot be calibrated (fewer than two people with enough images)."""
    enrolled, tests = [], []
    for person in people:
        rows = rng.permutation(np.flatnonzero(faces.labels == person))
        cut = max(1, round(TEST_SHARE * len(rows))) if len(rows) >= 4 else 0
        tests.append(rows[:cut])
        enrolled.append(rows[cut:])
    own, test = np.concatenate(enrolled), np.concatenate(tests)
    labels = np.searchsorted(people, faces.labels[own])
    seen = np.flatnonzero(np.isin(faces.labels, strangers))
    door_faces = DoorFaces(faces.embeddings[own], labels, check_split(labels, int(rng.integers(1 << 30))),
                           faces.embeddings[test], np.searchsorted(people, faces.labels[test]),
                           faces.embeddings[seen], public, faces.labels[seen])
    row = door(lambda embeddings: embeddings, door_faces, far)
    if row is not None and others is not None and len(others):
        templates = np.stack([template_of(faces.embeddings[own][labels == k]) for k in range(len(people))])
        threshold, _ = threshold_at_far((faces.embeddings[np.isin(faces.labels, others)] @ templates.T).ravel(), far)
        row["far_oracle"] = float(np.mean(faces.embeddings[seen] @ templates.T > threshold))
    return row


def doors(faces: Faces, size: int, devices: int, strangers: int, public: int, far: float, seed: int,
          public_people: int = 0) -> list[dict]:
    """`devices` devices of `size` people each, drawn at random; each with its own strangers (`strangers` people
    of no device) and its own draw of `public` public faces, or every face of `public_people` people of the set."""
    rng = np.random.default_rng(seed)
    everyone = np.unique(faces.labels)
    rows = []
    for _ in range(devices):
        drawn = rng.permutation(everyone)
        cut = size + strangers + public_people
        if public_people:
            seen = faces.embeddings[np.isin(faces.labels, drawn[size + strangers:cut])]
        else:
            seen = faces.public[rng.choice(len(faces.public), min(public, len(faces.public)), replace=False)]
        row = one_door(faces, np.sort(drawn[:size]), np.sort(drawn[size:size + strangers]), seen, far, rng,
                       drawn[cut:])
        if row is not None:
            rows.append(row)
    return rows


def summary(rows: list[dict], far: float) -> dict:
    """What the promise is worth over these devices."""
    kept = np.array([r["far"] for r in rows])
    verdicts = [over_promise({**r, "far_promised": far}) for r in rows]  # this summary's promise
    over = [r for r, (is_over, _) in zip(rows, verdicts) if is_over]
    beyond = [r for r, (_, is_beyond) in zip(rows, verdicts) if is_beyond]
    oracle = np.array([r["far_oracle"] for r in rows if r.get("far_oracle") is not None])
    tar = [r["tar"] for r in rows if r["tar"] is not None]
    return {"devices": len(rows), "far_promised": far, "far_mean": float(kept.mean()),
            "far_median": float(np.median(kept)), "far_p90": float(np.percentile(kept, 90)),
            "far_worst": float(kept.max()), "share_over_2x": len(over) / len(rows),
            "share_beyond_2x": len(beyond) / len(rows),
            "oracle_far_mean": float(oracle.mean()) if len(oracle) else None,
            "oracle_share_over_2x": float(np.mean(oracle > 2 * far)) if len(oracle) else None,
            "over_2x_top_stranger_share": float(np.mean([r["top_stranger_share"] for r in over])) if over else None,
            "tar_mean": float(np.mean(tar)) if tar else None,
            "threshold_mean": float(np.mean([r["threshold"] for r in rows])),
            "capture_shift_mean": float(np.mean([r["capture_shift"] for r in rows]))}


def embed_sets(data: Path, public_dir: Path, public_limit: int, seed: int) -> Faces:
    """The labelled set cropped as a device crops (`ffr device enroll`'s detector) and the public faces read as
    `ffr edge public-set` reads them, embedded by the shipped model."""
    from bench.personalisation import public_images
    from fleet.evaluation import embed
    from models.faces.crops import CropConfig, crop_index
    from models.faces.datasets import load_index
    from models.networks.face_model import global_embedder, initial_global_state

    crops = crop_index(load_index(data), CropConfig(detector="auto", fallback_center=True), progress=False)
    public = public_images(public_dir, public_limit, seed)
    model = global_embedder(initial_global_state())
    return Faces(normalise(embed(model, crops.images)), crops.labels, normalise(embed(model, public)))


def main(argv: list[str] | None = None) -> int:
    from models.public_set import HELD_SHARE

    served = round(2000 * (1 - HELD_SHARE))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, help="labelled faces (default: $FFR_FACES_DIR/celeba_subset)")
    p.add_argument("--public-faces", type=Path,
                   help="faces of nobody's people (default: $FFR_FACES_DIR/celebahq_aligned)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", type=result_name, default="door_far")
    p.add_argument("--people", type=int, nargs="+", default=[3, 8, 20], help="people per device (default 3 8 20)")
    p.add_argument("--devices", type=int, default=200, help="simulated devices per size (default 200)")
    p.add_argument("--strangers", type=int, default=60, help="people of no device tried on each door (default 60)")
    p.add_argument("--public-limit", type=int, default=2000,
                   help="public faces read: an operator's public set (default 2000, `ffr edge public-set`'s)")
    p.add_argument("--public", type=int, default=served,
                   help=f"of them, the faces each device calibrates on (default {served}: what `ffr coordinator "
                        "serve` serves of 2,000 after keeping its gate's share)")
    p.add_argument("--public-people", type=int, default=0,
                   help="serve each device every face of this many people of --data instead of --public-faces "
                        "(as `ffr fleet simulate` serves 20%% of the people on no device; default 0: public faces)")
    p.add_argument("--far", type=float, default=DEFAULT_FAR,
                   help=f"the FAR each door promises (default {DEFAULT_FAR:g})")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.public_people < 0:
        p.error(f"--public-people is a number of people, at least 0 (got {args.public_people})")
    data = face_set(args.data)
    public_dir = args.public_faces or ((faces_dir() or Path("missing")) / "celebahq_aligned")
    if data is None or not public_dir.is_dir():
        print(f"need labelled faces and public faces (no folder at {public_dir})", file=sys.stderr)
        return 2
    faces = embed_sets(data, public_dir, args.public_limit, args.seed)
    results = {"sizes": {}}
    for size in args.people:
        rows = doors(faces, size, args.devices, args.strangers, args.public, args.far, args.seed + size,
                     args.public_people)
        if rows:
            results["sizes"][str(size)] = {"summary": summary(rows, args.far), "devices": rows}
    table = [{"people per device": size, **{k: v for k, v in r["summary"].items() if k != "far_promised"}}
             for size, r in results["sizes"].items()]
    write_results(args.out, args.name, results, table,
                  f"The door's promise: FAR {args.far:g} on strangers over {args.devices} simulated devices per size "
                  f"({data.name}, public faces from "
                  f"{f'{args.public_people} people of the set' if args.public_people else public_dir.name}, "
                  "the shipped model)",
                  "python -m bench.door_far " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
