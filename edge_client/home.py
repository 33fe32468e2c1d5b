"""A device's private state folder (`--home`): key, private model parts, pending update, exports.

Nothing in here is ever sent: the signing key, the local head and DFC branch, the
half-sent update (kept so a reconnect can resume it), and the exported ONNX models.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


class DeviceHome:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        for sub in ("private", "pending", "models", "crops"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)

    @property
    def key_file(self) -> Path:
        return self.root / "device.key"

    def load_key(self) -> str | None:
        return self.key_file.read_text().strip() if self.key_file.exists() else None

    def save_key(self, key: str) -> None:
        fd = os.open(self.key_file.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(key)
        self.key_file.with_suffix(".tmp").replace(self.key_file)

    @property
    def private_state(self) -> Path:
        return self.root / "private" / "head_and_dfc.safetensors"

    @property
    def local_backbone(self) -> Path:
        """The backbone after this device's last local training: Theta of its personalised model."""
        return self.root / "private" / "local_backbone.safetensors"

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

    def pending_paths(self, round_id: int) -> tuple[Path, Path]:
        return self.root / "pending" / f"round{round_id}.safetensors", self.root / "pending" / f"round{round_id}.json"

    def rounds_log(self) -> list[dict]:
        path = self.root / "rounds.json"
        return json.loads(path.read_text()) if path.exists() else []

    def log_round(self, entry: dict) -> None:
        entries = self.rounds_log() + [entry]
        tmp = self.root / "rounds.json.tmp"
        tmp.write_text(json.dumps(entries, indent=2))
        tmp.replace(self.root / "rounds.json")
