"""How far does an honest round move one impostor pair? The bar of the gate's pair check (`worst_pair`).

The per-pair check refuses a candidate when any impostor pair it accepts rose by more than `PAIR_JUMP` (cosine)
since the current model: a face pulled onto another moves one pair far, an honest round moves all of them a little.
The bar must sit above what honest rounds do, or honest rounds are rolled back. This bench reads the published
models of finished honest runs (`ffr fleet simulate` run folders), scores each on faces (the run's own gate faces and
any labelled aligned sets given) and reports, for every round step (v_k -> v_k+1) and for the whole run (v0 -> v_k):
the largest rise of any impostor pair and of one the candidate accepts at the current model's FAR=1e-3 threshold,
the largest rise beyond the median one in robust deviations, the check's bar, and how many pairs it would flag (0
for an honest round).

    python -m bench.pair_jumps --run RUN [--run RUN2] [--faces DIR] --out bench/results
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from bench.common import face_set, result_name, write_results
from coordinator.quality_gate import load_faces
from coordinator.store import Store
from models.evaluation.separation import (
    DEFAULT_LIMIT,
    PAIR_JUMP,
    PAIR_SIGMAS,
    FaceSet,
    Scores,
    pair_excess,
    robust_deviation,
    score,
)
from models.evaluation.thresholds import threshold_at_far

FAR = 1e-3


def jumps(current: Scores, candidate: Scores, far: float = FAR, jump: float = PAIR_JUMP) -> dict:
    """The rises of impostor pair scores from `current` to `candidate`, and what the pair check sees of them: each
    pair's rise beyond the median one, in robust deviations, and the pairs over its bar (`pair_excess`)."""
    threshold, _ = threshold_at_far(current.impostor, far)
    rise = candidate.impostor - current.impostor
    excess, bar = pair_excess(current, candidate, jump)
    spread = robust_deviation(excess)
    accepted = candidate.impostor > threshold
    return {"threshold": float(threshold), "rise_median": float(np.median(rise)), "rise_max": float(rise.max()),
            "accepted_rise_max": float(rise[accepted].max()) if accepted.any() else 0.0,
            "excess_max_in_deviations": float(excess.max() / spread) if spread > 0 else 0.0, "bar": bar,
            "flagged": int((accepted & (excess > bar)).sum()), "pairs": int(len(rise))}


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
    p.add_argument("--name", type=result_name, default="pair_jumps")
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
    worst = max(r["excess_max_in_deviations"] for r in rows)
    command = "python -m bench.pair_jumps " + " ".join(sys.argv[1:] if argv is None else argv)
    title = (f"Honest rounds' impostor-pair rises (pair check: {PAIR_JUMP:g}, or {PAIR_SIGMAS:g} robust deviations "
             f"beyond the median rise; the largest honest excess: {worst:.1f} deviations)")
    write_results(args.out, args.name, {"pair_jump": PAIR_JUMP, "pair_sigmas": PAIR_SIGMAS, "far": FAR,
                                        "worst_excess_in_deviations": worst}, rows, title, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
