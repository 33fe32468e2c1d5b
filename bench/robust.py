"""Robust aggregation under attack: 20% of a 10-device fleet poison their updates.

    python -m bench.robust --out bench/results [--rounds 2] [--malicious 0.2]
                           [--attacks scaled sign-flip wipe] [--rules mean trimmed-mean median krum]
    python -m bench.robust --suite collapse --out bench/results   (robust_collapse.md)

The collapse suite (`fleet.attacks`' collapse: poisoning from inside every bound) runs on the
CelebA subset (10 devices, 20% attackers) and ORL (3 devices, 1 attacker): clean with the default
defences, then the attack against each combination rule without the quality gate, and against the
defaults (mean, gate on the unlabelled public faces `utkface_aligned`). Each run's published
model is scored on Glint24 (people in no run and not in the gate's faces): its AUC, and its
false-accept rate at the clean run's FAR=1e-3 threshold. "devices refused" counts updates whose
device's adoption check (`edge_client.adoption`) kept its last good model instead of the announced one.

Every run is a full `ffr fleet simulate` (real coordinator, Mosquitto, edge clients) on the
CelebA subset from the shipped face init, IID, FedAvg on the devices, DFC off (only the
global model is measured here: the model after the last round, on people no device has). The DP-FedAvg rows
(`coordinator.dp`) show the cost in AUC of user-level differential privacy at this fleet size, with the epsilon
spent. The malicious devices (`fleet.attacks`) are admitted,
sign correctly and follow the protocol: they only lie in their delta and sample count.
Every row has the coordinator's per-update norm clipping and sample-count cap; the rule
column is how the clipped updates are combined; a round whose new model fails the
coordinator's checks is rolled back (the model stays). The bar: for the robust rules the
attacked global model's held-out AUC stays within 0.01 of the clean FedAvg run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.common import face_set, faces_dir, result_name, round_outcomes, write_results
from coordinator.quality_gate import GateSettings, GateSetup
from coordinator.settings import RoundSettings
from fleet.config import SimConfig
from fleet.simulate import simulate
from models.evaluation.separation import Scores
from protocol.messages import TrainingConfig


def run_one(args, data: Path, rule: str, attack: str | None, dp_noise: float | None = None) -> dict:
    name = f"{rule}-{attack or 'clean'}" + (f"-dp{dp_noise:g}" if dp_noise is not None else "")
    training = TrainingConfig(algorithm="fedavg", dfc=False, dp_clip=args.dp_clip if dp_noise is not None else None)
    config = SimConfig(data=str(data), holdout_identities=0.1, clients=args.clients, partition="iid", patience=0,
                       public_identities=0.0, workers=args.workers, centralized=False, init="face", mlflow=False,
                       malicious=args.malicious if attack else 0.0, attack=attack or "scaled",
                       server=RoundSettings(rounds=args.rounds, combine=rule, dp_noise=dp_noise or 0.0,
                                            training=training))
    done = args.runs / name / "summary.json"
    print(f"== {name}", flush=True)
    summary = json.loads(done.read_text()) if args.reuse and done.exists() else simulate(config, args.runs / name)
    outcome = round_outcomes(args.runs / name)
    privacy = summary.get("privacy") or {}
    final = summary["history"][-1]  # the model after the last round (not the simulator's best round)
    dp = "-" if dp_noise is None else f"clip {args.dp_clip:g}, z {dp_noise:g}"
    return {"rule": rule, "attack": attack or "none (clean)", "malicious": f"{config.malicious:.0%}", "DP-FedAvg": dp,
            "epsilon (delta 1e-5)": "-" if dp_noise is None or privacy.get("epsilon") is None else privacy["epsilon"],
            "global AUC": final["holdout_auc"], "global EER": final["holdout_eer"],
            "clipped updates": sum(r["metrics"].get("clipped_updates", 0) for r in outcome["rounds"]),
            "rounds completed": outcome["completed"], "rounds rolled back": outcome["rolled_back"],
            "s/round": summary["round_seconds_mean"]}


def published_scores(run: Path, faces) -> Scores:
    """The run's last published model, scored on `faces` (models.evaluation.separation)."""
    from coordinator.store import Store
    from models.evaluation.separation import score

    store = Store(run / "coordinator")
    version, state, _ = store.latest_model()
    return score(state, faces, threads=2)


def run_collapse(args, set_name: str, clients: int, malicious: float, rule: str, attack: str | None, gate: bool,
                 eval_faces, public: Path) -> tuple[dict, Scores]:
    data = face_set(None, set_name)
    name = f"{set_name}-{rule}-{attack or 'clean'}-{'gate' if gate else 'nogate'}"
    if gate and args.gate_far_ratio != GateSettings().far_ratio:
        name += f"-far-ratio{args.gate_far_ratio:g}"
    server = RoundSettings(rounds=args.rounds, combine=rule, training=TrainingConfig(algorithm="fedavg", dfc=False))
    config = SimConfig(data=str(data), clients=clients, partition="iid", patience=0, workers=args.workers,
                       centralized=False, init="face", malicious=malicious if attack else 0.0,
                       attack=attack or "scaled", mlflow=False, holdout_identities=0.2, eval_clients=1,
                       public_identities=0.0, server=server,
                       gate=GateSetup(data=str(public) if gate else None, off=not gate,
                                      bar=GateSettings(far_ratio=args.gate_far_ratio)))
    done = args.runs / name / "summary.json"
    print(f"== {name}", flush=True)
    summary = json.loads(done.read_text()) if args.reuse and done.exists() else simulate(config, args.runs / name)
    from coordinator.store import Store

    store, outcome = Store(args.runs / name / "coordinator"), round_outcomes(args.runs / name)
    refused = sum(1 for r in outcome["rounds"] for u in store.accepted_updates(r["round_id"])
                  if u["metrics"].get("global_adopted") == 0.0)
    final = summary["history"][-1]
    scores = published_scores(args.runs / name, eval_faces)
    return {"data": f"{set_name} ({clients} devices)", "rule": rule, "attack": attack or "none (clean)",
            "malicious": f"{config.malicious:.0%}", "quality gate": "on" if gate else "off",
            "held-out AUC (sim)": final["holdout_auc"], "Glint24 AUC": round(scores.auc, 4),
            "rounds rolled back": outcome["rolled_back"], "rounds completed": outcome["completed"],
            "devices refused": refused, "s/round": summary["round_seconds_mean"]}, scores


def main_collapse(args, command: str) -> int:
    from coordinator.quality_gate import load_faces

    faces = faces_dir()
    if faces is None:
        print("no face data (set FFR_FACES_DIR)", file=sys.stderr)
        return 2
    eval_faces = load_faces(faces / "glint24_aligned", 480, seed=1)
    public = faces / "utkface_aligned"
    rows: list[dict] = []
    plan = [("celeba_subset", 10, 0.2), ("orl", 3, 1 / 3)]
    for set_name, clients, malicious in plan:
        if set_name not in args.sets:
            continue
        # the defaults first (clean, then attacked), then the attack against each rule without the gate
        runs = [("mean", None, True), ("mean", "collapse", True)] + [(rule, "collapse", False) for rule in args.rules]
        clean_scores = None
        for rule, attack, gate in runs:
            row, scores = run_collapse(args, set_name, clients, malicious, rule, attack, gate, eval_faces, public)
            if clean_scores is None:
                clean_scores = scores
            from models.evaluation.thresholds import threshold_at_far

            threshold, _ = threshold_at_far(clean_scores.impostor, 1e-3)
            row["FAR at clean 1e-3 threshold"] = round(float((scores.impostor > threshold).mean()), 5)
            row["AUC vs clean"] = round(row["Glint24 AUC"] - clean_scores.auc, 4)
            rows.append(row)
            write_results(args.out, args.name, {"rounds": args.rounds, "complete": False}, rows,
                          f"The collapse attack and its defences, {args.rounds} rounds", command)
    write_results(args.out, args.name, {"rounds": args.rounds, "complete": True}, rows,
                  f"The collapse attack and its defences, {args.rounds} rounds", command)
    return 0


def run_insider(args, data: Path, attack: str | None, attackers: int) -> dict:
    """One `ffr fleet simulate` at its defaults (the coordinator's own people for its gate, the devices' defaults)
    with `attackers` devices running `attack` (issue 48's insiders: drift, impersonate); None: the clean run."""
    name = f"insider-{attack or 'clean'}-{attackers if attack else 0}"
    malicious = attackers / args.clients if attack else 0.0
    config = SimConfig(data=str(data), clients=args.clients, partition="iid", patience=0, workers=args.workers,
                       centralized=False, mlflow=False, malicious=malicious, attack=attack or "scaled",
                       eval_clients=1, public_identities=0.0, server=RoundSettings(rounds=args.rounds))
    done = args.runs / name / "summary.json"
    print(f"== {name}", flush=True)
    summary = json.loads(done.read_text()) if args.reuse and done.exists() else simulate(config, args.runs / name)
    outcome, history = round_outcomes(args.runs / name), summary["history"]
    found = summary.get("attack") or {}
    start, last = history[0].get("holdout_far@start"), history[-1].get("holdout_far@start")
    return {"attack": attack or "none (clean)", "attackers": len(found.get("attackers", [])),
            "held-out AUC start": history[0]["holdout_auc"], "held-out AUC last": history[-1]["holdout_auc"],
            "FAR at start threshold": last, "x start": last / start if start else None,
            "success on victim's device": found.get("success_rate", "-"),
            "success, global model": found.get("success_rate_global", "-"),
            "success, start model": found.get("success_rate_start", "-"),
            "rounds completed": outcome["completed"], "rounds rolled back": outcome["rolled_back"],
            "left out (device-rounds)": sum(len(r["metrics"].get("gate_excluded_devices", []))
                                           for r in outcome["rounds"]),
            "screened out (device-rounds)": sum(len(r["metrics"].get("screen_excluded_devices", []))
                                                for r in outcome["rounds"]),
            "attackers screened out (device-rounds)": sum(
                len(set(r["metrics"].get("screen_excluded_devices", [])) & set(found.get("attackers", [])))
                for r in outcome["rounds"]),
            "s/round": summary["round_seconds_mean"]}


def main_insider(args, command: str) -> int:
    data = face_set(args.data)
    if data is None:
        print("no face data (set FFR_FACES_DIR)", file=sys.stderr)
        return 2
    plan = [(None, 0)] + [(attack, n) for attack in args.insider_attacks for n in args.attackers]
    rows: list[dict] = []
    for attack, n in plan:
        rows.append(run_insider(args, data, attack, n))
        write_results(args.out, args.name, {"rounds": args.rounds, "clients": args.clients,
                                            "complete": len(rows) == len(plan)}, rows,
                      f"Insiders who know the defences, {args.clients} devices, {args.rounds} rounds, defaults",
                      command)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--runs", type=Path, default=Path("bench/results/robust_runs"), help="simulation run folders")
    parser.add_argument("--data", type=Path, help="default $FFR_FACES_DIR/celeba_subset")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--malicious", type=float, default=0.2)
    parser.add_argument("--attacks", nargs="+", default=["scaled", "sign-flip", "wipe"])
    parser.add_argument("--rules", nargs="*", default=["mean", "trimmed-mean", "median", "krum"],
                        help="combination rules to attack (collapse suite: those without the gate; none: only the "
                             "gate's two runs)")
    parser.add_argument("--clean-rules", nargs="+", default=["mean"],
                        help="rules also run without attackers (the first is the reference; default mean)")
    parser.add_argument("--dp", nargs="*", type=float, default=[0.01, 1.0], metavar="Z",
                        help="DP-FedAvg rows (clean, mean): one per noise multiplier z (default 0.01 1.0)")
    parser.add_argument("--dp-clip", type=float, default=2.0,
                        help="DP-FedAvg clipping norm (default 2.0, about an honest update's norm here)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reuse", action="store_true", help="read runs that already have a summary.json")
    parser.add_argument("--suite", choices=("rules", "collapse", "insider"), default="rules",
                        help="rules: the boosting attacks against each rule (robust.md); collapse: the collapse attack "
                             "against the rules, the quality gate and the devices' adoption check "
                             "(robust_collapse.md); insider: drift and impersonation at the defaults (--name, e.g. "
                             "robust_insider)")
    parser.add_argument("--insider-attacks", nargs="+", default=["impersonate", "drift"],
                        help="insider suite: the attacks (default impersonate drift)")
    parser.add_argument("--attackers", nargs="+", type=int, default=[1, 2],
                        help="insider suite: runs with this many attacking devices each (default 1 2)")
    parser.add_argument("--sets", nargs="+", default=["celeba_subset", "orl"], help="collapse suite's data sets")
    parser.add_argument("--gate-far-ratio", type=float, default=GateSettings().far_ratio,
                        help="collapse suite: the quality gate's bar, as `ffr coordinator serve --gate-far-ratio` "
                             f"(default {GateSettings().far_ratio:g})")
    parser.add_argument("--name", type=result_name, default="robust_collapse",
                        help="collapse suite's results file name")
    args = parser.parse_args(argv)
    command = "python -m bench.robust " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.suite == "collapse":
        return main_collapse(args, command)
    if args.suite == "insider":
        return main_insider(args, command)
    data = face_set(args.data)
    if data is None:
        return 2
    plan = [(rule, None, None) for rule in args.clean_rules]
    plan += [(rule, attack, None) for attack in args.attacks for rule in args.rules]
    plan += [("mean", None, z) for z in args.dp]
    rows: list[dict] = []
    command = "python -m bench.robust " + " ".join(argv if argv is not None else sys.argv[1:])
    for rule, attack, z in plan:  # the table is rewritten after every run: a long benchmark shows progress
        rows.append(run_one(args, data, rule, attack, z))
        clean = rows[0]["global AUC"]
        for row in rows:
            row["AUC vs clean FedAvg"] = round(row["global AUC"] - clean, 4)
        write_results(args.out, "robust", {"data": str(data), "clients": args.clients, "rounds": args.rounds,
                                           "malicious": args.malicious, "complete": len(rows) == len(plan)}, rows,
                      f"Robust aggregation: {args.malicious:.0%} of {args.clients} devices malicious, "
                      f"{args.rounds} rounds, {data.name}", command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
