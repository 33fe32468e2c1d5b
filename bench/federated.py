"""Federated runtime costs: bytes per update, aggregation time and memory, round overhead.

python -m bench.federated --out bench/results
- bytes: one device's backbone delta (the real MobileNetV2-1.0 embedder) under each codec,
  and the number of MQTT messages at the default 256 KiB chunk size;
- aggregation: per update, what the coordinator does on accepting it (match the signed sha256,
  decode and check, norm and clip, fold into the float32 running mean) for 10 to 1,000 updates per codec,
  split by phase,
  beside two floors measured in the same run (numpy adding the same wire arrays into a float32
  accumulator; the bytes touched over the machine's copy bandwidth), and the peak Python-tracked
  memory of 1,000 (tracemalloc sees numpy's buffers); the robust rules' memory for n updates;
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
from safetensors.numpy import load

from bench.common import write_results
from coordinator.aggregation import FedAvg, RunningMean
from coordinator.robust import combine, l2_norm
from models.maths.state_norms import clip_scale
from models.networks.face_model import initial_global_state
from protocol.chunks import DEFAULT_CHUNK_BYTES, split
from protocol.codecs import CODECS, TOPK_FRACTION, Staging, decode_update, decode_verified, encode_update, layout
from protocol.tensors import check_sha256


def random_delta(state: dict[str, np.ndarray], seed: int = 0, scale: float = 2e-4) -> dict[str, np.ndarray]:
    """An update at the scale of real ones: the first CelebA FedAvg round (bench.fleet, face init) moved the
    median weight by 1.4e-4, which 2e-4 * 0.674 matches; 23% of those values are float16 subnormals."""
    rng = np.random.default_rng(seed)
    return {k: (rng.normal(0, scale, v.shape).astype(np.float32) if v.dtype.kind == "f" else np.zeros_like(v))
            for k, v in state.items()}


def bytes_rows(state: dict[str, np.ndarray]) -> list[dict]:
    rows = []
    n_params = int(sum(v.size for v in state.values()))
    fp32 = len(encode_update(random_delta(state), "fp32")[0].data)
    for codec, fraction in [(c, TOPK_FRACTION) for c in CODECS] + [("topk", 0.05)]:
        encoded, _ = encode_update(random_delta(state), codec, fraction)
        chunks = split("bench", encoded.data, DEFAULT_CHUNK_BYTES)
        label = f"codec {codec}" + (f" {fraction:.0%} kept" if codec == "topk" else "")
        rows.append(
            {
                "payload": f"backbone delta, {label}",
                "fraction_of_fp32": len(encoded.data) / fp32,
                "parameters": n_params,
                "bytes": len(encoded.data),
                "MiB": len(encoded.data) / 2**20,
                "mqtt_messages_at_256KiB": len(chunks) + 1,
                "framing_overhead_bytes": sum(len(c.transfer_id) + 120 for c in chunks),
            }
        )
    return rows


def memory_bandwidth_gbs(mib: int = 256, repeats: int = 5) -> float:
    """This machine's single-core copy bandwidth (read + write bytes per second), best of `repeats`."""
    src = np.ones(mib << 20, np.uint8)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeats))
    return 2 * src.nbytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fold_update(running: RunningMean, staging: Staging, data: bytes, sha256: str, codec: str, shapes: dict,
                kinds: dict, bound: float, weight: float, phases: dict) -> None:
    """What the coordinator does with each accepted update (coordinator.engine): match its bytes to the signed
    sha256 (the chunk reassembler's check), decode and check it into the reused staging tensors, take its norm,
    fold it into the running mean clipped to the bound; each phase's seconds added to `phases`."""
    t0 = time.perf_counter()
    check_sha256(data, sha256)
    t1 = time.perf_counter()
    delta = decode_verified(data, codec, shapes, kinds, into=staging)
    t2 = time.perf_counter()
    norm = l2_norm(delta)
    scale = clip_scale(norm, bound)
    t3 = time.perf_counter()
    running.add(delta, weight, scale)
    t4 = time.perf_counter()
    for name, seconds in (("hash", t1 - t0), ("decode", t2 - t1), ("norm_clip", t3 - t2), ("fold", t4 - t3)):
        phases[name] = phases.get(name, 0.0) + seconds


def aggregation_rows(state: dict[str, np.ndarray], counts: list[int], codecs: list[str]) -> list[dict]:
    """ms per update folded, by phase, beside two floors measured in the same run: numpy adding the same
    (already decoded) wire arrays into a float32 accumulator, and the bytes touched over memory bandwidth."""
    shapes, kinds = layout(state)
    model_bytes = sum(v.nbytes for v in state.values())
    bandwidth = memory_bandwidth_gbs()
    rows = []
    for codec in codecs:
        encoded, _ = encode_update(random_delta(state), codec)
        wire = load(encoded.data)
        for n in counts:
            phases: dict[str, float] = {}
            running, staging = RunningMean(), Staging(shapes, kinds, codec)
            start = time.perf_counter()
            for i in range(n):
                fold_update(running, staging, encoded.data, encoded.sha256, codec, shapes, kinds, 1e9, 10 + i % 7,
                            phases)
            FedAvg().aggregate(state, running.mean())
            seconds = time.perf_counter() - start
            floor = _numpy_floor(wire, n)
            touched = len(encoded.data) + 2 * model_bytes  # read the payload, read + write the accumulator
            peak = _peak_mib(state, shapes, kinds, encoded, codec, n)
            rows.append({"codec": codec, "updates": n, "payload_bytes": len(encoded.data), "peak_MiB": peak,
                         "seconds": seconds,
                         "ms_per_update": 1000 * seconds / n,
                         **{f"{k}_ms": 1000 * v / n for k, v in phases.items()},
                         "numpy_floor_ms": 1000 * floor,
                         "bandwidth_floor_ms": 1000 * touched / (bandwidth * 1e9), "bandwidth_GBps": bandwidth})
    return rows


def _numpy_floor(wire: dict[str, np.ndarray], n: int) -> float:
    """Seconds per update for `acc += x` over the wire's arrays as they are (no hashing, checking or decoding)."""
    acc = {k: np.zeros(v.shape, np.float32) for k, v in wire.items()}
    start = time.perf_counter()
    for _ in range(n):
        for k, v in wire.items():
            np.add(acc[k], v, out=acc[k], casting="unsafe")
    return (time.perf_counter() - start) / n


def _peak_mib(state, shapes, kinds, encoded, codec: str, n: int) -> float:
    """Peak Python-tracked memory (tracemalloc sees numpy's buffers) while folding n updates: O(model), not O(n)."""
    tracemalloc.start()
    running, staging = RunningMean(), Staging(shapes, kinds, codec)
    for i in range(n):
        fold_update(running, staging, encoded.data, encoded.sha256, codec, shapes, kinds, 1e9, 1.0, {})
    FedAvg().aggregate(state, running.mean())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / 2**20


def robust_rows(state: dict[str, np.ndarray], n: int) -> list[dict]:
    """The coordinate-wise rules hold every update at once: time and peak memory for n of them."""
    shapes, kinds = layout(state)
    encoded, _ = encode_update(random_delta(state), "fp16")
    rows = []
    for rule in ("trimmed-mean", "median", "krum"):
        tracemalloc.start()
        start = time.perf_counter()
        deltas = [decode_update(encoded.data, encoded.sha256, "fp16", shapes, kinds) for _ in range(n)]
        combine(deltas, [1.0] * n, rule)
        seconds = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del deltas
        rows.append({"rule": rule, "updates": n, "ms_per_update": 1000 * seconds / n, "peak_MiB": peak / 2**20,
                     "peak_per_update_MiB": peak / 2**20 / n})
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
    parser.add_argument("--codecs", nargs="+", choices=CODECS, default=["fp16", "int8", "topk"])
    parser.add_argument("--robust-updates", type=int, default=50, help="updates held at once by the robust rules")
    parser.add_argument("--only", choices=("bytes", "aggregation", "overhead"), nargs="+",
                        default=["bytes", "aggregation", "overhead"])
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    state = initial_global_state()
    command = "python -m bench.federated " + " ".join(argv if argv is not None else sys.argv[1:])
    if "bytes" in args.only:
        write_results(args.out, "federated_bytes", {}, bytes_rows(state), "Bytes per device per round", command)
    if "aggregation" in args.only:
        write_results(args.out, "federated_aggregation", {}, aggregation_rows(state, args.updates, args.codecs),
                      "Coordinator aggregation: sha256 + decode + check + clip + fold into the running mean, per "
                      "update, MobileNetV2-1.0 backbone, one thread (torch's float16 copy may use a second core)",
                      command)
        write_results(args.out, "federated_robust_memory", {}, robust_rows(state, args.robust_updates),
                      "Robust rules hold every update (float32) at once: time and peak memory", command)
    if "overhead" in args.only:
        write_results(args.out, "federated_round_overhead", {}, round_overhead_rows(args.devices, args.rounds),
                      f"Round overhead, {args.devices} in-process devices, embedded mosquitto, 2 cores", command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
