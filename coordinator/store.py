"""The coordinator's durable state: model versions as safetensors files, history in SQLite.

Everything needed to resume after a crash is here: registered devices and their keys, the
last sequence number seen from each (replay protection survives restarts), every round
with its outcome, and every global model version.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from protocol.tensors import sha256_hex

SCHEMA = """
CREATE TABLE IF NOT EXISTS devices (
    device_id TEXT PRIMARY KEY, key TEXT NOT NULL, registered_at REAL, last_seen REAL,
    last_seq INTEGER DEFAULT -1, rounds_joined INTEGER DEFAULT 0, n_images INTEGER, n_identities INTEGER);
CREATE TABLE IF NOT EXISTS rounds (
    round_id INTEGER PRIMARY KEY, status TEXT, base_version INTEGER, new_version INTEGER,
    started_at REAL, deadline REAL, closed_at REAL, participants TEXT, n_updates INTEGER DEFAULT 0,
    n_dropped INTEGER DEFAULT 0, metrics TEXT, reason TEXT);
CREATE TABLE IF NOT EXISTS updates (
    round_id INTEGER, device_id TEXT, n_samples INTEGER, accepted INTEGER, reason TEXT, bytes INTEGER,
    received_at REAL, metrics TEXT, PRIMARY KEY (round_id, device_id));
CREATE TABLE IF NOT EXISTS models (
    version INTEGER PRIMARY KEY, sha256 TEXT, path TEXT, created_at REAL, round_id INTEGER);
CREATE TABLE IF NOT EXISTS rejections (at REAL, sender TEXT, topic TEXT, reason TEXT);
"""


class Store:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        (self.root / "models").mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self.db = sqlite3.connect(self.root / "coordinator.sqlite", check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)
        self.db.row_factory = sqlite3.Row

    def _q(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self.db.execute(sql, args).fetchall()

    # models ---------------------------------------------------------------
    def save_model(self, version: int, state: dict[str, np.ndarray], round_id: int | None) -> str:
        """Write the version's file atomically, then record it: a crash leaves either both or neither."""
        path = self.root / "models" / f"v{version:05d}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file({k: np.asarray(v).copy(order="C") for k, v in state.items()}, str(tmp))
        tmp.replace(path)
        digest = sha256_hex(path.read_bytes())
        self._q("INSERT OR REPLACE INTO models VALUES (?,?,?,?,?)", (version, digest, path.name, time.time(), round_id))
        return digest

    def latest_model(self) -> tuple[int, dict[str, np.ndarray], str] | None:
        rows = self._q("SELECT version, path, sha256 FROM models ORDER BY version DESC LIMIT 1")
        if not rows:
            return None
        path = self.root / "models" / rows[0]["path"]
        return rows[0]["version"], load_file(str(path)), rows[0]["sha256"]

    def _model_file(self, version: int) -> Path | None:
        rows = self._q("SELECT path FROM models WHERE version=?", (version,))
        return self.root / "models" / rows[0]["path"] if rows else None

    def load_model(self, version: int) -> dict[str, np.ndarray] | None:
        path = self._model_file(version)
        return load_file(str(path)) if path else None

    def model_bytes(self, version: int) -> bytes | None:
        path = self._model_file(version)
        return path.read_bytes() if path else None

    def models(self) -> list[dict]:
        return [dict(r) for r in self._q("SELECT * FROM models ORDER BY version")]

    # devices --------------------------------------------------------------
    def register(self, device_id: str, key: str, n_images: int, n_identities: int) -> None:
        now = time.time()
        self._q("INSERT INTO devices (device_id, key, registered_at, last_seen, n_images, n_identities) "
                "VALUES (?,?,?,?,?,?)", (device_id, key, now, now, n_images, n_identities))

    def device_keys(self) -> dict[str, str]:
        return {r["device_id"]: r["key"] for r in self._q("SELECT device_id, key FROM devices")}

    def last_seqs(self) -> dict[str, int]:
        return {r["device_id"]: r["last_seq"] for r in self._q("SELECT device_id, last_seq FROM devices")}

    def seen(self, device_id: str, seq: int) -> None:
        self._q("UPDATE devices SET last_seen=?, last_seq=MAX(last_seq, ?) WHERE device_id=?", (time.time(), seq, device_id))

    def devices(self) -> list[dict]:
        return [{k: r[k] for k in r.keys() if k != "key"} for r in self._q("SELECT * FROM devices ORDER BY device_id")]

    # rounds ---------------------------------------------------------------
    def open_round(self, round_id: int, base_version: int, deadline: float, participants: list[str]) -> None:
        self._q("INSERT OR REPLACE INTO rounds (round_id, status, base_version, started_at, deadline, participants) "
                "VALUES (?,?,?,?,?,?)", (round_id, "open", base_version, time.time(), deadline, json.dumps(participants)))

    def close_round(self, round_id: int, status: str, new_version: int | None, n_updates: int, n_dropped: int,
                    metrics: dict, reason: str = "") -> None:
        self._q("UPDATE rounds SET status=?, new_version=?, closed_at=?, n_updates=?, n_dropped=?, metrics=?, reason=? "
                "WHERE round_id=?", (status, new_version, time.time(), n_updates, n_dropped, json.dumps(metrics),
                                     reason, round_id))
        if status == "completed":
            for device in json.loads(self._q("SELECT participants FROM rounds WHERE round_id=?", (round_id,))[0][0]):
                if self.update_accepted(round_id, device):
                    self._q("UPDATE devices SET rounds_joined=rounds_joined+1 WHERE device_id=?", (device,))

    def abort_open_rounds(self, reason: str) -> int:
        rows = self._q("SELECT round_id FROM rounds WHERE status='open'")
        self._q("UPDATE rounds SET status='aborted', closed_at=?, reason=? WHERE status='open'", (time.time(), reason))
        return len(rows)

    def rounds(self) -> list[dict]:
        out = []
        for r in self._q("SELECT * FROM rounds ORDER BY round_id"):
            row = dict(r)
            row["participants"] = json.loads(row["participants"] or "[]")
            row["metrics"] = json.loads(row["metrics"] or "{}")
            out.append(row)
        return out

    def completed_rounds(self) -> int:
        return self._q("SELECT COUNT(*) FROM rounds WHERE status='completed'")[0][0]

    def next_round_id(self) -> int:
        return (self._q("SELECT MAX(round_id) FROM rounds")[0][0] or 0) + 1

    def record_update(self, round_id: int, device_id: str, n_samples: int, accepted: bool, reason: str,
                      n_bytes: int, metrics: dict) -> None:
        self._q("INSERT OR REPLACE INTO updates VALUES (?,?,?,?,?,?,?,?)",
                (round_id, device_id, n_samples, int(accepted), reason, n_bytes, time.time(), json.dumps(metrics)))

    def accepted_updates(self, round_id: int) -> list[dict]:
        rows = self._q("SELECT * FROM updates WHERE round_id=? AND accepted=1", (round_id,))
        return [{**dict(r), "metrics": json.loads(r["metrics"] or "{}")} for r in rows]

    def update_accepted(self, round_id: int, device_id: str) -> bool:
        return bool(self._q("SELECT 1 FROM updates WHERE round_id=? AND device_id=? AND accepted=1", (round_id, device_id)))

    def record_rejection(self, sender: str, topic: str, reason: str) -> None:
        self._q("INSERT INTO rejections VALUES (?,?,?,?)", (time.time(), sender, topic, reason))

    def rejections(self) -> list[dict]:
        return [dict(r) for r in self._q("SELECT * FROM rejections ORDER BY at")]

    # server optimiser state (FedAvgM velocity) ------------------------------
    def save_strategy_state(self, state: dict[str, np.ndarray] | None) -> None:
        if state:
            path = self.root / "strategy_state.safetensors"
            save_file({k: np.asarray(v).copy(order="C") for k, v in state.items()}, str(path.with_suffix(".tmp")))
            path.with_suffix(".tmp").replace(path)

    def load_strategy_state(self) -> dict[str, np.ndarray] | None:
        path = self.root / "strategy_state.safetensors"
        return load_file(str(path)) if path.exists() else None
