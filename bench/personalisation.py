"""How a device's personalised model is fitted, setting by setting: each device's own people against strangers.

The federation issue asks a device's personalised model for 10 points of TAR@FAR=1e-3 on its own people above the
starting model's, at the same FAR on strangers. A device's personalised model is the global backbone with a DFC
branch fitted on its features (`edge_client.local_training.personalised_global`), and that fit does not change the
backbone, so its settings can be compared on one backbone without any round: the starting model's, as every
device holds it before round 1. Each arm differs only in `TrainingConfig`'s DFC fields (`--arm NAME:k=v,...`);
the devices and strangers are `bench.honest_round`'s (the same partition, people of no device as strangers).

    python -m bench.personalisation --out bench/results \\
        --arm defaults: --arm steps1000:dfc_steps=1000 --arm views4:dfc_views=4 --arm lr3e-2:dfc_lr=0.03
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from bench.common import write_results
from bench.honest_round import BASE, _mean, _n, add_fleet_options, device_crops, fleet_data, own_vs_strangers, parse_arm
from edge_client.local_training import personalised_global
from fleet.evaluation import embed
from models.networks.face_model import global_embedder, initial_global_state
from protocol.messages import TrainingConfig


def score_arm(data, strangers: np.ndarray, state: dict, overrides: dict, seed: int) -> dict:
    """Mean over devices of TAR@1e-3 on their own people against strangers, with the arm's personalised model."""
    config = TrainingConfig(**{**BASE, **overrides})
    torch_state = {k: torch.from_numpy(v.copy()) for k, v in state.items()}
    images, per_device = data.crops.images, {}
    for k in data.training_clients:
        model = personalised_global(torch_state, device_crops(data, k), config, seed + k)
        row = own_vs_strangers(data, k, lambda idx: embed(model, images[idx], True), strangers)
        if row is not None:
            per_device[str(k)] = row
    return {"overrides": overrides, "tar@1e-3": _mean([r["tar@1e-3"] for r in per_device.values()]),
            "tar@1e-2": _mean([r["tar@1e-2"] for r in per_device.values()]), "per_client": per_device}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_fleet_options(p, "personalisation", "dirichlet")
    args = p.parse_args(argv)
    fleet = fleet_data(args)
    if fleet is None:
        print("no labelled faces: set FFR_FACES_DIR or give --data", file=sys.stderr)
        return 2
    data, strangers, _, _ = fleet
    state, images = initial_global_state(), data.crops.images
    model = global_embedder(state)
    rows = {str(k): row for k in data.training_clients
            if (row := own_vs_strangers(data, k, lambda idx: embed(model, images[idx]), strangers)) is not None}
    results = {"partition": args.partition, "clients": args.clients,
               "start": {"tar@1e-3": _mean([r["tar@1e-3"] for r in rows.values()]),
                         "tar@1e-2": _mean([r["tar@1e-2"] for r in rows.values()]), "per_client": rows}, "arms": {}}
    print(f"start (no personalisation): own TAR@1e-3 {_n(results['start']['tar@1e-3'])}", flush=True)
    for text in args.arm or ["defaults:"]:
        name, overrides = parse_arm(text)
        started = time.perf_counter()
        results["arms"][name] = score_arm(data, strangers, state, overrides, args.seed)
        arm = results["arms"][name]
        gain = (arm["tar@1e-3"] - results["start"]["tar@1e-3"]
                if None not in (arm["tar@1e-3"], results["start"]["tar@1e-3"]) else None)
        print(f"{name} {overrides or 'defaults'}: own TAR@1e-3 {_n(arm['tar@1e-3'])} "
              f"({'n/a' if gain is None else f'{gain:+.3f}'}; {time.perf_counter() - started:.0f} s)", flush=True)
        table = [{"arm": "start", "settings": "the starting model, no personalisation",
                  "tar@1e-3": results["start"]["tar@1e-3"], "tar@1e-2": results["start"]["tar@1e-2"]}]
        table += [{"arm": n, "settings": ", ".join(f"{k}={v}" for k, v in a["overrides"].items()) or "defaults",
                   "tar@1e-3": a["tar@1e-3"], "tar@1e-2": a["tar@1e-2"]} for n, a in results["arms"].items()]
        write_results(args.out, args.name, results, table,
                      f"Personalised models fitted on the starting backbone, {args.clients} CelebA devices, "
                      f"{args.partition}: own people against strangers (mean over devices)",
                      "python -m bench.personalisation " + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
