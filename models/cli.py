"""`ffr`: one command for every user task. Each subcommand's --help says what it does.

Heavy imports (torch, mlflow) happen inside the subcommands that need them, so `ffr --help`
is instant and the ONNX-only paths never load torch.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from models.faces.datasets import LAYOUTS, DatasetError
from models.faces.detect import DETECTORS

log = logging.getLogger("ffr")


def _add_data_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data and face detection")
    g.add_argument("--data", required=True, type=Path,
                   help="dataset folder: one folder per identity (VGGFace2/ORL), LFW, or CelebA "
                        "(identity_CelebA.txt + image folder)")
    g.add_argument("--layout", choices=LAYOUTS, default="auto", help="dataset layout (default: guessed)")
    g.add_argument("--detector", choices=DETECTORS, default=None,
                   help="face detector: haar (OpenCV's cascade, default for photos), yunet (needs "
                        "--yunet-model), none (images are already face crops; default for synthetic data)")
    g.add_argument("--yunet-model", type=Path, help="YuNet .onnx file for --detector yunet")
    g.add_argument("--fallback-center", action="store_true",
                   help="when no face is found, use the centre square instead of skipping the image "
                        "(for roughly pre-cropped datasets such as ORL)")
    g.add_argument("--margin", type=float, default=0.2, help="margin around the detected face, as a fraction of its side")
    g.add_argument("--cache-dir", type=Path, help="where cropped faces are cached (default $FFR_CACHE_DIR or ~/.cache/ffr-edge)")
    g.add_argument("--no-cache", action="store_true", help="do not read or write the crop cache")


def _crops(args, min_images: int = 1):
    from models.faces.crops import CropConfig, crop_index
    from models.faces.datasets import load_index

    index = load_index(args.data, args.layout)
    detector = args.detector or ("yunet" if args.yunet_model else "none" if index.synthetic else "haar")
    config = CropConfig(detector=detector, yunet_model=str(args.yunet_model) if args.yunet_model else None,
                        margin=args.margin, fallback_center=args.fallback_center)
    for note in index.notes:
        log.warning(note)
    crops = crop_index(index, config, args.cache_dir, use_cache=not args.no_cache, progress=not args.quiet,
                       min_images=min_images)
    report = crops.report
    kind = "SYNTHETIC faces" if index.synthetic else f"{index.layout} layout"
    log.info("%s: %d images of %d identities (%s); %d unreadable, %d without a detected face, %d centre fallbacks",
             args.data, len(crops), len(crops.identities), kind, len(report.unreadable), len(report.no_face),
             report.n_center_fallback)
    return index, crops


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def cmd_train(args) -> int:
    from models.faces.splits import training_split
    from models.tracking import MlflowTracker, NullTracker, default_tracking_uri
    from models.training import TrainConfig, Trainer

    _set_threads(args.threads)
    out: Path = args.out
    if (out / "latest.pt").exists() and not (args.resume or args.force):
        raise SystemExit(f"ffr train: {out} already holds a run; pass --resume to continue it or --force to start over")
    _, crops = _crops(args, min_images=2)
    split = training_split(crops, args.holdout_identities, args.val_fraction, args.seed)
    if split.n_classes < 2:
        raise DatasetError("training needs at least 2 identities with 2 or more usable images each")
    config = TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, patience=args.patience,
                         aug=args.aug, head=args.head, width_mult=args.width_mult, pretrained=not args.no_pretrained,
                         weights_path=str(args.weights) if args.weights else None, dfc=args.dfc,
                         class_weighted=args.class_weighted, seed=args.seed, progress=not args.quiet,
                         extra={"data": str(args.data)})
    out.mkdir(parents=True, exist_ok=True)
    tracker = NullTracker() if args.no_mlflow else MlflowTracker(args.mlflow_uri or default_tracking_uri(out))
    trainer = Trainer(config, split, out, tracker)
    if args.resume and (out / "latest.pt").exists():
        trainer.resume()
        log.info("resuming %s from epoch %d", out, trainer.start_epoch)
    try:
        metrics = trainer.fit()
    except KeyboardInterrupt:
        print(f"\ninterrupted: resume with  ffr train --data {args.data} --out {out} --resume", file=sys.stderr)
        return 130
    final = metrics.get("final", {})
    print(json.dumps({"status": metrics["status"], "best_epoch": metrics["best_epoch"], "out": str(out),
                      "data_kind": metrics["data_kind"], "evaluated_on": metrics["evaluated_on"],
                      **{k: final.get(k) for k in ("auc", "eer", "tar_at_far")}}, indent=2))
    return 0


def cmd_export(args) -> int:
    from models.face_model import load_checkpoint
    from models.onnx_export import export_onnx

    model, payload = load_checkpoint(args.model)
    out = export_onnx(model, args.out, personalised=args.personalized,
                      extra={"checkpoint": str(args.model), "epoch": payload.get("epoch"),
                             "identities": len(payload.get("identities", []))})
    print(f"wrote {out} ({'personalised [backbone + DFC transform]' if args.personalized else 'generic'} embedder)")
    return 0


def cmd_eval(args) -> int:
    from models.embedders import load_embedder
    from models.evaluation.evaluate import evaluate_crops

    _set_threads(args.threads if args.model.suffix != ".onnx" else None)
    embedder = load_embedder(args.model, personalised=args.personalized, threads=args.threads)
    index, crops = _crops(args)
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

    out = write_dataset(args.out, args.identities, args.images, args.seed)
    print(f"wrote {args.identities} SYNTHETIC identities x {args.images} images to {out}")
    return 0


def cmd_demo(args) -> int:
    """Synthetic faces -> centralised training -> ONNX export -> verification with onnxruntime."""
    out: Path = args.out
    data = out / "synthetic_faces"
    if not (data / "SYNTHETIC_FACES.txt").exists():
        cmd_synth(argparse.Namespace(out=data, identities=args.identities, images=args.images, seed=args.seed))
    run = out / "train"
    pre = ["--quiet"] if args.quiet else []
    common = ["--data", str(data), "--no-cache"]
    train_args = [*pre, "train", *common, "--out", str(run), "--epochs", str(args.epochs),
                  "--force", "--dfc", "--lr", str(args.lr), "--holdout-identities", "0.25"]
    if args.no_mlflow:
        train_args.append("--no-mlflow")
    if main(train_args) != 0:
        return 1
    main([*pre, "export", "--model", str(run / "best.pt"), "--out", str(out / "generic.onnx")])
    main([*pre, "export", "--model", str(run / "best.pt"), "--out", str(out / "personalised.onnx"), "--personalized"])
    print("\nverification with ONNX Runtime, generic embedder, on all SYNTHETIC identities (training ones included):")
    main([*pre, "eval", "--model", str(out / "generic.onnx"), *common, "--roc", str(out / "roc.png")])
    print(f"\nplots: {run / 'curves.png'}, {run / 'roc.png'}, {out / 'roc.png'}; models: {out}/*.onnx")
    return 0


def cmd_coordinator_serve(args) -> int:
    from coordinator.engine import RoundSettings
    from coordinator.service import ServiceConfig, serve
    from protocol.messages import TrainingConfig

    training = TrainingConfig(epochs=args.local_epochs, batch_size=args.batch_size, lr=args.lr, dfc=not args.no_dfc,
                              dfc_weight=args.dfc_weight,
                              wire_dtype=args.wire_dtype, chunk_bytes=args.chunk_kib * 1024, width_mult=args.width_mult,
                              algorithm=args.strategy, prox_mu=args.mu)
    settings = RoundSettings(rounds=args.rounds, min_clients=args.min_clients, fraction=args.fraction,
                             round_timeout_s=args.round_timeout, training=training, seed=args.seed)
    config = ServiceConfig(state=args.state, broker=args.broker, username=args.username, password=args.password,
                           ca_file=args.ca_file, http_host=args.http_host, http_port=args.http_port,
                           strategy=args.strategy, prox_mu=args.mu, server_momentum=args.server_momentum,
                           pretrained=not args.no_pretrained)
    return serve(config, settings, exit_when_done=args.exit_when_done)


def cmd_edge_run(args) -> int:
    from edge_client.daemon import run

    return run(args.device_id, args.data, args.home, args.broker, until_finished=args.exit_when_done,
               detector=args.detector, username=args.username, password=args.password, ca_file=args.ca_file,
               export_onnx=not args.no_export, seed=args.seed)


def _command_group(sub, name: str, help: str):
    """`ffr NAME COMMAND ...`: a group of related subcommands."""
    return sub.add_parser(name, help=help).add_subparsers(dest=f"{name}_command", required=True, metavar="COMMAND")


def _add_device_commands(sub) -> None:
    from edge_client.device_cli import add_commands

    add_commands(_command_group(sub, "device", "enrol, verify and identify people on this device (ONNX only)"))


def _add_fleet_commands(sub) -> None:
    from fleet.cli import add_commands

    add_commands(_command_group(sub, "fleet", "fleet simulation: partition, simulate, report"))


def _add_broker_options(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument("--broker", default=default, help="MQTT broker URL, mqtt://HOST:PORT or mqtts://HOST:PORT"
                   + ("" if default else " (default: start an embedded mosquitto)"))
    p.add_argument("--username", help="broker user name")
    p.add_argument("--password", help="broker password")
    p.add_argument("--ca-file", help="CA certificate for mqtts:// brokers")


def _add_federated_commands(sub) -> None:
    csub = _command_group(sub, "coordinator", "the federation coordinator service")
    p = csub.add_parser("serve", help="run federated rounds over MQTT, with an HTTP API",
                        description="Run rounds: sample devices, announce, collect backbone deltas, aggregate, "
                                    "publish the new global model. State (models, history) lives in --state and "
                                    "survives restarts. HTTP API docs at http://HOST:PORT/docs.")
    _add_broker_options(p, None)
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8080)
    p.add_argument("--rounds", type=int, default=10, help="rounds to run (default 10)")
    p.add_argument("--min-clients", type=int, default=2, help="devices needed to start a round and to aggregate it")
    p.add_argument("--fraction", type=float, default=1.0, help="fraction of registered devices sampled per round")
    p.add_argument("--strategy", choices=("fedavg", "fedprox", "fedavgm"), default="fedavg")
    p.add_argument("--mu", type=float, default=0.01, help="FedProx proximal weight (default 0.01)")
    p.add_argument("--server-momentum", type=float, default=0.9, help="FedAvgM server momentum")
    p.add_argument("--state", type=Path, default=Path("coordinator_state"), help="state folder")
    p.add_argument("--round-timeout", type=float, default=600.0, help="seconds a round waits for updates")
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--no-dfc", action="store_true", help="devices train without the DFC branch")
    p.add_argument("--dfc-weight", type=float, default=1.0, help="alpha: weight of the DFC loss on devices")
    p.add_argument("--wire-dtype", choices=("fp16", "fp32"), default="fp16", help="dtype of deltas on the wire")
    p.add_argument("--chunk-kib", type=int, default=256, help="largest MQTT message, KiB")
    p.add_argument("--width-mult", type=float, default=1.0)
    p.add_argument("--no-pretrained", action="store_true", help="round 0 model from random weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exit-when-done", action="store_true", help="exit after the last round is aggregated")
    p.set_defaults(func=cmd_coordinator_serve)

    esub = _command_group(sub, "edge", "the edge device daemon")
    p = esub.add_parser("run", help="join the federation: train locally each round, send only backbone deltas",
                        description="Registers with the coordinator, trains on the people enrolled in --data (one "
                                    "folder each) every round it is picked for, sends only the backbone delta, and "
                                    "exports its personalised ONNX model into --home.")
    p.add_argument("--device-id", required=True)
    p.add_argument("--data", required=True, type=Path, help="the device's enrolled people, one folder each")
    p.add_argument("--home", required=True, type=Path, help="the device's private state folder")
    _add_broker_options(p, "mqtt://127.0.0.1:1883")
    p.add_argument("--detector", choices=DETECTORS, help="face detector for the enrolled images")
    p.add_argument("--no-export", action="store_true", help="do not export ONNX models after each round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exit-when-done", action="store_true", help="exit after the coordinator's last round")
    p.set_defaults(func=cmd_edge_run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ffr", description="ffr-edge: federated face recognition for edge devices.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars or info messages")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="centralised training (the upper bound for federated runs)",
                       description="Train the face model on one dataset. Writes RUN_DIR/best.pt, latest.pt, "
                                   "metrics.json, curves.png and roc.png, and logs to MLflow (SQLite in RUN_DIR).")
    _add_data_options(p)
    p.add_argument("--out", required=True, type=Path, help="run folder (RUN_DIR)")
    p.add_argument("--epochs", type=int, default=20, help="maximum epochs (default 20)")
    p.add_argument("--batch-size", type=int, default=32, help="default 32")
    p.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate (default 1e-4)")
    p.add_argument("--patience", type=int, default=10, help="early stopping: epochs without a better validation loss")
    p.add_argument("--head", choices=("cosface", "arcface", "softmax"), default="cosface", help="margin head")
    p.add_argument("--aug", choices=("weak", "strong", "none"), default="weak", help="augmentation")
    p.add_argument("--width-mult", type=float, default=1.0, help="MobileNetV2 width multiplier")
    p.add_argument("--no-pretrained", action="store_true", help="start from random weights instead of ImageNet")
    p.add_argument("--weights", type=Path, help="a local torchvision MobileNetV2 weights file to start from")
    p.add_argument("--dfc", action="store_true", help="also train the DFC personalisation branch")
    p.add_argument("--class-weighted", action="store_true", help="inverse-frequency class weights in the loss")
    p.add_argument("--holdout-identities", type=float, default=0.2,
                   help="fraction of identities kept out of training to measure verification on new people")
    p.add_argument("--val-fraction", type=float, default=0.1, help="fraction of each identity's images for validation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue the run in RUN_DIR from latest.pt")
    p.add_argument("--force", action="store_true", help="start over even if RUN_DIR holds a run")
    p.add_argument("--mlflow-uri", help="MLflow tracking URI (default sqlite:///RUN_DIR/mlflow.db)")
    p.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("export", help="export a checkpoint to ONNX for on-device verification",
                       description="Write a single-file ONNX embedder (dynamic batch, preprocessing in its metadata).")
    p.add_argument("--model", required=True, type=Path, help="checkpoint (.pt) from ffr train")
    p.add_argument("--out", required=True, type=Path, help="MODEL.onnx to write")
    p.add_argument("--personalized", action="store_true",
                   help="export [backbone + DFC transform] instead of the generic backbone")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("eval", help="verification metrics of a model on a dataset",
                       description="AUC, EER, TAR@FAR, 10-fold accuracy and 1:N TPIR@FPIR; with --pairs, LFW's protocol.")
    p.add_argument("--model", required=True, type=Path, help="checkpoint (.pt) or exported .onnx")
    _add_data_options(p)
    p.add_argument("--pairs", type=Path, help="LFW-style pairs.txt: 10-fold accuracy with thresholds from the other folds")
    p.add_argument("--use-dataset-pairs", action="store_true", help="use the pairs.txt found beside an LFW dataset")
    p.add_argument("--personalized", action="store_true", help="checkpoints only: use the DFC-personalised embedding")
    p.add_argument("--max-pairs", type=int, default=200_000, help="sample pairs beyond this many")
    p.add_argument("--roc", type=Path, help="write the ROC curve to this PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, help="CPU threads")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("synth", help="write a SYNTHETIC face dataset (no real people) for demos and tests")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--identities", type=int, default=20)
    p.add_argument("--images", type=int, default=12, help="images per identity")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("demo", help="train, export and verify on SYNTHETIC faces, end to end (no data needed)")
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument("--identities", type=int, default=24)
    p.add_argument("--images", type=int, default=12)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", type=float, default=1e-3, help="higher than the design's 1e-4 so a demo learns in minutes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-mlflow", action="store_true")
    p.set_defaults(func=cmd_demo)
    _add_federated_commands(sub)
    _add_fleet_commands(sub)
    _add_device_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    for name in ("ffr", "models", "edge_client", "coordinator", "protocol"):
        logging.getLogger(name).setLevel(level)
    try:
        return args.func(args)
    except (DatasetError, FileNotFoundError, ValueError) as exc:
        sub = getattr(args, f"{args.command}_command", None)
        print(f"ffr {args.command}{' ' + sub if sub else ''}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
