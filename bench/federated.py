"""Federated runtime costs: bytes per update, aggregation time and memory, round overhead.

python -m bench.federated --out bench/results
- bytes: one device's backbone delta (the real MobileNetV2-1.0 embedder) in fp32 and fp16,
  and the number of MQTT messages at the default 256 KiB chunk size;
- aggregation: decode + streaming weighted mean + FedAvg step for 10, 100 and 1,000 updates,
  wall time and peak Python-tracked memory (tracemalloc sees numpy's buffers);
- round overhead: a coordinator and 10 in-process devices over the embedded mosquitto, the
  time of each round not spent in the slowest device's local training.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from bench.common import write_results
from coordinator.aggregation import FedAvg, RunningMean
from models.face_model import initial_global_state
from protocol.chunks import DEFAULT_CHUNK_BYTES, split
from protocol.tensors import decode, encode


def random_delta(state: dict[str, np.ndarray], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (rng.normal(0, 1e-3, v.shape).astype(np.float32) if v.dtype.kind == "f" else np.zeros_like(v))
            for k, v in state.items()}


def bytes_rows(state: dict[str, np.ndarray]) -> list[dict]:
    rows = []
    n_params = int(sum(v.size for v in state.values()))
    for dtype in ("fp32", "fp16"):
        encoded = encode(random_delta(state), dtype)
        chunks = split("bench", encoded.data, DEFAULT_CHUNK_BYTES)
        rows.append({"payload": f"backbone delta {dtype}", "parameters": n_params, "bytes": len(encoded.data),
                     "MiB": len(encoded.data) / 2**20, "mqtt_messages_at_256KiB": len(chunks) + 1,
                     "framing_overhead_bytes": sum(len(c.transfer_id) + 120 for c in chunks)})
    return rows


def aggregation_rows(state: dict[str, np.ndarray], counts: list[int]) -> list[dict]:
    encoded = encode(random_delta(state), "fp16")
    expected = {k: v.shape for k, v in state.items()}
    rows = []
    for n in counts:
        tracemalloc.start()
        start = time.perf_counter()
        mean = RunningMean()
        for i in range(n):
            mean.add(decode(encoded.data, encoded.sha256, expected), weight=10 + i % 7)
        FedAvg().aggregate(state, mean.mean())
        seconds = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rows.append({"updates": n, "seconds": seconds, "ms_per_update": 1000 * seconds / n,
                     "peak_MiB": peak / 2**20, "model_MiB_fp32": sum(v.nbytes for v in state.values()) / 2**20})
    return rows


def round_overhead_rows(n_devices: int, rounds: int) -> list[dict]:
    from coordinator.engine import RoundSettings
    from coordinator.service import Service, ServiceConfig
    from edge_client.daemon import EdgeDevice
    from models.faces.datasets import SYNTHETIC_MARKER
    from models.faces.synthetic import identity_name, write_dataset
    from protocol.messages import TrainingConfig

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        full = write_dataset(tmp / "all", 2 * n_devices, 3, seed=0)
        service = Service(ServiceConfig(state=tmp / "state"),
                          RoundSettings(rounds=rounds, min_clients=n_devices, round_timeout_s=600,
                                        training=TrainingConfig(epochs=1, batch_size=8, lr=1e-3)))
        devices = []
        for d in range(n_devices):
            data = tmp / f"d{d}"
            data.mkdir()
            for i in (2 * d, 2 * d + 1):
                shutil.copytree(full / identity_name(i), data / identity_name(i))
            (data / SYNTHETIC_MARKER).write_text("synthetic")
            devices.append(EdgeDevice(service.admit(f"dev{d:02d}"), data, tmp / f"h{d}", export_onnx=False))
        for device in devices:
            device.start()
        while not service.finished:
            time.sleep(0.2)
        rows = []
        store = service.engine.store
        for r in store.rounds():
            updates = store.accepted_updates(r["round_id"])
            metrics = [u["metrics"] for u in updates]
            wall = r["closed_at"] - r["started_at"]
            slowest = max(m["fetch_seconds"] + m["train_seconds"] for m in metrics)
            rows.append({"round": r["round_id"], "devices": len(metrics), "round_wall_s": wall,
                         "slowest_device_fetch_plus_train_s": slowest, "overhead_s": wall - slowest,
                         "mean_fetch_s": float(np.mean([m["fetch_seconds"] for m in metrics])),
                         "aggregation_s": r["metrics"]["aggregation_seconds"],
                         "bytes_up_total": int(sum(u["bytes"] for u in updates))})
        for device in devices:
            device.stop()
        service.close()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--updates", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    state = initial_global_state()
    command = "python -m bench.federated " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(args.out, "federated_bytes", {}, bytes_rows(state), "Bytes per device per round", command)
    write_results(args.out, "federated_aggregation", {}, aggregation_rows(state, args.updates),
                  "Coordinator aggregation (decode + streaming FedAvg), MobileNetV2-1.0 backbone", command)
    write_results(args.out, "federated_round_overhead", {}, round_overhead_rows(args.devices, args.rounds),
                  f"Round overhead, {args.devices} in-process devices, embedded mosquitto, 2 cores", command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
