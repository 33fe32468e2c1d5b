"""Distillation recipes side by side on one fixed CPU budget (issue: "more from each sample").

python -m bench.distill_arms --budget-minutes 5 --max-images 4000 --out bench/results

Every arm starts from the shipped weights, reads the same images (a fixed random subset of the
aligned UTKFace + All-Age-Faces crops) and trains for the same training time (`--budget-minutes`,
the learning rate decaying over it), one after the other in one run:
  (a) cosine: today's loss (1 - cos + 2 x batch pairwise similarity), 2 cached views;
  (b) bank: relational KD against a memory bank of every cached teacher view, hardness-weighted;
  (c) cosine with 8 cached views (the image, its mirror, 6 geometric jitters);
  (b+c) bank with 8 cached views;
  (a4) cosine with 4 cached views (the image, its mirror, 2 jitters);
  (d) (a4) with progressive resolution: the student at 96 px for the first 3/4 of the budget (about twice the
      steps per second), then at the deployed 128 px.
Filling the teacher cache is reported apart (done once per data set, then reused by every run).
Reported per arm: held-out cosine to the teacher and Glint24 AUC (all 24 people, never in the data) at the end,
the issue's target figures (Glint24's and CelebA's held-out AUC, the people `bench.verify_quality` holds out,
CelebA aligned by YuNet), and each one's change from the shipped weights per CPU-hour of training.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.common import faces_dir, result_name, write_results
from bench.held_out_sets import crop_kinds, held_out_pairs
from bench.ratchet import load_candidate
from bench.verify_quality import measure, ours
from models.networks.face_weights import shipped_weights

ARMS = {"a: cosine, 2 views": ["--loss", "cosine", "--views", "2"],
        "b: bank, 2 views": ["--loss", "bank", "--views", "2"],
        "c: cosine, 8 views": ["--loss", "cosine", "--views", "8"],
        "b+c: bank, 8 views": ["--loss", "bank", "--views", "8"],
        "a4: cosine, 4 views": ["--loss", "cosine", "--views", "4"],
        "d: cosine, 4 views, 96 px then 128 px": ["--loss", "cosine", "--views", "4", "--low-res", "96",
                                                  "--low-res-fraction", "0.75"]}
DEFAULT_ARMS = ["a: cosine, 2 views", "b: bank, 2 views", "c: cosine, 8 views", "b+c: bank, 8 views"]


# the sets issue 27's targets name, each cut as bench.verify_quality cuts it (its first crop kind)
TARGET_SETS = {"glint24_heldout_auc": "glint24_aligned", "celeba_heldout_auc": "celeba_subset"}


def target_people(faces: Path, seed: int = 0, max_pairs: int = 100_000) -> dict[str, tuple]:
    """Each target set's held-out people with their pairs, cut once and shared by every arm."""
    return {key: held_out_pairs(faces / name, crop_kinds(name)[0][1], seed, max_pairs)
            for key, name in TARGET_SETS.items()}


def target_aucs(model, people: dict[str, tuple]) -> dict[str, float]:
    return {key: measure(ours(model, held, pairs), same)["auc"] for key, (held, pairs, same) in people.items()}


def run_arm(name: str, args, data: list[Path], eval_set: Path) -> dict:
    from ffr.cli import main

    out = args.work / name.split(":")[0].replace("+", "")
    subset = ["--max-images", str(args.max_images)] if args.max_images else []
    argv = ["-q", "pretrain", *[a for d in data for a in ("--data", str(d))], "--out", str(out), "--force",
            "--init", "face", "--epochs", "1000", "--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps),
            "--threads", str(args.threads), *subset, *ARMS[name], "--budget-minutes", str(args.budget_minutes),
            "--eval-data", str(eval_set), "--cache-dir", str(args.cache_dir)]
    start = time.time()
    if main(argv) != 0:
        raise SystemExit(f"arm {name} failed")
    metrics = json.loads((out / "metrics.json").read_text())
    return {"metrics": metrics, "wall_s": time.time() - start, "embedder": out / "embedder.safetensors"}


def baseline(args, data: list[Path], eval_set: Path) -> dict:
    """The shipped weights' figures on the same held-out images and eval set (no training)."""
    from models.training.pretraining import PretrainConfig, Pretrainer

    views = min(int(ARMS[name][ARMS[name].index("--views") + 1]) for name in args.arms)  # a cache an arm fills
    config = PretrainConfig(data=[str(d) for d in data], init="face",
                            max_images=args.max_images or None, eval_data=[str(eval_set)], views=views)
    trainer = Pretrainer(config, args.work / "baseline", args.cache_dir, threads=args.threads, progress=False)
    trainer.fill_targets()
    return trainer.evaluate()


def per_cpu_hour(now: dict, start: dict, cpu_h: float) -> dict:
    """Each figure's change from the shipped weights per CPU-hour of training (issue 27's yardstick)."""
    return {f"d_{key}_per_cpu_h": (now[key] - start[key]) / cpu_h for key in now}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-minutes", type=float, default=5.0, help="training time per arm")
    parser.add_argument("--max-images", type=int, default=4000,
                        help="images every arm reads (a fixed subset; 0: all 35,143)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=list(ARMS))
    parser.add_argument("--name", type=result_name, default="distill_arms",
                        help="results file name (NAME.json, NAME.md)")
    parser.add_argument("--work", type=Path, default=Path("runs/distill_arms"))
    parser.add_argument("--cache-dir", type=Path, default=Path(".cache/distill_arms"))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    faces = faces_dir()
    if faces is None:
        print("no face data (set FFR_FACES_DIR)", file=sys.stderr)
        return 2
    data = [faces / "utkface_aligned", faces / "all_age_faces_aligned"]
    eval_set = faces / "glint24_aligned"
    start = baseline(args, data, eval_set)
    people = target_people(faces)
    auc_key = "glint24_aligned_auc"
    start_figures = {"cosine_to_teacher": start["val_teacher_cosine"], "glint24_auc": start[auc_key],
                     **target_aucs(load_candidate(shipped_weights()), people)}
    rows = [{"arm": "shipped weights (start)", "samples": 0, "train_cpu_h": 0.0, **start_figures,
             **{f"d_{key}_per_cpu_h": "" for key in start_figures}, "teacher_fill": ""}]
    detail = {"start": {**start, **start_figures}}
    for name in args.arms:
        result = run_arm(name, args, data, eval_set)
        m, last = result["metrics"], result["metrics"]["history"][-1]
        cpu_h = m["trained_s"] / 3600 * args.threads
        figures = {"cosine_to_teacher": last["val_teacher_cosine"], "glint24_auc": last[auc_key],
                   **target_aucs(load_candidate(result["embedder"]), people)}
        rows.append({"arm": name, "samples": m["samples"], "train_cpu_h": round(cpu_h, 3), **figures,
                     **per_cpu_hour(figures, start_figures, cpu_h),
                     "teacher_fill": f"{m['teacher_embeddings_computed']} embeddings"})
        detail[name] = {"history": m["history"], "wall_s": result["wall_s"], **figures}
    command = "python -m bench.distill_arms " + " ".join(
        f"'{a}'" if " " in a else a for a in (argv if argv is not None else sys.argv[1:]))
    write_results(args.out, args.name, detail, rows,
                  f"Distillation arms, {args.budget_minutes} min of training each on {args.threads} CPU cores, "
                  f"from the shipped weights, {args.max_images or 'all'} images", command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
