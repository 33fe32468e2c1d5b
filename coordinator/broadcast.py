"""What the coordinator publishes as retained chunk messages: the global model, server state beside it, candidates.

Retained, so a device that connects late still finds them; cleared (an empty retained message per chunk) once
superseded, so the broker does not keep every model forever. The engine decides when; this module only encodes,
splits and publishes (`protocol.chunks`, `protocol.tensors`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from protocol import topics
from protocol.chunks import split, to_bytes
from protocol.tensors import encode

Publish = Callable[[str, bytes, bool], None]
State = dict[str, np.ndarray]


@dataclass(frozen=True)
class Published:
    """One published tensor file: what an announcement tells devices to fetch and check."""

    sha256: str
    size: int
    chunks: int


class ModelBroadcast:
    def __init__(self, publish: Publish, model_dtype: str, chunk_bytes: int):
        self.publish, self.model_dtype, self.chunk_bytes = publish, model_dtype, chunk_bytes
        self.model: Published | None = None
        self.server_state: Published | None = None  # PFM's global momentum, when the strategy broadcasts one

    def _put(self, name: str, topic: str, state: State, dtype: str) -> Published:
        wire = encode(state, dtype)
        for chunk in split(name, wire.data, self.chunk_bytes):
            self.publish(f"{topic}/{chunk.index}", to_bytes(chunk), True)
        return Published(wire.sha256, len(wire.data), -(-len(wire.data) // self.chunk_bytes))

    def _clear(self, topic: str, chunks: int) -> None:
        for index in range(chunks):
            self.publish(f"{topic}/{index}", b"", True)

    def publish_model(self, version: int, state: State, server_state: State | None) -> None:
        """The global backbone in the wire dtype (fp16 by default: half the download; the coordinator keeps the
        float32 master), and the strategy's broadcast state beside it (fp16 when it fits)."""
        self.model = self._put(f"model-{version}", topics.model_chunks(version), state, self.model_dtype)
        self.server_state = None
        if server_state is not None:
            dtype = "fp16" if max(float(np.abs(v).max(initial=0.0)) for v in server_state.values()) < 6e4 else "fp32"
            self.server_state = self._put(f"momentum-{version}", topics.momentum_chunks(version),
                                          server_state, dtype)

    def retract_model(self, version: int) -> None:
        """Clear a superseded version's chunks (the current sizes: the layout is fixed for a run)."""
        self._clear(topics.model_chunks(version), self.model.chunks)
        if self.server_state is not None:
            self._clear(topics.momentum_chunks(version), self.server_state.chunks)

    def publish_candidate(self, round_id: int, index: int, state: State) -> Published:
        """Federated Validation's candidate `index` of a round, for the validators to score."""
        return self._put(f"candidate-{round_id}-{index}", topics.candidate_chunks(round_id, index), state,
                         self.model_dtype)

    def retract_candidate(self, round_id: int, index: int, chunks: int) -> None:
        self._clear(topics.candidate_chunks(round_id, index), chunks)

    def announcement_fields(self) -> dict:
        """The model's (and server state's) sha256, size and chunk count, as announcements spell them."""
        fields = {"model_sha256": self.model.sha256, "model_bytes": self.model.size, "model_chunks": self.model.chunks}
        if self.server_state is not None:
            fields.update(momentum_sha256=self.server_state.sha256, momentum_bytes=self.server_state.size,
                          momentum_chunks=self.server_state.chunks)
        return fields
