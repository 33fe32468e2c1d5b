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


def _write_private_crops(data, clients: list[int], private_dir: Path) -> None:
    """Each client's training crops, written once: Ray actors read their own file, not the whole dataset."""
    from fleet.data import TRAIN
    from models.faces.splits import relabel

    private_dir.mkdir(exist_ok=True)
    for k in clients:
        crops = data.union(TRAIN, [k])
        crops = relabel(crops, np.unique(crops.labels))
        np.savez(private_dir / f"client-{k:03d}.npz", images=crops.images, labels=crops.labels,
                 identities=np.array(crops.identities))


def _client_crops(private_dir: Path, k: int):
    from models.faces.crops import CropReport, FaceCrops

    with np.load(private_dir / f"client-{k:03d}.npz") as saved:
        return FaceCrops(saved["images"], saved["labels"], saved["identities"].tolist(), [], CropReport())


def _client_app(config, clients: list[int], private_dir: Path):
    """Flower's client: one local round of this project's `train_round`; the private head and DFC stay on disk."""
    import torch
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from safetensors.torch import load_file, save_file

    from edge_client.local_training import train_round
    from models.networks.face_model import FaceModel, ModelConfig, private_state, shareable_state
    from protocol.methods import FedAvg

    local = config.training  # the simulated devices' local round, as the fleet run sent it
    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        k = clients[int(context.node_config["partition-id"])]
        crops = _client_crops(private_dir, k)
        model = FaceModel(ModelConfig(n_classes=len(crops.identities), width_mult=local.model.width_mult,
                                      pretrained=False, dfc=local.model.dfc, dfc_weight=local.model.dfc_weight))
        saved = private_dir / f"client-{k:03d}.safetensors"
        if saved.exists():
            model.load_state_dict(load_file(str(saved)), strict=False)
        global_state = msg.content["arrays"].to_torch_state_dict()
        round_no = int(msg.content["config"]["server-round"])
        training = time.perf_counter()
        result = train_round(model, crops, global_state, local.model_copy(update={"method": FedAvg()}),
                             seed=config.seed * 1000 + k + round_no)
        save_file({n: v.contiguous() for n, v in private_state(model).items()}, str(saved))
        content = RecordDict({"arrays": ArrayRecord(shareable_state(model)),
                              "metrics": MetricRecord({"train_loss": result.metrics["train_loss"],
                                                       "train_seconds": time.perf_counter() - training,
                                                       "num-examples": result.n_samples})})
        return Message(content=content, reply_to=msg)

    return client_app


def _timed_fedavg(stats: dict):
    """Flower's FedAvg, counting the arrays it sends and receives and timing each round into `stats`."""
    from flwr.serverapp.strategy import FedAvg

    class TimedFedAvg(FedAvg):
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

    return TimedFedAvg


def _server_app(config, n_clients: int, rounds: int, stats: dict, final: dict):
    """Flower's server: FedAvg from the fleet run's starting model for its rounds; the result goes to `final`."""
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp

    from models.networks.face_model import from_numpy_state, initial_global_state

    server_app = ServerApp()

    @server_app.main()
    def main_fn(grid: Grid, context: Context) -> None:
        initial = initial_global_state(config.training.model.width_mult, 128, config.init)
        strategy = _timed_fedavg(stats)(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n_clients,
                                        min_available_nodes=n_clients)
        started = time.perf_counter()
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(from_numpy_state(initial)),
                                train_config=ConfigRecord({}), num_rounds=rounds)
        final["seconds"] = time.perf_counter() - started
        final["arrays"] = result.arrays

    return server_app


def _figures(stats: dict, final: dict, wall: float, n_clients: int, report: dict) -> dict:
    rounds = len(stats["round_s"])
    return {"framework": "flwr", "rounds": rounds, "clients": n_clients, "wall_seconds": wall,
            "strategy_seconds": final["seconds"], "round_seconds_mean": float(np.mean(stats["round_s"])),
            "bytes_down": stats["bytes_down"], "bytes_up": stats["bytes_up"],
            "bytes_up_per_round": stats["bytes_up"] / max(1, rounds),
            "train_seconds_mean": float(np.mean(stats["train_s"])),
            "aggregation_seconds_mean": float(np.mean(stats["aggregation_s"])),
            "global_auc": report.get("auc"), "global_eer": report.get("eer")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, type=Path, help="a finished `ffr fleet simulate` run folder")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--workers", type=int, default=2, help="clients trained at once (Ray actors)")
    args = parser.parse_args(argv)

    from flwr.simulation import run_simulation

    from fleet.config import SimConfig
    from fleet.data import prepare
    from models.evaluation.evaluate import verification
    from models.networks.face_model import global_embedder

    config = SimConfig.load(args.run / "config.json")
    config.progress = False
    data = prepare(config, args.run)
    clients = data.training_clients
    private_dir = args.run / "flower_private"
    _write_private_crops(data, clients, private_dir)
    history = json.loads((args.run / "state.json").read_text())["history"]
    rounds = sum(h["round"] > 0 for h in history)  # round 0 is the starting model
    stats = {"bytes_down": 0, "bytes_up": 0, "round_started": [], "round_s": [], "train_s": [], "aggregation_s": []}
    final = {}
    started = time.perf_counter()
    run_simulation(server_app=_server_app(config, len(clients), rounds, stats, final),
                   client_app=_client_app(config, clients, private_dir), num_supernodes=len(clients),
                   backend_config={"client_resources": {"num_cpus": max(1, (os.cpu_count() or 2) // args.workers)}})
    wall = time.perf_counter() - started
    model = global_embedder(final["arrays"].to_torch_state_dict(), config.training.model.width_mult)  # int buffers back
    report, _ = verification(model, data.holdout(), config.max_eval_pairs, config.seed)
    out = _figures(stats, final, wall, len(clients), report)
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
