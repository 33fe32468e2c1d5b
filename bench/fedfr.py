"""FedFR's ablation (Liu et al., AAAI 2022, Table 1) on this machine.

    python -m bench.fedfr --out bench/results [--rounds 2] [--partitions iid dirichlet0.5]
                          [--public-data DIR] [--public-limit 500]

Every run is a full `ffr fleet simulate` (real coordinator, Mosquitto, edge clients) on the CelebA
subset, 10 clients, from the shipped face-pretrained model, FedAvg aggregation. Rows, per partition:
the pretrained model alone; FedAvg; + hard negatives (from a public set of people no client has,
default `utkface_aligned`); + contrastive; + DFC (= FedFR); the centralised bound (same budget).
Generic columns: the global model (the simulator's best round by validation) on people no client has.
Personalised columns: per-client TAR@FAR=1e-2 (own genuine pairs, impostors from other clients' people)
with the global model, the local backbone and the local backbone + DFC, mean +- std over clients.
No row has the coordinator's quality gate (`gate.off`): the FedFR rows carry a public set, which the gate would
otherwise score on, while FedAvg has none; the ablation compares training, and `bench.robust` measures the gate.
`--gate` runs every row with the gate at its defaults on the public set's faces instead (what `ffr fleet simulate
--public-data DIR` does), to see which rounds it publishes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.common import faces_dir, result_name, round_outcomes, write_results
from coordinator.quality_gate import GateSetup
from coordinator.settings import RoundSettings
from fleet.config import SimConfig
from fleet.report import mean_std
from fleet.simulate import simulate
from protocol.messages import TrainingConfig
from protocol.methods import METHODS
from protocol.training_parts import ModelSpec

ABLATION = {  # key: (row, method, hard negatives, contrastive, dfc)
    "fedavg": ("FedAvg", "fedavg", False, False, False),
    "hn": ("+ HN", "fedfr", True, False, False),
    "con": ("+ HN + contrastive", "fedfr", True, True, False),
    "fedfr": ("+ HN + contrastive + DFC (FedFR)", "fedfr", True, True, True),
}


def _partition(name: str) -> dict:
    if name.startswith("dirichlet"):
        return {"partition": "dirichlet", "alpha": float(name.removeprefix("dirichlet") or 0.5)}
    return {"partition": name}


def row_config(args, data: Path, partition: str, row: tuple) -> SimConfig:
    """One ablation row's simulation: the same fleet for every row, none gated, or all on the same faces (--gate)."""
    _, method, hn, con, dfc = row
    kind = METHODS[method]
    settings = kind(hard_negatives=hn, contrastive=con) if method == "fedfr" else kind()
    training = TrainingConfig(method=settings, model=ModelSpec(dfc=dfc, dfc_weight=kind.model_defaults.get(
        "dfc_weight", ModelSpec().dfc_weight)))
    return SimConfig(data=str(data), holdout_identities=0.1, public_identities=0.0, clients=args.clients,
                     server=RoundSettings(rounds=args.rounds, training=training),
                     **_partition(partition), patience=0, workers=args.workers,
                     centralized=args.centralized and method == "fedavg", init="face", mlflow=False,
                     public_data=str(args.public_data) if method == "fedfr" else None,
                     public_limit=args.public_limit,
                     gate=GateSetup(data=str(args.public_data) if args.gate else None, off=not args.gate))


def run_one(args, data: Path, partition: str, row: tuple) -> dict:
    label = row[0]
    name = f"{partition}-{label.replace(' ', '').replace('+', '_').replace('(', '').replace(')', '')}"
    config = row_config(args, data, partition, row)
    done = args.runs / name / "summary.json"
    print(f"== {partition}: {label}", flush=True)
    summary = json.loads(done.read_text()) if args.reuse and done.exists() else simulate(config, args.runs / name)
    outcome = round_outcomes(args.runs / name)
    return {**summary, "rounds rolled back": f"{outcome['rolled_back']} of {len(outcome['rounds'])}",
            "MB/round up": outcome["mb_up_per_round"]}


def _generic(report: dict) -> dict:
    return {"AUC": report.get("auc"), "EER": report.get("eer"), "TAR@1e-2": report.get("tar@1e-2"),
            "TAR@1e-3": report.get("tar@1e-3")}


def rows_for(partition: str, summaries: list[tuple[str, dict]]) -> list[dict]:
    """The table's rows of one partition: pretrained, the ablation, centralised."""
    first = summaries[0][1]
    rows = [{"partition": partition, "row": "pretrained only (round 0)", **_generic(first["initial"] or {})}]
    for label, summary in summaries:
        clients = summary["personalized"]["training_clients"]
        hn = [h["hn_fraction"] for h in summary["history"][1:] if h.get("hn_fraction") is not None]
        rows.append({"partition": partition, "row": label, **_generic(summary["global"]),
                     **{f"pers. TAR@1e-2 {v}": mean_std(clients.get(v), "tar@1e-2")
                        for v in ("global", "local", "local+dfc")},
                     "HN fraction": sum(hn) / len(hn) if hn else "-",
                     "MB/round up": summary["MB/round up"],
                     "s/round": summary.get("round_seconds_mean") or "-",
                     "rounds rolled back": summary["rounds rolled back"]})
    central = first.get("centralized")
    if central:
        rows.append({"partition": partition, "row": f"centralised ({central['epochs']} epochs)",
                     **_generic(central["global"]),
                     "pers. TAR@1e-2 global": mean_std(first["personalized"]["training_clients"].get("centralized"),
                                                       "tar@1e-2")})
    columns = list(rows[1]) if len(rows) > 1 else list(rows[0])
    return [{k: row.get(k, "-") for k in columns} for row in rows]  # every row every column, for the table


def _mean(cell: str) -> float:
    """The mean of a 'mean ± std' cell; NaN for 'n/a' or '-'."""
    try:
        return float(cell.split(" ")[0])
    except ValueError:
        return float("nan")


def plot(rows: list[dict], path: Path) -> None:
    """Per-client TAR@1e-2 of the three verifiers, and generic AUC, per row and partition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    runs = [r for r in rows if r.get("pers. TAR@1e-2 local", "-") != "-"]  # the federated runs
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    x = np.arange(len(runs))
    for i, verifier in enumerate(("global", "local", "local+dfc")):
        values = [_mean(r[f"pers. TAR@1e-2 {verifier}"]) for r in runs]
        left.bar(x + (i - 1) * 0.27, values, 0.27, label=verifier)
    labels = [f"{r['partition']}\n{r['row']}" for r in runs]
    left.set_xticks(x, labels, rotation=30, ha="right", fontsize=7)
    left.set_ylabel("per-client TAR@FAR=1e-2 (mean)")
    left.set_ylim(0, 1)
    left.legend(loc="upper left", ncol=3)
    right.bar(x, [r["AUC"] for r in runs], color="grey")
    right.set_xticks(x, labels, rotation=30, ha="right", fontsize=7)
    right.set_ylim(min(r["AUC"] for r in runs) - 0.02, max(r["AUC"] for r in runs) + 0.01)
    right.set_ylabel("generic AUC (people on no device)")
    fig.tight_layout()
    fig.savefig(path, dpi=150)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--runs", type=Path, default=Path("bench/results/fedfr_runs"), help="simulation run folders")
    parser.add_argument("--data", type=Path, help="default $FFR_FACES_DIR/celeba_subset")
    parser.add_argument("--public-data", type=Path, help="D_g; default $FFR_FACES_DIR/utkface_aligned")
    parser.add_argument("--public-limit", type=int, default=500)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--partitions", nargs="+", default=["iid", "dirichlet0.5"])
    parser.add_argument("--rows", nargs="+", choices=list(ABLATION), default=list(ABLATION),
                        help="which runs of the ablation (default all; the first must be fedavg for the "
                             "pretrained and centralised rows)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--no-centralised", dest="centralized", action="store_false",
                        help="skip the centralised bound (it does not depend on the partition)")
    parser.add_argument("--reuse", action="store_true", help="read runs that already have a summary.json")
    parser.add_argument("--gate", action="store_true",
                        help="every row with the coordinator's quality gate at its defaults, scoring on the public "
                             "set's faces (default: no row gated)")
    parser.add_argument("--name", type=result_name, default="fedfr",
                        help="results file name (default fedfr: NAME.json/.md/.png)")
    args = parser.parse_args(argv)
    root = faces_dir() or Path("missing")
    data = args.data or root / "celeba_subset"
    args.public_data = args.public_data or root / "utkface_aligned"
    for what, path in (("face data", data), ("public set", args.public_data)):
        if not path.is_dir():
            print(f"no {what} at {path} (set FFR_FACES_DIR, --data or --public-data)", file=sys.stderr)
            return 2
    command = "python -m bench.fedfr " + " ".join(argv if argv is not None else sys.argv[1:])
    rows: list[dict] = []
    for partition in args.partitions:
        summaries = []
        for row in (ABLATION[key] for key in args.rows):  # the table is rewritten after every run
            summaries.append((row[0], run_one(args, data, partition, row)))
            done = rows + rows_for(partition, summaries)
            write_results(args.out, args.name, {"data": str(data), "public_data": str(args.public_data),
                                              "clients": args.clients, "rounds": args.rounds,
                                              "complete": False}, done,
                          f"FedFR ablation: {args.clients} clients, {args.rounds} rounds, {data.name}", command)
        rows += rows_for(partition, summaries)
    write_results(args.out, args.name, {"data": str(data), "public_data": str(args.public_data),
                                      "clients": args.clients,
                                      "rounds": args.rounds, "complete": True}, rows,
                  f"FedFR ablation: {args.clients} clients, {args.rounds} rounds, {data.name}", command)
    plot(rows, args.out / f"{args.name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
