"""The other two federated face papers, in their own terms, against FedAvg, on CelebA.

python -m bench.metafed --out bench/results [--part 1 2] [--clients 10] [--rounds 3] [--fraction 1.0]

Part 1 (HF-MAML, ../shared/papers/000): partitions `equal` and `lognormal` (mu = sigma = 3); rows
FedAvg, HF-MAML and HF-MAML + embedding regularisation, each measured per client on the global model
and "tuned" (the global model after 5 local batches), mean and standard deviation over clients (the
paper's fairness measure), AUC/EER on people no client has, seconds and bytes per round. The paper's
attribute partition needs CelebA's attribute file, which the shared subset does not have: it is not run.

Part 2 (FedFace, ../shared/papers/004): FedAvg, FedAvg + FV, PFM and PFM + FV (= FedFace) at two
synchronisation intervals (local epochs per round), and the centralised model, on the IID partition
with one client held out of training as the validator; generic verification on people no client has.

Every run is a full `ffr fleet simulate` over the real broker, coordinator and edge clients.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.common import face_set, write_results
from coordinator.settings import RoundSettings
from fleet.config import SimConfig
from fleet.report import mean_std
from fleet.simulate import simulate
from protocol.messages import TrainingConfig

# label: (--method, the local training it sends)
PART1_METHODS = {"FedAvg": ("fedavg", {"algorithm": "fedavg"}),
                 "HF-MAML": ("hfmaml", {"algorithm": "fedavg", "hfmaml": True}),
                 "HF-MAML + embedding reg.": ("hfmaml", {"algorithm": "fedavg", "hfmaml": True, "embedding_reg": 1.0})}
PART1_PARTITIONS = {"equal": {"partition": "equal"},
                    "lognormal": {"partition": "lognormal", "lognormal_mu": 3.0, "lognormal_sigma": 3.0}}


def _run(args, data: Path, name: str, training: dict, server: dict | None = None, **options) -> dict:
    """One simulation: `training` and `server` are the spec's local-training and rounds parts, `options` its own."""
    done = args.runs / name / "summary.json"
    if args.reuse and done.exists():
        return json.loads(done.read_text())
    rounds = RoundSettings(rounds=args.rounds, fraction=args.fraction, training=TrainingConfig(dfc=False, **training),
                           **(server or {}))
    config = SimConfig(data=str(data), holdout_identities=0.1, clients=args.clients, patience=0, workers=args.workers,
                       public_identities=0.0, init=args.init, server=rounds, **options)
    print(f"== {name}", flush=True)
    return simulate(config, args.runs / name)


def part1_rows(args, data: Path) -> list[dict]:
    rows = []
    for partition in args.partitions:
        p_options = PART1_PARTITIONS[partition]
        for method, (_, training) in PART1_METHODS.items():
            name = f"metafed1-{partition}-{method.lower().replace(' ', '').replace('.', '').replace('+', '-')}"
            summary = _run(args, data, name, training, centralized=False, tune_steps=5, **p_options)
            clients = summary["personalized"]["training_clients"]
            for model in ("global", "tuned"):
                stats = clients.get(model) or {}
                rows.append({"partition": partition, "method": method, "model": model,
                             "AUC mean ± std": mean_std(stats, "auc"),
                             "TAR@1e-2 mean ± std": mean_std(stats, "tar@1e-2"),
                             "TAR@1e-3 mean ± std": mean_std(stats, "tar@1e-3"),
                             "unseen AUC": summary["global"]["auc"], "unseen EER": summary["global"]["eer"],
                             "s/round": summary["round_seconds_mean"],
                             "MB/round up": summary["bytes"]["per_round_up_mean"] / 1e6})
    return rows


def part2_rows(args, data: Path) -> list[dict]:
    rows, central = [], None
    for epochs in args.intervals:
        for label, algorithm, lr, fv in (("FedAvg", "fedavg", args.lr_fedavg, False),
                                         ("FedAvg + FV", "fedavg", args.lr_fedavg, True),
                                         ("PFM", "pfm", args.lr_pfm, False),
                                         ("FedFace (PFM + FV)", "pfm", args.lr_pfm, True)):
            name = f"metafed2-e{epochs}-" + label.split(" (")[0].lower().replace(" + ", "-").replace(" ", "")
            # generic verification only: no per-client evaluation (eval_clients=0), the costliest part of a run
            summary = _run(args, data, name, {"algorithm": algorithm, "lr": lr, "epochs": epochs},
                           {"fv": fv, "fv_phi": args.fv_phi}, partition="iid", centralized=central is None,
                           heldout_clients=1, eval_clients=0)
            central = central or summary.get("centralized")
            rows.append({"method": label, "local epochs per round": epochs, "unseen AUC": summary["global"]["auc"],
                         "unseen EER": summary["global"]["eer"], "s/round": summary["round_seconds_mean"]})
    if central:
        rows.append({"method": f"centralised ({central['epochs']} epochs)", "local epochs per round": "-",
                     "unseen AUC": central["global"]["auc"], "unseen EER": central["global"]["eer"], "s/round": "-"})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--runs", type=Path, default=Path("bench/results/metafed_runs"))
    parser.add_argument("--data", type=Path, help="default $FFR_FACES_DIR/celeba_subset")
    parser.add_argument("--part", type=int, nargs="+", choices=(1, 2), default=[1, 2])
    parser.add_argument("--partitions", nargs="+", choices=tuple(PART1_PARTITIONS), default=list(PART1_PARTITIONS),
                        help="part 1's partitions")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fraction", type=float, default=1.0,
                        help="share of the training clients sampled each round (the papers sample a fraction too)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--init", choices=("face", "imagenet"), default="face")
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 2], help="local epochs per round (part 2)")
    parser.add_argument("--lr-fedavg", type=float, default=1e-4, help="FedAvg's Adam learning rate (part 2)")
    parser.add_argument("--lr-pfm", type=float, default=1e-3,
                        help="PFM's SGD learning rate (part 2; the paper's 0.1 trains from scratch: fine-tuning the "
                             "shipped model, 1e-2 lost 0.024 AUC in one round)")
    parser.add_argument("--fv-phi", type=float, default=0.5,
                        help="FV's smoothing rate (the paper's 0.01 suits thousands of validation rounds, not 3)")
    parser.add_argument("--reuse", action="store_true", help="read runs that already have a summary.json")
    args = parser.parse_args(argv)
    data = face_set(args.data)
    if data is None:
        return 2
    command = "python -m bench.metafed " + " ".join(argv if argv is not None else sys.argv[1:])
    if 1 in args.part:
        write_results(args.out, "metafed_hfmaml",
                      {"clients": args.clients, "rounds": args.rounds, "fraction": args.fraction},
                      part1_rows(args, data), f"HF-MAML vs FedAvg on {data.name}: per-client TAR (mean ± std over "
                      f"clients), global and tuned (5 local batches), {args.clients} clients, {args.rounds} rounds",
                      command)
    if 2 in args.part:
        write_results(args.out, "metafed_fedface",
                      {"clients": args.clients, "rounds": args.rounds, "fraction": args.fraction},
                      part2_rows(args, data), f"PFM vs FedAvg on {data.name} (IID), unseen people, "
                      f"{args.clients} clients, {args.rounds} rounds", command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
