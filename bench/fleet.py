"""Fleet benchmark: centralised vs FedAvg vs FedProx, IID and Dirichlet partitions, on real faces.

Every federated run is a full `ffr fleet simulate` (real coordinator, Mosquitto, edge clients),
10 clients by default, the same epoch budget for all, DFC on so that each run reports the
personalised TAR with and without the DFC transform. The centralised upper bound is trained
once: every partition here keeps the same people off the devices (same seed) and trains on
the same union of images, so one centralised model serves as the bound for all rows.

    python -m bench.fleet --out bench/results [--rounds 3] [--clients 10] [--init face|imagenet]
                          [--partitions iid dirichlet0.5 dirichlet0.1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.common import face_set, result_name, write_results
from coordinator.settings import RoundSettings
from fleet.config import SimConfig
from fleet.report import mean_std
from fleet.simulate import simulate
from models.training.supervised import FACE_ANCHOR_WEIGHT
from protocol.codecs import TOPK_FRACTION
from protocol.messages import TrainingConfig

SETTINGS = {"iid": ("iid", None), "dirichlet0.5": ("dirichlet", 0.5), "dirichlet0.1": ("dirichlet", 0.1)}
# FedAvg on the IID partition again, with one thing changed: who runs the devices, or how updates travel
# (label, simulation options, local training options)
VARIANTS = {"ray": ("Ray backend", {"backend": "ray"}, {}), "int8": ("int8 updates", {}, {"codec": "int8"}),
            "topk": (f"top-k {TOPK_FRACTION:.0%} updates", {}, {"codec": "topk", "topk_fraction": TOPK_FRACTION}),
            "fp32": ("fp32 updates", {}, {"codec": "fp32"}),
            # eq. 4 of the HF-MAML paper at the C centralised fine-tuning pays (models.training.supervised)
            "anchor": (f"anchor C={FACE_ANCHOR_WEIGHT:g}", {}, {"embedding_reg": FACE_ANCHOR_WEIGHT})}
PHASES = ("fetch_s", "train_s", "upload_s", "turn_s", "aggregation_s", "eval_s", "wall_s")


def phase_row(name: str, summary: dict) -> dict:
    """Mean seconds per round by phase (device phases: the mean device), from the run's history."""
    rounds = [h for h in summary["history"][1:] if h.get("train_s") is not None]
    means = {p: (sum(h.get(p) or 0.0 for h in rounds) / len(rounds) if rounds else None) for p in PHASES}
    timed = rounds and all(h.get(p) is not None for h in rounds for p in ("turn_s", "fetch_s", "upload_s"))
    start_stop = means["turn_s"] - means["fetch_s"] - means["train_s"] - means["upload_s"] if timed else None
    return {"run": name, "download (device mean)": means["fetch_s"], "local training (device mean)": means["train_s"],
            "upload (device mean)": means["upload_s"], "device start/stop (device mean)": start_stop,
            "aggregation": means["aggregation_s"],
            "evaluation (not in round)": means["eval_s"], "round wall": means["wall_s"],
            "bytes up / update": summary["bytes"]["per_round_up_mean"] / max(1, summary["history"][-1]["updates"])}


def peer_phase_row(peer: dict) -> dict:
    return {"run": "Flower 1.41 FedAvg (simulation)", "download (device mean)": "in-process",
            "local training (device mean)": peer.get("train_seconds_mean"), "upload (device mean)": "in-process",
            "device start/stop (device mean)": "-",
            "aggregation": peer.get("aggregation_seconds_mean"), "evaluation (not in round)": "-",
            "round wall": peer["round_seconds_mean"], "bytes up / update": peer["bytes_up_per_round"] / peer["clients"]}


def _tar(stats: dict, verifier: str) -> str:
    return mean_std(stats.get(verifier), "tar@1e-2")


def row(name: str, summary: dict) -> dict:
    g, clients = summary["global"], summary["personalized"]["training_clients"]
    return {"run": name, "global AUC": g["auc"], "global EER": g["eer"],
            "pers. TAR@1e-2 global": _tar(clients, "global"), "pers. TAR@1e-2 local": _tar(clients, "local"),
            "pers. TAR@1e-2 local+DFC": _tar(clients, "local+dfc"),
            "s/round": summary["round_seconds_mean"], "MB/round (up)": summary["bytes"]["per_round_up_mean"] / 1e6,
            "MB/round (down)": summary["bytes"]["per_round_down_mean"] / 1e6, "wall s": summary["wall_seconds"]}


def central_row(summary: dict) -> dict:
    c = summary["centralized"]
    clients = summary["personalized"]["training_clients"]
    return {"run": f"centralised ({c['epochs']} epochs)", "global AUC": c["global"]["auc"],
            "global EER": c["global"]["eer"], "pers. TAR@1e-2 global": _tar(clients, "centralized"),
            "pers. TAR@1e-2 local": "-", "pers. TAR@1e-2 local+DFC": "-", "s/round": "-",
            "MB/round (up)": "-", "MB/round (down)": "-", "wall s": c["train_seconds"]}


def initial_row(summary: dict, run: Path) -> dict:
    """The starting model (round 0) on the same unseen people: what training adds."""
    initial = summary.get("initial")
    if initial is None:  # a run made before round 0 was recorded: evaluate its version 0 now
        from coordinator.store import Store
        from fleet.config import SimConfig
        from fleet.data import prepare
        from fleet.evaluation import flat
        from models.evaluation.evaluate import verification
        from models.networks.face_model import global_embedder

        config = SimConfig.load(run / "config.json")
        config.progress = False
        model = global_embedder(Store(run / "coordinator").load_model(0), config.training.model.width_mult)
        report, _ = verification(model, prepare(config, run).holdout(), config.max_eval_pairs, config.seed)
        initial = flat(report)
    init = json.loads((run / "config.json").read_text()).get("init", "imagenet")
    return {"run": f"starting model ({init} init, round 0)", "global AUC": initial["auc"],
            "global EER": initial["eer"], "pers. TAR@1e-2 global": "-", "pers. TAR@1e-2 local": "-",
            "pers. TAR@1e-2 local+DFC": "-", "s/round": "-", "MB/round (up)": "-", "MB/round (down)": "-",
            "wall s": "-"}


def flower_peer(args, run: Path) -> dict | None:
    """Flower's FedAvg on the same run (same crops, partition, model, budget), in its own venv."""
    if not Path(args.flower_python).exists():
        print(f"no Flower environment at {args.flower_python}: the peer comparison is skipped", file=sys.stderr)
        return None
    out = run / "flower.json"
    if not (args.reuse and out.exists()):
        subprocess.run([args.flower_python, "-m", "bench.flower_peer", "--run", str(run), "--out", str(out),
                        "--workers", str(args.workers)], check=True)
    return json.loads(out.read_text())


def peer_row(peer: dict) -> dict:
    return {"run": "Flower 1.41 FedAvg (simulation), iid", "global AUC": peer["global_auc"],
            "global EER": peer["global_eer"], "pers. TAR@1e-2 global": "-", "pers. TAR@1e-2 local": "-",
            "pers. TAR@1e-2 local+DFC": "-", "s/round": peer["round_seconds_mean"],
            "MB/round (up)": peer["bytes_up_per_round"] / 1e6,
            "MB/round (down)": peer["bytes_down"] / peer["rounds"] / 1e6,
            "wall s": peer["wall_seconds"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--runs", type=Path, default=Path("bench/results/fleet_runs"), help="simulation run folders")
    parser.add_argument("--data", type=Path, help="default $FFR_FACES_DIR/celeba_subset")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "fedprox"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--init", choices=("face", "imagenet"), default="face", help="round 0's model (default face)")
    parser.add_argument("--partitions", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=[],
                        help="FedAvg on the IID partition again with one change each (ray: --backend ray; "
                             "int8/topk/fp32: --codec; anchor: --embedding-reg 10, the anchor centralised "
                             "fine-tuning pays)")
    parser.add_argument("--name", type=result_name, default="fleet",
                        help="results file name (default fleet: fleet.json, fleet.md)")
    parser.add_argument("--reuse", action="store_true", help="read runs that already have a summary.json")
    parser.add_argument("--flower-python", default=os.environ.get("FFR_FLOWER_PYTHON", ".venv-flower/bin/python"),
                        help="a Python with flwr[simulation] and this project (`make bench-fleet` builds one)")
    args = parser.parse_args(argv)
    data = face_set(args.data)
    if data is None:
        return 2
    rows, summaries, central = [], {}, None
    for scheme, alpha in (SETTINGS[p] for p in args.partitions):
        for algorithm in args.algorithms:
            name = f"{algorithm}-{scheme}" + (f"{alpha}" if alpha else "")
            server = RoundSettings(rounds=args.rounds, training=TrainingConfig(algorithm=algorithm, dfc=True))
            config = SimConfig(data=str(data), holdout_identities=0.1, clients=args.clients, partition=scheme,
                               public_identities=0.0, alpha=alpha or 0.5, patience=0, workers=args.workers,
                               centralized=central is None, init=args.init, server=server)
            print(f"== {name}", flush=True)
            done = args.runs / name / "summary.json"
            reuse = args.reuse and done.exists()
            summary = json.loads(done.read_text()) if reuse else simulate(config, args.runs / name)
            summaries[name] = summary
            if central is None:
                central = summary
            rows.append(row(f"{algorithm}, {scheme}" + (f" α={alpha}" if alpha else ""), summary))
    phases = [phase_row(n, summaries[n]) for n in summaries]
    for variant in args.variants:
        label, change, local = VARIANTS[variant]
        name = f"fedavg-iid-{variant}"
        server = RoundSettings(rounds=args.rounds, training=TrainingConfig(algorithm="fedavg", dfc=True, **local))
        config = SimConfig(data=str(data), holdout_identities=0.1, clients=args.clients, partition="iid", alpha=0.5,
                           public_identities=0.0, patience=0, workers=args.workers, centralized=False, init=args.init,
                           server=server, **change)
        print(f"== {name}", flush=True)
        done = args.runs / name / "summary.json"
        summary = json.loads(done.read_text()) if args.reuse and done.exists() else simulate(config, args.runs / name)
        summaries[name] = summary
        rows.append(row(f"fedavg, iid, {label}", summary))
        phases.append(phase_row(name, summary))
    rows.insert(0, central_row(central))
    rows.insert(0, initial_row(central, args.runs / next(iter(summaries))))
    peer = flower_peer(args, args.runs / "fedavg-iid") if "fedavg-iid" in summaries else None
    if peer is not None:
        rows.append(peer_row(peer))
        phases.append(peer_phase_row(peer))
    command = "python -m bench.fleet " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(args.out, args.name, {"init": args.init, "data": str(data), "clients": args.clients,
                                        "rounds": args.rounds,
                                      "runs": {k: {kk: v[kk] for kk in ("global", "personalized", "bytes",
                                                                         "wall_seconds", "round_seconds_mean",
                                                                         "partition", "centralized")}
                                               for k, v in summaries.items()}, "flower": peer},
                  rows, f"Fleet simulation on {data.name}: {args.clients} clients, {args.rounds} rounds", command)
    write_results(args.out, f"{args.name}_phases", {}, phases,
                  f"Seconds per round by phase, {args.clients} clients on {data.name}, 2 cores", command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
