"""Message authentication: HMAC-SHA256 with a per-device key, plus replay protection.

The signature covers the canonical JSON of everything in the envelope but the signature
itself, so no field (device, round, sequence number) can be altered in transit. Each
device numbers its messages; a number not above the last one accepted is a replay.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import secrets


class AuthError(ValueError):
    """A message whose origin cannot be trusted; the reason is logged and, when possible, returned."""


def new_device_key() -> str:
    return secrets.token_hex(32)


def canonical(fields: dict) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(fields: dict, key: str) -> str:
    return hmac.new(bytes.fromhex(key), canonical(fields), hashlib.sha256).hexdigest()


def verify(fields: dict, signature: str, key: str) -> None:
    if not hmac.compare_digest(sign(fields, key), signature or ""):
        raise AuthError("bad signature")


class ReplayGuard:
    """Remembers the highest sequence number accepted from each device."""

    def __init__(self, last_seen: dict[str, int] | None = None):
        self.last_seen = dict(last_seen or {})

    def check(self, device_id: str, seq: int) -> None:
        if seq <= self.last_seen.get(device_id, -1):
            raise AuthError(f"replayed or reordered message: sequence {seq} <= {self.last_seen[device_id]}")

    def accept(self, device_id: str, seq: int) -> None:
        self.check(device_id, seq)
        self.last_seen[device_id] = seq
