"""`ffr fleet simulate`: the real coordinator and the real edge client, over a real broker, on partitioned faces.

The simulator only plays the parts a real fleet has no one for: it hands each device its
share of a dataset, lets a small process pool run the devices' turns, opens one round at a
time (so it can evaluate the global model between rounds and stop early), and finally
measures everything against a centrally trained upper bound. Every step leaves its state in
the run folder, so Ctrl-C and running the same command again picks up where it stopped.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from coordinator.service import Service, ServiceConfig, check_port_free
from edge_client.home import DeviceHome
from fleet.attack_report import AttackReport
from fleet.config import SimConfig
from fleet.data import (
    TRAIN,
    VAL,
    FleetData,
    crop_cache,
    device_id,
    prepare,
    write_device_folders,
    write_people,
)
from fleet.devices import DevicePool, Turn
from fleet.evaluation import flat
from fleet.final_report import FinalEvaluation
from fleet.report import write_summary
from models.evaluation.evaluate import unseen_people, verification
from models.networks.backbone import FaceEmbedder
from models.networks.face_model import global_embedder
from models.progress import bar_disable
from models.training.tracking import MlflowTracker, NullTracker, default_tracking_uri
from protocol.json_file import json_object, read_json

log = logging.getLogger("ffr.fleet")


@dataclass
class RunState:
    """What the run folder remembers between invocations (rewritten atomically after every round)."""

    history: list[dict] = field(default_factory=list)
    status: str = "running"
    mlflow_run_id: str | None = None
    elapsed_s: float = 0.0

    @classmethod
    def load(cls, path: Path) -> RunState:
        """The run folder's state, or a fresh one; a damaged or foreign file is refused in one line."""
        return read_json(path, "ffr fleet simulate", "choose another --out", _run_state) if path.exists() else cls()

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)


def _run_state(raw) -> RunState:
    """state.json's shape: RunState's fields, its history a list of objects."""
    state = RunState(**json_object(raw))
    if not (isinstance(state.history, list) and all(isinstance(row, dict) for row in state.history)):
        raise TypeError("history is not a list of rounds")
    return state


START_FAR = 1e-3  # the operating point whose threshold, on the starting model, every round is judged at


def should_stop(history: list[dict], patience: int, min_delta: float) -> bool:
    """True after `patience` rounds without a validation AUC at least `min_delta` above the best before."""
    if patience <= 0 or len(history) <= patience:
        return False
    scores = [h.get("select_auc") for h in history]
    if any(s is None for s in scores):
        return False
    best_before = max(scores[:-patience])
    return max(scores[-patience:]) < best_before + min_delta


class Simulation:
    def __init__(self, config: SimConfig, run_dir: Path):
        config.validate()
        if config.dashboard_port:  # taken: said now, not as uvicorn's log line after the dashboard URL was printed
            check_port_free("127.0.0.1", config.dashboard_port, "--dashboard-port")
        self.config, self.run_dir = config, Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._check_resume()
        self.data: FleetData = prepare(config, self.run_dir)  # every data/partition error surfaces here
        self.val = self.data.union(VAL, self.data.training_clients)  # evaluation sets, built once
        self.holdout = self.data.holdout()
        self.public_set = self._public_set()
        if self.public_set is None and config.training.method.uses_public_set():
            raise ValueError(f"hard negatives need a public set: the {len(self.data.partition.holdout_identities)} "
                             "people on no device are too few to spare --public-identities "
                             f"{config.public_identities:g} of them for one; give --public-data DIR (aligned faces of "
                             "people no client has) or --no-hard-negatives")
        config.save(self.run_dir / "config.json")
        self.state_path = self.run_dir / "state.json"
        self.state = RunState.load(self.state_path)
        self.cores = os.cpu_count() or 1
        self.turn_seconds: dict[int, list[float]] = {}  # round id -> each device's whole turn, start to stop
        self.attacks = AttackReport(config, self.data, self.run_dir, self._global_model)

    def _check_resume(self) -> None:
        path = self.run_dir / "config.json"
        if path.exists():
            changed = self.config.differences(SimConfig.load(path))
            if changed:
                raise ValueError(f"{self.run_dir} holds another simulation ({'; '.join(changed)}); "
                                 "run the same command to resume it, or choose another --out")

    # setup ------------------------------------------------------------------
    def _public_set(self) -> Path | None:
        """D_g packed once per run (models.public_set) from --public-data, else from the public people
        (`fleet.data.public_people`); every device reads the same read-only file."""
        c = self.config
        source = (Path(c.public_data) if c.public_data is not None
                  else write_people(self.data, self.data.public_people, self.run_dir / "public_faces"))
        if source is None:
            return None
        path = self.run_dir / "public_set.safetensors"
        if not path.exists():
            from models.public_set import build_public_set

            build_public_set(source, path, c.public_limit, c.seed, progress=c.progress)
        return path

    def _service(self) -> Service:
        """The coordinator as `ffr coordinator serve` runs it, on the spec's server and gate parts; rounds start when
        the simulator opens them, and any one device's update may close a round (the quorum of one). Its gate judges
        on --gate-data, else on its own people (`fleet.data.coordinator_people`), else on the public set."""
        c = self.config
        own = write_people(self.data, self.data.gate_people, self.run_dir / "coordinator_faces")
        gate = replace(c.gate, data=c.gate.data or own or self.public_set)
        return Service(ServiceConfig(state=self.run_dir / "coordinator", broker=c.broker, init=c.init,
                                     start_paused=True, gate=gate), replace(c.server, min_clients=1))

    def _turn(self, client: int, round_id: int | None) -> Turn:
        root = self.run_dir / "devices" / device_id(client)
        public = str(self.public_set) if self.public_set is not None else None
        return Turn(str(root / "credential.json"), str(root / "data"), str(root / "home"), self.service.broker_url,
                    str(crop_cache(self.config)), self.data.detector, self.config.seed * 1000 + client, round_id,
                    self.config.server.round_timeout_s, self.attacks.kind_for(client), public,
                    attack_bound=self.service.engine.view.norm_bound(),
                    attack_epochs=self.config.training.optimisation.epochs,
                    attack_share=1.0 / max(1, len(self.data.training_clients)),
                    attack_photos=str(self.attacks.photos) if self.attacks.photos else None)

    # the run ----------------------------------------------------------------
    def run(self) -> dict:
        c = self.config
        started = time.time()
        write_device_folders(self.data, self.run_dir / "devices")
        tracker = MlflowTracker(default_tracking_uri(self.run_dir), "ffr-fleet") if c.mlflow else NullTracker()
        tracker.start(self.run_dir.name, c.by_name(), self.state.mlflow_run_id)
        self.state.mlflow_run_id, self.state.status = tracker.run_id, "running"
        self.service = self._service()
        if c.dashboard_port:
            self._serve_dashboard(c.dashboard_port)
        pool = self._pool()
        validators = []
        try:
            self._register(pool)
            validators = self._start_validators()
            self._rounds(pool, tracker)
            pool.close()
        except BaseException as exc:
            pool.terminate()
            for device in validators:
                device.stop()
            self.service.close()
            self.state.status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
            self.state.elapsed_s += time.time() - started
            self.state.save(self.state_path)
            tracker.end("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            raise
        for device in validators:
            device.stop()
        self.service.close()
        summary = self._finish(tracker, started)
        tracker.end()
        return summary

    def _serve_dashboard(self, port: int) -> None:
        """The coordinator's HTTP API and dashboard for the length of the run (127.0.0.1 only)."""
        import threading

        import uvicorn

        from coordinator.api import create_app

        server = uvicorn.Server(uvicorn.Config(create_app(self.service), host="127.0.0.1", port=port,
                                               log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        tqdm.write(f"dashboard: http://127.0.0.1:{port}/dashboard#token={self.service.api_token}")

    def _pool(self):
        """The device runner: the process pool (default), or Ray tasks locally or on a cluster."""
        c = self.config
        if c.backend == "ray":
            from fleet.ray_pool import RayPool

            return RayPool(c.ray_address, c.cpus_per_device, c.gpus_per_device,
                           num_cpus=None if c.ray_address else max(1, c.workers))
        return DevicePool(c.workers, max(1, self.cores // c.workers))

    def _start_validators(self) -> list:
        """FedFace's validators: the first held-out clients, online for the whole run in this process, each scoring
        candidates on its own training and validation images (its test images stay for the final report)."""
        if not self.config.server.fv:
            return []
        from edge_client.daemon import EdgeDevice

        devices = []
        clients = sorted(self.data.partition.heldout_clients)[:self.config.fv_validators]
        folders = write_device_folders(self.data, self.run_dir / "devices", clients, (TRAIN, VAL))
        for k in clients:
            root = self.run_dir / "devices" / device_id(k)
            if not (root / "credential.json").exists() or device_id(k) not in self.service.engine.view.registered():
                self.service.admit(device_id(k), root / "credential.json")
            device = EdgeDevice(root / "credential.json", folders[k], root / "home", broker=self.service.broker_url,
                                detector=self.data.detector, export_onnx=False, crop_cache=crop_cache(self.config),
                                validation=folders[k])
            device.start()
            if not device.registered.wait(120):
                raise RuntimeError(f"validator {device_id(k)} could not register")
            devices.append(device)
        return devices

    def _register(self, pool: DevicePool) -> None:
        """The simulator is the operator too: it admits its own devices, then each joins with its credential."""
        known = self.service.engine.view.registered()
        new = [k for k in self.data.training_clients if device_id(k) not in known]
        for k in new:
            self.service.admit(device_id(k), self.run_dir / "devices" / device_id(k) / "credential.json")
        turns = [self._turn(k, None) for k in new]
        for result in tqdm(pool.run(turns), total=len(turns), desc="registering devices", unit="device",
                           disable=bar_disable(self.config.progress and turns)):
            if not result["ok"]:
                raise RuntimeError(f"{result['device_id']} could not register: {result.get('error')}")

    def _rounds(self, pool: DevicePool, tracker) -> None:
        c, engine = self.config, self.service.engine
        view = engine.view
        self._catch_up(tracker)
        while view.finished_rounds() < c.server.rounds:
            if should_stop(self.state.history, c.patience, c.min_delta):
                self.state.status = "early_stopped"
                tqdm.write(f"early stop: no validation AUC gain of {c.min_delta} in {c.patience} rounds")
                return
            current = engine.open_round()
            if current is None:
                raise RuntimeError("the coordinator opened no round: no device is registered")
            round_started = time.time()
            self._run_devices(pool, current.round_id, current.participants)
            self._close(current.round_id)
            row = view.round(current.round_id)
            if row["status"] == "rolled_back":  # the coordinator refused the new model; the run goes on from the old
                tqdm.write(f"round {current.round_id} rolled back by the coordinator: {row['reason']}")
            elif row["status"] != "completed":  # every device failed: retrying the same thing would loop forever
                raise RuntimeError(f"round {current.round_id} failed ({row['reason']}); see the device errors above")
            self._catch_up(tracker, wall_s=time.time() - round_started)
        self.state.status = "completed"

    def _run_devices(self, pool: DevicePool, round_id: int, participants: list[str]) -> None:
        clients = [int(d.removeprefix("client-")) for d in participants]
        view = self.service.engine.view
        turns = [self._turn(k, round_id) for k in clients if not view.update_accepted(round_id, device_id(k))]
        number = view.finished_rounds() + 1
        bar = tqdm(pool.run(turns), total=len(turns), desc=f"round {number}/{self.config.server.rounds}", unit="device",
                   disable=bar_disable(self.config.progress))
        for result in bar:
            if result["ok"]:
                self.turn_seconds.setdefault(round_id, []).append(result["turn_seconds"])
                bar.set_postfix(device=result["device_id"], loss=f"{result.get('train_loss', float('nan')):.3f}")
            else:
                tqdm.write(f"  {result['device_id']}: dropped from round {round_id}: {result.get('error')}")

    def _close(self, round_id: int, grace_s: float = 10.0) -> None:
        """Wait for the coordinator to aggregate; devices that failed are given up on after `grace_s`."""
        engine, waited = self.service.engine, time.monotonic()
        while True:
            view = engine.round_view()
            if view is None or view.round_id != round_id:
                return
            if time.monotonic() - waited > grace_s:
                engine.close_round(round_id)
            time.sleep(0.1)

    def _catch_up(self, tracker, wall_s: float | None = None) -> None:
        """Evaluate every aggregated round not yet in the history (also the one a Ctrl-C interrupted)."""
        seen = {h["round_id"] for h in self.state.history}
        initial = {"round_id": 0, "status": "completed", "new_version": 0, "base_version": 0, "n_updates": 0,
                   "n_dropped": 0, "participants": [], "metrics": {}, "started_at": 0, "closed_at": 0}
        for row in [initial, *self.service.engine.view.rounds()]:  # round 0: the starting model, for reference
            if row["status"] != "completed" or row["round_id"] in seen:
                continue
            record = self._round_record(row, wall_s if row["round_id"] else 0.0)
            self.state.history.append(record)
            self.state.save(self.state_path)
            tracker.log_metrics(record, record["round"])
            shown = " ".join(f"{k}={record[k]:.4f}" for k in ("train_loss", "train_acc", "val_auc", "holdout_auc",
                                                              "holdout_eer") if record.get(k) is not None)
            tqdm.write(f"round {record['round']}: {shown} ({record['updates']} updates, "
                       f"{record['bytes_up'] / 1e6:.1f} MB up)")

    def _device_mean(self, row: dict, key: str) -> float | None:
        """The mean of a figure devices log but never send (e.g. FedFR's hard-negative fraction), read from their
        homes: the simulator runs the devices, so it may look in."""
        values = [e[key] for d in row["participants"]
                  for e in DeviceHome(self.run_dir / "devices" / d / "home").rounds_log()
                  if e.get("round_id") == row["round_id"] and e.get(key) is not None]
        return float(np.mean(values)) if values else None

    def _round_record(self, row: dict, wall_s: float | None) -> dict:
        """Cost and global-model quality of one aggregated round (round 0: the starting model)."""
        m = row["metrics"]
        version = row["new_version"]
        model = self._global_model(version)
        record = {"round": len(self.state.history), "round_id": row["round_id"], "model_version": version,
                  "updates": row["n_updates"], "dropped": row["n_dropped"],
                  "train_loss": m.get("mean_train_loss"), "train_acc": m.get("mean_train_acc"),
                  "bytes_up": m.get("bytes_received", 0),
                  # the wire (fp16) size
                  "bytes_down": self.service.engine.view.model_bytes() * len(row["participants"]),
                  "wall_s": wall_s if wall_s is not None else (row["closed_at"] or 0) - (row["started_at"] or 0),
                  "aggregation_s": m.get("aggregation_seconds"),
                  "hn_fraction": self._device_mean(row, "hn_fraction"),
                  **{f"{phase}_s": self._device_mean(row, f"{phase}_seconds")
                     for phase in ("fetch", "train", "upload")},
                  # the device's start (connect, register, wait for the job) and stop are the rest of its turn
                  "turn_s": float(np.mean(self.turn_seconds[row["round_id"]]))
                  if self.turn_seconds.get(row["round_id"]) else None}
        evaluating = time.perf_counter()
        self._eval_threads()
        val_report, _ = verification(model, self.val, self.config.max_eval_pairs, self.config.seed)
        hold_report, raw = unseen_people(model, self.holdout, self.config.max_eval_pairs, self.config.seed)
        record.update({f"val_{k}": v for k, v in flat(val_report).items() if k in ("auc", "eer")})
        record.update({f"holdout_{k}": v for k, v in flat(hold_report).items()})
        record.update(impostors_at_start(raw, self.state.history))
        record["holdout_interval"] = hold_report.get("interval")
        # the best round and early stopping watch people no device holds (what the federation must not make worse);
        # the devices' own validation images only when there are no such people: they can rise while those fall
        unseen = record.get("holdout_auc")
        record["select_auc"] = unseen if unseen is not None else record.get("val_auc")
        record["eval_s"] = time.perf_counter() - evaluating
        quality = {k: float(record[f"holdout_{k}"]) for k in ("auc", "eer") if record.get(f"holdout_{k}") is not None}
        if quality:  # the coordinator's dashboard plots it (the operator's evaluation: the simulator holds the faces)
            self.service.record_evaluation(version, quality, "fleet simulator, held-out people")
        return record

    def _eval_threads(self) -> None:
        torch.set_num_threads(self.cores)

    def _global_model(self, version: int) -> FaceEmbedder:
        return global_embedder(self.service.engine.view.model(version), self.config.training.model.width_mult)

    # the end ----------------------------------------------------------------
    def _finish(self, tracker, started: float) -> dict:
        self._eval_threads()
        final = FinalEvaluation(self.config, self.data, self.run_dir, self.holdout)
        result = final.evaluate(self.state.history, self._global_model)
        self.state.elapsed_s += time.time() - started
        self.state.save(self.state_path)
        rolled_back = [r for r in self.service.engine.view.rounds() if r["status"] == "rolled_back"]
        privacy = None if self.config.training.dp_clip is None else privacy_spent(self.service.engine.view.rounds())
        summary = final.summary(result, self.state, tracker.run_id, privacy, rolled_back)
        if self.config.malicious > 0:
            summary["attack"] = self.attacks.summary(self.state.history)
        paths = write_summary(summary, self.run_dir)
        tracker.log_metrics(_final_metrics(summary), len(self.state.history))
        for path in [*result.figures.values(), *paths]:
            tracker.log_artifact(path)
        return summary


def privacy_spent(rounds: list[dict]) -> dict:
    """DP-FedAvg's privacy spent after the last completed round, from the round log's metrics."""
    done = [r for r in rounds if r["status"] == "completed"]
    last = done[-1]["metrics"] if done else {}
    return {k.removeprefix("dp_"): last.get(k) for k in ("dp_epsilon", "dp_delta", "dp_noise_multiplier", "dp_clip",
                                                         "dp_q")}


def impostors_at_start(raw: tuple | None, history: list[dict]) -> dict:
    """The impostors let in on unseen people at the starting model's FAR=1e-3 threshold (a device calibrated on
    the start holds that threshold): over the run, a drift shows here even when each round looked small."""
    if raw is None:
        return {}
    from models.evaluation.thresholds import threshold_at_far

    scores, same = raw
    start = history[0].get("holdout_start_threshold") if history else None
    if start is None:
        start = threshold_at_far(scores[~same], START_FAR)[0]
    return {"holdout_start_threshold": float(start), "holdout_far@start": float(np.mean(scores[~same] > start))}


def _final_metrics(summary: dict) -> dict:
    out = {f"final_global_{k}": v for k, v in summary["global"].items() if isinstance(v, float)}
    for name, stats in summary["personalized"]["training_clients"].items():
        for metric, value in stats.items():
            if isinstance(value, dict):
                out[f"final_personalized_{name}_{metric}_mean"] = value["mean"]
                out[f"final_personalized_{name}_{metric}_std"] = value["std"]
    if summary["centralized"]:
        out.update({f"final_centralized_{k}": v for k, v in summary["centralized"]["global"].items()
                    if isinstance(v, float)})
    return out


def simulate(config: SimConfig, run_dir: Path) -> dict:
    return Simulation(config, run_dir).run()
