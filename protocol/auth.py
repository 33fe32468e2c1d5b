"""Message authentication: Ed25519 signatures by each party's own key, plus replay protection.

Every party (the coordinator and each device) signs with a private key that never leaves it;
the other side holds only the public key, so a listener on the broker learns nothing it
could sign with. The signature covers the canonical JSON of the whole envelope but the
signature itself, so no field (sender, recipient, round, sequence number) can be altered.

Each device numbers its messages; a number not above the last one accepted is a replay, and
a number far ahead of the coordinator's clock is refused too, so no message can burn a
device's future sequence numbers. A device whose counter is refused is told (in a signed
error) where to resume: it never needs an operator to rejoin.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

MAX_SEQ = 2 ** 53                 # JSON-safe integers only
MAX_SEQ_AHEAD_MS = 24 * 3600 * 1000  # a sequence number may run ahead of the coordinator's clock by a day at most
SIGNATURE_PATTERN = r"^[0-9a-f]{128}$"
PUBLIC_KEY_PATTERN = r"^[0-9a-f]{64}$"


class AuthError(ValueError):
    """A message whose origin cannot be trusted; the reason is logged and, when possible, returned."""


def canonical(fields: dict) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


class Signer:
    """An Ed25519 private key, kept in a 0600 file; only its public half is ever shared."""

    def __init__(self, key: Ed25519PrivateKey):
        self._key = key
        raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.public_hex = raw.hex()

    @classmethod
    def generate(cls) -> Signer:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: Path) -> Signer:
        """The key at `path`, created (mode 0600, atomically) on first use."""
        path = Path(path)
        if path.exists():
            return cls.load(path)
        signer = cls.generate()
        signer.save(path)
        return signer

    @classmethod
    def load(cls, path: Path) -> Signer:
        try:
            key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        except (ValueError, TypeError):  # not PEM, damaged, or encrypted: the file is named
            raise AuthError(f"{path} is damaged or not an unencrypted PEM private key") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise AuthError(f"{path} does not hold an Ed25519 private key")
        return cls(key)

    def save(self, path: Path) -> None:
        pem = self._key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())
        write_secret(Path(path), pem)

    def sign(self, fields: dict) -> str:
        return self._key.sign(canonical(fields)).hex()


def verify(fields: dict, signature: str, public_hex: str) -> None:
    """Raise AuthError unless `signature` is `public_hex`'s Ed25519 signature of `fields`."""
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_hex))
        key.verify(bytes.fromhex(signature), canonical(fields))
    except (InvalidSignature, ValueError, TypeError):
        raise AuthError("bad signature") from None


def write_secret(path: Path, data: bytes | str) -> None:
    """Write a file readable by its owner only (mode 0600 from the start, then an atomic rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)
    tmp.replace(path)


def new_token() -> str:
    return secrets.token_hex(32)


def token_proof(token: str, device_id: str, public_hex: str) -> str:
    """Proof that the sender holds the admission token, bound to its id and public key.

    The token itself never crosses the broker: a listener who sees the proof can neither
    reuse it for another key nor learn the token from it.
    """
    return hmac.new(bytes.fromhex(token), f"ffr-admit|{device_id}|{public_hex}".encode(), hashlib.sha256).hexdigest()


def proof_matches(token: str, device_id: str, public_hex: str, proof: str) -> bool:
    return hmac.compare_digest(token_proof(token, device_id, public_hex).encode(), proof.encode("ascii", "replace"))


class ReplayGuard:
    """Remembers the highest sequence number accepted from each device."""

    def __init__(self, last_seen: dict[str, int] | None = None):
        self.last_seen = dict(last_seen or {})

    def check(self, device_id: str, seq: int, now_ms: int | None = None) -> None:
        last = self.last_seen.get(device_id, -1)
        if seq <= last:
            raise AuthError(f"replayed or reordered message: sequence {seq} <= {last}")
        if now_ms is not None and seq > max(now_ms, last) + MAX_SEQ_AHEAD_MS:
            raise AuthError(f"sequence {seq} is too far ahead of the coordinator's clock")

    def accept(self, device_id: str, seq: int, now_ms: int | None = None) -> None:
        self.check(device_id, seq, now_ms)
        self.last_seen[device_id] = seq

    def resume_point(self, device_id: str) -> int:
        """The number a device's next message must exceed."""
        return self.last_seen.get(device_id, -1)
