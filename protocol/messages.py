"""Typed, versioned, bounded messages (pydantic). Every message travels in a signed `Envelope`.

Everything that arrives from the network is written by a possible attacker, so every field
is bounded: sizes, lengths, integers (at most 2^53, JSON's safe range), finite floats only,
ASCII hex for hashes, keys and signatures, and the raw message's size and nesting depth.
The body's `type` names its schema; unknown types, wrong schema versions and malformed JSON
are rejected with a reason, never a crash.
"""
from __future__ import annotations

import json
import time
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from protocol import SCHEMA_VERSION
from protocol.auth import MAX_SEQ, PUBLIC_KEY_PATTERN, SIGNATURE_PATTERN, AuthError, ReplayGuard, Signer, verify
from protocol.codecs import TOPK_FRACTION
from protocol.methods import FLAT_NAMES, FedAvg, MethodSettings, from_flat
from protocol.training_parts import ModelSpec, OptimiserSettings, nest

MAX_MESSAGE_BYTES = 256 * 1024     # a round announcement for thousands of participants still fits
MAX_DEVICES_PER_ROUND = 4096
MAX_INT = 2 ** 53
MAX_FV_CANDIDATES = 64            # FedFace's T: candidate weightings scored per round
MAX_CHUNK_BYTES = 8 * 1024 * 1024  # the largest chunk of an update or model on the wire
MAX_PUBLIC_SET_BYTES = 4 << 30     # 4 GiB: ~80k 128 px crops; a device refuses to fetch more

DeviceId = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
Hex64 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
MetricName = Annotated[str, StringConstraints(max_length=64, pattern=r"^[A-Za-z0-9_.@-]+$")]


def _together(body, *names: str):
    """Optional fields that describe one thing (a file: where, its hash, its size) come all together or not at all."""
    given = [getattr(body, name) is not None for name in names]
    if any(given) and not all(given):
        raise ValueError(f"{', '.join(names[:-1])} and {names[-1]} come together")
    return body


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def model_copy(self, *, update: dict | None = None, deep: bool = False):
        """A copy with `update` validated like any message: pydantic's own copy takes any name without a word, so
        a setting that moved into a part (`lr` into `optimisation`) would be dropped, and a bound would not hold."""
        if not update:
            return super().model_copy(deep=deep)
        return type(self).model_validate({**self.model_dump(), **update})


class Hello(_Body):
    """A device introduces itself: its public key, and (until admitted) proof of its admission token."""

    type: Literal["hello"] = "hello"
    n_identities: int = Field(ge=0, le=1_000_000)
    n_images: int = Field(ge=0, le=10_000_000)
    software: str = Field("ffr-edge", max_length=64)
    public_key: str = Field(pattern=PUBLIC_KEY_PATTERN)
    token_proof: Hex64 | None = None  # HMAC(token, id | public key): the token itself never travels
    validator: bool = False           # FedFace's FV: this device scores candidate models on private images


class Registered(_Body):
    """The coordinator's answer to an admitted device's first hello. It carries no secret."""

    type: Literal["registered"] = "registered"
    device_id: DeviceId


class Heartbeat(_Body):
    type: Literal["heartbeat"] = "heartbeat"
    state: str = Field("idle", max_length=32)


class TransportSettings(_Body):
    """How a round's updates travel: the codec (`protocol.codecs`), the share of coordinates topk keeps, and the
    chunk size on the broker. The device's training never reads them; its upload does."""

    codec: Literal["fp16", "fp32", "int8", "topk"] = "fp16"
    topk_fraction: float = Field(TOPK_FRACTION, ge=1e-4, le=1.0)
    chunk_bytes: int = Field(256 * 1024, ge=1024, le=MAX_CHUNK_BYTES)


class PublicSetRef(_Body):
    """The public set the coordinator serves (`coordinator.public_set`: FedFR's D_g, and the strangers every device
    calibrates on): where a device fetches it over HTTP, its hash and its size. Fetched once and kept by its hash
    (`edge_client.public_set`); one part, so the three come together by construction."""

    url: str = Field(max_length=512, pattern=r"^https?://[!-~]+$")
    sha256: Hex64
    size_bytes: int = Field(ge=1, le=MAX_PUBLIC_SET_BYTES)


# format 1's flat names of the public set's fields (`TrainingConfig._older_formats`)
PUBLIC_SET_FLAT = {"public_set_url": "url", "public_set_sha256": "sha256", "public_set_bytes": "size_bytes"}
# a round's bounds on its optimiser, each with the option that sets it: no announcement can make a device train
# forever or diverge by design
ROUND_LIMITS = {"epochs": ("--local-epochs", 20), "batch_size": ("--batch-size", 512), "lr": ("--lr", 1.0)}
# the model part a round names by default: devices train the DFC branch
ROUND_MODEL = {"dfc": True}


class TrainingConfig(_Body):
    """Local training settings, bounded so that no announcement can make a device train forever.

    Format 3 names the federated method with the settings only it takes (`method`, one of `protocol.methods`'
    models, by `name`) and nests the optimiser (`optimisation`) and the model (`model`) parts that centralised
    training embeds too (`protocol.training_parts`), how updates travel (`transport`) and where the public set is
    (`public_set`). Formats 1 (every field at the top) and 2 (the method's settings at the top) are still read
    (`_older_formats`)."""

    type: Literal["training_config"] = "training_config"
    version: Literal[3] = 3
    method: MethodSettings = Field(default_factory=FedAvg)
    optimisation: OptimiserSettings = Field(default_factory=OptimiserSettings)
    model: ModelSpec = Field(default_factory=lambda: ModelSpec(**ROUND_MODEL))
    transport: TransportSettings = Field(default_factory=TransportSettings)
    dp_clip: float | None = Field(None, gt=0, le=1e6)  # DP-FedAvg: clip the update to this L2 norm before sending
    dfc_steps: int = Field(300, ge=0, le=20_000)  # fitting the DFC branch on frozen features after local training
    dfc_lr: float = Field(3e-3, gt=0, le=1.0)  # measured: bench/results/personalisation_lr.md
    dfc_views: int = Field(2, ge=1, le=16)     # views of each local image (the first unaugmented) for that fit
    dfc_anchor: float = Field(0.0, ge=0, le=1e4)  # that fit pays this x Pi's drift from the identity (dfc.fit_dfc)
    # what of the shared embedder a round may change (models.training.trainable): BatchNorm's statistics (frozen:
    # a device's few people never become the shared model's statistics; frozen-trunk: the embedding layer's own
    # BatchNorm still learns; bench.honest_round measured them), and how many of the trunk's last blocks train
    # (None: all)
    batchnorm: Literal["train", "frozen", "frozen-trunk"] = "frozen"
    top_blocks: int | None = Field(None, ge=0, le=64)
    public_set: PublicSetRef | None = None  # where the served public set is, when the coordinator serves one

    @property
    def algorithm(self) -> str:
        """How the coordinator aggregates this configuration's rounds: its method's strategy."""
        return self.method.strategy

    @model_validator(mode="before")
    @classmethod
    def _older_formats(cls, data):
        """Format 1 (no `version`: an older coordinator's, or settings written before the parts) has its parts'
        fields at the top, read into the parts with a round's own defaults for them; formats 1 and 2 name the
        method's settings at the top (`algorithm`, `prox_mu`, FedFR's and HF-MAML's terms), read into `method`."""
        if not isinstance(data, dict) or data.get("version", 2) != 2:  # no `version`: format 1
            return data
        data = dict(data)  # the caller's form is read, not changed
        if "version" not in data:
            data = nest(data, {"optimisation": (OptimiserSettings, {}), "model": (ModelSpec, ROUND_MODEL),
                               "transport": (TransportSettings, {}), "public_set": (PublicSetRef, {}, PUBLIC_SET_FLAT)})
        flat = {k: data.pop(k) for k in FLAT_NAMES if k in data}
        if flat and "method" in data:
            raise ValueError(f"{', '.join(flat)} and method both given: a configuration names its method one way")
        if flat:
            data["method"] = from_flat(flat)
        return {**data, "version": 3}

    @field_validator("optimisation")
    @classmethod
    def _round_bounds(cls, part: OptimiserSettings) -> OptimiserSettings:
        for name, (flag, most) in ROUND_LIMITS.items():
            if getattr(part, name) > most:
                raise ValueError(f"{flag} must be at most {most:g} in a round (got {getattr(part, name):g})")
        return part


class RoundAnnouncement(_Body):
    type: Literal["round"] = "round"
    round_id: int = Field(ge=1, le=MAX_INT)
    model_version: Count
    model_sha256: Hex64
    model_bytes: int = Field(ge=1, le=1 << 31)
    model_chunks: int = Field(ge=1, le=1 << 20)
    total_rounds: int = Field(ge=1, le=MAX_INT)
    deadline_unix: float = Field(ge=0, le=1e11)
    config: TrainingConfig
    participants: list[DeviceId] = Field(max_length=MAX_DEVICES_PER_ROUND)
    # PFM's global momentum for this model version (all three or none), chunked like the model
    momentum_sha256: Hex64 | None = None
    momentum_bytes: int | None = Field(None, ge=1, le=1 << 31)
    momentum_chunks: int | None = Field(None, ge=1, le=1 << 20)

    @model_validator(mode="after")
    def _momentum_complete(self) -> RoundAnnouncement:
        return _together(self, "momentum_sha256", "momentum_bytes", "momentum_chunks")


class ModelRelease(_Body):
    """The federation's final model, after its last round (retained on the announcements topic): every device
    fetches it like a round's model, checks it (edge_client.adoption) and verifies with it from then on."""

    type: Literal["release"] = "release"
    model_version: Count
    model_sha256: Hex64
    model_bytes: int = Field(ge=1, le=1 << 31)
    model_chunks: int = Field(ge=1, le=1 << 20)
    config: TrainingConfig


class UpdateHeader(_Body):
    """Announces an update whose tensors follow as chunks of transfer `transfer_id`."""

    type: Literal["update"] = "update"
    round_id: int = Field(ge=1, le=MAX_INT)
    base_version: Count
    n_samples: int = Field(ge=1, le=MAX_INT)
    transfer_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    payload_sha256: Hex64
    payload_bytes: int = Field(ge=1, le=1 << 31)
    codec: Literal["fp16", "fp32", "int8", "topk"] = "fp16"  # must be the round's; signed with the rest
    metrics: dict[MetricName, float] = Field(default_factory=dict, max_length=32)


class ValidationRequest(_Body):
    """FedFace's Federated Validation: score this candidate global model (chunks on the candidate's topic)."""

    type: Literal["validate"] = "validate"
    round_id: int = Field(ge=1, le=MAX_INT)
    candidate: int = Field(ge=1, le=MAX_FV_CANDIDATES)
    model_sha256: Hex64
    model_bytes: int = Field(ge=1, le=1 << 31)
    model_chunks: int = Field(ge=1, le=1 << 20)
    deadline_unix: float = Field(ge=0, le=1e11)


class ValidationScore(_Body):
    """A validator's answer: one number in [0, 1] (its verification AUC on its own images), nothing else."""

    type: Literal["score"] = "score"
    round_id: int = Field(ge=1, le=MAX_INT)
    candidate: int = Field(ge=1, le=MAX_FV_CANDIDATES)
    score: float = Field(ge=0.0, le=1.0)


class Ack(_Body):
    type: Literal["ack"] = "ack"
    of: str = Field(max_length=64)
    round_id: int | None = Field(None, ge=0, le=MAX_INT)


class Error(_Body):
    type: Literal["error"] = "error"
    reason: str = Field(max_length=512)
    round_id: int | None = Field(None, ge=0, le=MAX_INT)
    resume_seq: int | None = Field(None, ge=-1, le=MAX_SEQ)  # a refused counter: number from here
    code: Literal["admission"] | None = None  # "admission": this device's credential is refused; it cannot join


Body = Annotated[
    Hello
    | Registered
    | Heartbeat
    | RoundAnnouncement
    | ModelRelease
    | UpdateHeader
    | ValidationRequest
    | ValidationScore
    | Ack
    | Error,
    Field(discriminator="type"),
]


class Envelope(BaseModel):
    """Who sent it, to whom (None: everyone), its number, and the sender's signature over all of it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    schema_version: int = Field(ge=0, le=1000)
    sender: DeviceId
    to: DeviceId | None = None
    seq: int = Field(ge=0, le=MAX_SEQ)
    sent_at: float = Field(ge=0, le=1e11)
    body: Body
    signature: str = Field(pattern=SIGNATURE_PATTERN)
    _received: dict | None = PrivateAttr(default=None)

    def signed_fields(self) -> dict:
        """What the signature covers: the fields exactly as received (so a receiver whose schema has gained an
        optional field still verifies an older sender), or, for a message being sent, as it will be sent."""
        if self._received is not None:
            return self._received
        return self.model_dump(mode="json", exclude={"signature"})


class MessageError(ValueError):
    """A message that cannot be accepted; `str(exc)` is the reason to log and send back."""


_ENVELOPE = TypeAdapter(Envelope)


def seal(sender: str, seq: int, body: _Body, signer: Signer, to: str | None = None) -> bytes:
    """Serialise and sign a message."""
    envelope = Envelope(schema_version=SCHEMA_VERSION, sender=sender, to=to, seq=seq, sent_at=time.time(), body=body,
                        signature="0" * 128)
    envelope.signature = signer.sign(envelope.signed_fields())
    return envelope.model_dump_json().encode()


def parse(raw: bytes) -> Envelope:
    """Bytes -> a schema-valid envelope (not yet authenticated), or MessageError with the first reason."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        envelope = _ENVELOPE.validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))[:80]
        raise MessageError(f"invalid message: {where}: {str(first.get('msg'))[:120]}") from None
    if envelope.schema_version != SCHEMA_VERSION:
        raise MessageError(f"unsupported schema version {envelope.schema_version} (this side speaks {SCHEMA_VERSION})")
    received = json.loads(raw)  # safe: the schema (size, depth, types) has already accepted these bytes
    received.pop("signature", None)
    envelope._received = received
    return envelope


def authenticate(envelope: Envelope, public_key: str, guard: ReplayGuard | None = None,
                 now_ms: int | None = None) -> Envelope:
    """Check the sender's signature, then (with a guard) refuse replays; MessageError otherwise."""
    try:
        verify(envelope.signed_fields(), envelope.signature, public_key)
        if guard is not None:
            guard.accept(envelope.sender, envelope.seq, now_ms)
    except AuthError as exc:
        raise MessageError(str(exc)) from None
    return envelope


def open_envelope(raw: bytes, public_key: str, guard: ReplayGuard | None = None) -> Envelope:
    """Parse and authenticate a message from the holder of `public_key`."""
    return authenticate(parse(raw), public_key, guard)
