"""Verification quality on people never trained on: ours from ImageNet and from the face weights, the teacher, dlib.

python -m bench.verify_quality --out bench/results [--sets orl celeba_subset ...] [--epochs 3]

Per labelled set: identities split 70/30 (seed 0, as `bench.device`); every row is measured on
the held-out 30% (all genuine pairs, impostors sampled), which the shipped weights never saw
(they are distilled from unlabelled sets only). Rows:
  - ffr-edge, ImageNet init (what the project shipped before the face weights);
  - ffr-edge, face init as shipped;
  - ffr-edge, face init fine-tuned with the `ffr train` trainer (CosFace, its default anchor to the face
    weights) on the set's other 70% of people, less the share (`--select-identities`, `ffr train`'s default)
    kept out to choose how far the weights move from the start (WiSE-FT; the row names the alpha chosen, and
    gives its AUC gain over the shipped row with a 95% interval, a paired bootstrap over the held-out people);
  - the teacher, OpenCV's SFace, on the same aligned crops;
  - face_recognition (dlib), when installed (`make bench-device` installs it), on its usual square crops.
Photo sets are cut two ways for our models: aligned (YuNet five points, the default) and Haar's
square crop (the old default). Sets are read from $FFR_FACES_DIR (../shared/faces by default).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import faces_dir, write_results
from bench.held_out_sets import ALIGNED, GIVEN, HAAR, PHOTO_SETS, SETS, d_auc_interval, held_out
from models.cli.common import SELECT_IDENTITIES
from models.evaluation.metrics import cosine_scores, make_pairs, roc_report
from models.faces.crops import FaceCrops
from models.networks.face_model import ModelConfig
from models.training.supervised import TrainConfig
from protocol.training_parts import TrainerSettings


def measure(scores: np.ndarray, same: np.ndarray) -> dict:
    report = roc_report(scores, same)
    tar = report["tar_at_far"]
    return {"auc": report["auc"], "eer": report["eer"], "tar@far=1e-2": tar["0.01"], "tar@far=1e-3": tar["0.001"]}


def ours(model, crops: FaceCrops, pairs: np.ndarray, mirror: bool = False) -> np.ndarray:
    """The pairs' cosine scores, each face embedded alone or, with `mirror`, as a device's ONNX file embeds it."""
    from models.evaluation.evaluate import embed_all
    from models.networks.embedders import TorchEmbedder

    return cosine_scores(embed_all(TorchEmbedder(model, mirror=mirror), crops.images), pairs)


def teacher_scores(crops: FaceCrops, pairs: np.ndarray) -> np.ndarray:
    from models.networks.teacher import load_teacher

    return cosine_scores(load_teacher("sface", threads=2).embed(crops.images), pairs)


def finetune(split, args, run_dir: Path):
    """(the fine-tuned model, what its WiSE-FT step chose: None without selection people)."""
    from models.training.supervised import Trainer

    config = TrainConfig(optimisation=TrainerSettings(epochs=args.epochs, lr=args.lr, batch_size=32),
                         model=ModelConfig(head="cosface", init="face"), aug="weak", seed=args.seed,
                         patience=10, max_eval_pairs=args.max_pairs, anchor_weight=args.anchor_weight)
    trainer = Trainer(config, split, run_dir, progress=False)
    trainer.fit()
    from models.networks.face_model import load_checkpoint

    model, payload = load_checkpoint(run_dir / "best.pt")
    return model, payload.get("interpolation")


def tuned_name(args, interpolation: dict | None) -> str:
    moved = ("" if interpolation is None else
             f", alpha {interpolation['alpha']:g} chosen on {interpolation['select_identities']} kept-out people")
    return f"ffr-edge, face init + fine-tuned ({args.epochs} ep. CosFace, anchor {args.anchor_weight:g}{moved})"


def bench_set(name: str, root: Path, args, fr) -> list[dict]:
    from models.networks.face_model import new_embedder

    is_photo = name in PHOTO_SETS
    crops, split = held_out(root, ALIGNED if is_photo else GIVEN, args.seed, args.select_identities)
    held = split.holdout
    pairs, same = make_pairs(held.labels, args.max_pairs, args.seed)
    base = {"set": name, "identities": len(held.identities), "images": len(held),
            "pairs": f"{int(same.sum())}/{int((~same).sum())}"}
    rows = []
    people = np.asarray(held.labels)[pairs]

    def add(model: str, crop: str, scores: np.ndarray, seconds: float = 0.0, versus: np.ndarray | None = None) -> None:
        """A row; with `versus` (the shipped row's scores) also the AUC gain over it and its 95% interval."""
        row = {**base, "model": model, "crops": crop, **measure(scores, same), "train_s": round(seconds),
               "auc_gain_vs_shipped": "", "gain_95%": ""}
        if versus is not None:
            low, high = d_auc_interval(same, people, versus, scores, seed=args.seed)
            row["auc_gain_vs_shipped"] = row["auc"] - rows[shipped_row]["auc"]
            row["gain_95%"] = f"{low:+.4f} to {high:+.4f}"
        rows.append(row)
        print(rows[-1], flush=True)

    crop_name = ("aligned (YuNet 5-point)" if is_photo else "given (pre-aligned)" if name == "glint24_aligned"
                 else "given (24x24 thumbnails)")
    import torch

    torch.manual_seed(args.seed)  # the ImageNet row's 128-d projection is drawn at random: the same one every run
    imagenet, face = new_embedder("imagenet").eval(), new_embedder("face").eval()
    add("ffr-edge, ImageNet init", crop_name, ours(imagenet, held, pairs))
    shipped, shipped_row = ours(face, held, pairs), len(rows)
    add("ffr-edge, face init (shipped)", crop_name, shipped)
    if is_photo:  # the same people and pairs, cut as Haar squares (the previous default)
        haar_crops, haar_split = held_out(root, HAAR, args.seed)
        assert haar_split.holdout.identities == held.identities and len(haar_split.holdout) == len(held)
        add("ffr-edge, ImageNet init", "Haar square", ours(imagenet, haar_split.holdout, pairs))
        add("ffr-edge, face init (shipped)", "Haar square", ours(face, haar_split.holdout, pairs))
    if args.epochs > 0:
        start = time.perf_counter()
        tuned, interpolation = finetune(split, args, args.out / "quality_runs" / name / "face-cosface")
        add(tuned_name(args, interpolation), crop_name, ours(tuned, held, pairs), time.perf_counter() - start,
            versus=shipped)
    add("teacher: SFace (OpenCV Zoo, int8 folded to fp32)", crop_name, teacher_scores(held, pairs))
    if fr is not None:
        from bench.peer import peer_embeddings

        square = held if not is_photo else held_out(root, HAAR, args.seed)[1].holdout
        emb = peer_embeddings(fr, square.images)
        add("face_recognition 1.3 (dlib)", "Haar square" if is_photo else crop_name,
            -np.linalg.norm(emb[pairs[:, 0]] - emb[pairs[:, 1]], axis=1))
    return rows


def merged(previous: Path, rows: list[dict], sets: list[str], settings: dict) -> tuple[list[dict], str | None]:
    """A rerun of some sets replaces their rows in the existing table (same weights and fine-tuning settings)
    and keeps the others.

    Returns the rows and the command that produced the kept ones (None when nothing was kept)."""
    import json

    from models.networks.face_weights import SHIPPED_SHA256

    if not previous.is_file():
        return rows, None
    old = json.loads(previous.read_text())
    kept = [r for r in old["table"] if r["set"] not in sets]
    if old.get("weights_sha256") != SHIPPED_SHA256 or any(old.get(k) != v for k, v in settings.items()) or not kept:
        return rows, None
    return sorted(kept + rows, key=lambda r: SETS.index(r["set"])), old["command"]  # stable sort


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--epochs", type=int, default=3, help="fine-tuning epochs (0: skip the fine-tuned row)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--anchor-weight", type=float, default=None,
                        help="fine-tuning's anchor to the face weights (default: `ffr train`'s)")
    parser.add_argument("--select-identities", type=float, default=SELECT_IDENTITIES,
                        help="share of the 70%% kept out of fine-tuning to choose its WiSE-FT alpha "
                             "(default: `ffr train`'s, %(default)s; 0: no such step)")
    parser.add_argument("--max-pairs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-peer", action="store_true", help="skip face_recognition even when installed")
    args = parser.parse_args(argv)
    args.anchor_weight = TrainConfig(model=ModelConfig(init="face"),
                                     anchor_weight=args.anchor_weight).anchor_weight  # resolved once
    root = faces_dir()
    if root is None:
        print("no face data: set FFR_FACES_DIR to the folder holding orl/, celeba_subset/, ...", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    fr = None
    if not args.no_peer:
        try:
            from bench.peer import load_face_recognition

            fr = load_face_recognition()
        except ImportError as exc:
            print(f"face_recognition not installed ({exc}); its rows are skipped (make bench-device installs it)",
                  file=sys.stderr)
    rows = []
    for name in args.sets:
        rows += bench_set(name, root / name, args, fr)
    settings = {"epochs": args.epochs, "lr": args.lr, "anchor_weight": args.anchor_weight,
                "select_identities": args.select_identities}
    rows, earlier = merged(args.out / "verify_quality.json", rows, args.sets, settings)
    from models.networks.face_weights import SHIPPED_SHA256

    command = ("python -m bench.verify_quality " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    if earlier:
        command = f"{earlier}`, then for {', '.join(args.sets)}: `{command}"
    write_results(
        args.out,
        "verify_quality",
        {**settings, "weights_sha256": SHIPPED_SHA256},
        rows,
        "Verification on held-out people: ImageNet vs face init, fine-tuned, teacher, dlib",
        command,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
