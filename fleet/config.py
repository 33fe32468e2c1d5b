"""What a fleet simulation runs: one dataclass, saved in the run folder so a run can be resumed or repeated.

Defaults follow the design document: 10 clients, weak augmentation, batch 32, Adam at 1e-4,
FedProx with mu 0.01, DFC on.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from protocol.codecs import CODECS, TOPK_FRACTION
from protocol.messages import ALGORITHMS

# Options that may change between an interrupted run and its resumption; all others must match.
RESUMABLE_CHANGES = {"rounds", "workers", "dashboard_port", "backend", "ray_address", "cpus_per_device",
                     "gpus_per_device", "patience", "min_delta", "round_timeout", "centralized", "mlflow", "broker",
                     "crop_cache", "progress", "eval_clients", "tune_steps"}


@dataclass
class SimConfig:
    data: str | None = None            # None: SYNTHETIC identities generated into the run folder
    layout: str = "auto"
    synthetic_identities: int = 60
    synthetic_images: int = 10
    detector: str = "auto"             # auto: none for SYNTHETIC data, else YuNet-aligned with Haar fallback
    clients: int = 10
    rounds: int = 10
    partition: str = "iid"
    alpha: float = 0.5
    alpha_x100: bool = False
    lognormal_mu: float = 3.0
    lognormal_sigma: float = 3.0
    rules: list | None = None
    holdout_identities: float = 0.2  # models.cli_common.HOLDOUT_IDENTITIES (the benchmarks pin their own)
    heldout_clients: int = 0
    split: tuple[float, float, float] = (0.7, 0.1, 0.2)
    algorithm: str = "fedprox"
    prox_mu: float = 0.01
    server_momentum: float = 0.9
    dfc: bool = True
    dfc_weight: float | None = None    # alpha_3; None: 1, or 10 with method fedfr (models.objective_cli)
    method: str | None = None          # the CLI's --method (models.objective_cli.METHODS); None: `algorithm` alone
    hard_negatives: bool | None = None  # None: on with method fedfr
    contrastive: bool | None = None     # None: on with method fedfr
    t_hn: float = 0.4
    tau: float = 0.5
    alpha_cos: float = 1.0
    alpha_con: float = 5.0
    dfc_steps: int = 300
    dfc_lr: float = 1e-2
    imprint_head: bool = True
    embedding_reg: float = 0.0         # C of the HF-MAML paper's eq. 4
    maml_alpha: float = 0.01
    maml_beta: float = 0.01
    maml_delta: float = 1e-3
    public_data: str | None = None     # FedFR's D_g: aligned faces of people no client has
    public_limit: int = 2000
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 1e-4
    fraction: float = 1.0
    patience: int = 5                  # rounds without a better validation AUC before stopping; 0: never
    min_delta: float = 1e-3
    seed: int = 0
    width_mult: float = 1.0
    init: str = "face"                 # round 0: face (shipped weights) | imagenet | none
    codec: str = "fp16"                # how updates travel: fp16 | fp32 | int8 | topk (protocol.codecs)
    topk_fraction: float = TOPK_FRACTION
    workers: int = field(default_factory=lambda: max(1, min(2, os.cpu_count() or 1)))
    backend: str = "pool"              # pool (worker processes) | ray (fleet.ray_pool)
    ray_address: str | None = None     # an existing Ray cluster; None: start Ray on this machine
    cpus_per_device: float = 1.0       # what Ray reserves for each device turn
    gpus_per_device: float = 0.0
    dashboard_port: int | None = None  # serve the coordinator's dashboard on 127.0.0.1 during the run
    round_timeout: float = 3600.0
    centralized: bool = True
    impostor_images: int = 300         # other clients' test images each client's verifier is tried on
    fv: bool = False                   # FedFace's Federated Validation, validators = the first held-out clients
    fv_validators: int = 1
    fv_candidates: int = 3             # T
    fv_phi: float = 0.01               # eq. 13
    fv_epsilon: float = 1e-3
    tune_steps: int = 0                # also measure each client's "tuned" model: the global one after this many
                                       # local batches (the HF-MAML paper's evaluation; 5 there); 0: off
    eval_clients: int | None = None    # per-client evaluation on a seeded sample of this many clients; None: all
    max_eval_pairs: int = 100_000
    broker: str | None = None
    crop_cache: str | None = None      # None: the user's crop cache ($FFR_CACHE_DIR), shared with other commands
    mlflow: bool = True
    progress: bool = True
    malicious: float = 0.0             # fraction of training clients that poison their updates (fleet.attacks)
    attack: str = "scaled"
    combine: str = "mean"              # how the coordinator combines updates (coordinator.robust)
    dp_clip: float | None = None       # DP-FedAvg: devices clip updates to this L2 norm (coordinator.dp)
    dp_noise: float = 0.0              # DP-FedAvg: noise multiplier z
    gate_data: str | None = None       # the coordinator's quality gate faces (default: the packed --public-data)
    gate_far: float = 1e-3             # coordinator.quality_gate.GateSettings
    gate_far_ratio: float = 2.0
    gate_auc_margin: float = 0.01
    gate_faces: int = 400
    no_gate: bool = False

    def validate(self) -> None:
        if self.clients < 1:
            raise ValueError("--clients must be at least 1")
        if self.rounds < 1:
            raise ValueError("--rounds must be at least 1")
        if self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"unknown aggregation {self.algorithm!r} (--method); choose one of {', '.join(ALGORITHMS)}"
            )
        if not 0 < self.fraction <= 1:
            raise ValueError("--fraction must be in (0, 1]")
        if self.backend not in ("pool", "ray"):
            raise ValueError(f"unknown --backend {self.backend!r}; choose pool or ray")
        if self.ray_address and self.backend != "ray":
            raise ValueError("--ray-address needs --backend ray")
        if self.cpus_per_device <= 0 or self.gpus_per_device < 0:
            raise ValueError("--cpus-per-device must be positive and --gpus-per-device not negative")
        if self.codec not in CODECS or not 0 < self.topk_fraction <= 1:
            raise ValueError("--codec must be fp16, fp32, int8 or topk, and --topk-fraction in (0, 1]")
        if self.data is not None and not Path(self.data).exists():
            raise FileNotFoundError(f"dataset path does not exist: {self.data}")
        self._validate_defences()
        self._validate_objective()
        self._validate_public_and_gate()
        if abs(sum(self.split) - 1.0) > 1e-6 or min(self.split) < 0:
            raise ValueError(f"--split fractions must be >= 0 and sum to 1, got {self.split}")

    def _validate_defences(self) -> None:
        """The attack, the combination rule, DP-FedAvg and FedFace's Federated Validation."""
        from coordinator.robust import COMBINERS
        from fleet.attacks import ATTACKS

        if not 0 <= self.malicious < 1:
            raise ValueError("--malicious must be in [0, 1)")
        if self.attack not in ATTACKS:
            raise ValueError(f"unknown --attack {self.attack!r}; choose one of {', '.join(ATTACKS)}")
        if self.combine not in COMBINERS:
            raise ValueError(f"unknown --combine {self.combine!r}; choose one of {', '.join(COMBINERS)}")
        if self.dp_noise > 0 and self.dp_clip is None:
            raise ValueError("--dp-noise needs --dp-clip (the L2 norm devices clip their updates to)")
        if self.dp_clip is not None and (self.dp_clip <= 0 or self.combine != "mean"):
            raise ValueError("--dp-clip must be > 0, with --combine mean")
        if self.fv and (self.fv_validators < 1 or self.heldout_clients < self.fv_validators):
            raise ValueError("--fv needs --holdout-clients of at least --fv-validators (validators are clients kept "
                             "out of training, scoring on their own images)")
        if self.fv and self.combine != "mean":
            raise ValueError("--fv weighs a mean: use --combine mean with it")
        if self.fv_candidates < 2 or not 0 < self.fv_phi <= 1:
            raise ValueError("--fv-candidates must be at least 2 and --fv-phi in (0, 1]")

    def _validate_objective(self) -> None:
        """--method and the local objective's switches, which some methods exclude."""
        from models.objective_cli import METHODS

        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"unknown --method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.embedding_reg < 0:
            raise ValueError("--embedding-reg must not be negative")
        if self.method == "hfmaml" and (self.hard_negatives or self.contrastive):
            raise ValueError("--method hfmaml takes no hard negatives or contrastive term (FedFR's)")
        if self.embedding_reg and (self.method == "fedfr" or self.hard_negatives or self.contrastive):
            raise ValueError("--embedding-reg applies to fedavg, fedprox and hfmaml, not to FedFR's objective")

    def _validate_public_and_gate(self) -> None:
        """FedFR's public set D_g (other people than --data) and the coordinator's quality gate."""
        from coordinator.quality_gate import GateSettings
        from models.objective_cli import objective_settings

        if objective_settings(self)["hard_negatives"] and self.public_data is None:
            raise ValueError("hard negatives need a public set: --public-data DIR (aligned faces of people no "
                             "client has, e.g. ../shared/faces/utkface_aligned), or --no-hard-negatives")
        if self.public_data is not None:
            public = Path(self.public_data).resolve()
            if not public.is_dir():
                raise FileNotFoundError(f"--public-data folder does not exist: {self.public_data}")
            if self.data is not None and public == Path(self.data).resolve():
                raise ValueError("--public-data must hold other people than --data (D_g is nobody's enrolled people)")
        if self.gate_data is not None and not Path(self.gate_data).exists():
            raise FileNotFoundError(f"--gate-data does not exist: {self.gate_data}")
        GateSettings(self.gate_far, self.gate_far_ratio, self.gate_auc_margin, self.gate_faces)  # its own checks
        if self.public_limit < 1:
            raise ValueError("--public-limit must be at least 1")

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> SimConfig:
        raw = json.loads(path.read_text())
        known = {f.name for f in fields(cls)}
        config = cls(**{k: v for k, v in raw.items() if k in known})
        config.split = tuple(config.split)
        return config

    def differences(self, other: SimConfig) -> list[str]:
        """Options that differ from `other` and may not change when resuming."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{k}: {theirs[k]!r} -> {mine[k]!r}" for k in mine
                if k not in RESUMABLE_CHANGES and _norm(mine[k]) != _norm(theirs[k])]


def _norm(value):
    return list(value) if isinstance(value, tuple) else value
