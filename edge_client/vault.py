"""The enrolled people's face crops and templates, encrypted at rest (AES-256-GCM, `cryptography`).

One file per person, named by an HMAC of the name (so file names reveal nobody), holding
`MAGIC | nonce | AES-GCM(name, crops, template, model hash)` with the file name as associated
data, so a file moved onto another person's name fails to decrypt. Writes are atomic
(temporary file, fsync, rename): a crash leaves the old record or the new one, never half.
A key check file tells a wrong key apart from a damaged record; neither is ever used silently.

The store is the device's trust root. A sealed manifest (`people/manifest.sealed`, AES-GCM under the
same key) lists every record with its sha256 and a generation that only grows: a record file that is
not listed (a removed person's file copied back) or does not match its hash is refused by name, and
so is a missing manifest. It also holds the MAC of `device.json` (`mac`), so the decision settings
there (threshold, the installed models' hashes) cannot be edited, deleted or rolled back either.
What it cannot tell apart is a consistent roll-back of the whole home (manifest, records and
settings copied back together): that needs a counter outside the home (a TPM or a rollback-protected
store), which a Raspberry Pi does not have.

The key is 32 random bytes in `store.key` (mode 0600, created on first use) or, hex or
base64, in $FFR_STORE_KEY (then nothing secret is written to disk).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import io
import json
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_ENV = "FFR_STORE_KEY"
MAGIC = b"FFRSTORE1"
_CHECK = b"ffr-edge store key check"


class VaultError(ValueError):
    """The store cannot be used as it is: wrong key, damaged or tampered file, unknown person."""


@dataclass
class Person:
    name: str
    crops: np.ndarray          # (K, S, S, 3) RGB uint8: what templates are recomputed from
    template: np.ndarray       # (D,) float32, L2-normalised mean embedding
    model_sha256: str          # the model the template was computed with
    enrolled_at: float

    def to_bytes(self) -> bytes:
        header = json.dumps({"name": self.name, "model_sha256": self.model_sha256, "enrolled_at": self.enrolled_at,
                             "crops_shape": list(self.crops.shape), "template_dim": int(self.template.shape[0])})
        data = header.encode()
        return len(data).to_bytes(4, "big") + data + self.crops.astype(np.uint8).tobytes() + \
            self.template.astype("<f4").tobytes()

    @classmethod
    def from_bytes(cls, blob: bytes) -> Person:
        n = int.from_bytes(blob[:4], "big")
        header = json.loads(blob[4:4 + n])
        shape, dim = tuple(header["crops_shape"]), header["template_dim"]
        size = int(np.prod(shape))
        body = io.BytesIO(blob[4 + n:]).getbuffer()
        crops = np.frombuffer(body[:size], dtype=np.uint8).reshape(shape).copy()
        template = np.frombuffer(body[size:size + 4 * dim], dtype="<f4").copy()
        return cls(header["name"], crops, template, header["model_sha256"], header["enrolled_at"])


def _atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _key_from_env(value: str) -> bytes:
    value = value.strip()
    try:
        key = bytes.fromhex(value)
    except ValueError:
        try:
            key = base64.b64decode(value, validate=True)
        except ValueError:
            key = b""
    if len(key) != 32:
        raise VaultError(f"${KEY_ENV} must hold a 32-byte key, hex or base64 (got {len(key)} bytes)")
    return key


def load_key(root: Path) -> bytes:
    """$FFR_STORE_KEY if set, else `store.key` (created with mode 0600 on first use)."""
    if os.environ.get(KEY_ENV):
        return _key_from_env(os.environ[KEY_ENV])
    path = root / "store.key"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, AESGCM.generate_key(bit_length=256))
    if path.stat().st_mode & 0o077:
        raise VaultError(f"{path} is readable by other users; run: chmod 600 {path}")
    key = path.read_bytes()
    if len(key) != 32:
        raise VaultError(f"{path} is not a 32-byte key")
    return key


MANIFEST = "manifest.sealed"


class Vault:
    def __init__(self, root: Path, key: bytes):
        self.root = Path(root)
        self.people_dir = self.root / "people"
        self.people_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self._aead, self._key = AESGCM(key), key
        self._mac_key = hmac.new(key, b"ffr-edge settings seal", hashlib.sha256).digest()
        self._check_key()

    # the sealed manifest ------------------------------------------------------
    def mac(self, data: bytes) -> str:
        """HMAC-SHA256 of `data` under a key derived from the store's key (device.json's seal)."""
        return hmac.new(self._mac_key, data, hashlib.sha256).hexdigest()

    def manifest(self) -> dict:
        """{"generation": n, "records": {file name: sha256}, "names": {file name: person}, "settings_mac": str | None},
        authenticated."""
        path = self.people_dir / MANIFEST
        if not path.exists():
            if any(self.people_dir.glob("*.person")):
                raise VaultError(f"{path} is missing: the records in {self.people_dir} cannot be trusted "
                                 "(remove them and enrol the people again)")
            return {"generation": 0, "records": {}, "settings_mac": None}
        try:
            return json.loads(self._open(path.read_bytes(), MANIFEST))
        except (InvalidTag, ValueError):
            raise VaultError(f"{path} is corrupted or was tampered with; refusing to use the store") from None

    def _save_manifest(self, manifest: dict) -> None:
        manifest = {**manifest, "generation": manifest["generation"] + 1}
        _atomic_write(self.people_dir / MANIFEST, self._seal(json.dumps(manifest).encode(), MANIFEST))

    def seal_settings(self, mac: str) -> None:
        """Record the MAC of the device.json just written: an older or edited copy no longer matches."""
        self._save_manifest({**self.manifest(), "settings_mac": mac})

    @classmethod
    def open(cls, root: Path) -> Vault:
        return cls(root, load_key(root))

    def _check_key(self) -> None:
        path = self.root / "key.check"
        if not path.exists():
            if any(self.people_dir.iterdir()):
                raise VaultError(f"{path} is missing: the store cannot tell whether this key is the right one")
            _atomic_write(path, self._seal(_CHECK, path.name))
            return
        try:
            if self._open(path.read_bytes(), path.name) != _CHECK:
                raise InvalidTag
        except (InvalidTag, VaultError):
            raise VaultError(f"wrong key for the store in {self.root} (or its key check file is damaged)") from None

    def _seal(self, data: bytes, name: str) -> bytes:
        nonce = os.urandom(12)
        return MAGIC + nonce + self._aead.encrypt(nonce, data, MAGIC + name.encode())

    def _open(self, blob: bytes, name: str) -> bytes:
        if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 12 + 16:
            raise VaultError(f"{name} is not an ffr-edge store file (damaged?)")
        nonce = blob[len(MAGIC):len(MAGIC) + 12]
        return self._aead.decrypt(nonce, blob[len(MAGIC) + 12:], MAGIC + name.encode())

    def _path(self, name: str) -> Path:
        digest = hmac.new(self._key, name.encode(), hashlib.sha256).hexdigest()[:32]
        return self.people_dir / f"{digest}.person"

    def put(self, person: Person) -> None:
        path = self._path(person.name)
        manifest = self.manifest()
        blob = self._seal(person.to_bytes(), path.name)
        _atomic_write(path, blob)
        self._save_manifest(
            {
                **manifest,
                "records": {**manifest["records"], path.name: hashlib.sha256(blob).hexdigest()},
                "names": {**manifest.get("names", {}), path.name: person.name},
            }
        )

    def get(self, name: str) -> Person:
        path = self._path(name)
        if not path.exists():
            known = ", ".join(self.names()) or "nobody is enrolled"
            raise VaultError(f"unknown name {name!r} (enrolled: {known})")
        return self._read(path)

    def _read(self, path: Path, manifest: dict | None = None) -> Person:
        manifest = manifest or self.manifest()
        listed = manifest["records"].get(path.name)
        who = manifest.get("names", {}).get(path.name)  # sealed with the records, so a damaged record is named
        record = f"{who}'s record ({path})" if who else f"store file {path}"
        fix = (f"; remove it (`ffr device remove --name {shlex.quote(who)}`) and enrol {who} again" if who
               else "; remove it and enrol the person again")
        blob = path.read_bytes()
        if listed is None:
            raise VaultError(f"store file {path} is not in the store's sealed manifest (a removed person's file copied "
                             "back?); refusing to use it: delete it")
        if hashlib.sha256(blob).hexdigest() != listed:
            raise VaultError(f"{record} is corrupted or was tampered with (it is not the one the store sealed: "
                             f"damaged, or an older copy?); refusing to use it{fix}")
        try:
            return Person.from_bytes(self._open(blob, path.name))
        except InvalidTag:
            raise VaultError(f"{record} is corrupted or was tampered with; refusing to use it{fix}") from None
        except (ValueError, KeyError, json.JSONDecodeError) as exc:
            raise VaultError(f"{record} is damaged: {exc}{fix}") from None

    def people(self, damaged: list[str] | None = None) -> list[Person]:
        """Everyone enrolled. A record that fails its seal raises; with a `damaged` list, it is left out instead
        and its one-line description (naming the person) appended there, so one bad file does not hide the rest."""
        manifest, people = self.manifest(), []
        for path in self.people_dir.glob("*.person"):
            try:
                people.append(self._read(path, manifest))
            except VaultError as exc:
                if damaged is None:
                    raise
                damaged.append(str(exc))
        return sorted(people, key=lambda p: p.name)

    def names(self) -> list[str]:
        """The readable people's names (a damaged record can be enrolled again over)."""
        return [p.name for p in self.people(damaged=[])]

    def remove(self, name: str) -> None:
        """Delete the person's record for good (overwritten before unlinking)."""
        path = self._path(name)
        if not path.exists():
            raise VaultError(f"unknown name {name!r}")
        manifest = self.manifest()
        self._save_manifest({**manifest, "records": {k: v for k, v in manifest["records"].items() if k != path.name},
                             "names": {k: v for k, v in manifest.get("names", {}).items() if k != path.name}})
        size = path.stat().st_size
        with open(path, "r+b") as fh:
            fh.write(os.urandom(size))
            fh.flush()
            os.fsync(fh.fileno())
        path.unlink()


NAME_MAX = 64
NAME_PUNCTUATION = " ._-'"


def check_person_name(name: str) -> str:
    """A new person's name, refused in one line unless it is 1-64 letters (any script), digits, spaces or . _ - ':
    the name is printed by every command and in the JSON output, so no control characters or terminal escapes."""
    if not name or name != name.strip():
        raise ValueError(f"a person's name must not be empty or start or end with a space (got {name!r})")
    if len(name) > NAME_MAX:
        raise ValueError(f"a person's name must be at most {NAME_MAX} characters (got {len(name)})")
    odd = sorted({c for c in name if not (c.isalnum() or c in NAME_PUNCTUATION)})
    if odd or not any(c.isalnum() for c in name):
        raise ValueError(f"a person's name takes letters, digits, spaces and . _ - ' only (got {name!r})")
    return name


def new_person(name: str, crops: np.ndarray, template: np.ndarray, model_sha256: str) -> Person:
    return Person(check_person_name(name), crops, template.astype(np.float32), model_sha256, time.time())
