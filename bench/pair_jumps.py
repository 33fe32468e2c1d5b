"""How far does an honest round move one impostor pair? The bar of the gate's pair check (`worst_pair`).

The per-pair check refuses a candidate when any impostor pair it accepts rose by more than `PAIR_JUMP` (cosine)
since the current model: a face pulled onto another moves one pair far, an honest round moves all of them a little.
The bar must sit above what honest rounds do, or honest rounds are rolled back. This bench reads the published
models of finished honest runs (`ffr fleet simulate` run folders), scores each on faces (the run's own gate faces and
any labelled aligned sets given) and reports, for every round step (v_k -> v_k+1) and for the whole run (v0 -> v_k):
the largest rise of any impostor pair, of one the candidate accepts at the current model's FAR=1e-3 threshold, and
how many pairs the check at `PAIR_JUMP` would flag (0 for an honest round).

    python -m bench.pair_jumps --run RUN [--run RUN2] [--faces DIR] --out bench/results
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from bench.common import face_set, write_results
from coordinator.quality_gate import load_faces
from coordinator.store import Store
from models.evaluation.separation import DEFAULT_LIMIT, PAIR_JUMP, FaceSet, Scores, score
from models.evaluation.thresholds import threshold_at_far

FAR = 1e-3


def jumps(current: Scores, candidate: Scores, far: float = FAR, bar: float = PAIR_JUMP) -> dict:
    """The rises of impostor pair scores from `current` to `candidate`, and those the pair check looks at."""
    threshold, _ = threshold_at_far(current.impostor, far)
    rise = candidate.impostor - current.impostor
    accepted = candidate.impostor > threshold
    return {"threshold": float(threshold), "rise_sd": float(rise.std()), "rise_max": float(rise.max()),
            "rise_p9999": float(np.quantile(rise, 0.9999)),
            "accepted_rise_max": float(rise[accepted].max()) if accepted.any() else 0.0,
            "flagged": int((accepted & (rise > bar)).sum()), "pairs": int(len(rise))}


def run_rows(run: Path, sets: dict[str, FaceSet]) -> list[dict]:
    """One row per face set and step of this run's published models."""
    store = Store(run / "coordinator")
    versions = [m["version"] for m in store.models()]
    rows = []
    for name, faces in sets.items():
        scored = {v: score(store.load_model(v), faces, threads=None) for v in versions}
        steps = [(a, b) for a, b in zip(versions, versions[1:])] + [(versions[0], v) for v in versions[2:]]
        for a, b in steps:
            rows.append({"run": run.name, "faces": name, "step": f"v{a} -> v{b}", **jumps(scored[a], scored[b])})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, action="append", required=True, help="a finished `ffr fleet simulate` folder")
    p.add_argument("--faces", type=Path, action="append", default=[],
                   help="labelled aligned faces, a folder per person (default: $FFR_FACES_DIR/glint24_aligned)")
    p.add_argument("--limit", type=int, default=DEFAULT_LIMIT, help=f"faces per set (default {DEFAULT_LIMIT})")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", default="pair_jumps")
    args = p.parse_args(argv)
    extra = args.faces or [f for f in [face_set(None, "glint24_aligned")] if f is not None]
    rows = []
    for run in args.run:
        sets = {"gate faces": load_faces(run / "coordinator_faces", args.limit)} \
            if (run / "coordinator_faces").is_dir() else {}
        sets.update({folder.name: load_faces(folder, args.limit) for folder in extra})
        rows += run_rows(run, sets)
    if not rows:
        print("no published model steps to measure", file=sys.stderr)
        return 1
    worst = max(r["accepted_rise_max"] for r in rows)
    write_results(args.out, args.name, {"pair_jump": PAIR_JUMP, "far": FAR, "worst_accepted_rise": worst},
                  rows, f"Honest rounds' largest impostor-pair rises (pair check bar {PAIR_JUMP:g}; worst accepted "
                  f"rise {worst:.3f})", "python -m bench.pair_jumps " + " ".join(sys.argv[1:] if argv is None
                                                                                  else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
