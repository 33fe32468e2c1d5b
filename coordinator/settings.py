"""A coordinator run's settings: rounds, quorum, limits, the combination rule and its defences, validated once.

Every check a run's settings must pass lives here (`__post_init__`), named as `ffr coordinator serve` spells
the options, so the service, the simulator and the tests all refuse the same things with the same words.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from coordinator.robust import COMBINERS
from coordinator.server_step import FIXED_STEP
from coordinator.update_screen import SCREENS
from models.typed_fields import check_types
from protocol.messages import TrainingConfig

ROUND_TIMEOUT_S = 3600.0  # devices on phones train when they can; the simulator's rounds take turns on a few cores


@dataclass
class RoundSettings:
    rounds: int = 10
    min_clients: int = 2
    fraction: float = 1.0
    round_timeout_s: float = ROUND_TIMEOUT_S
    training: TrainingConfig = field(default_factory=TrainingConfig)  # the local round every device is sent;
                                   # its method's strategy is how the coordinator aggregates (coordinator.aggregation)
    server_momentum: float = 0.9   # FedAvgM's server momentum
    server_step: float = FIXED_STEP  # how far towards the round's aggregate without real faces to choose on
    max_update_bytes: int = 64 * 1024 * 1024
    max_inflight_bytes: int = 1024 * 1024 * 1024  # all half-received updates together
    seed: int = 0
    combine: str = "mean"          # mean | trimmed-mean | median | krum (coordinator.robust)
    trim: float = 0.2              # trimmed mean: fraction dropped at each end
    byzantine: int | None = None   # Krum's f; default (n - 3) // 2
    screen: str | None = None      # none | flame (coordinator.update_screen); default flame, none under DP-FedAvg
    norm_factor: float = 3.0       # an update may be at most this x the median recent update norm
    norm_ceiling: float = 0.1      # ... and never above this fraction of the global model's norm
    norm_action: str = "clip"      # clip | reject an update above the bound
    weight_factor: float = 3.0     # no update weighs more than this x the round's median weight
    errors_per_minute: int = 30    # replies to one device that explain a refusal
    dp_noise: float = 0.0          # DP-FedAvg noise multiplier z (needs training.dp_clip); 0: no noise
    dp_delta: float = 1e-5         # the delta at which epsilon is reported
    model_dtype: str = "fp16"      # the global model on the wire: fp16 (half the bytes) or fp32
    fv: bool = False               # FedFace's Federated Validation (coordinator.validation) when validators are online
    fv_candidates: int = 3         # T
    fv_phi: float = 0.01           # eq. 13's smoothing rate
    fv_epsilon: float = 1e-3       # eq. 8, and the margin a candidate must win by
    fv_timeout_s: float = 120.0    # how long validators have to score a round's candidates

    def __post_init__(self):
        """Settings that cannot work are refused here, named as `ffr coordinator serve` spells them."""
        check_types(self)
        if self.screen is None:  # DP's accounting covers a mean of n clipped updates, not a choice among them
            self.screen = "none" if self.training.dp_clip is not None else "flame"
        checks = [(self.rounds >= 1, f"--rounds must be at least 1 (got {self.rounds})"),
                  (self.min_clients >= 1, f"--min-clients must be at least 1 (got {self.min_clients})"),
                  (0 < self.fraction <= 1, f"--fraction must be in (0, 1] (got {self.fraction:g})"),
                  (self.round_timeout_s > 0, f"--round-timeout must be positive (got {self.round_timeout_s:g})"),
                  (0 <= self.trim < 0.5, f"--trim must be in [0, 0.5) (got {self.trim:g})"),
                  (self.norm_factor > 0 and self.norm_ceiling > 0, "--norm-factor and --norm-ceiling must be positive"),
                  (self.dp_noise >= 0, f"--dp-noise must not be negative (got {self.dp_noise:g})"),
                  (0 < self.dp_delta < 1, f"--dp-delta must be in (0, 1) (got {self.dp_delta:g})"),
                  (0 < self.server_step <= 1, f"--server-step must be in (0, 1] (got {self.server_step:g})"),
                  (0 <= self.server_momentum < 1,
                   f"--server-momentum must be in [0, 1) (got {self.server_momentum:g})"),
                  (self.byzantine is None or self.byzantine >= 0, "--byzantine must not be negative"),
                  (self.max_update_bytes > 0 and self.max_inflight_bytes > 0 and self.errors_per_minute >= 0
                   and self.weight_factor > 0, "the update size limits and weight factor must be positive"),
                  (self.fv_epsilon >= 0, f"--fv-epsilon must not be negative (got {self.fv_epsilon:g})"),
                  (self.fv_timeout_s > 0 and self.fv_candidates >= 2, "--fv-timeout must be positive and "
                                                                       "--fv-candidates at least 2"),
                  (0 < self.fv_phi <= 1, f"--fv-phi must be in (0, 1] (got {self.fv_phi:g})"),
                  (self.combine in COMBINERS, f"unknown combination rule {self.combine!r}; "
                                              f"choose one of {', '.join(COMBINERS)}"),
                  (not self.fv or self.combine == "mean",
                   "Federated Validation weighs a mean: use the mean combination rule with it"),
                  (self.screen in SCREENS, f"unknown update screen {self.screen!r}; choose one of "
                                           f"{', '.join(SCREENS)}"),
                  (self.screen == "none" or self.training.dp_clip is None,
                   "DP-FedAvg's accounting covers every clipped update: use --screen none with it"),
                  (self.model_dtype in ("fp16", "fp32"), "model_dtype must be fp16 or fp32"),
                  (self.norm_action in ("clip", "reject"), "norm_action must be clip or reject"),
                  (self.dp_noise == 0 or self.training.dp_clip is not None,
                   "differential privacy needs a clipping norm (dp_clip) as well as a noise multiplier"),
                  (self.training.dp_clip is None or self.combine == "mean",
                   "DP-FedAvg averages updates: use the mean combination rule with it")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def to_dict(self) -> dict:
        """JSON-ready, the local training as its wire message's fields."""
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "training"},
                "training": self.training.model_dump(exclude={"type"})}

    @classmethod
    def from_dict(cls, raw: dict) -> RoundSettings:
        """From `to_dict`'s form; both parts are validated again."""
        return cls(**{**raw, "training": TrainingConfig(**raw.get("training", {}))})
