"""Downloads of retained chunk frames (models, candidates, PFM momentum), one transfer at a time.

The coordinator announces each transfer in a signed message (its id, sha256 and size); the frames themselves
are unsigned, so every one is checked against that announcement and a frame of anything else is dropped
before it is assembled. Training and validation share the one reassembler, hence the lock.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from protocol.chunks import Reassembler, from_bytes

log = logging.getLogger("edge_client")


class ChunkDownloads:
    def __init__(self, subscribe: Callable[[str], None], unsubscribe: Callable[[str], None], device_id: str):
        self._subscribe, self._unsubscribe, self.device_id = subscribe, unsubscribe, device_id
        self._lock = threading.Lock()
        self.download: Reassembler | None = None
        self.expected_transfer: tuple[str, str, int] | None = None
        self.downloaded = threading.Event()
        self.model_payload: bytes | None = None
        self.topic: str | None = None  # the subscription in progress, renewed after a reconnect

    def fetch(self, topic: str, transfer_id: str, sha256: str, size: int, what: str, timeout: float = 120.0) -> bytes:
        """Retained chunk frames on `topic`/+, each checked against the announced transfer, hash and size."""
        with self._lock:
            self.download, self.downloaded = None, threading.Event()
            self.expected_transfer = (transfer_id, sha256, size)
            subscription = self.topic = f"{topic}/+"
            self._subscribe(subscription)
            try:
                if not self.downloaded.wait(timeout):
                    raise TimeoutError(f"{what} did not arrive within {timeout:.0f} s")
            finally:
                self.topic = None
                self._unsubscribe(subscription)
            return self.model_payload

    def on_chunk(self, frame: bytes) -> None:
        """One frame from the broker (paho's thread): kept only if it belongs to the announced transfer."""
        if not frame or self.downloaded.is_set() or self.expected_transfer is None:
            return
        chunk = from_bytes(frame)
        transfer_id, sha, size = self.expected_transfer
        if chunk.transfer_id != transfer_id or chunk.sha256 != sha or chunk.total_bytes != size:
            log.error("%s: chunk does not match the announced %s; not using it", self.device_id, transfer_id)
            return
        if self.download is None:
            self.download = Reassembler.for_chunk(chunk)
        payload = self.download.add(chunk)
        if payload is not None:
            self.model_payload = payload
            self.downloaded.set()
