"""Verification quality of centralised training on the real face sets, on identities never trained on.

python -m bench.verify_quality --out bench/results [--sets orl glint24_aligned] [--epochs 10]
For each set: identities split 70/30 (seeded); each (head, augmentation) trains on the 70%
with the real `ffr train` trainer and is measured on the held-out 30%: AUC, EER, TAR@FAR.
The untrained ImageNet embedder is the first row of every set, so learning shows as a gain.
Reads the sets from $FFR_FACES_DIR (../shared/faces by default); never copies them.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench.common import faces_dir, write_results
from models.faces.crops import CropConfig, crop_index
from models.faces.datasets import load_index
from models.faces.splits import training_split
from models.training import TrainConfig, Trainer, build_model, verification

# how each set is cropped: photos need detection; aligned or pre-framed sets do not
SETS = {
    "orl": CropConfig(detector="haar", fallback_center=True),
    "extended_yale_b": CropConfig(detector="none"),
    "glint24_aligned": CropConfig(detector="none"),
    "celeba_subset": CropConfig(detector="haar", fallback_center=True),
}
COMBOS = [("softmax", "weak"), ("cosface", "weak"), ("arcface", "weak"),
          ("softmax", "strong"), ("cosface", "strong"), ("arcface", "strong")]


def row(set_name: str, head: str, aug: str, report: dict, seconds: float, epochs: int) -> dict:
    tar = report.get("tar_at_far", {})
    return {"set": set_name, "head": head, "aug": aug, "epochs": epochs, "auc": report.get("auc"),
            "eer": report.get("eer"), "tar@far=1e-1": tar.get("0.1"), "tar@far=1e-2": tar.get("0.01"),
            "tar@far=1e-3": tar.get("0.001"), "genuine/impostor pairs":
                f"{report.get('n_genuine_pairs')}/{report.get('n_impostor_pairs')}", "train_s": round(seconds)}


def bench_set(name: str, root: Path, args, runs_dir: Path) -> list[dict]:
    crops = crop_index(load_index(root), SETS[name], progress=True, min_images=2)
    split = training_split(crops, holdout_fraction=0.3, val_fraction=0.1, seed=args.seed)
    print(f"{name}: {len(split.train)} training images of {split.n_classes} identities; held out "
          f"{len(split.holdout)} images of {len(split.holdout.identities)} identities; "
          f"{crops.report.faces_not_detected} faces not detected", flush=True)
    base = build_model(TrainConfig(), split.train)
    rows = [row(name, "untrained (ImageNet)", "-", verification(base, split.holdout, args.max_pairs, args.seed)[0], 0, 0)]
    for head, aug in COMBOS:
        if args.heads and head not in args.heads or args.augs and aug not in args.augs:
            continue
        config = TrainConfig(epochs=args.epochs, head=head, aug=aug, lr=args.lr, batch_size=32, seed=args.seed,
                             patience=10, progress=False, max_eval_pairs=args.max_pairs)
        start = time.perf_counter()
        metrics = Trainer(config, split, runs_dir / name / f"{head}-{aug}").fit()
        rows.append(row(name, head, aug, metrics["final"], time.perf_counter() - start, metrics["epochs_run"]))
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--heads", nargs="+", choices=("softmax", "cosface", "arcface"))
    parser.add_argument("--augs", nargs="+", choices=("weak", "strong"))
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-pairs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    root = faces_dir()
    if root is None:
        print("no face data: set FFR_FACES_DIR to the folder holding orl/, celeba_subset/, ...", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    rows = []
    for name in args.sets:
        rows += bench_set(name, root / name, args, args.out / "quality_runs")
    command = "python -m bench.verify_quality " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(args.out, "verify_quality_" + "_".join(args.sets), {"epochs": args.epochs, "lr": args.lr}, rows,
                  "Verification on held-out identities after centralised training", command.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
