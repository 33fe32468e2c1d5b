"""The distillation ratchet's gate: a candidate embedder replaces the shipped one only if it is better on every set.

python -m bench.ratchet --candidate RUN_DIR/embedder.safetensors [--ship]

Issue 27's rule, measured as `bench.verify_quality` measures (the labelled sets' held-out 30% of people, seed 0,
all genuine pairs, the same impostor pairs): the shipped weights and the candidate side by side on every set and
every crop kind (aligned or given; Haar squares too for photo sets). The candidate is better only if its AUC is
higher on every row. Each row also gives the 95% interval of the AUC gain (a paired bootstrap over the held-out
people), so that a verdict decided by noise (ORL holds out 12 people) can be seen as such; the rule does not use it.
With `--ship` a better candidate becomes `models/weights/face_embedder.safetensors` (fp16,
at most 5 MB) and its sha256 is recorded in `models.networks.face_weights.SHIPPED_SHA256`; the model card's
figures are then the next thing to rewrite (`python -m bench.verify_quality`). Every verdict is kept in
`bench/results/ratchet.json` (its history) and the latest table in `ratchet.md`.

`--mirrored` scores both files as a device's ONNX file embeds a face (averaged with its mirror image,
`models.networks.mirror`) instead of one view: the function devices run, and the fair view of a candidate distilled
toward the mirror-averaged teacher (`ffr pretrain --mirrored-teacher`). The history records which way each verdict
was measured.

`--ship --override REASON` ships a candidate the rule turned down: a person's call, recorded with its reason in the
history, never the automatic path. Even then nothing ships from a part of the sets, nor with a row whose gain
interval lies wholly below zero (a measured loss, not noise).
"""
from __future__ import annotations

import argparse
import hashlib
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

from bench.common import add_made_by, faces_dir, result_name, write_results
from bench.held_out_sets import SETS, crop_kinds, d_auc_interval, held_out_pairs
from bench.verify_quality import measure, ours
from edge_client.recognizer import DEFAULT_THRESHOLD
from models.networks import face_weights
from protocol.json_file import json_object, read_json

MAX_BYTES = 5 * 1024 * 1024


def load_candidate(path: Path) -> torch.nn.Module:
    """The candidate as a FaceEmbedder (`face_weights.checked_embedder`), refused in one line otherwise."""
    if not path.is_file():
        raise SystemExit(f"bench.ratchet: no candidate at {path}")
    try:
        return face_weights.checked_embedder(path)
    except ValueError as exc:
        raise SystemExit(f"bench.ratchet: {exc}") from None


def _history(raw: object) -> list[dict]:
    """`read_json`'s build: a ratchet result's list of verdicts, nothing else."""
    history = json_object(raw).get("history")
    if not isinstance(history, list) or not all(isinstance(entry, dict) for entry in history):
        raise ValueError("no list of verdicts under 'history'")
    return history


def verdict_history(path: Path) -> list[dict]:
    """The verdicts kept in a results file so far, read before measuring (`protocol.json_file`, as every file read
    back): a file there that is not a ratchet's (another bench's, or damaged) is refused in one line rather than
    overwritten with its contents lost."""
    if not path.is_file():
        return []
    try:
        return read_json(path, "bench.ratchet", "it holds no verdict history and is left as it is: choose another "
                         "--name or --out", _history)
    except ValueError as exc:
        raise SystemExit(f"bench.ratchet: {exc}") from None


def compare_set(name: str, root: Path, shipped, candidate, seed: int, max_pairs: int, mirror: bool = False
                ) -> list[dict]:
    """Both embedders on the set's held-out people, the same pairs, each crop kind the quality bench uses."""
    rows = []
    for crop_name, config in crop_kinds(name):
        held, pairs, same = held_out_pairs(root, config, seed, max_pairs)
        scores_before, scores_after = ours(shipped, held, pairs, mirror), ours(candidate, held, pairs, mirror)
        before, after = measure(scores_before, same), measure(scores_after, same)
        low, high = d_auc_interval(same, np.asarray(held.labels)[pairs], scores_before, scores_after, seed=seed)
        rows.append({"set": name, "crops": crop_name, "identities": len(held.identities),
                     "shipped_auc": before["auc"], "candidate_auc": after["auc"],
                     "d_auc": after["auc"] - before["auc"], "d_auc_95%_low": low, "d_auc_95%_high": high,
                     "shipped_eer": before["eer"],
                     "candidate_eer": after["eer"], "shipped_tar@1e-3": before["tar@far=1e-3"],
                     "candidate_tar@1e-3": after["tar@far=1e-3"],
                     # what a device accepts before `ffr device calibrate` has run
                     "shipped_far@uncalibrated": accepted(scores_before, ~same),
                     "candidate_far@uncalibrated": accepted(scores_after, ~same)})
        print(rows[-1], flush=True)
    return rows


def accepted(scores: np.ndarray, chosen: np.ndarray) -> float:
    """The share of the chosen pairs a device accepts at its uncalibrated threshold (`DEFAULT_THRESHOLD`; a match
    is a score above it, as `ffr device verify` decides)."""
    return float((np.asarray(scores)[chosen] > DEFAULT_THRESHOLD).mean())


def better_everywhere(rows: list[dict]) -> bool:
    return bool(rows) and all(r["candidate_auc"] > r["shipped_auc"] for r in rows)


def override_refused(rows: list[dict], complete: bool) -> str | None:
    """Why a person's override may not ship this candidate, or None: never from a part of the sets, never over a
    row whose 95% interval of the AUC gain lies wholly below zero (a loss that is not noise)."""
    if not complete:
        return "only some sets were measured"
    losses = [f"{r['set']} / {r['crops']}" for r in rows if r["d_auc_95%_high"] < 0]
    return f"a measured loss on {', '.join(losses)}" if losses else None


def ship(candidate: torch.nn.Module, source: Path, target: Path = face_weights.SHIPPED_WEIGHTS,
         module: Path = Path(face_weights.__file__)) -> str:
    """Write the candidate as the shipped file `target` (fp16, the shipped format) and its sha256 into `module`'s
    SHIPPED_SHA256 line; returns the sha256. Nothing changes unless both can be written."""
    _, metadata = face_weights.read_embedder_numpy(source)
    tmp = target.with_name("candidate.safetensors")
    face_weights.save_embedder(tmp, candidate, {**metadata, "ratchet_source": source.name})
    if tmp.stat().st_size > MAX_BYTES:
        tmp.unlink()
        raise SystemExit(f"bench.ratchet: the candidate is {tmp.stat().st_size} bytes, over the 5 MB the project keeps")
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    text, count = re.subn(r'^SHIPPED_SHA256 = "[0-9a-f]{64}"$', f'SHIPPED_SHA256 = "{digest}"',
                          module.read_text(), flags=re.MULTILINE)
    if count != 1:
        tmp.unlink()
        raise SystemExit(f"bench.ratchet: {module} does not hold exactly one SHIPPED_SHA256 line; nothing shipped")
    tmp.replace(target)
    module.write_text(text)
    return digest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--candidate", required=True, type=Path, help="an embedder file (`ffr pretrain`'s output)")
    parser.add_argument("--ship", action="store_true", help="replace the shipped weights if better on every set")
    parser.add_argument("--override", metavar="REASON",
                        help="with --ship: ship even if not better on every set, recording REASON; refused when "
                             "a row's gain interval lies wholly below zero or only some sets were measured")
    parser.add_argument("--mirrored", action="store_true",
                        help="embed each face averaged with its mirror, as a device's ONNX file does (default: one "
                             "view, as every verdict before it)")
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", type=result_name, default="ratchet",
                        help="results as OUT/NAME.json and .md; the verdict history is kept in that file")
    add_made_by(parser)
    parser.add_argument("--max-pairs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.override is not None and (not args.ship or not args.override.strip()):
        parser.error("--override takes a reason and goes with --ship")
    root = faces_dir()
    if root is None:
        print("no face data: set FFR_FACES_DIR to the folder holding orl/, celeba_subset/, ...", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    history = verdict_history(args.out / f"{args.name}.json")
    candidate = load_candidate(args.candidate)
    shipped_sha = face_weights.SHIPPED_SHA256
    shipped = face_weights.load_face_embedder(face_weights.shipped_weights()).eval()
    rows = [r for name in args.sets for r in compare_set(name, root / name, shipped, candidate, args.seed,
                                                         args.max_pairs, args.mirrored)]
    views = "mirror-averaged" if args.mirrored else "one view"
    better = better_everywhere(rows) and set(args.sets) == set(SETS)
    verdict = ("better on every set" if better else "not better on every set: the shipped weights stay"
               if set(args.sets) == set(SETS) else "measured on some sets only: never shipped from a part")
    refused = override_refused(rows, set(args.sets) == set(SETS)) if args.override and not better else None
    if refused:
        print(f"bench.ratchet: no override: {refused}", file=sys.stderr)
    overridden = args.override is not None and not better and refused is None
    if overridden:
        verdict = f"not better on every set; shipped over the rule by hand: {args.override.strip()}"
    shipped_now = ship(candidate, args.candidate) if (better or overridden) and args.ship else None
    history.append({"candidate": str(args.candidate), "candidate_sha256": face_weights.file_sha256(args.candidate),
                    "shipped_sha256": shipped_sha, "verdict": verdict, "shipped_now": shipped_now,
                    "override": args.override if overridden else None, "views": views, "made_by": args.made_by,
                    "d_auc": {f"{r['set']} / {r['crops']}": round(r["d_auc"], 5) for r in rows}})
    command = "python -m bench.ratchet " + shlex.join(argv if argv is not None else sys.argv[1:])
    write_results(args.out, args.name, {"verdict": verdict, "history": history}, rows,
                  f"Ratchet: candidate vs shipped weights on held-out people ({views}): {verdict}"
                  + (f"; shipped as {shipped_now[:16]}..." if shipped_now else ""), command, args.made_by)
    if shipped_now:
        print(f"shipped: {face_weights.SHIPPED_WEIGHTS} (sha256 {shipped_now}); now rerun "
              "`python -m bench.verify_quality --out bench/results` and update models/weights/MODEL_CARD.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
