"""What a fleet simulation runs: one nested spec, saved in the run folder so a run can be resumed or repeated.

The spec has three parts, each the type the rest of the product uses for it: the simulation's own options
(data, partition, the fleet's machines, evaluation, attacks) here; `server`, the coordinator's
`coordinator.settings.RoundSettings` (rounds, combination rule, DP, Federated Validation), which holds the
local training every device is sent (`server.training`, the wire's `protocol.messages.TrainingConfig`); and
`gate`, the coordinator's `coordinator.quality_gate.GateSetup` (its faces, off or not, its bar). Each part
validates itself when built; `validate` checks only what ties the parts to the simulation. `ffr fleet simulate`
builds the parts with the same functions as `ffr coordinator serve`, so one flag means one thing in both.

Defaults follow the design document: 10 clients, weak augmentation, batch 32, Adam at 1e-4, DFC on.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from coordinator.quality_gate import GateSettings, GateSetup
from coordinator.settings import RoundSettings
from models.faces.partition import check_rules, check_scheme
from models.typed_fields import check_types
from protocol.json_file import json_object, read_json
from protocol.messages import TrainingConfig
from protocol.training_parts import PART_NAMES, flatten

# Options that may change between an interrupted run and its resumption; all others must match.
RESUMABLE_CHANGES = {"server.rounds", "workers", "dashboard_port", "backend", "ray_address", "cpus_per_device",
                     "gpus_per_device", "patience", "min_delta", "server.round_timeout_s", "centralized", "mlflow",
                     "broker", "crop_cache", "progress", "eval_clients", "tune_steps"}


@dataclass
class SimConfig:
    data: str | None = None            # None: SYNTHETIC identities generated into the run folder
    layout: str = "auto"
    synthetic_identities: int = 60
    synthetic_images: int = 10
    detector: str = "auto"             # auto: none for SYNTHETIC data, else YuNet-aligned with Haar fallback
    clients: int = 10
    partition: str = "iid"
    alpha: float = 0.5
    alpha_x100: bool = False
    lognormal_mu: float = 3.0
    lognormal_sigma: float = 3.0
    rules: list | None = None
    holdout_identities: float = 0.2  # models.cli.common.HOLDOUT_IDENTITIES (the benchmarks pin their own)
    heldout_clients: int = 0
    split: tuple[float, float, float] = (0.7, 0.1, 0.2)
    server: RoundSettings = field(default_factory=RoundSettings)  # the coordinator's rounds and devices' training
    gate: GateSetup = field(default_factory=GateSetup)  # the coordinator's quality gate (default faces: its people)
    public_data: str | None = None     # FedFR's D_g: aligned faces of people no client has
    public_limit: int = 2000
    patience: int = 5                  # rounds without a better validation AUC before stopping; 0: never
    min_delta: float = 1e-3
    init: str = "face"                 # round 0: face (shipped weights) | imagenet | none
    workers: int = field(default_factory=lambda: max(1, min(2, os.cpu_count() or 1)))
    backend: str = "pool"              # pool (worker processes) | ray (fleet.ray_pool)
    ray_address: str | None = None     # an existing Ray cluster; None: start Ray on this machine
    cpus_per_device: float = 1.0       # what Ray reserves for each device turn
    gpus_per_device: float = 0.0
    dashboard_port: int | None = None  # serve the coordinator's dashboard on 127.0.0.1 during the run
    centralized: bool = True
    impostor_images: int = 300         # other clients' test images each client's verifier is tried on
    fv_validators: int = 1             # with server.fv: the first held-out clients validate
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
    gate_identities: float = 0.3       # models.cli.common.GATE_IDENTITIES: the share of the people on no device
                                       # the coordinator keeps for its gate (without --gate-data); 0: public set
    public_identities: float = 0.2     # models.cli.common.PUBLIC_IDENTITIES: without --public-data, the share of the
                                       # people on no device whose faces devices are served as their public set

    @property
    def training(self) -> TrainingConfig:
        """The local round every device is sent."""
        return self.server.training

    @property
    def seed(self) -> int:
        """The run's one seed: partition, sampling, round 0 and training (the server part's)."""
        return self.server.seed

    def validate(self) -> None:
        """What ties the parts to the simulation; `server`, `server.training` and `gate` checked themselves."""
        checks = [(self.clients >= 1, "--clients must be at least 1"),
                  (self.data is not None or min(self.synthetic_identities, self.synthetic_images) >= 2,
                   "SYNTHETIC data needs --synthetic-identities and --synthetic-images of at least 2"),
                  (self.workers >= 1, f"--workers must be at least 1 (got {self.workers})"),
                  (self.backend in ("pool", "ray"), f"unknown --backend {self.backend!r}; choose pool or ray"),
                  (not self.ray_address or self.backend == "ray", "--ray-address needs --backend ray"),
                  (self.cpus_per_device > 0 and self.gpus_per_device >= 0,
                   "--cpus-per-device must be positive and --gpus-per-device not negative"),
                  (abs(sum(self.split) - 1.0) < 1e-6 and min(self.split) >= 0,
                   f"--split fractions must be >= 0 and sum to 1, got {self.split}"),
                  (0 <= self.malicious < 1, "--malicious must be in [0, 1)"),
                  (not self.server.fv or 1 <= self.fv_validators <= self.heldout_clients,
                   "--fv needs --holdout-clients of at least --fv-validators (validators are clients kept out of "
                   "training, scoring on their own images)"),
                  (self.public_limit >= 1, "--public-limit must be at least 1"),
                  (0 <= self.gate_identities < 1,
                   f"--gate-identities is a fraction of the people on no device, in [0, 1) (got "
                   f"{self.gate_identities:g})"),
                  (0 <= self.public_identities < 1,
                   f"--public-identities is a fraction of the people on no device, in [0, 1) (got "
                   f"{self.public_identities:g})"),
                  (0 <= self.holdout_identities < 1,
                   f"--holdout-identities is a fraction of the people, in [0, 1) (got {self.holdout_identities:g})"),
                  *[(value >= 0, f"{flag} must not be negative (got {value})") for flag, value in
                    (("--holdout-clients", self.heldout_clients), ("--impostor-images", self.impostor_images),
                     ("--tune-steps", self.tune_steps), ("--patience", self.patience))],
                  (self.eval_clients is None or self.eval_clients >= 1, "--eval-clients must be at least 1"),
                  (0 <= self.min_delta < float("inf"), f"--min-delta must be a number >= 0 (got {self.min_delta})"),
                  (not self.training.method.uses_public_set() or self.public_data is not None
                   or self.public_identities > 0,
                   "hard negatives need a public set: --public-data DIR (aligned faces of people no client has, "
                   "e.g. ../shared/faces/utkface_aligned), --public-identities above 0, or --no-hard-negatives")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.partition != "attribute":
            check_scheme(self.partition, self.alpha, self.lognormal_sigma)
        elif self.data is None:
            raise ValueError("SYNTHETIC faces have no per-image attributes: --partition attribute needs --data "
                             "with them (CelebA's list_attr_celeba.txt)")
        elif self.rules is not None:  # none at all: the partition says so, after whether the data has attributes
            check_rules(self.rules)
        self._validate_names()
        self._validate_paths()

    def _validate_names(self) -> None:
        from fleet.attacks import ATTACKS

        if self.attack not in ATTACKS:
            raise ValueError(f"unknown --attack {self.attack!r}; choose one of {', '.join(ATTACKS)}")

    def _validate_paths(self) -> None:
        """--data, FedFR's public set D_g (other people than --data) and the quality gate's faces."""
        if self.data is not None and not Path(self.data).exists():
            raise FileNotFoundError(f"dataset path does not exist: {self.data}")
        if self.public_data is not None:
            public = Path(self.public_data).resolve()
            if not public.is_dir():
                raise FileNotFoundError(f"--public-data folder does not exist: {self.public_data}")
            if self.data is not None and public == Path(self.data).resolve():
                raise ValueError("--public-data must hold other people than --data (D_g is nobody's enrolled people)")
        if self.gate.data is not None and not Path(self.gate.data).exists():
            raise FileNotFoundError(f"--gate-data does not exist: {self.gate.data}")

    def to_dict(self) -> dict:
        """JSON-ready: the simulation's options, then `server` (with `training`) and `gate` as sections."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("server", "gate")}
        gate = {"data": None if self.gate.data is None else str(self.gate.data), "off": self.gate.off,
                "bar": asdict(self.gate.bar)}
        return {**json.loads(json.dumps(own)), "server": self.server.to_dict(), "gate": gate}

    def by_name(self) -> dict:
        """Every option under its own name, one level (the run's summary and MLflow's parameters): the simulation's,
        the rounds' and the local training's names do not clash; the gate's are `gate.*` (its bar's too)."""
        raw = self.to_dict()
        server = {k: v for k, v in raw.pop("server").items() if k != "training"}
        gate = raw.pop("gate")
        gate = {f"gate.{k}": v for k, v in {**gate.pop("bar"), **gate}.items()}
        return {**raw, **server, **flatten(self.training.model_dump(exclude={"type", "version"})), **gate}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps({"format_version": CONFIG_FORMAT, **self.to_dict()}, indent=1))

    @classmethod
    def from_dict(cls, raw: dict) -> SimConfig:
        """From `to_dict`'s form, or from a run folder of an older format (`format_version`; before it was written:
        1 when flat, 2 when nested)."""
        raw = dict(raw)
        version = raw.pop("format_version", 2 if "server" in raw else 1)
        if version not in READERS:
            raise ValueError(f"config.json format {version!r}: this ffr-edge reads formats 1-{CONFIG_FORMAT} (a newer "
                             "version wrote it; upgrade ffr-edge to resume or read this run)")
        raw = READERS[version](raw)
        known = {f.name for f in fields(cls)} - {"server", "gate"}
        gate = dict(raw.get("gate", {}))
        gate = GateSetup(**{k: gate[k] for k in ("data", "off") if k in gate}, bar=GateSettings(**gate.get("bar", {})))
        check_types(gate)
        config = cls(**{k: v for k, v in raw.items() if k in known}, server=RoundSettings.from_dict(raw["server"]),
                     gate=gate)
        config.split = tuple(config.split)
        check_types(config)
        return config

    @classmethod
    def load(cls, path: Path) -> SimConfig:
        """A run folder's spec; a damaged or foreign file is refused in one line, never half-read."""
        return read_json(path, "ffr fleet simulate", "choose another --out",
                         lambda raw: cls.from_dict(json_object(raw)))

    def differences(self, other: SimConfig) -> list[str]:
        """Options that differ from `other` and may not change when resuming."""
        mine, theirs = dotted(self.to_dict()), dotted(other.to_dict())
        return [f"{k}: {theirs.get(k)!r} -> {mine[k]!r}" for k in mine
                if k not in RESUMABLE_CHANGES and _norm(mine[k]) != _norm(theirs.get(k))]


def dotted(raw: dict, prefix: str = "") -> dict:
    """{"server.training.lr": ..., ...}: every option by its dotted path; a part's fields are its owner's
    (`protocol.training_parts`: no name is in two parts), so the path is the same in every saved form."""
    out = {}
    for key, value in raw.items():
        if isinstance(value, dict) and key in PART_NAMES:
            out.update(dotted(value, prefix))
        elif isinstance(value, dict) and key in ("server", "training", "method", "gate", "bar"):
            out.update(dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _nested(raw: dict) -> dict:
    """A run folder's config.json from before the nested spec (one flat list of options), in today's form."""
    from protocol.methods import DEFAULT_METHOD, FLAT_NAMES, method_named

    chosen = method_named(raw.get("method") or DEFAULT_METHOD)  # the run's --method (read by `_method_of_run`)
    flat = {k: raw[k] for k in FLAT_NAMES if raw.get(k) is not None}  # null: the method's own
    flat.setdefault("algorithm", chosen.strategy)
    dfc_weight = raw.get("dfc_weight")  # unset: the run's --method's own (FedFR's 10), as its command chose
    if dfc_weight is None:
        dfc_weight = chosen.model_defaults.get("dfc_weight", 1.0)
    training = {"epochs": raw.get("local_epochs", 1), **flat, "dfc_weight": dfc_weight,
                "dfc_steps": raw.get("dfc_steps", 300), "dfc_lr": raw.get("dfc_lr", 1e-2),
                "imprint_head": raw.get("imprint_head", True),
                **{k: raw[k] for k in ("batch_size", "lr", "dfc", "codec", "topk_fraction", "width_mult", "dp_clip")
                   if k in raw}}
    renamed = {"round_timeout": "round_timeout_s"}
    server = {renamed.get(k, k): raw[k] for k in ("rounds", "fraction", "round_timeout", "seed", "combine",
                                                    "dp_noise", "fv", "fv_candidates", "fv_phi", "fv_epsilon",
                                                    "server_momentum") if k in raw}
    gate = {new: raw[old_name] for old_name, new in (("gate_far", "far"), ("gate_far_ratio", "far_ratio"),
                                                     ("gate_auc_margin", "auc_margin"), ("gate_faces", "limit"))
            if old_name in raw}
    return {**raw, "server": {**server, "min_clients": 1, "training": training},
            "gate": {**gate, "seed": raw.get("seed", 0)}}


def _method_of_run(raw: dict) -> dict:
    """Format 5 -> 6: the run's `--method`, kept beside the spec for its label (FedFace was PFM on the wire), names
    the round configuration's method, which now says it itself."""
    from protocol.methods import FLAT_NAMES, from_flat

    raw, name = dict(raw), raw.get("method")
    raw.pop("method", None)
    training = dict(raw.get("server", {}).get("training", {}))
    if "method" not in training:
        flat = {k: training.pop(k) for k in FLAT_NAMES if k in training}
        if flat or name:
            training["method"] = from_flat(flat, name)
    return {**raw, "server": {**raw.get("server", {}), "training": training}}


def _gate_part(raw: dict) -> dict:
    """Format 2 -> 3: the gate's faces and switch (`gate_data`, `no_gate`) join its bar in the `gate` part."""
    raw = dict(raw)
    data, off = raw.pop("gate_data", None), raw.pop("no_gate", False)
    return {**raw, "gate": {"data": data, "off": off, "bar": raw.get("gate", {})}}


def _no_public_people(raw: dict) -> dict:
    """Format 3 -> 4: a run from before `public_identities` served its devices no public set of its own people."""
    return {"public_identities": 0.0, **raw}


# a run folder's config.json: 1 one flat list of options; 2 `server` (with `training`) and `gate` (the bar); 3 `gate`
# holds the gate's faces, switch and bar; 4 `public_identities`; 5 `server.training` nests its optimiser and model
# parts (`protocol.training_parts`; the round configuration reads its flat form itself); 6 `server.training.method`
# names the method with its own settings (`protocol.methods`; the run's `--method` beside the spec is gone)
CONFIG_FORMAT = 6
READERS = {1: lambda raw: _method_of_run(_no_public_people(_gate_part(_nested(raw)))),  # each into today's form
           2: lambda raw: _method_of_run(_no_public_people(_gate_part(raw))),
           3: lambda raw: _method_of_run(_no_public_people(raw)), 4: _method_of_run, 5: _method_of_run,
           6: lambda raw: raw}


def _norm(value):
    return list(value) if isinstance(value, tuple) else value
