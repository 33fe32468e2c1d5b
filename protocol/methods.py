"""The federated methods: one list, keyed by the name `--method` takes, each with the settings only it takes.

A method is a pydantic model of its own settings, named by `name`; a round's configuration carries one as
`TrainingConfig.method` (the discriminated union `MethodSettings`), so no setting of another method can travel with
it. The class says the rest: how the coordinator aggregates its rounds (`strategy`, one of `ALGORITHMS`, whose
classes are `coordinator.aggregation.STRATEGIES`), whether the coordinator runs FedFace's Federated Validation, the
defaults it gives the model part (FedFR's DFC weight), and each setting's help; a setting's option is its name
(`prox_mu` is `--prox-mu`, one name in the settings, the options and every saved form), from which the CLI builds
`--method`, the methods' options and their refusal with a method that lacks them (`models.cli.objective`). The
device looks its local steps up by the same name (`edge_client.local_algorithms.LOCAL_ALGORITHMS`), and asks the
settings what a round needs (`uses_public_set`, `proximal_mu`, ...) instead of probing for fields.

Adding a method: its class here and an entry in `_ALL`; its local steps in `edge_client/local_algorithms.py`; its
aggregation in `coordinator/aggregation.py` only if it brings a new one (ARCHITECTURE.md shows an example).
"""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field

# how the coordinator aggregates a round: the one list of these names, for the schema, the coordinator and the CLI
Algorithm = Literal["fedavg", "fedprox", "fedavgm", "pfm"]
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)


def setting(default: Any, help: str, **bounds) -> Any:
    """A method's setting: its default, bounds (pydantic's) and the help of its option."""
    return Field(default, description=help, **bounds)


class _Method(BaseModel):
    """What every method's settings are: strict (no unknown name, no infinity or NaN: they arrive from the network),
    and able to say what a round of it needs from the device."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str
    strategy: ClassVar[str] = "fedavg"   # how the coordinator aggregates (ALGORITHMS)
    summary: ClassVar[str] = ""          # its part of `--method`'s help
    validation: ClassVar[bool] = False   # FedFace's Federated Validation at the coordinator
    model_defaults: ClassVar[Mapping[str, Any]] = MappingProxyType({})  # defaults it gives the model part

    @classmethod
    def flags(cls) -> dict[str, str]:
        """{option: field} of the settings it takes."""
        return {f"--{name.replace('_', '-')}": name for name in cls.model_fields if name != "name"}

    def uses_public_set(self) -> bool:
        """Whether a round samples the device's public set D_g (FedFR's hard negatives)."""
        return False

    def uses_previous_local(self) -> bool:
        """Whether a round needs the device's last local backbone (FedFR's contrastive term)."""
        return False

    def proximal_mu(self) -> float:
        """FedProx's mu: the weight of mu/2 ||w - w_global||^2 in the local loss (0: none)."""
        return 0.0

    def embedding_anchor(self) -> float:
        """C of the HF-MAML paper's eq. 4, C * (1 - cos(global embedding, local embedding)) (0: none)."""
        return 0.0


class _Anchored(_Method):
    """A method that takes eq. 4's embedding anchor (all but FedFR, whose objective has its own regulariser)."""

    embedding_reg: float = setting(0.0, "C: add C * (1 - cos(global embedding, local embedding)) "
                                   "to the local loss (the HF-MAML paper's eq. 4; 0: off)", ge=0, le=100.0)

    def embedding_anchor(self) -> float:
        return self.embedding_reg


class FedAvg(_Anchored):
    name: Literal["fedavg"] = "fedavg"
    summary: ClassVar[str] = "FedAvg (McMahan et al., AISTATS 2017)"


class FedProx(_Anchored):
    name: Literal["fedprox"] = "fedprox"
    strategy: ClassVar[str] = "fedprox"
    summary: ClassVar[str] = "FedAvg with FedProx's proximal term, --prox-mu (Li et al., MLSys 2020)"
    prox_mu: float = setting(0.01, "FedProx's proximal weight mu", ge=0, le=10.0)

    def proximal_mu(self) -> float:
        return self.prox_mu


class FedAvgM(_Anchored):
    name: Literal["fedavgm"] = "fedavgm"
    strategy: ClassVar[str] = "fedavgm"
    summary: ClassVar[str] = "server momentum, --server-momentum (Hsu et al. 2019)"


class PFM(_Anchored):
    name: Literal["pfm"] = "pfm"
    strategy: ClassVar[str] = "pfm"
    summary: ClassVar[str] = "FedFace's partially federated momentum: devices on plain SGD at --lr, e.g. --lr 0.01"
    pfm_beta: float = setting(0.9, "PFM's momentum parameter beta (FedFace, eq. 1-3)", ge=0, lt=1.0)


class FedFace(PFM):
    name: Literal["fedface"] = "fedface"  # type: ignore[assignment]
    summary: ClassVar[str] = "pfm + Federated Validation (Aggarwal et al., IJCB 2021)"
    validation: ClassVar[bool] = True


class FedFR(_Method):
    """FedFR's local objective (Liu et al., AAAI 2022, eq. 7: alpha_1 L_cos + alpha_2 L_con + alpha_3 L_BCE, alpha_3
    being the model part's `dfc_weight`), each technique with its own switch so an ablation is one option."""

    name: Literal["fedfr"] = "fedfr"
    summary: ClassVar[str] = ("FedAvg aggregation with hard negatives from {public}, the contrastive term and DFC, at "
                              "the paper's weights (Liu et al., AAAI 2022, eq. 7)")
    model_defaults: ClassVar[Mapping[str, Any]] = MappingProxyType({"dfc_weight": 10.0})
    alpha_cos: float = setting(1.0, "alpha_1: weight of the CosFace loss", ge=0, le=100.0)
    hard_negatives: bool = setting(True, "sample hard negatives from the device's public set")
    t_hn: float = setting(0.4, "hard-negative cosine threshold t_HN", ge=-1.0, le=1.0)
    contrastive: bool = setting(True, "FedFR's contrastive regulariser, eq. 5")
    alpha_con: float = setting(5.0, "alpha_2: weight of the contrastive term", ge=0, le=100.0)
    tau: float = setting(0.5, "contrastive temperature", gt=0.01, le=10.0)

    def uses_public_set(self) -> bool:
        return self.hard_negatives

    def uses_previous_local(self) -> bool:
        return self.contrastive

    def plain(self) -> bool:
        """No term of its own on: its local steps are FedAvg's (an ablation's baseline row)."""
        return not (self.hard_negatives or self.contrastive or self.alpha_cos != 1.0)


class HFMAML(_Anchored):
    """Hessian-free MAML local steps (eq. 1-3 of the HF-MAML face paper), FedAvg aggregation."""

    name: Literal["hfmaml"] = "hfmaml"
    summary: ClassVar[str] = "Hessian-free MAML local steps, FedAvg aggregation; add --embedding-reg C for eq. 4"
    maml_alpha: float = setting(0.01, "HF-MAML inner step size alpha", gt=0, le=1.0)
    maml_beta: float = setting(0.01, "HF-MAML outer step size beta (the paper's Tab. IV)", gt=0, le=1.0)
    maml_delta: float = setting(1e-3, "HF-MAML finite-difference step delta of the Hessian-vector product",
                                gt=0, le=1.0)


_ALL: tuple[type[_Method], ...] = (FedAvg, FedProx, FedAvgM, PFM, FedFR, HFMAML, FedFace)
MethodSettings = Annotated[Union[_ALL], Field(discriminator="name")]  # noqa: UP007 (a tuple of classes)
METHODS: Mapping[str, type[_Method]] = MappingProxyType({m.model_fields["name"].default: m for m in _ALL})
DEFAULT_METHOD = "fedprox"  # the design document's choice, in every command
assert {m.strategy for m in _ALL} <= set(ALGORITHMS)


def method_named(name: str) -> type[_Method]:
    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"unknown --method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def owners_of(flag: str) -> list[str]:
    """The methods that take an option, by name (none: an option every round takes)."""
    return [name for name, m in METHODS.items() if flag in m.flags()]


# Formats 1 and 2 of the round configuration named the methods' settings at its top, by the same names
FLAT_NAMES = ("algorithm", "hfmaml", *dict.fromkeys(f for m in (FedProx, PFM, FedFR, HFMAML) for f in m.model_fields
                                                   if f != "name"))


def from_flat(flat: dict, name: str | None = None) -> dict:
    """The method part of a round configuration saved flat (formats 1 and 2: `algorithm`, `hfmaml` and the terms
    beside every other setting): the method it ran, with its settings; what another method alone reads was unused
    and is left. `name`: the method, where the saved form knew it (a run's `--method`: FedFace is PFM on the wire).
    A form whose terms and aggregation no one method runs (FedFR's terms under FedProx) is refused: format 3
    cannot say it, and reading it as something else would change the run."""
    algorithm = flat.get("algorithm", "fedavg")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {str(algorithm)[:40]!r}; a saved round configuration names one of "
                         f"{', '.join(ALGORITHMS)}")
    hfmaml, hard_negatives, contrastive = (_switch(flat, k) for k in ("hfmaml", "hard_negatives", "contrastive"))
    fedfr_on = hard_negatives or contrastive or flat.get("alpha_cos", 1.0) != 1.0
    inferred = name is None
    name = name or ("hfmaml" if hfmaml else "fedfr" if fedfr_on else algorithm)
    kind = method_named(name)
    if kind.strategy != algorithm:
        raise ValueError(f"a saved round configuration runs {name}'s local steps with {algorithm}'s aggregation, "
                         "which no one method does")
    if name == "fedfr" and flat.get("embedding_reg"):
        raise ValueError("a saved round configuration runs FedFR's objective with --embedding-reg, which it never "
                         "took")
    mine = {k: v for k, v in flat.items() if k in kind.model_fields and k != "name"}
    if name == "fedfr" and inferred:  # a flat form's switches were off unless it says so
        mine = {"hard_negatives": False, "contrastive": False, **mine}
    return {"name": name, **mine}


def _switch(flat: dict, key: str) -> bool:
    """A flat form's switch, which says the method it ran: true or false, nothing that only looks like one."""
    value = flat.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{key} is true or false in a saved round configuration (got {str(value)[:40]!r})")
    return value
