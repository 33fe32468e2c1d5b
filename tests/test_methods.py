"""The federated methods are one list (`protocol.methods.METHODS`): the `--method` choice of every command, the round
configuration each builds, the coordinator's aggregation and its Federated Validation switch all come from it."""
from __future__ import annotations

import pytest

from coordinator.aggregation import STRATEGIES
from coordinator.cli import round_settings
from ffr.cli import build_parser
from models.cli.objective import OWNED, training_config
from protocol.messages import TrainingConfig
from protocol.methods import DEFAULT_METHOD, METHODS, method_named, owner_of
from protocol.training_parts import flatten


def _choices(parser, *command: str) -> tuple[str, ...]:
    sub = parser
    for word in command:
        sub = next(a for a in sub._actions if a.dest and a.choices and word in a.choices).choices[word]
    return tuple(next(a for a in sub._actions if a.dest == "method").choices)


def test_every_command_offers_the_methods_of_the_one_list_and_each_has_its_aggregation():
    parser = build_parser()
    assert _choices(parser, "coordinator", "serve") == tuple(METHODS) == _choices(parser, "fleet", "simulate")
    assert DEFAULT_METHOD in METHODS
    for method in METHODS.values():
        assert method.strategy in STRATEGIES


@pytest.mark.parametrize("name", list(METHODS))
def test_a_method_builds_the_round_its_entry_describes(tmp_path, name):
    args = build_parser().parse_args(["coordinator", "serve", "--state", str(tmp_path / "s"), "--method", name])
    training = training_config(args)
    settings = round_settings(args, training, min_clients=1)
    method = method_named(name)
    assert training.algorithm == method.strategy
    assert settings.fv == method.validation
    settings = flatten(training.model_dump())  # the terms name settings flat (protocol.training_parts)
    for field, value in method.terms.items():
        assert settings[field] == value
    assert method.is_on(training)
    others = [m for m in METHODS.values() if m.name != name and m.strategy == method.strategy]
    assert not any(m.is_on(training) and m.terms for m in others)  # fedfr's round is not hfmaml's, nor the reverse


def test_a_methods_own_options_are_refused_with_another_method_and_taken_with_it(tmp_path):
    parser = build_parser()
    owned = [(m, option) for m in METHODS.values() for option in m.options]
    assert {"--prox-mu", "--maml-alpha", "--server-momentum"} <= {option for _, option in owned}
    for method, option in owned:
        assert owner_of(option) is method
        other = next(m.name for m in METHODS.values() if not m.is_on(TrainingConfig(algorithm=method.strategy,
                                                                                     **method.terms)))
        for chosen, refused in ((method.name, False), (other, True)):
            args = parser.parse_args(["coordinator", "serve", "--state", str(tmp_path / "s"), "--method", chosen,
                                      option, "0.5"])
            if refused:
                with pytest.raises(ValueError, match=f"{option} has no effect without --method {method.name}"):
                    round_settings(args, training_config(args), min_clients=1)
            else:
                round_settings(args, training_config(args), min_clients=1)
    assert all(option in OWNED for _, option in owned if option != "--server-momentum")


def test_an_unknown_method_is_refused_with_the_list():
    with pytest.raises(ValueError, match="choose one of fedavg, fedprox"):
        method_named("fedsomething")


def test_a_method_made_of_existing_parts_is_one_entry(tmp_path, monkeypatch):
    """ARCHITECTURE.md's example: FedAvg with the embedding anchor always on, added to the list and nowhere else."""
    from types import MappingProxyType

    from protocol import methods

    anchored = methods.Method("fedanchor", "fedavg", "FedAvg with the embedding anchor",
                              terms=MappingProxyType({"embedding_reg": 1.0}))
    monkeypatch.setattr(methods, "METHODS", MappingProxyType({**methods.METHODS, "fedanchor": anchored}))
    args = build_parser().parse_args(["fleet", "simulate", "--out", str(tmp_path / "r"), "--method", "fedanchor"])
    training = training_config(args)
    assert (training.algorithm, training.embedding_reg, training.hard_negatives) == ("fedavg", 1.0, False)
    given = build_parser().parse_args(["fleet", "simulate", "--out", str(tmp_path / "r"), "--method", "fedanchor",
                                       "--embedding-reg", "0.5"])
    assert training_config(given).embedding_reg == 0.5  # a setting given wins over the method's term
