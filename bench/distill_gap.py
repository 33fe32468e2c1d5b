"""Where the student falls short of its teacher: per set, how close its embedding is to the teacher's on the same
faces, and the verification AUC each gives.

    python -m bench.distill_gap --out bench/results [--candidate [LABEL=]FILE ...] [--distillation-data PACK]

Why: more distillation samples close the gap only where the student already sees faces like the ones it is
measured on. If the student agrees with the teacher about as well on a benchmark's people as on the distillation
faces, the shortfall is one of fit (more samples, or a GPU, close it); if it agrees much less there, it is one of
data (faces unlike the benchmark's), and more samples of the same data will not close it.

Rows, per candidate:
  - the distillation faces (default: the unlabelled sets the shipped weights were distilled from, as the GPU kit
    packs them), split again as `ffr pretrain --online` split them with `--seed`: the ones it held out, and a
    sample of those it trained on (the two differ by what the student memorised);
  - each labelled set's held-out people, cut as every quality bench cuts them (`bench.held_out_sets`).
Per row: the mean and 10th percentile of the per-face cosine between student and teacher, each model's AUC on the
set's pairs, and the rank correlation of their pair scores. Sets are read from $FFR_FACES_DIR.
`--mirrored` embeds every face, by student and teacher alike, averaged with its mirror (`models.networks.mirror`;
the teacher as `bench.mirror_averaging` runs it):
the function a device's ONNX file computes, and the target `ffr pretrain --mirrored-teacher` distils toward.
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr
from sklearn.metrics import roc_auc_score

from bench.common import add_made_by, faces_dir, result_name, write_results
from bench.held_out_sets import ALIGNED, GIVEN, PHOTO_SETS, SETS, held_out
from bench.mirror_averaging import TeacherViews
from models.evaluation.metrics import cosine_scores, make_pairs

DISTILLATION_SETS = ("utkface_aligned", "all_age_faces_aligned")


def agreement(student: np.ndarray, teacher: np.ndarray) -> dict:
    """Per-face cosine between two L2-normalised embeddings of the same faces: mean and 10th percentile."""
    cos = (student * teacher).sum(1)
    return {"cosine_mean": round(float(cos.mean()), 4), "cosine_p10": round(float(np.percentile(cos, 10)), 4)}


def pair_figures(student: np.ndarray, teacher: np.ndarray, pairs: np.ndarray, same: np.ndarray) -> dict:
    """Each model's AUC on the pairs, and how alike the two rank them (Spearman over the pair scores)."""
    s, t = cosine_scores(student, pairs), cosine_scores(teacher, pairs)
    student_auc, teacher_auc = roc_auc_score(same, s), roc_auc_score(same, t)
    return {"student_auc": round(float(student_auc), 4), "teacher_auc": round(float(teacher_auc), 4),
            "auc_gap": round(float(teacher_auc - student_auc), 4),
            "score_rank_corr": round(float(spearmanr(s, t).statistic), 4)}


def student_embeddings(model, images: np.ndarray, mirror: bool = False) -> np.ndarray:
    from models.evaluation.evaluate import embed_all
    from models.evaluation.metrics import l2_normalise
    from models.networks.embedders import TorchEmbedder

    return l2_normalise(embed_all(TorchEmbedder(model, mirror=mirror), images))


AGE_BANDS = ((0, 12), (13, 19), (20, 39), (40, 59), (60, 200))
_AGE = (re.compile(r"^(\d+)_\d+_\d+_"), re.compile(r"^\d+A(\d+)\."))  # UTKFace's and All-Age-Faces' file names


def face_age(name: str) -> int | None:
    """The age a distillation face's file name gives (UTKFace: `age_gender_race_date.jpg`, All-Age-Faces:
    `indexAage.jpg`), else None."""
    base = Path(name).name
    for pattern in _AGE:
        match = pattern.match(base)
        if match:
            return int(match.group(1))
    return None


def distillation_faces(data: list[str], seed: int, val_fraction: float, sample: int,
                       by_age: bool = False) -> list[tuple[str, np.ndarray]]:
    """(row name, crops): the faces `ffr pretrain --online` held out of this data list with this seed, and a seeded
    sample of those it trained on, found again by the run's own split (`held_out_split`); with `by_age`, each
    also by the age its file name gives."""
    from models.training.online_distill import held_out_split, load_training_crops

    crops, names = load_training_crops(data, 112, threads=2, progress=True)
    held, trained = held_out_split(len(crops), seed, val_fraction)
    trained = np.sort(np.random.default_rng(seed).choice(trained, min(sample, len(trained)), replace=False))
    groups = [("distillation faces, held out", held), ("distillation faces, trained on (sample)", trained)]
    if by_age:
        ages = np.array([-1 if (a := face_age(n)) is None else a for n in names])
        groups += [(f"{name}, age {low}-{high}", index[(ages[index] >= low) & (ages[index] <= high)])
                   for name, index in groups[:2] for low, high in AGE_BANDS]
    return [(name, crops[index]) for name, index in groups if len(index)]


def set_rows(name: str, images: np.ndarray, people, pairs, same, models: dict, teacher: TeacherViews) -> list[dict]:
    """One row per candidate on one set's faces; the teacher embeds them once, and every student in the teacher's
    view (one, or mirror-averaged)."""
    target = teacher.embed(images)
    rows = []
    for label, model in models.items():
        student = student_embeddings(model, images, teacher.mirror)
        figures = (pair_figures(student, target, pairs, same) if pairs is not None else
                   dict.fromkeys(("student_auc", "teacher_auc", "auc_gap", "score_rank_corr"), ""))
        rows.append({"weights": label, "set": name, "faces": len(images), "people": people,
                     **agreement(student, target), **figures})
        print(rows[-1], flush=True)
    return rows


def labelled(name: str, root: Path, seed: int, max_pairs: int):
    """(crops, people, pairs, same) of a labelled set's held-out people."""
    held = held_out(root, ALIGNED if name in PHOTO_SETS else GIVEN, seed)[1].holdout
    pairs, same = make_pairs(held.labels, max_pairs, seed)
    return held.images, len(held.identities), pairs, same


def candidate(spec: str) -> tuple[str, Path]:
    """`LABEL=FILE` or `FILE` (labelled by its name)."""
    label, _, path = spec.rpartition("=")
    return label or Path(path).stem, Path(path)


def main(argv=None) -> int:
    from models.networks import face_weights
    from models.training.pretraining import PretrainConfig

    parser = argparse.ArgumentParser(prog="python -m bench.distill_gap", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="the results' folder")
    parser.add_argument("--name", type=result_name, default="distill_gap", help="results as OUT/NAME.json and .md")
    add_made_by(parser)
    parser.add_argument("--candidate", nargs="+", default=[f"shipped={face_weights.SHIPPED_WEIGHTS}"],
                        metavar="[LABEL=]FILE", help="students' weights (safetensors, the shipped architecture), "
                        "each measured on the same faces: several give a learning curve")
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS,
                        help="labelled sets whose held-out people are measured (those under $FFR_FACES_DIR)")
    parser.add_argument("--distillation-data", nargs="+", default=None, metavar="DIR_OR_PACK",
                        help="the students' distillation data, in the order `ffr pretrain --data` was given it "
                             "(default: " + " and ".join(DISTILLATION_SETS) + " under $FFR_FACES_DIR)")
    parser.add_argument("--val-fraction", type=float, default=PretrainConfig.val_fraction,
                        help="the run's --val-fraction: with --seed, which distillation faces it held out")
    parser.add_argument("--sample", type=int, default=2000, help="trained-on distillation faces drawn (seeded)")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed, and the pairs' and samples' seed")
    parser.add_argument("--by-age", action="store_true",
                        help="also each distillation row by the age its file name gives (UTKFace, All-Age-Faces)")
    parser.add_argument("--max-pairs", type=int, default=100_000, help="pairs drawn per labelled set (seeded)")
    parser.add_argument("--mirrored", action="store_true",
                        help="student and teacher embed each face averaged with its mirror, as a device's ONNX file "
                             "does and as `ffr pretrain --mirrored-teacher` distils; without it, one view")
    args = parser.parse_args(argv)
    root = faces_dir()
    if root is None:
        print("bench.distill_gap: no face data (set FFR_FACES_DIR)", file=sys.stderr)
        return 2
    from bench.ratchet import load_candidate

    models = {label: load_candidate(path) for label, path in map(candidate, args.candidate)}
    teacher = TeacherViews(args.mirrored, threads=2)
    data = args.distillation_data or [str(root / name) for name in DISTILLATION_SETS]
    try:
        distillation = distillation_faces(data, args.seed, args.val_fraction, args.sample, args.by_age)
    except (FileNotFoundError, ValueError) as exc:
        print(f"bench.distill_gap: {str(exc).splitlines()[0]} (see --distillation-data)", file=sys.stderr)
        return 2
    rows = []
    for name, crops in distillation:
        rows += set_rows(name, crops, "unlabelled", None, None, models, teacher)
    for set_name in (s for s in args.sets if (root / s).is_dir()):
        rows += set_rows(f"{set_name} (held-out people)", *labelled(set_name, root / set_name, args.seed,
                                                                     args.max_pairs), models, teacher)
    command = "python -m bench.distill_gap " + shlex.join(argv if argv is not None else sys.argv[1:])
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    views = "each face averaged with its mirror" if args.mirrored else "one view of each face"
    write_results(args.out, args.name, {"settings": settings}, rows,
                  f"How close the student is to its teacher, per set ({views})", command, args.made_by)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
