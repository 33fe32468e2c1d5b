"""Split large payloads into broker-sized chunks and put them back together.

Brokers often cap a message at a few hundred KiB, so a payload travels as numbered chunks
(default 256 KiB). The reassembler tolerates reordering and duplicates, reports what is
missing, and refuses chunks that disagree with the transfer they claim to belong to.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from protocol.tensors import PayloadError, sha256_hex

DEFAULT_CHUNK_BYTES = 256 * 1024
FRAME_RESERVE = 512  # room for the JSON header, so a framed chunk never exceeds the chunk size
MAX_HEADER_BYTES = 1024
MAX_CHUNKS = 1 << 20
MAX_TOTAL_BYTES = 1 << 31
_TRANSFER_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Chunk:
    transfer_id: str
    index: int
    count: int
    total_bytes: int
    sha256: str          # of the whole payload
    data: bytes


def split(transfer_id: str, payload: bytes, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[Chunk]:
    """Chunks whose frames (`to_bytes`) are at most `chunk_bytes` long, the broker's message limit."""
    piece = chunk_bytes - FRAME_RESERVE
    if piece < 1 or len(transfer_id) > 128:
        raise ValueError(f"chunk size must exceed {FRAME_RESERVE} bytes and transfer ids be at most 128 characters")
    digest = sha256_hex(payload)
    count = max(1, -(-len(payload) // piece))
    return [Chunk(transfer_id, i, count, len(payload), digest, payload[i * piece:(i + 1) * piece])
            for i in range(count)]


@dataclass
class Reassembler:
    """Collects the chunks of one transfer; `add` returns the payload once it is complete and intact."""

    transfer_id: str
    count: int
    total_bytes: int
    sha256: str
    max_bytes: int = 256 * 1024 * 1024
    parts: dict[int, bytes] = field(default_factory=dict)
    received_bytes: int = 0

    @classmethod
    def for_chunk(cls, chunk: Chunk, max_bytes: int = 256 * 1024 * 1024) -> Reassembler:
        if chunk.total_bytes > max_bytes:
            raise PayloadError(f"payload of {chunk.total_bytes} bytes exceeds the {max_bytes}-byte limit")
        return cls(chunk.transfer_id, chunk.count, chunk.total_bytes, chunk.sha256, max_bytes)

    @property
    def missing(self) -> list[int]:
        """The indices still to come (O(count): for reports, not for every chunk)."""
        return [i for i in range(self.count) if i not in self.parts]

    @property
    def complete(self) -> bool:
        return len(self.parts) == self.count

    def add(self, chunk: Chunk) -> bytes | None:
        if (chunk.transfer_id, chunk.count, chunk.total_bytes, chunk.sha256) != \
                (self.transfer_id, self.count, self.total_bytes, self.sha256):
            raise PayloadError(f"chunk {chunk.index} does not belong to transfer {self.transfer_id}")
        if not 0 <= chunk.index < self.count:
            raise PayloadError(f"chunk index {chunk.index} outside 0..{self.count - 1}")
        if chunk.index in self.parts:
            if self.parts[chunk.index] != chunk.data:
                raise PayloadError(f"chunk {chunk.index} sent twice with different bytes")
            return None  # a harmless duplicate (e.g. QoS 1 redelivery)
        if self.received_bytes + len(chunk.data) > self.total_bytes:
            raise PayloadError(f"chunks of transfer {self.transfer_id} exceed its declared {self.total_bytes} bytes")
        self.parts[chunk.index] = chunk.data
        self.received_bytes += len(chunk.data)
        if not self.complete:
            return None
        payload = b"".join(self.parts[i] for i in range(self.count))
        if len(payload) != self.total_bytes or sha256_hex(payload) != self.sha256:
            raise PayloadError("reassembled payload is truncated or corrupted (size or sha256 mismatch)")
        return payload


def to_bytes(chunk: Chunk) -> bytes:
    """Frame: 4-byte big-endian header length, JSON header, raw chunk bytes."""
    header = json.dumps({"transfer_id": chunk.transfer_id, "index": chunk.index, "count": chunk.count,
                         "total_bytes": chunk.total_bytes, "sha256": chunk.sha256}).encode()
    return len(header).to_bytes(4, "big") + header + chunk.data


def from_bytes(frame: bytes) -> Chunk:
    """Parse a frame whose header may be hostile: bounded size, flat JSON, exact types and ranges."""
    if len(frame) < 4:
        raise PayloadError("chunk frame shorter than its header length")
    size = int.from_bytes(frame[:4], "big")
    if size > MAX_HEADER_BYTES or 4 + size > len(frame):
        raise PayloadError(f"chunk header length {size} is out of range")
    raw = frame[4:4 + size]
    if raw.count(b"[") + raw.count(b"{") > 1:
        raise PayloadError("chunk header must be one flat JSON object")
    try:
        header = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PayloadError(f"malformed chunk header: {str(exc)[:80]}") from None
    if not isinstance(header, dict) or set(header) != {"transfer_id", "index", "count", "total_bytes", "sha256"}:
        raise PayloadError("chunk header must have exactly transfer_id, index, count, total_bytes, sha256")
    transfer_id, sha = header["transfer_id"], header["sha256"]
    index, count, total = header["index"], header["count"], header["total_bytes"]
    if not (isinstance(transfer_id, str) and _TRANSFER_ID.fullmatch(transfer_id)):
        raise PayloadError("chunk header: transfer_id must be 1-128 characters of [A-Za-z0-9_.-]")
    if not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
        raise PayloadError("chunk header: sha256 must be 64 lowercase hex digits")
    if not all(type(v) is int for v in (index, count, total)):
        raise PayloadError("chunk header: index, count and total_bytes must be integers")
    if not (1 <= count <= MAX_CHUNKS and 0 <= index < count and 1 <= total <= MAX_TOTAL_BYTES and count <= total):
        raise PayloadError(f"chunk header out of range (index {index}, count {count}, total_bytes {total})")
    return Chunk(transfer_id, index, count, total, sha, frame[4 + size:])


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")
