"""The coordinator's durable state: model versions as safetensors files, history in SQLite.

Everything needed to resume after a crash is here: admitted devices and their public keys,
the last sequence number seen from each (replay protection survives restarts), every round
with its outcome, every global model version, and each accepted update of the open round
(written before it is acknowledged, so an acked update survives a crash).
"""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import threading
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from protocol.tensors import sha256_hex

SCHEMA = """
CREATE TABLE IF NOT EXISTS devices (
    device_id TEXT PRIMARY KEY, public_key TEXT NOT NULL, registered_at REAL, last_seen REAL,
    last_seq INTEGER DEFAULT -1, rounds_joined INTEGER DEFAULT 0, n_images INTEGER, n_identities INTEGER);
CREATE TABLE IF NOT EXISTS admissions (
    device_id TEXT PRIMARY KEY, token TEXT NOT NULL, issued_at REAL, used_at REAL);
CREATE TABLE IF NOT EXISTS rounds (
    round_id INTEGER PRIMARY KEY, status TEXT, base_version INTEGER, new_version INTEGER,
    started_at REAL, deadline REAL, closed_at REAL, participants TEXT, n_updates INTEGER DEFAULT 0,
    n_dropped INTEGER DEFAULT 0, metrics TEXT, reason TEXT);
CREATE TABLE IF NOT EXISTS updates (
    round_id INTEGER, device_id TEXT, n_samples INTEGER, accepted INTEGER, reason TEXT, bytes INTEGER,
    received_at REAL, metrics TEXT, PRIMARY KEY (round_id, device_id));
CREATE TABLE IF NOT EXISTS models (
    version INTEGER PRIMARY KEY, sha256 TEXT, path TEXT, created_at REAL, round_id INTEGER);
CREATE TABLE IF NOT EXISTS rejections (id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL, sender TEXT, topic TEXT,
    reason TEXT);
CREATE TABLE IF NOT EXISTS evaluations (model_version INTEGER PRIMARY KEY, at REAL, source TEXT, metrics TEXT);
CREATE TABLE IF NOT EXISTS robust_state (id INTEGER PRIMARY KEY CHECK (id = 1), state TEXT);
"""
MAX_REJECTIONS = 10_000   # the newest are kept; older ones are dropped (the count of all is kept in memory)
MAX_REASON_CHARS = 300


class StateError(ValueError):
    """A state folder this version cannot use (said in one line by `ffr`, as bad input is)."""


class Store:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        (self.root / "models").mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)  # admission tokens, keys and updates: the coordinator's user alone
        self._lock = threading.RLock()
        database = self.root / "coordinator.sqlite"
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT, 0o600))  # SQLite gives -wal/-shm the same mode
        os.chmod(database, 0o600)
        self.db = sqlite3.connect(database, check_same_thread=False, isolation_level=None)
        try:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.executescript(SCHEMA)
        except sqlite3.DatabaseError as exc:  # not SQLite, or damaged: named, not a traceback
            self.db.close()
            raise StateError(f"{database} is damaged or not an ffr-edge coordinator's ({exc}); move it away, or "
                             "give another --state") from None
        self.db.row_factory = sqlite3.Row
        columns = {r["name"] for r in self.db.execute("PRAGMA table_info(devices)")}
        if "public_key" not in columns:
            raise StateError(f"{self.root} was created by an older ffr-edge (devices with shared keys); "
                             "start from a new --state folder and admit the devices again")
        self.rejections_total = 0

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

    # devices ------------------------------------------------------------
    def register(self, device_id: str, public_key: str, n_images: int, n_identities: int) -> None:
        """A new device, or an admitted device's new key (re-enrolment restarts its sequence numbers)."""
        now = time.time()
        self._q("INSERT INTO devices (device_id, public_key, registered_at, last_seen, n_images, n_identities) "
                "VALUES (?,?,?,?,?,?) ON CONFLICT(device_id) DO UPDATE SET public_key=excluded.public_key, "
                "registered_at=excluded.registered_at, last_seq=-1, n_images=excluded.n_images, "
                "n_identities=excluded.n_identities", (device_id, public_key, now, now, n_images, n_identities))

    def device_keys(self) -> dict[str, str]:
        return {r["device_id"]: r["public_key"] for r in self._q("SELECT device_id, public_key FROM devices")}

    def device_images(self) -> dict[str, int]:
        return {r["device_id"]: r["n_images"] for r in self._q("SELECT device_id, n_images FROM devices")}

    def last_seqs(self) -> dict[str, int]:
        return {r["device_id"]: r["last_seq"] for r in self._q("SELECT device_id, last_seq FROM devices")}

    def seen(self, device_id: str, seq: int) -> None:
        self._q(
            "UPDATE devices SET last_seen=?, last_seq=MAX(last_seq, ?) WHERE device_id=?", (time.time(), seq, device_id)
        )

    def devices(self) -> list[dict]:
        return [dict(r) for r in self._q("SELECT * FROM devices ORDER BY device_id")]

    # admissions: one-time tokens the operator hands to a device out of band ----
    def admit(self, device_id: str, token: str) -> None:
        self._q("INSERT OR REPLACE INTO admissions VALUES (?,?,?,NULL)", (device_id, token, time.time()))

    def admission_token(self, device_id: str) -> str | None:
        """The device's token while it is unused; None once used or never issued."""
        rows = self._q("SELECT token FROM admissions WHERE device_id=? AND used_at IS NULL", (device_id,))
        return rows[0]["token"] if rows else None

    def admitted_never_seen(self) -> list[dict]:
        """Devices admitted by the operator that have never registered: {device_id, admitted_at}."""
        rows = self._q("SELECT device_id, issued_at FROM admissions WHERE device_id NOT IN "
                       "(SELECT device_id FROM devices) ORDER BY device_id")
        return [{"device_id": r["device_id"], "admitted_at": r["issued_at"]} for r in rows]

    def use_admission(self, device_id: str) -> None:
        self._q("UPDATE admissions SET used_at=? WHERE device_id=?", (time.time(), device_id))

    # rounds ---------------------------------------------------------------
    def open_round(self, round_id: int, base_version: int, deadline: float, participants: list[str]) -> None:
        self._q(
            "INSERT OR REPLACE INTO rounds (round_id, status, base_version, started_at, deadline, participants) "
            "VALUES (?,?,?,?,?,?)",
            (round_id, "open", base_version, time.time(), deadline, json.dumps(participants)),
        )

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

    def finished_rounds(self) -> int:
        """Rounds that count toward --rounds: aggregated, or rolled back (their model refused)."""
        return self._q("SELECT COUNT(*) FROM rounds WHERE status IN ('completed', 'rolled_back')")[0][0]

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
        return bool(
            self._q("SELECT 1 FROM updates WHERE round_id=? AND device_id=? AND accepted=1", (round_id, device_id))
        )

    def record_rejection(self, sender: str, topic: str, reason: str) -> None:
        """Truncated and capped: a flood of hostile messages cannot fill the disk."""
        self._q("INSERT INTO rejections (at, sender, topic, reason) VALUES (?,?,?,?)",
                (time.time(), sender[:64], topic[:160], reason[:MAX_REASON_CHARS]))
        self.rejections_total += 1
        if self.rejections_total % 500 == 0:
            self._q("DELETE FROM rejections WHERE id <= (SELECT MAX(id) FROM rejections) - ?", (MAX_REJECTIONS,))

    # evaluations: an operator's held-out quality of a model version (the coordinator holds no faces) ----
    def record_evaluation(self, model_version: int, metrics: dict[str, float], source: str) -> None:
        self._q("INSERT OR REPLACE INTO evaluations VALUES (?,?,?,?)",
                (model_version, time.time(), source[:64], json.dumps(metrics)))

    def evaluations(self) -> list[dict]:
        return [{**dict(r), "metrics": json.loads(r["metrics"])}
                for r in self._q("SELECT * FROM evaluations ORDER BY model_version")]

    def dropped_rounds(self) -> dict[str, int]:
        """Per device: finished rounds it was selected for but delivered no accepted update to."""
        rows = self._q(
            "SELECT round_id, participants FROM rounds WHERE status IN ('completed', 'rolled_back', 'failed')"
        )
        accepted = {(r["round_id"], r["device_id"]) for r in self._q("SELECT round_id, device_id FROM updates "
                                                                     "WHERE accepted=1")}
        dropped: dict[str, int] = {}
        for row in rows:
            for device in json.loads(row["participants"] or "[]"):
                if (row["round_id"], device) not in accepted:
                    dropped[device] = dropped.get(device, 0) + 1
        return dropped

    def rejections(self, offset: int = 0, limit: int | None = None) -> list[dict]:
        """Oldest first, one page at a time."""
        return [
            dict(r)
            for r in self._q(
                "SELECT at, sender, topic, reason FROM rejections ORDER BY id LIMIT ? OFFSET ?",
                (-1 if limit is None else limit, offset),
            )
        ]

    def count_rejections(self) -> int:
        return self._q("SELECT COUNT(*) FROM rejections")[0][0]

    # accepted updates of the open round, durable before they are acknowledged ---
    def update_path(self, round_id: int, device_id: str) -> Path:
        return self.root / "updates" / f"r{round_id:06d}" / f"{device_id}.safetensors"

    def save_update(self, round_id: int, device_id: str, payload: bytes) -> None:
        path = self.update_path(round_id, device_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(path)

    def drop_updates(self, round_id: int) -> None:
        shutil.rmtree(self.root / "updates" / f"r{round_id:06d}", ignore_errors=True)

    def open_round_row(self) -> dict | None:
        rows = self._q("SELECT * FROM rounds WHERE status='open' ORDER BY round_id DESC LIMIT 1")
        if not rows:
            return None
        return {**dict(rows[0]), "participants": json.loads(rows[0]["participants"] or "[]")}

    # defences' state (the norm bound's history, FV's weighting): kept with the rounds, so a restart changes nothing
    def save_robust_state(self, state: dict) -> None:
        self._q("INSERT OR REPLACE INTO robust_state (id, state) VALUES (1, ?)", (json.dumps(state),))

    def robust_state(self) -> dict:
        rows = self._q("SELECT state FROM robust_state WHERE id = 1")
        return json.loads(rows[0]["state"]) if rows else {}

    # server optimiser state (FedAvgM velocity) ------------------------------
    def save_strategy_state(self, state: dict[str, np.ndarray] | None) -> None:
        if state:
            path = self.root / "strategy_state.safetensors"
            save_file({k: np.asarray(v).copy(order="C") for k, v in state.items()}, str(path.with_suffix(".tmp")))
            path.with_suffix(".tmp").replace(path)

    def load_strategy_state(self) -> dict[str, np.ndarray] | None:
        path = self.root / "strategy_state.safetensors"
        return load_file(str(path)) if path.exists() else None
