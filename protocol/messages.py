"""Typed, versioned messages (pydantic). Every device message travels in a signed `Envelope`.

The body's `type` names its schema; unknown types, wrong schema versions and malformed
JSON are rejected with a reason, never a crash.
"""
from __future__ import annotations

import time
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from protocol import SCHEMA_VERSION
from protocol.auth import AuthError, ReplayGuard, sign, verify


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Hello(_Body):
    type: Literal["hello"] = "hello"
    n_identities: int = Field(ge=0)
    n_images: int = Field(ge=0)
    software: str = "ffr-edge"


class Registered(_Body):
    """The coordinator's answer to a first hello: the device's own signing key."""

    type: Literal["registered"] = "registered"
    device_id: str
    key: str = Field(pattern=r"^[0-9a-f]{64}$")


class Heartbeat(_Body):
    type: Literal["heartbeat"] = "heartbeat"
    state: str = "idle"


class TrainingConfig(_Body):
    type: Literal["training_config"] = "training_config"
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(1e-4, gt=0)
    algorithm: Literal["fedavg", "fedprox", "fedavgm"] = "fedavg"
    prox_mu: float = Field(0.01, ge=0)
    dfc: bool = True
    dfc_weight: float = Field(1.0, ge=0)  # alpha: weight of the DFC branch's loss beside the margin head
    wire_dtype: Literal["fp16", "fp32"] = "fp16"
    chunk_bytes: int = Field(256 * 1024, ge=1024)
    width_mult: float = 1.0
    embedding_dim: int = 128


class RoundAnnouncement(_Body):
    type: Literal["round"] = "round"
    round_id: int = Field(ge=1)
    model_version: int = Field(ge=0)
    model_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    model_bytes: int = Field(ge=1)
    model_chunks: int = Field(ge=1)
    total_rounds: int = Field(ge=1)
    deadline_unix: float
    config: TrainingConfig
    participants: list[str]


class UpdateHeader(_Body):
    """Announces an update whose tensors follow as chunks of transfer `transfer_id`."""

    type: Literal["update"] = "update"
    round_id: int = Field(ge=1)
    base_version: int = Field(ge=0)
    n_samples: int = Field(ge=1)
    transfer_id: str = Field(min_length=1, max_length=128)
    payload_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    payload_bytes: int = Field(ge=1)
    metrics: dict[str, float] = {}


class Ack(_Body):
    type: Literal["ack"] = "ack"
    of: str
    round_id: int | None = None


class Error(_Body):
    type: Literal["error"] = "error"
    reason: str
    round_id: int | None = None


Body = Annotated[Union[Hello, Registered, Heartbeat, RoundAnnouncement, UpdateHeader, Ack, Error], Field(discriminator="type")]


class Envelope(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int
    sender: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    seq: int = Field(ge=0)
    sent_at: float
    body: Body
    signature: str = ""

    def signed_fields(self) -> dict:
        return self.model_dump(mode="json", exclude={"signature"})


class MessageError(ValueError):
    """A message that cannot be accepted; `str(exc)` is the reason to log and send back."""


_ENVELOPE = TypeAdapter(Envelope)


def seal(sender: str, seq: int, body: _Body, key: str | None) -> bytes:
    """Serialise and (when a key is given) sign a message."""
    envelope = Envelope(schema_version=SCHEMA_VERSION, sender=sender, seq=seq, sent_at=time.time(), body=body)
    if key is not None:
        envelope.signature = sign(envelope.signed_fields(), key)
    return envelope.model_dump_json().encode()


def open_envelope(raw: bytes, keys: dict[str, str] | None = None, guard: ReplayGuard | None = None) -> Envelope:
    """Parse, check the schema version, authenticate and refuse replays, in that order."""
    try:
        envelope = _ENVELOPE.validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise MessageError(f"invalid message: {where}: {first.get('msg')}") from None
    if envelope.schema_version != SCHEMA_VERSION:
        raise MessageError(f"unsupported schema version {envelope.schema_version} (this side speaks {SCHEMA_VERSION})")
    if keys is not None:
        key = keys.get(envelope.sender)
        if key is None:
            raise MessageError(f"unknown device {envelope.sender!r}")
        try:
            verify(envelope.signed_fields(), envelope.signature, key)
            if guard is not None:
                guard.accept(envelope.sender, envelope.seq)
        except AuthError as exc:
            raise MessageError(str(exc)) from None
    return envelope
