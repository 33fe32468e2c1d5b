"""The peer: the same federated run in Flower's simulation (FedAvg, Ray backend), for `bench.fleet`.

python -m bench.flower_peer --run RUN_DIR --out RESULT.json   (in a venv with flwr[simulation])

It reads a finished `ffr fleet simulate` run folder and repeats its federated part with Flower:
the same crops, partition and per-image splits (`fleet.data.prepare` on the saved config and
partition), the same model (backbone + private CosFace head + DFC branch per client, kept on
disk between rounds), the same local training function (`edge_client.local_training.train_round`),
the same rounds, epochs, batch size and learning rate, and the same global evaluation on unseen
people. Bytes are the arrays Flower carries (fp32 backbone both ways); Flower's own framing is
not counted.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, type=Path, help="a finished `ffr fleet simulate` run folder")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--workers", type=int, default=2, help="clients trained at once (Ray actors)")
    args = parser.parse_args(argv)

    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation
    from safetensors.torch import load_file, save_file

    from edge_client.local_training import train_round
    from fleet.config import SimConfig
    from fleet.data import TRAIN, prepare
    from models.evaluation.evaluate import verification
    from models.faces.splits import relabel
    from models.networks.face_model import (
        FaceModel,
        ModelConfig,
        from_numpy_state,
        global_embedder,
        initial_global_state,
        private_state,
        shareable_state,
    )

    config = SimConfig.load(args.run / "config.json")
    config.progress = False
    local = config.training  # the simulated devices' local round, as the fleet run sent it
    data = prepare(config, args.run)
    clients = data.training_clients
    private_dir = args.run / "flower_private"
    private_dir.mkdir(exist_ok=True)
    stats = {"bytes_down": 0, "bytes_up": 0, "round_started": [], "round_s": [], "train_s": [], "aggregation_s": []}

    # each client's training crops, written once: Ray actors read their own file, not the whole dataset
    for k in clients:
        crops = data.union(TRAIN, [k])
        crops = relabel(crops, np.unique(crops.labels))
        np.savez(private_dir / f"client-{k:03d}.npz", images=crops.images, labels=crops.labels,
                 identities=np.array(crops.identities))

    def client_crops(k: int):
        from models.faces.crops import CropReport, FaceCrops

        with np.load(private_dir / f"client-{k:03d}.npz") as saved:
            return FaceCrops(saved["images"], saved["labels"], saved["identities"].tolist(), [], CropReport())

    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        k = clients[int(context.node_config["partition-id"])]
        crops = client_crops(k)
        model = FaceModel(ModelConfig(n_classes=len(crops.identities), width_mult=local.width_mult, pretrained=False,
                                      dfc=local.dfc, dfc_weight=local.dfc_weight))
        saved = private_dir / f"client-{k:03d}.safetensors"
        if saved.exists():
            model.load_state_dict(load_file(str(saved)), strict=False)
        global_state = msg.content["arrays"].to_torch_state_dict()
        round_no = int(msg.content["config"]["server-round"])
        training = time.perf_counter()
        result = train_round(model, crops, global_state, local.epochs, local.batch_size, local.lr,
                             0.0, seed=config.seed * 1000 + k + round_no, objective=local)
        save_file({n: v.contiguous() for n, v in private_state(model).items()}, str(saved))
        content = RecordDict({"arrays": ArrayRecord(shareable_state(model)),
                              "metrics": MetricRecord({"train_loss": result.metrics["train_loss"],
                                                       "train_seconds": time.perf_counter() - training,
                                                       "num-examples": result.n_samples})})
        return Message(content=content, reply_to=msg)

    class TimedFedAvg(FedAvg):
        """Flower's FedAvg, counting the arrays it sends and receives and timing each round."""

        def configure_train(self, server_round, arrays, config_record, grid):
            stats["round_started"].append(time.perf_counter())
            messages = list(super().configure_train(server_round, arrays, config_record, grid))
            stats["bytes_down"] += sum(m.content["arrays"].count_bytes() for m in messages)
            return messages

        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            stats["bytes_up"] += sum(r.content["arrays"].count_bytes() for r in replies if r.has_content())
            stats["train_s"] += [float(r.content["metrics"]["train_seconds"]) for r in replies if r.has_content()]
            aggregating = time.perf_counter()
            out = super().aggregate_train(server_round, replies)
            stats["aggregation_s"].append(time.perf_counter() - aggregating)
            stats["round_s"].append(time.perf_counter() - stats["round_started"][-1])
            return out

    final = {}
    server_app = ServerApp()

    @server_app.main()
    def main_fn(grid: Grid, context: Context) -> None:
        initial = initial_global_state(local.width_mult, 128, config.init)
        strategy = TimedFedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=len(clients),
                               min_available_nodes=len(clients))
        started = time.perf_counter()
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(from_numpy_state(initial)),
                                train_config=ConfigRecord({}),
                                num_rounds=sum(h["round"] > 0 for h in  # round 0 is the starting model
                                               json.loads((args.run / "state.json").read_text())["history"]))
        final["seconds"] = time.perf_counter() - started
        final["arrays"] = result.arrays

    started = time.perf_counter()
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=len(clients),
                   backend_config={"client_resources": {"num_cpus": max(1, (os.cpu_count() or 2) // args.workers)}})
    wall = time.perf_counter() - started
    model = global_embedder(final["arrays"].to_torch_state_dict(), local.width_mult)  # integer buffers cast back
    report, _ = verification(model, data.holdout(), config.max_eval_pairs, config.seed)
    rounds = len(stats["round_s"])
    out = {"framework": "flwr", "rounds": rounds, "clients": len(clients), "wall_seconds": wall,
           "strategy_seconds": final["seconds"], "round_seconds_mean": float(np.mean(stats["round_s"])),
           "bytes_down": stats["bytes_down"], "bytes_up": stats["bytes_up"],
           "bytes_up_per_round": stats["bytes_up"] / max(1, rounds),
           "train_seconds_mean": float(np.mean(stats["train_s"])),
           "aggregation_seconds_mean": float(np.mean(stats["aggregation_s"])),
           "global_auc": report.get("auc"), "global_eer": report.get("eer")}
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
