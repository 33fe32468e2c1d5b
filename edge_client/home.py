"""A device's private state folder (`--home`): key, private model parts, pending update, exports.

Nothing in here is ever sent: the signing key, the local head and DFC branch, the
half-sent update (kept so a reconnect can resume it), and the exported ONNX models.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from protocol.folder_lock import FolderHeld, hold, let_go
from protocol.json_file import read_json

# an `ffr device` command waits this long for the daemon to finish writing a round's models ($FFR_HOME_WAIT_S)
WRITER_WAIT_S = float(os.environ.get("FFR_HOME_WAIT_S", 30.0))
DAEMON_WAIT_S = 600.0  # the daemon waits this long for a command (an enrolment from a camera takes a while)


class HomeInUse(ValueError):
    """Another process holds the home (two `ffr edge run` on one home replay each other's sequence numbers)."""


class DeviceHome:
    def __init__(self, root: str | Path, create: bool = True):
        """`create=False`: commands that only read a home refuse a missing one instead of making an empty one (a
        mistyped --home would otherwise look like a device that lost its people)."""
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"--home {self.root} is a file; give a folder for the device's private state")
        if not create and not (self.root / "store").is_dir():
            raise FileNotFoundError(f"no device home at {self.root}: nobody was enrolled there (check --home)")
        for sub in ("private", "pending", "models", "crops"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self._lock_fd: int | None = None

    def lock(self, wait_s: float | None = None) -> DeviceHome:
        """Hold the home's files for this process (released when it exits): one writer at a time. Another holder
        is waited for up to `wait_s` (a running `ffr edge run` holds them only while it writes a round's models), then
        refused, naming it."""
        try:
            self._lock_fd = hold(self.root / "home.lock", WRITER_WAIT_S if wait_s is None else wait_s)
        except FolderHeld as held:
            raise HomeInUse(f"home {self.root} is in use by process {held.holder} (an `ffr device` command, or "
                            "`ffr edge run` writing its models); try again when it is done, or give another --home"
                            ) from None
        return self

    def hold_daemon(self) -> DeviceHome:
        """One `ffr edge run` per home, for its whole life (released when it exits). It takes the home's files only
        while it writes (`writing`), so `ffr device enroll`, `remove` and `calibrate` work while it runs."""
        try:
            self._daemon_fd = hold(self.root / "daemon.lock")
        except FolderHeld as held:
            raise HomeInUse(f"home {self.root} is in use by process {held.holder} (an `ffr edge run`); stop it "
                            "first, or give another --home") from None
        return self

    @contextmanager
    def writing(self, wait_s: float = DAEMON_WAIT_S) -> Iterator[None]:
        """The home's files held for one write of the daemon's (a round's models, its calibration, the references
        it adopted), waiting for an `ffr device` command that holds them."""
        fd = hold(self.root / "home.lock", wait_s)
        try:
            yield
        finally:
            let_go(fd)

    @property
    def signing_key(self) -> Path:
        """The device's own Ed25519 private key (mode 0600); only its public half is ever sent."""
        return self.root / "device_ed25519.pem"

    @property
    def _registration(self) -> Path:
        return self.root / "registered.json"

    def registered_with(self) -> tuple[str, str] | None:
        """(coordinator public key, admission token) of the admission this device completed, if any."""
        if not self._registration.exists():
            return None
        return read_json(self._registration, "ffr-edge", "delete it and the device registers again with its "
                         "credential", lambda saved: (str(saved["coordinator_public_key"]), str(saved["token"])))

    def save_registration(self, coordinator_public_key: str, token: str) -> None:
        from protocol.auth import write_secret

        write_secret(self._registration, json.dumps({"coordinator_public_key": coordinator_public_key, "token": token}))

    def write_ca(self, pem: str) -> Path:
        path = self.root / "broker-ca.pem"
        path.write_text(pem)
        return path

    @property
    def private_state(self) -> Path:
        return self.root / "private" / "head_and_dfc.safetensors"

    @property
    def local_backbone(self) -> Path:
        """The backbone after this device's last local training: Theta of its personalised model."""
        return self.root / "private" / "local_backbone.safetensors"

    @property
    def codec_residual(self) -> Path:
        """Error feedback's residual: what lossy codecs could not send yet (edge_client.error_feedback)."""
        return self.root / "private" / "codec_residual.safetensors"

    @staticmethod
    def save_tensors(path: Path, tensors: dict) -> None:
        """Atomic safetensors write: a device killed mid-write keeps its previous state."""
        from safetensors.torch import save_file

        tmp = path.with_suffix(".tmp")
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp))
        tmp.replace(path)

    @property
    def personalised_onnx(self) -> Path:
        return self.root / "models" / "personalised.onnx"

    @property
    def generic_onnx(self) -> Path:
        return self.root / "models" / "generic.onnx"

    @property
    def _model_cache(self) -> Path:
        return self.root / "models" / "global.safetensors"

    def cached_model(self, version: int, sha256: str) -> bytes | None:
        """The global model of `version` if this device already downloaded it (and it still has that hash)."""
        from protocol.tensors import sha256_hex

        meta = self._model_cache.with_suffix(".json")
        if not (meta.exists() and self._model_cache.exists()):
            return None
        try:
            if json.loads(meta.read_text()) != {"version": version, "sha256": sha256}:
                return None
        except ValueError:  # a damaged note: the model is downloaded again
            return None
        data = self._model_cache.read_bytes()
        return data if sha256_hex(data) == sha256 else None

    def cache_model(self, version: int, sha256: str, data: bytes) -> None:
        """Keep the latest downloaded global model (one version: the next one replaces it)."""
        tmp = self._model_cache.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(self._model_cache)
        self._model_cache.with_suffix(".json").write_text(json.dumps({"version": version, "sha256": sha256}))

    def pending_paths(self, round_id: int) -> tuple[Path, Path]:
        return self.root / "pending" / f"round{round_id}.safetensors", self.root / "pending" / f"round{round_id}.json"

    def rounds_log(self) -> list[dict]:
        """The rounds this device took part in (it skips them after a restart); a damaged log is named."""
        path = self.root / "rounds.json"
        if not path.exists():
            return []
        return read_json(path, "ffr-edge", "move it away (the device then takes part in the coordinator's open "
                         "round again)", _round_entries)

    def log_round(self, entry: dict) -> None:
        entries = self.rounds_log() + [entry]
        tmp = self.root / "rounds.json.tmp"
        tmp.write_text(json.dumps(entries, indent=2))
        tmp.replace(self.root / "rounds.json")


def _round_entries(raw) -> list[dict]:
    """rounds.json's shape: a list of objects, each with an integer round_id."""
    if not (isinstance(raw, list) and all(isinstance(e, dict) and isinstance(e.get("round_id"), int) for e in raw)):
        raise TypeError("not a list of rounds")
    return raw
