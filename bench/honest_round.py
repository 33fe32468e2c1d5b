"""What honest federated rounds do to the shared model, setting by setting: start vs after, on the figures a device
lives by. The federation issue's measurement of why honest rounds degrade.

Each arm replays R rounds of N CelebA devices in one process, with the device's own round function
(`edge_client.local_training.train_round`), the coordinator's own mean (`coordinator.aggregation.RunningMean`,
`apply_delta`) and, as `ffr fleet simulate` gives it, its quality gate on its own people (a share of the people on
no device, `--gate-identities`): the server step chosen on them (`coordinator.server_step`) and the gate's verdict.
No broker: the figures depend only on the local training and what the coordinator does with the mean. After each
round it scores
  - the global model on people no device holds (AUC, TAR@FAR=1e-3 and 1e-4), and
  - each device's own people against strangers (people of no device, TAR@FAR=1e-3), with the global model and
    with the device's local model,
beside the starting model's same figures. Arms differ only in `TrainingConfig` fields (`--arm NAME:k=v,k=v`).

    python -m bench.honest_round --out bench/results --rounds 2 \
        --arm today: --arm bn_frozen:batchnorm=frozen --arm anchor10:embedding_reg=10
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.common import face_set, result_name, write_results
from coordinator.aggregation import RunningMean, apply_delta
from edge_client.local_training import personalised_global, train_round
from fleet.config import SimConfig
from fleet.data import TEST, TRAIN, FleetData, prepare
from fleet.evaluation import client_pairs, embed, flat
from models.evaluation.evaluate import unseen_people
from models.evaluation.metrics import cosine_scores, roc_report
from models.faces.splits import relabel
from models.networks.face_model import (
    FaceModel,
    ModelConfig,
    global_embedder,
    initial_global_state,
)
from protocol.messages import TrainingConfig

BASE = {"algorithm": "fedprox"}  # `ffr coordinator serve`'s and `ffr fleet simulate`'s default method


def parse_arm(text: str) -> tuple[str, dict]:
    """'name:k=v,k=v' -> (name, TrainingConfig overrides); values are JSON where they parse, else strings."""
    name, _, rest = text.partition(":")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return name, overrides


def device_crops(data: FleetData, client: int):
    train = data.union(TRAIN, [client])
    return relabel(train, np.unique(train.labels))


def own_vs_strangers(data: FleetData, client: int, embedder, strangers: np.ndarray) -> dict | None:
    """TAR@FAR of the client's own people's test images against strangers' images (people of no device); None
    when its test images hold no genuine pair."""
    own = np.flatnonzero(data.client_mask(client, TEST))
    pairs, same = client_pairs(data.crops.labels[own], len(strangers))
    if not same.any() or same.all():
        return None
    scores = cosine_scores(embedder(np.concatenate([own, strangers])), pairs)
    return flat(roc_report(scores, same))


def _mean(values: list) -> float | None:
    """The mean of the figures that could be measured (a device with too few pairs has None)."""
    kept = [v for v in values if isinstance(v, float)]
    return float(np.mean(kept)) if kept else None


def _n(value, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def score_round(data: FleetData, state: dict, locals_: dict[int, FaceModel], strangers: np.ndarray,
                max_pairs: int, seed: int, config: TrainingConfig | None = None) -> dict:
    model = global_embedder(state)
    unseen, _ = unseen_people(model, data.holdout(), max_pairs, seed)
    images = data.crops.images
    table = {}
    for k in data.training_clients:
        row = {"global": own_vs_strangers(data, k, lambda idx: embed(model, images[idx]), strangers)}
        if row["global"] is None:
            continue
        if k in locals_:
            mine = locals_[k]
            row["local"] = own_vs_strangers(data, k, lambda idx: embed(mine, images[idx]), strangers)
            if mine.dfc is not None:
                row["local+dfc"] = own_vs_strangers(data, k, lambda idx: embed(mine, images[idx], True), strangers)
                ours = personalised_global({k2: torch.from_numpy(v.copy()) for k2, v in state.items()},
                                           device_crops(data, k), config or TrainingConfig(), seed + k)
                row["global+dfc"] = own_vs_strangers(data, k, lambda idx: embed(ours, images[idx], True), strangers)
        table[k] = row
    per = {name: _mean([r[name]["tar@1e-3"] for r in table.values() if name in r])
           for name in ("global", "local", "local+dfc", "global+dfc") if any(name in r for r in table.values())}
    tar = unseen.get("tar_at_far", {})
    return {"unseen_auc": unseen.get("auc"), "unseen_tar@1e-3": tar.get("0.001"), "unseen_tar@1e-4": tar.get("0.0001"),
            "unseen_interval": unseen.get("interval"), "own_tar@1e-3": per,
            "per_client": {str(k): v for k, v in table.items()}}


def coordinator_gate(data: FleetData, seed: int):
    """The quality gate `ffr fleet simulate` gives the coordinator: its own people's faces (None without them)."""
    from coordinator.quality_gate import GateSettings, QualityGate
    from models.evaluation.separation import FaceSet

    if not data.gate_people:
        return None
    mask = data.gate_mask()
    return QualityGate(FaceSet(np.ascontiguousarray(data.crops.images[mask]), data.crops.labels[mask]),
                       GateSettings(seed=seed), "the coordinator's people")


def publish(gate, state: dict, aggregate: dict, round_id: int, start: dict, limit: float) -> tuple[dict, dict]:
    """What the coordinator publishes from the round's aggregate (`coordinator.round_aggregation.publishable`, no
    leave-out: every device here is honest; steps up to `limit`), anchored on the start; without a gate, the
    aggregate."""
    from coordinator.round_aggregation import publishable

    if gate is None:
        return aggregate, {}
    gate.anchor_on(lambda: start)
    chosen, problem, figures = publishable(gate, state, f"round-{round_id}", aggregate, limit=limit)
    return chosen, {**figures, "rolled_back": problem}


def screened_mean(deltas: dict[str, dict], weights: dict[str, float]) -> tuple[dict, dict, float]:
    """The round's mean as the coordinator forms it at its defaults: the update screen (`coordinator.update_screen`)
    admits and clips, then the sample-weighted mean; with what the screen did (every device here is honest, so any
    update left out is a false exclusion) and how far past the mean the server step may go (FedExP's eta)."""
    from coordinator.server_step import extrapolation_limit
    from coordinator.settings import RoundSettings
    from coordinator.update_screen import make_screen
    from models.maths.state_norms import l2_norm

    screen = make_screen(RoundSettings().screen)
    norms = {k: l2_norm(d) for k, d in deltas.items()}
    screening = screen.screen(list(deltas), {k: screen.observe(d) for k, d in deltas.items()}, norms)
    mean = RunningMean()
    for k in screening.admitted:
        mean.add(deltas[k], weights[k], screening.scales.get(k, 1.0))
    mean = mean.mean()
    limit = extrapolation_limit([norms[k] * screening.scales.get(k, 1.0) for k in screening.admitted],
                                [weights[k] for k in screening.admitted], l2_norm(mean))
    return mean, screening.metrics, limit


def run_arm(data: FleetData, overrides: dict, rounds: int, seed: int, max_pairs: int, strangers: np.ndarray,
            start_scores: dict, gate=None, on_round: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """Train and publish `rounds` honest rounds, scoring each; `on_round` sees the rows so far after every round, so
    that a run stopped half way keeps what it measured."""
    config = TrainingConfig(**{**BASE, **overrides})
    state = start = initial_global_state()
    rows: list[dict] = []
    for r in range(1, rounds + 1):
        locals_, deltas, weights, started = {}, {}, {}, time.perf_counter()
        torch_state = {k: torch.from_numpy(v.copy()) for k, v in state.items()}
        for k in data.training_clients:
            crops = device_crops(data, k)
            model = FaceModel(ModelConfig(n_classes=len(crops.identities), pretrained=False, dfc=config.model.dfc,
                                          dfc_weight=config.model.dfc_weight))
            result = train_round(model, crops, torch_state, config, seed=seed * 1000 + k + r)
            deltas[str(k)], weights[str(k)] = result.delta, result.n_samples
            locals_[k] = model.eval()
        mean, screened, limit = screened_mean(deltas, weights)
        state, published = publish(gate, state, apply_delta(state, mean), r, start, limit)
        published = {**published, **screened}
        scores = score_round(data, state, locals_, strangers, max_pairs, seed, config)
        scores.update(round=r, seconds=time.perf_counter() - started, coordinator=published)
        own, was = scores["own_tar@1e-3"], start_scores["own_tar@1e-3"]
        print(f"  round {r}: unseen AUC {_n(start_scores['unseen_auc'], 4)} -> {_n(scores['unseen_auc'], 4)}, "
              f"TAR@1e-3 {_n(start_scores['unseen_tar@1e-3'])} -> {_n(scores['unseen_tar@1e-3'])}; own people "
              f"TAR@1e-3 {_n(was['global'])} -> global {_n(own['global'])}, local {_n(own.get('local'))}, local+DFC "
              f"{_n(own.get('local+dfc'))}, global+DFC {_n(own.get('global+dfc'))} ({scores['seconds']:.0f} s)"
              + (f"; server step {published['server_step']:g} (FedExP limit {published['server_step_limit']:.2f}), "
                 f"{published['rolled_back'] or 'published'}"
                 if "server_step" in published else "")
              + (f"; screen left out {published['screen_excluded']}, clipped {published['screen_clipped']}"
                 if "screen_excluded" in published else ""), flush=True)
        rows.append(scores)
        on_round(rows)
    return rows


def centralised(data: FleetData, sim: SimConfig, rounds: int, out: Path, max_pairs: int, seed: int) -> dict:
    """The bound: the devices' model trained centrally on the union of their training images for as many epochs as
    the rounds, scored on the unseen people like the rounds' models."""
    from dataclasses import replace

    from fleet.centralized import train_centralized

    sim = replace(sim, server=replace(sim.server, rounds=rounds))
    model, _ = train_centralized(data, sim, out)
    unseen, _ = unseen_people(model.backbone.eval(), data.holdout(), max_pairs, seed)
    tar = unseen.get("tar_at_far", {})
    return {"unseen_auc": unseen.get("auc"), "unseen_tar@1e-3": tar.get("0.001"), "unseen_tar@1e-4": tar.get("0.0001"),
            "unseen_interval": unseen.get("interval"), "epochs": rounds}


def table(results: dict) -> list[dict]:
    """One row per arm and round, the start first."""
    def row(arm: str, settings: str, r: int, scores: dict) -> dict:
        own = scores["own_tar@1e-3"]
        published = scores.get("coordinator") or {}
        step = "-" if "server_step" not in published else (
            f"{published['server_step']:g}" + (" rolled back" if published["rolled_back"] else "")
            + (f" (limit {published['server_step_limit']:.2f})" if "server_step_limit" in published else ""))
        screened = "-" if "screen_excluded" not in published else (
            f"{published['screen_excluded']} out, {published['screen_clipped']} clipped")
        return {"arm": arm, "settings": settings, "round": r, "server step": step, "screen": screened,
                "unseen AUC": scores["unseen_auc"],
                "unseen TAR@1e-3": scores["unseen_tar@1e-3"], "unseen TAR@1e-4": scores["unseen_tar@1e-4"],
                "own TAR@1e-3 (global)": own["global"], "own TAR@1e-3 (local)": own.get("local", "-"),
                "own TAR@1e-3 (local+DFC)": own.get("local+dfc", "-"),
                "own TAR@1e-3 (global+DFC)": own.get("global+dfc", "-")}

    rows = [row("start", "shipped model", 0, results["start"])]
    if results.get("centralised"):
        c = results["centralised"]
        rows.append({"arm": "centralised", "settings": f"{c['epochs']} epochs on the devices' images", "round": "-",
                     "server step": "-", "screen": "-", "unseen AUC": c["unseen_auc"],
                     "unseen TAR@1e-3": c["unseen_tar@1e-3"],
                     "unseen TAR@1e-4": c["unseen_tar@1e-4"], "own TAR@1e-3 (global)": "-",
                     "own TAR@1e-3 (local)": "-", "own TAR@1e-3 (local+DFC)": "-"})
    for name, arm in results["arms"].items():
        settings = ", ".join(f"{k}={v}" for k, v in arm["overrides"].items()) or "defaults"
        rows += [row(name, settings, scores["round"], scores) for scores in arm["rounds"]]
    return rows


def add_fleet_options(p: argparse.ArgumentParser, name: str, partition: str) -> None:
    """The options `fleet_data` reads, and the arms (`parse_arm`), for this bench and `bench.personalisation`."""
    p.add_argument("--data", type=Path, help="labelled faces (default: $FFR_FACES_DIR/celeba_subset)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", type=result_name, default=name)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--partition", default=partition, help=f"how people are spread over devices (default {partition})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strangers", type=int, default=300, help="images of people of no device each device is tried on")
    p.add_argument("--gate-identities", type=float, default=0.3,
                   help="share of the people on no device the coordinator keeps for its server step and gate, as "
                        "`ffr fleet simulate` does (0: publish every aggregate)")
    p.add_argument("--arm", action="append", default=[], help="NAME:field=value,... (TrainingConfig fields)")


def fleet_data(args) -> tuple[FleetData, np.ndarray, SimConfig, Path] | None:
    """The devices' faces as `ffr fleet simulate` partitions them (`args`: data, clients, partition, seed,
    gate_identities, out, name) and the strangers' images each device is tried on; None without face data."""
    data_dir = face_set(args.data)
    if data_dir is None:
        return None
    torch.manual_seed(args.seed)
    sim = SimConfig(data=str(data_dir), clients=args.clients, partition=args.partition, holdout_identities=0.2,
                    public_identities=0.0, gate_identities=args.gate_identities, progress=False, mlflow=False)
    sim.server.seed = args.seed
    run_dir = args.out / f".{args.name}_data"
    run_dir.mkdir(parents=True, exist_ok=True)
    data = prepare(sim, run_dir)
    rng = np.random.default_rng(args.seed)
    holdout = np.flatnonzero(data.holdout_mask())
    strangers = np.sort(rng.choice(holdout, min(args.strangers, len(holdout)), replace=False))
    return data, strangers, sim, run_dir


def main(argv: list[str] | None = None) -> int:
    import sys

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_fleet_options(p, "honest_round", "iid")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-pairs", type=int, default=100_000)
    p.add_argument("--centralised", action="store_true",
                   help="also train the centralised bound on the union of the devices' training images (same budget "
                        "in epochs as the rounds, `fleet.centralized`) and score it on the unseen people")
    args = p.parse_args(argv)
    fleet = fleet_data(args)
    if fleet is None:
        return 2
    data, strangers, sim, run_dir = fleet
    start = score_round(data, initial_global_state(), {}, strangers, args.max_pairs, args.seed)
    print(f"start: unseen AUC {_n(start['unseen_auc'], 4)}, TAR@1e-3 {_n(start['unseen_tar@1e-3'])}; own people "
          f"TAR@1e-3 {_n(start['own_tar@1e-3']['global'])}", flush=True)
    gate = coordinator_gate(data, args.seed)
    results = {"clients": args.clients, "partition": args.partition, "start": start, "arms": {}}
    if args.centralised:
        results["centralised"] = centralised(data, sim, args.rounds, run_dir / "centralised", args.max_pairs,
                                             args.seed)
        print(f"centralised: unseen AUC {_n(results['centralised']['unseen_auc'], 4)}, TAR@1e-3 "
              f"{_n(results['centralised']['unseen_tar@1e-3'])}", flush=True)
    for text in args.arm or ["today:"]:
        name, overrides = parse_arm(text)
        print(f"arm {name}: {overrides or 'defaults'}", flush=True)
        arm = results["arms"][name] = {"overrides": overrides, "rounds": []}

        def save(rows: list[dict], arm: dict = arm) -> None:
            arm["rounds"] = list(rows)
            partial = "" if len(rows) == args.rounds else f" (so far: {len(rows)} of {args.rounds} rounds)"
            write_results(args.out, args.name, results, table(results),
                          f"Honest rounds, start vs after: {args.clients} CelebA devices, {args.partition} (unseen: "
                          "people no device holds; own: each device's people against strangers, mean TAR@1e-3 over "
                          f"devices){partial}", "python -m bench.honest_round " + " ".join(sys.argv[1:]))

        run_arm(data, overrides, args.rounds, args.seed, args.max_pairs, strangers, start, gate, on_round=save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
