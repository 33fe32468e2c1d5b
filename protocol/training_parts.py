"""The parts every training configuration is built from, each declared once.

A round's configuration (`protocol.messages.TrainingConfig`), centralised training's (`models.training.supervised.
TrainConfig`), distillation's (`models.training.pretraining.PretrainConfig`) and the checkpoint's model description
(`models.networks.face_model.ModelConfig`) embed these parts instead of copying their fields, so a setting has one
name, one bound and one description. Each owner gives its part its own defaults (a round trains one epoch,
`ffr train` twenty); what only one owner allows (a round's upper bounds against a hostile coordinator) is that
owner's check on the part.

Saved forms from before the parts were flat: `nest` reads them, `flatten` gives today's form one level deep
(run summaries, MLflow parameters, comparing a resumed run's settings).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

WIDTH_MULTS = (0.25, 1.4)  # MobileNetV2 width multipliers a model may have (lowest, highest)


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class OptimiserSettings(_Part):
    """What every optimisation names: passes over the data, faces a step and the step size (Adam's or AdamW's)."""

    epochs: int = Field(1, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(1e-4, gt=0)


class TrainerSettings(OptimiserSettings):
    """A centralised trainer's optimiser: also its weight decay and the trunk's numeric precision
    (`models.training.fast_step.resolve_precision`). A device's round has neither: it trains in fp32, undecayed.
    A batch holds at least two faces: BatchNorm and the pairwise losses need two."""

    weight_decay: float = Field(0.0, ge=0)
    precision: Literal["auto", "bf16", "fp32"] = "auto"

    @model_validator(mode="before")
    @classmethod
    def _workable(cls, data):
        """Refused as `ffr train` and `ffr pretrain` spell the options, before pydantic's generic bounds."""
        if not isinstance(data, Mapping):
            return data
        epochs, batch, lr, decay = (data.get(k) for k in ("epochs", "batch_size", "lr", "weight_decay"))
        checks = [(epochs is None or not isinstance(epochs, int) or epochs >= 1,
                   f"--epochs must be at least 1 (got {epochs})"),
                  (batch is None or not isinstance(batch, int) or batch >= 2,
                   f"--batch-size must be at least 2 (got {batch}): BatchNorm and the pairwise losses need two "
                   "faces a batch"),
                  (lr is None or not isinstance(lr, (int, float)) or lr > 0, f"--lr must be positive (got {lr})"),
                  (decay is None or not isinstance(decay, (int, float)) or decay >= 0,
                   f"--weight-decay must not be negative (got {decay})")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        return data


class ModelSpec(_Part):
    """The model a configuration trains: the embedding's size and width, FedFR's DFC personalisation branch and its
    loss weight, and whether the margin head's class centres start from the people's mean embeddings under the
    starting model (weight imprinting, `models.networks.heads.imprint`) rather than at random."""

    embedding_dim: int = Field(128, ge=16, le=1024)
    width_mult: float = 1.0
    dfc: bool = False
    dfc_weight: float = Field(1.0, ge=0, le=100.0)  # alpha_3: the DFC branch's loss beside the margin head's
    imprint_head: bool = True

    @field_validator("width_mult")
    @classmethod
    def _width(cls, value: float) -> float:
        if not WIDTH_MULTS[0] <= value <= WIDTH_MULTS[1]:
            raise ValueError(f"--width-mult must be in [{WIDTH_MULTS[0]:g}, {WIDTH_MULTS[1]:g}] (got {value:g})")
        return value


PART_NAMES = ("optimisation", "model", "transport")  # where owners keep their parts (transport: a round's own)


def nest(raw: Mapping, parts: Mapping[str, tuple[type[BaseModel], Mapping]]) -> dict:
    """A flat saved form (its parts' fields at the top) in today's nested form. `parts`: for each part its class
    and the owner's defaults for it. A form that gives a part both ways is refused: which one meant it is
    unknowable."""
    out = dict(raw)
    for part, (kind, defaults) in parts.items():
        flat = {k: out.pop(k) for k in kind.model_fields if k in out}
        if flat and part in out:
            raise ValueError(f"{', '.join(flat)} and {part} both given: a configuration names its {part} one way")
        if flat:
            out[part] = {**defaults, **flat}
    return out


def flatten(raw: Mapping) -> dict:
    """Today's form one level deep: each part's fields beside the owner's own (every name is distinct)."""
    out = {k: v for k, v in raw.items() if k not in PART_NAMES or not isinstance(v, Mapping)}
    for part in PART_NAMES:
        if isinstance(raw.get(part), Mapping):
            out.update(raw[part])
    return out
