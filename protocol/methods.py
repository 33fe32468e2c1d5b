"""The federated methods: one list, keyed by the name `--method` takes.

An entry says what a method is made of: how the coordinator aggregates its rounds (`strategy`, one of
`protocol.messages.ALGORITHMS`, whose classes are `coordinator.aggregation.STRATEGIES`), the local objective's
terms it turns on (round-configuration fields, `TrainingConfig`), whether the coordinator runs FedFace's Federated
Validation, and the options only it takes. The CLI's `--method` choice and help, the round configuration's
`algorithm` and terms, the coordinator's validation switch and the "no effect without --method X" refusals are all
read from here. The device needs no name: its local steps follow from the announced settings
(`edge_client.local_algorithms.local_algorithm`).

Adding a method is an entry here, plus its aggregation in `coordinator/aggregation.py` if it brings a new one and its
local steps in `edge_client/local_algorithms.py` if it brings new ones (ARCHITECTURE.md shows an example).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from protocol.messages import ALGORITHMS
from protocol.training_parts import flatten


@dataclass(frozen=True)
class Method:
    name: str
    strategy: str                  # how the coordinator aggregates (protocol.messages.ALGORITHMS)
    summary: str                   # its part of `--method`'s help
    terms: Mapping[str, object] = field(default_factory=dict)  # round-configuration settings it sets by default,
                                                               # by name (flat: protocol.training_parts.flatten)
    validation: bool = False       # FedFace's Federated Validation at the coordinator
    options: tuple[str, ...] = ()  # options only this method takes (refused with another)

    def is_on(self, training) -> bool:
        """Whether a round configuration (`TrainingConfig`) runs this method's aggregation and its switched-on
        terms: what its own options are checked against."""
        switches = {k: v for k, v in self.terms.items() if isinstance(v, bool)}
        settings = flatten(training.model_dump())
        return training.algorithm == self.strategy and all(settings[k] == v for k, v in switches.items())


_ALL = (
    Method("fedavg", "fedavg", "FedAvg (McMahan et al., AISTATS 2017)"),
    Method("fedprox", "fedprox", "FedAvg with FedProx's proximal term, --prox-mu (Li et al., MLSys 2020)",
           options=("--prox-mu",)),
    Method("fedavgm", "fedavgm", "server momentum, --server-momentum (Hsu et al. 2019)",
           options=("--server-momentum",)),
    Method("pfm", "pfm", "FedFace's partially federated momentum: devices on plain SGD at --lr, e.g. --lr 0.01"),
    Method("fedfr", "fedavg", "FedAvg aggregation with hard negatives from {public}, the contrastive term and DFC, at "
                              "the paper's weights (Liu et al., AAAI 2022, eq. 7)",
           terms=MappingProxyType({"hard_negatives": True, "contrastive": True, "dfc_weight": 10.0})),
    Method("hfmaml", "fedavg", "Hessian-free MAML local steps, FedAvg aggregation; add --embedding-reg C for eq. 4",
           terms=MappingProxyType({"hfmaml": True}), options=("--maml-alpha", "--maml-beta", "--maml-delta")),
    Method("fedface", "pfm", "pfm + Federated Validation (Aggarwal et al., IJCB 2021)", validation=True),
)
METHODS: Mapping[str, Method] = MappingProxyType({m.name: m for m in _ALL})
DEFAULT_METHOD = "fedprox"  # the design document's choice, in every command
assert {m.strategy for m in _ALL} <= set(ALGORITHMS)


def method_named(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"unknown --method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def owner_of(option: str) -> Method | None:
    """The method an option belongs to, or None: an option every method takes."""
    return next((m for m in _ALL if option in m.options), None)
