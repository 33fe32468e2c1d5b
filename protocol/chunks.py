"""Split large payloads into broker-sized chunks and put them back together.

Brokers often cap a message at a few hundred KiB, so a payload travels as numbered chunks
(default 256 KiB). The reassembler tolerates reordering and duplicates, reports what is
missing, and refuses chunks that disagree with the transfer they claim to belong to.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from protocol.tensors import PayloadError, sha256_hex

DEFAULT_CHUNK_BYTES = 256 * 1024
FRAME_RESERVE = 512  # room for the JSON header, so a framed chunk never exceeds the chunk size


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

    @classmethod
    def for_chunk(cls, chunk: Chunk, max_bytes: int = 256 * 1024 * 1024) -> "Reassembler":
        if chunk.total_bytes > max_bytes:
            raise PayloadError(f"payload of {chunk.total_bytes} bytes exceeds the {max_bytes}-byte limit")
        return cls(chunk.transfer_id, chunk.count, chunk.total_bytes, chunk.sha256, max_bytes)

    @property
    def missing(self) -> list[int]:
        return [i for i in range(self.count) if i not in self.parts]

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
        self.parts[chunk.index] = chunk.data
        if self.missing:
            return None
        payload = b"".join(self.parts[i] for i in range(self.count))
        if len(payload) != self.total_bytes or sha256_hex(payload) != self.sha256:
            raise PayloadError("reassembled payload is truncated or corrupted (size or sha256 mismatch)")
        return payload


def to_bytes(chunk: Chunk) -> bytes:
    """Frame: 4-byte big-endian header length, JSON header, raw chunk bytes."""
    import json

    header = json.dumps({"transfer_id": chunk.transfer_id, "index": chunk.index, "count": chunk.count,
                         "total_bytes": chunk.total_bytes, "sha256": chunk.sha256}).encode()
    return len(header).to_bytes(4, "big") + header + chunk.data


def from_bytes(frame: bytes) -> Chunk:
    import json

    if len(frame) < 4:
        raise PayloadError("chunk frame shorter than its header length")
    size = int.from_bytes(frame[:4], "big")
    try:
        header = json.loads(frame[4:4 + size])
        return Chunk(str(header["transfer_id"]), int(header["index"]), int(header["count"]),
                     int(header["total_bytes"]), str(header["sha256"]), frame[4 + size:])
    except (ValueError, KeyError, TypeError) as exc:
        raise PayloadError(f"malformed chunk header: {exc}") from exc
