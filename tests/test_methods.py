"""The federated methods are one list (`protocol.methods.METHODS`), each a model of the settings only it takes: the
`--method` choice and the methods' options of every command, the round configuration each builds, the coordinator's
aggregation, the device's local steps and the Federated Validation switch all come from it."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from coordinator.aggregation import STRATEGIES
from coordinator.cli import round_settings
from edge_client.local_algorithms import LOCAL_ALGORITHMS
from ffr.cli import build_parser
from models.cli.objective import OWNED, method_flags, training_config
from protocol.messages import TrainingConfig
from protocol.methods import DEFAULT_METHOD, METHODS, FedFR, FedProx, method_named, owners_of


def _subparser(parser, *command: str):
    sub = parser
    for word in command:
        sub = next(a for a in sub._actions if a.dest and a.choices and word in a.choices).choices[word]
    return sub


def _choices(parser, *command: str) -> tuple[str, ...]:
    return tuple(next(a for a in _subparser(parser, *command)._actions if a.dest == "method").choices)


def test_every_command_offers_the_methods_of_the_one_list_and_each_has_its_aggregation_and_local_steps():
    parser = build_parser()
    assert _choices(parser, "coordinator", "serve") == tuple(METHODS) == _choices(parser, "fleet", "simulate")
    assert DEFAULT_METHOD in METHODS
    for name, kind in METHODS.items():
        assert kind.strategy in STRATEGIES and name in LOCAL_ALGORITHMS
        assert TrainingConfig(method=kind()).method.name == name  # the wire's union holds every method


@pytest.mark.parametrize("name", list(METHODS))
def test_a_method_builds_the_round_its_settings_describe(tmp_path, name):
    args = build_parser().parse_args(["coordinator", "serve", "--state", str(tmp_path / "s"), "--method", name])
    training = training_config(args)
    settings = round_settings(args, training, min_clients=1)
    kind = method_named(name)
    assert type(training.method) is kind and training.method == kind()  # its own defaults
    assert training.algorithm == kind.strategy and settings.fv == kind.validation
    for field, value in kind.model_defaults.items():  # what it sets in another part (FedFR's DFC weight)
        assert getattr(training.model, field) == value


def test_each_methods_options_are_its_settings_fields_and_the_help_says_so():
    sub = _subparser(build_parser(), "fleet", "simulate")
    actions = {a.option_strings[0]: a for a in sub._actions if a.option_strings}
    for name, kind in METHODS.items():
        for flag, field in kind.flags().items():
            assert kind.model_fields[field].description in actions[flag].help
            assert name in actions[flag].help  # which methods take it
    assert {"--prox-mu", "--maml-alpha", "--hard-negatives", "--t-hn", "--embedding-reg"} <= set(method_flags())


def _value(flag: str) -> list[str]:
    return [] if flag in ("--hard-negatives", "--contrastive") else [flag, "0.5"]


@pytest.mark.parametrize("flag", list(method_flags()))
def test_a_methods_own_option_is_taken_with_it_and_refused_with_another(tmp_path, flag):
    parser = build_parser()
    owners = owners_of(flag)
    others = [name for name in METHODS if name not in owners]
    for chosen in (owners[0], *others[:2]):
        argv = ["coordinator", "serve", "--state", str(tmp_path / "s"), "--method", chosen,
                *(_value(flag) or [flag])]
        args = parser.parse_args(argv)
        if chosen in owners:
            field = method_named(chosen).flags()[flag]
            assert getattr(training_config(args).method, field) == (0.5 if _value(flag) else True)
        else:
            with pytest.raises(ValueError, match=f"{flag} has no effect without --method "):
                training_config(args)
    assert flag in OWNED


def test_fedfrs_technique_options_need_their_technique_on():
    parser = build_parser()
    args = parser.parse_args(["fleet", "simulate", "--out", "/nowhere", "--method", "fedfr", "--no-contrastive",
                              "--tau", "0.3"])
    with pytest.raises(ValueError, match="--tau has no effect without --contrastive"):
        training_config(args)
    args = parser.parse_args(["fleet", "simulate", "--out", "/nowhere", "--method", "fedfr", "--no-hard-negatives"])
    assert training_config(args).method == FedFR(hard_negatives=False)


def test_an_unknown_method_is_refused_with_the_list():
    with pytest.raises(ValueError, match="choose one of fedavg, fedprox"):
        method_named("fedsomething")


@pytest.mark.parametrize("method", [{"name": "fedavg", "prox_mu": 0.1}, {"name": "fedprox", "hard_negatives": True},
                                    {"name": "fedfr", "embedding_reg": 1.0}, {"name": "fedsgd"},
                                    {"name": "fedprox", "prox_mu": -1.0}, {"name": "pfm", "pfm_beta": 1.0},
                                    {"prox_mu": 0.1}])
def test_a_round_configuration_carries_only_its_methods_own_settings(method):
    """From the network: a setting of another method, an unknown method or an out-of-bound value is refused."""
    with pytest.raises(ValidationError):
        TrainingConfig.model_validate({**TrainingConfig().model_dump(), "method": method})


def test_a_method_is_read_from_the_wire_as_sent():
    sent = TrainingConfig(method=FedProx(prox_mu=0.3, embedding_reg=2.0))
    received = TrainingConfig.model_validate_json(sent.model_dump_json())
    assert received == sent and received.method.proximal_mu() == 0.3 and received.method.embedding_anchor() == 2.0


ADD_A_METHOD = '''
from types import MappingProxyType
from typing import Annotated, ClassVar, Literal, Union

from pydantic import Field

import protocol.methods as m


class FedAnchor(m._Anchored):  # ARCHITECTURE.md's example, as a class in protocol/methods.py would be
    name: Literal["fedanchor"] = "fedanchor"
    summary: ClassVar[str] = "FedAvg with the embedding anchor on (HF-MAML's eq. 4)"
    embedding_reg: float = m.setting(1.0, "C of eq. 4", ge=0, le=100.0)


# its place in the list: what protocol/methods.py derives from `_ALL` when it is imported
m._ALL = (*m._ALL, FedAnchor)
m.MethodSettings = Annotated[Union[m._ALL], Field(discriminator="name")]
m.METHODS = MappingProxyType({k.model_fields["name"].default: k for k in m._ALL})
import edge_client.local_algorithms as steps  # noqa: E402

steps.LOCAL_ALGORITHMS["fedanchor"] = steps.supervised  # the second file

from coordinator.aggregation import FedAvg, strategy_for  # noqa: E402
from coordinator.settings import RoundSettings  # noqa: E402
from ffr.cli import build_parser  # noqa: E402
from models.cli.objective import training_config  # noqa: E402
from protocol.messages import TrainingConfig  # noqa: E402

args = build_parser().parse_args(["fleet", "simulate", "--out", "/nowhere", "--method", "fedanchor"])
training = training_config(args)
assert type(training.method) is FedAnchor and training.method.embedding_anchor() == 1.0
given = build_parser().parse_args(["fleet", "simulate", "--out", "/nowhere", "--method", "fedanchor",
                                   "--embedding-reg", "0.5"])
assert training_config(given).method.embedding_reg == 0.5
refused = build_parser().parse_args(["fleet", "simulate", "--out", "/nowhere", "--method", "fedanchor",
                                     "--prox-mu", "0.5"])
try:
    training_config(refused)
    raise SystemExit("--prox-mu taken by fedanchor")
except ValueError as exc:
    assert "--prox-mu has no effect without --method fedprox" in str(exc), exc
received = TrainingConfig.model_validate_json(training.model_dump_json())  # over the wire
assert received.method == training.method and received.algorithm == "fedavg"
assert type(strategy_for(RoundSettings(training=received))) is FedAvg
print("added")
'''


def test_a_method_made_of_existing_parts_is_one_class_in_the_list_and_its_local_steps(tmp_path):
    """ARCHITECTURE.md's example: FedAvg with the embedding anchor always on, added to `protocol.methods`' list (its
    class and its place in `_ALL`) and to `LOCAL_ALGORITHMS` by name, nowhere else; the CLI, the wire and the
    coordinator take it. In a fresh interpreter: the list is read when the modules are imported."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", ADD_A_METHOD], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "added", done.stderr[-2000:]
