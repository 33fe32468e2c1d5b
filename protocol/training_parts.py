"""The parts every training configuration is built from, each declared once.

A round's configuration (`protocol.messages.TrainingConfig`), centralised training's (`models.training.supervised.
TrainConfig`), distillation's (`models.training.pretraining.PretrainConfig`) and the checkpoint's model description
(`models.networks.face_model.ModelConfig`) embed these parts instead of copying their fields, so a setting has one
name, one bound and one description. Each owner gives its part its own defaults (a round trains one epoch,
`ffr train` twenty); what only one owner allows (a round's upper bounds against a hostile coordinator) is that
owner's check on the part.

Plain dataclasses that check themselves when built: distillation runs where no pydantic is installed (a lent GPU
machine, `bench/gpu_distill.sh`), and a round's message validates them with pydantic all the same (it reads
`__pydantic_config__`: no unknown field, no infinity or NaN, and `__post_init__`'s checks).

Saved forms from before the parts were flat: `nest` reads them, `flatten` gives today's form one level deep
(run summaries, MLflow parameters, comparing a resumed run's settings).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal

WIDTH_MULTS = (0.25, 1.4)  # MobileNetV2 width multipliers a model may have (lowest, highest)
PRECISIONS = ("auto", "bf16", "fp32")
_STRICT = {"extra": "forbid", "allow_inf_nan": False}  # a part inside a round's message (pydantic's ConfigDict)


def _refuse_unless(checks: list[tuple[bool, str]]) -> None:
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A finite number as JSON gives one (not a bool, not a numeric string): for values read from a hostile file."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class OptimiserSettings:
    """What every optimisation names: passes over the data, faces a step and the step size (Adam's or AdamW's)."""

    __pydantic_config__ = _STRICT

    epochs: int = 1
    batch_size: int = 32
    lr: float = 1e-4

    def __post_init__(self) -> None:
        self._check(lowest_batch=1, why="")

    def _check(self, lowest_batch: int, why: str) -> None:
        """Refused as the commands spell the options (`models.cli.common.one_line` respells one a command names
        otherwise, e.g. a round's `--local-epochs`)."""
        e, b, lr = self.epochs, self.batch_size, self.lr
        _refuse_unless([(_whole(e) and e >= 1, f"--epochs must be at least 1 (got {e!r})"),
                        (_whole(b) and b >= lowest_batch, f"--batch-size must be at least {lowest_batch} (got {b!r})"
                                                          f"{why}"),
                        (is_real(lr) and lr > 0, f"--lr must be positive (got {lr!r})")])


@dataclass
class TrainerSettings(OptimiserSettings):
    """A centralised trainer's optimiser: also its weight decay and the trunk's numeric precision
    (`models.training.fast_step.resolve_precision`). A device's round has neither: it trains in fp32, undecayed.
    A batch holds at least two faces: BatchNorm and the pairwise losses need two."""

    weight_decay: float = 0.0
    precision: Literal["auto", "bf16", "fp32"] = "auto"

    def __post_init__(self) -> None:
        self._check(lowest_batch=2, why=": BatchNorm and the pairwise losses need two faces a batch")
        _refuse_unless([(is_real(self.weight_decay) and self.weight_decay >= 0,
                         f"--weight-decay must not be negative (got {self.weight_decay!r})"),
                        (self.precision in PRECISIONS,
                         f"--precision must be one of {', '.join(PRECISIONS)} (got {self.precision!r})")])


@dataclass
class ModelSpec:
    """The model a configuration trains: the embedding's size and width, FedFR's DFC personalisation branch and its
    loss weight, and whether the margin head's class centres start from the people's mean embeddings under the
    starting model (weight imprinting, `models.networks.heads.imprint`) rather than at random."""

    __pydantic_config__ = _STRICT

    embedding_dim: int = 128
    width_mult: float = 1.0
    dfc: bool = False
    dfc_weight: float = 1.0  # alpha_3: the DFC branch's loss beside the margin head's
    imprint_head: bool = True

    def __post_init__(self) -> None:
        d, w, a = self.embedding_dim, self.width_mult, self.dfc_weight
        _refuse_unless([(_whole(d) and 16 <= d <= 1024, f"--embedding-dim must be in [16, 1024] (got {d!r})"),
                        (is_real(w) and WIDTH_MULTS[0] <= w <= WIDTH_MULTS[1],
                         f"--width-mult must be in [{WIDTH_MULTS[0]:g}, {WIDTH_MULTS[1]:g}] (got {w!r})"),
                        (is_real(a) and 0 <= a <= 100, f"--dfc-weight must be in [0, 100] (got {a!r})"),
                        (isinstance(self.dfc, bool) and isinstance(self.imprint_head, bool),
                         "--dfc and --imprint-head are on or off")])


PART_NAMES = ("optimisation", "model", "transport")  # where owners keep their parts (transport: a round's own)


def field_names(kind: type) -> list[str]:
    """A part's fields: a dataclass's, or a pydantic model's."""
    return list(getattr(kind, "model_fields", None) or (f.name for f in fields(kind)))


def nest(raw: Mapping, parts: Mapping[str, tuple]) -> dict:
    """A flat saved form (its parts' fields at the top) in today's nested form. `parts`: for each part its class, the
    owner's defaults for it and, where the flat form spelled them otherwise, {flat name: field} (format 1's
    `public_set_url` is the public set's `url`). A part given only as nulls is given as none (refused unless the
    owner's part may be none); one given both ways is refused: which one meant it is unknowable."""
    out = dict(raw)
    for part, (kind, defaults, *spelt) in parts.items():
        names = spelt[0] if spelt else {name: name for name in field_names(kind)}
        flat = {field: out.pop(name) for name, field in names.items() if name in out}
        if flat and part in out:
            raise ValueError(f"{', '.join(flat)} and {part} both given: a configuration names its {part} one way")
        if flat:
            out[part] = None if all(value is None for value in flat.values()) else {**defaults, **flat}
    return out


def flatten(raw: Mapping) -> dict:
    """Today's form one level deep: each part's fields beside the owner's own (every name is distinct); a round's
    method (`protocol.methods`), whose settings' names only it defines, as `method.name`, `method.prox_mu`, ..."""
    out = {k: v for k, v in raw.items() if k not in (*PART_NAMES, "method") or not isinstance(v, Mapping)}
    for part in PART_NAMES:
        if isinstance(raw.get(part), Mapping):
            out.update(raw[part])
    if isinstance(raw.get("method"), Mapping):
        out.update({f"method.{k}": v for k, v in raw["method"].items()})
    return out
