"""The device's copy of FedFR's public set D_g, fetched once from the coordinator over HTTP.

The round configuration (signed by the coordinator) names the file's URL, sha256 and size. The
device downloads it at most once per hash into its home, refuses a body that is larger than
announced or hashes differently (a tampering proxy or a wrong server), and keeps it read-only.
Only a GET leaves the device: nothing about the set, or about which faces it sampled, is sent.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
import urllib.request
from pathlib import Path

from models.public_set import PublicSetError, check_public_set_file

log = logging.getLogger(__name__)
BLOCK = 1 << 20


def cached_path(folder: Path, sha256: str) -> Path:
    return Path(folder) / f"{sha256}.safetensors"


def fetch_public_set(url: str, sha256: str, size: int, folder: Path, timeout_s: float = 60.0,
                     min_rate: float = 64 * 1024) -> Path:
    """The path of the verified copy, downloading it first if this device does not hold it yet.

    `timeout_s` bounds each read; the whole download must also finish within timeout_s + size / min_rate
    seconds, so a server dripping a byte at a time cannot hold the device's round forever."""
    path = cached_path(folder, sha256)
    if path.exists():
        return path
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{sha256}.part"
    digest, received = hashlib.sha256(), 0
    deadline = time.monotonic() + timeout_s + size / min_rate
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response, open(tmp, "wb") as out:
            while block := response.read1(BLOCK):  # returns what has arrived: the deadline is checked
                received += len(block)
                if received > size:
                    raise PublicSetError(f"public set from {url} is larger than the announced {size} bytes")
                if time.monotonic() > deadline:
                    raise PublicSetError(f"public set from {url}: {received} of {size} bytes after "
                                         f"{timeout_s + size / min_rate:.0f} s; giving up")
                digest.update(block)
                out.write(block)
        if received != size or digest.hexdigest() != sha256:
            raise PublicSetError(f"public set from {url}: {received} bytes with sha256 {digest.hexdigest()[:16]}..., "
                                 f"announced {size} bytes with {sha256[:16]}...")
        os.chmod(tmp, 0o444)
        tmp.replace(path)
    except OSError as exc:  # network errors (URLError is an OSError) and disk errors alike
        raise PublicSetError(f"could not fetch the public set from {url}: {exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    log.info("public set %s... fetched from %s (%d bytes)", sha256[:16], url, size)
    return path


class DevicePublicSet:
    """D_g as one device holds it: the operator's `--public-set` file, else the coordinator's (fetched once per
    announced hash into `folder`). Failures are said and the device goes on without it."""

    def __init__(self, path: Path | None, folder: Path, device_id: str):
        self.path, self.folder, self.device_id = None if path is None else Path(path), Path(folder), device_id
        if self.path is not None:  # the operator's own file: a wrong one is said at start, not in some round
            check_public_set_file(self.path)
        self._set = None  # models.public_set.PublicSet, once read
        self._sha: str | None = None  # the hash of the coordinator's set held in self._set

    def fetch(self, cfg) -> bool:
        """Download the set the round's (signed) configuration announces, if this device does not hold it yet (the
        daemon does this; its round's work reads it, `follow`). A failure is said, and False returned."""
        announced = cfg.public_set
        if self.path is not None or announced is None:
            return False
        try:
            fetch_public_set(announced.url, announced.sha256, announced.size_bytes, self.folder)
            return True
        except PublicSetError as exc:
            log.warning("%s: no public set this round: %s", self.device_id, exc)
            return False

    def follow(self, cfg) -> None:
        """Hold the set the round's (signed) configuration announces, whatever the round trains with: the device's
        adoption check and its calibration need strangers' faces as much as FedFR's hard negatives do (without them
        a door calibrated on 8 people let in 1.5% of strangers at a promised 0.1%). A failure is said; the device
        goes on with what it held."""
        from models.public_set import load_public_set

        sha = None if cfg.public_set is None else cfg.public_set.sha256
        if self.path is not None or sha is None or self._sha == sha:
            return
        if not self.fetch(cfg):
            return
        try:
            self._set = load_public_set(cached_path(self.folder, sha), sha)
            self._sha = sha
        except PublicSetError as exc:
            log.warning("%s: no public set this round: %s", self.device_id, exc)

    def __getstate__(self) -> dict:
        """Pickled without the faces read (a round's child process reads them from the file again)."""
        return {**self.__dict__, "_set": None, "_sha": None}

    def for_round(self, cfg):
        """D_g, only when the round samples hard negatives; None (and why, in the log) when there is none."""
        from models.public_set import load_public_set

        if not cfg.method.uses_public_set():
            return None
        if self.path is not None:
            try:
                if self._set is None:
                    self._set = load_public_set(self.path)
                return self._set
            except PublicSetError as exc:
                log.warning("%s: training without hard negatives this round: %s", self.device_id, exc)
                return None
        if cfg.public_set is None:
            log.warning("%s: the round asks for hard negatives but neither the coordinator nor --public-set "
                        "gives this device a public set", self.device_id)
            return None
        self.follow(cfg)
        if self._sha != cfg.public_set.sha256:
            log.warning("%s: training without hard negatives this round: the announced public set is not held",
                        self.device_id)
            return None
        return self._set

    @property
    def sha256(self) -> str | None:
        """The hash of the coordinator's set this device holds (None for an operator's `--public-set` file, which
        is not kept in the home)."""
        return None if self.path is not None else self._sha

    def negatives_for_adoption(self):
        """The public images the adoption check may use as impostors (the operator's file, or the last set the
        coordinator served), or None."""
        from models.public_set import load_public_set

        if self._set is None and self.path is not None:
            try:
                self._set = load_public_set(self.path)
            except PublicSetError as exc:
                log.warning("%s: adoption check without public negatives: %s", self.device_id, exc)
        return self._set.images if self._set is not None else None
