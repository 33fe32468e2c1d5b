"""The one configuration (issue 28): the simulation's nested spec, and one flag meaning one thing in every command."""
from __future__ import annotations

import json

import pytest

from coordinator.cli import round_settings
from coordinator.settings import RoundSettings
from ffr.cli import build_parser
from fleet.cli import _config
from fleet.config import SimConfig
from models.cli.objective import training_config
from protocol.messages import TrainingConfig
from protocol.methods import FedFace

SHARED = ["--rounds", "3", "--fraction", "0.5", "--round-timeout", "60", "--method", "fedprox", "--prox-mu", "0.2",
          "--local-epochs", "2", "--batch-size", "8", "--lr", "0.001", "--width-mult", "0.5", "--codec", "int8",
          "--combine", "median", "--norm-factor", "2", "--norm-ceiling", "0.2", "--dfc-steps", "7", "--seed", "5"]
SHARED_FEDFR = ["--method", "fedfr", "--t-hn", "0.2", "--tau", "0.3", "--alpha-cos", "2", "--no-dfc"]
SHARED_FV_DP = ["--method", "fedavgm", "--server-momentum", "0.5", "--no-dfc", "--fv", "--fv-candidates", "4",
                "--fv-phi", "0.5", "--fv-epsilon", "0.01", "--fv-timeout", "30", "--dp-clip", "2", "--dp-noise", "0.5",
                "--dp-delta", "1e-6", "--codec", "topk", "--topk-fraction", "0.3"]


@pytest.mark.parametrize("shared", [SHARED, SHARED_FV_DP, SHARED_FEDFR])
def test_serve_and_simulate_read_the_same_flags_into_the_same_spec(tmp_path, shared):
    """Every option both commands take builds the same RoundSettings and TrainingConfig: one name, one meaning."""
    parser = build_parser()
    serve = parser.parse_args(["coordinator", "serve", "--state", str(tmp_path / "s"), *shared])
    fleet = parser.parse_args(["fleet", "simulate", "--out", str(tmp_path / "r"), *shared])
    served = round_settings(serve, training_config(serve), min_clients=1).to_dict()
    simulated = _config(fleet).server.to_dict()
    assert served["training"]["transport"].pop("chunk_bytes") == 256 * 1024  # `serve --chunk-kib`: not simulate's
    simulated["training"]["transport"].pop("chunk_bytes")
    assert served == simulated
    if shared is SHARED:
        assert simulated["rounds"] == 3 and simulated["combine"] == "median"
        assert simulated["training"]["optimisation"]["lr"] == 0.001
        assert simulated["training"]["method"] == {"name": "fedprox", "embedding_reg": 0.0, "prox_mu": 0.2}
    elif shared is SHARED_FEDFR:
        assert simulated["training"]["method"]["t_hn"] == 0.2 and simulated["training"]["method"]["tau"] == 0.3
    else:
        assert simulated["server_momentum"] == 0.5 and simulated["fv_phi"] == 0.5 and simulated["dp_delta"] == 1e-6
        assert simulated["fv_timeout_s"] == 30 and simulated["training"]["transport"]["topk_fraction"] == 0.3


# Issue 28: a method, technique or rule takes only its own settings; given while its owner is off, one is refused
@pytest.mark.parametrize("argv, flag, owner", [
    (["--method", "fedavg", "--prox-mu", "0.2"], "--prox-mu", "--method fedprox"),
    (["--server-momentum", "0.5"], "--server-momentum", "--method fedavgm"),
    (["--method", "fedfr", "--maml-beta", "0.1"], "--maml-beta", "--method hfmaml"),
    (["--method", "fedfr", "--no-hard-negatives", "--t-hn", "0.1"], "--t-hn", "--hard-negatives"),
    (["--method", "fedfr", "--no-contrastive", "--tau", "0.3"], "--tau", "--contrastive"),
    (["--tau", "0.3"], "--tau", "--method fedfr"),  # FedFR's own, refused with the default method
    (["--method", "fedprox", "--hard-negatives"], "--hard-negatives", "--method fedfr"),
    (["--no-dfc", "--dfc-steps", "7"], "--dfc-steps", "--dfc"),
    (["--topk-fraction", "0.3"], "--topk-fraction", "--codec topk"),
    (["--combine", "median", "--trim", "0.1"], "--trim", "--combine trimmed-mean"),
    (["--byzantine", "1"], "--byzantine", "--combine krum"),
    (["--dp-delta", "1e-6"], "--dp-delta", "--dp-noise"),
    (["--fv-phi", "0.5"], "--fv-phi", "--fv"),
    (["--alpha", "0.1"], "--alpha", "--partition dirichlet"),  # the simulation's own (no serve option)
    (["--partition", "dirichlet", "--lognormal-sigma", "2"], "--lognormal-sigma", "--partition lognormal"),
    (["--attack", "wipe"], "--attack", "--malicious"),
    (["--fv-validators", "2"], "--fv-validators", "--fv"),
    (["--cpus-per-device", "2"], "--cpus-per-device", "--backend ray"),
    (["--broker", "mqtt://127.0.0.1:1", "--tls"], "--tls", "the embedded broker"),  # serve's own (no simulate)
    (["--broker", "mqtt://127.0.0.1:1", "--no-broker-acl"], "--no-broker-acl", "the embedded broker"),
    (["--username", "me", "--password", "pw"], "--username", "--broker URL"),
    (["--broker", "mqtt://127.0.0.1:1", "--ca-file", "ca.pem"], "--ca-file", "a TLS broker"),  # plaintext
])
def test_a_setting_whose_owner_is_off_is_refused_in_one_line(tmp_path, capsys, argv, flag, owner):
    from coordinator.cli import SERVE_OWNED
    from ffr.cli import main
    from fleet.cli import SIM_OWNED

    commands = []
    if flag not in SERVE_OWNED:
        commands.append(["fleet", "simulate", "--out", str(tmp_path / "r")])
    if flag not in SIM_OWNED:
        commands.append(["coordinator", "serve", "--state", str(tmp_path / "s")])
    for command in commands:
        assert main(["-q", *command, *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert f"{flag} has no effect without {owner}" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "r").exists() and not (tmp_path / "s").exists()  # refused before anything was written


def test_the_spec_round_trips_and_resuming_refuses_only_what_may_not_change(tmp_path):
    config = SimConfig(clients=3, server=RoundSettings(rounds=2, training=TrainingConfig(lr=1e-3)))
    config.save(tmp_path / "config.json")
    loaded = SimConfig.load(tmp_path / "config.json")
    assert loaded == config and loaded.training.optimisation.lr == 1e-3 and loaded.seed == 0
    more_rounds = SimConfig(clients=3, server=RoundSettings(rounds=9, training=TrainingConfig(lr=1e-3)))
    assert more_rounds.differences(config) == []
    other_lr = SimConfig(clients=3, server=RoundSettings(rounds=2, training=TrainingConfig(lr=1e-2)))
    assert other_lr.differences(config) == ["server.training.lr: 0.001 -> 0.01"]


def test_a_run_folder_from_before_the_nested_spec_still_loads(tmp_path):
    """config.json was one flat list of options; an interrupted run of that version resumes."""
    old = {"data": None, "clients": 4, "rounds": 6, "algorithm": "fedavg", "method": "fedfr", "hard_negatives": None,
           "contrastive": False, "dfc_weight": None, "local_epochs": 2, "lr": 0.01, "round_timeout": 99.0,
           "combine": "median", "gate_far": 0.01, "gate_faces": 50, "seed": 3, "split": [0.7, 0.1, 0.2]}
    (tmp_path / "config.json").write_text(json.dumps(old))
    config = SimConfig.load(tmp_path / "config.json")
    assert (config.clients, config.server.rounds, config.server.round_timeout_s, config.server.combine) == \
        (4, 6, 99.0, "median")
    assert config.training.optimisation.epochs == 2 and config.training.optimisation.lr == 0.01 and config.seed == 3
    assert config.training.method.hard_negatives and not config.training.method.contrastive  # fedfr's defaults
    assert config.training.model.dfc_weight == 10.0 and config.gate.bar.far == 0.01 and config.gate.bar.limit == 50


def test_a_run_folder_says_its_format_and_one_from_a_newer_version_is_refused_plainly(tmp_path):
    """config.json names its format; each older one has its reader, and a newer one is not half-read."""
    SimConfig(clients=3).save(tmp_path / "config.json")
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["format_version"] == 6 and SimConfig.load(tmp_path / "config.json").clients == 3
    assert SimConfig.load(tmp_path / "config.json").public_identities == 0.2
    (tmp_path / "config.json").write_text(json.dumps({**saved, "format_version": 7}))
    with pytest.raises(ValueError, match="config.json format 7: this ffr-edge reads formats 1-6 .*upgrade ffr-edge"):
        SimConfig.load(tmp_path / "config.json")
    # format 5: the round configuration's format 2, the method's settings at its top
    training = {**{k: v for k, v in saved["server"]["training"].items() if k != "method"}, "version": 2,
                "algorithm": "fedprox", "prox_mu": 0.3, "hard_negatives": False}
    fifth = {**saved, "format_version": 5, "server": {**saved["server"], "training": training}}
    (tmp_path / "config.json").write_text(json.dumps(fifth))
    assert SimConfig.load(tmp_path / "config.json").training.method.proximal_mu() == 0.3
    # format 5 kept the run's --method beside the spec, FedFace being PFM on the wire: it names the method now
    pfm = {**training, "algorithm": "pfm", "pfm_beta": 0.7}
    fifth = {**fifth, "method": "fedface", "server": {**saved["server"], "training": pfm}}
    (tmp_path / "config.json").write_text(json.dumps(fifth))
    assert SimConfig.load(tmp_path / "config.json").training.method == FedFace(pfm_beta=0.7)
    flat = {"clients": 4, "rounds": 6, "method": "fedavg", "format_version": 1}
    (tmp_path / "config.json").write_text(json.dumps(flat))
    assert SimConfig.load(tmp_path / "config.json").server.rounds == 6
    assert SimConfig.load(tmp_path / "config.json").public_identities == 0.0
    # format 3: no public people; a run resumed from it keeps serving its devices none
    third = {**{k: v for k, v in saved.items() if k != "public_identities"}, "format_version": 3}
    (tmp_path / "config.json").write_text(json.dumps(third))
    assert SimConfig.load(tmp_path / "config.json").public_identities == 0.0
    # format 2: the gate's faces and switch were options of their own beside its bar
    second = {**{k: v for k, v in saved.items() if k != "gate"}, "format_version": 2, "gate_data": str(tmp_path),
              "no_gate": True, "gate": {**saved["gate"]["bar"], "far_ratio": 3.0}}
    (tmp_path / "config.json").write_text(json.dumps(second))
    gate = SimConfig.load(tmp_path / "config.json").gate
    assert (gate.data, gate.off, gate.bar.far_ratio) == (str(tmp_path), True, 3.0)


def test_each_part_refuses_what_cannot_work_with_the_flag_it_came_from(tmp_path, capsys):
    from ffr.cli import main

    for args, message in ((["--fv-phi", "2"], "--fv-phi must be in (0, 1]"),
                          (["--lr", "5"], "--lr"),
                          (["--dp-noise", "1"], "needs a clipping norm"),
                          (["--local-epochs", "0"], "--local-epochs must be at least 1")):
        for command in (["coordinator", "serve", "--state", str(tmp_path / "s")],
                        ["fleet", "simulate", "--out", str(tmp_path / "r")]):
            assert main(["-q", *command, *args]) == 2
            err = capsys.readouterr().err
            assert message in err and len(err.strip().splitlines()) == 1, err
    for args, message in ((["--workers", "0"], "--workers must be at least 1"),  # the simulation's own part
                          (["--partition", "dirichlet", "--alpha", "0"], "(--alpha) must be positive"),
                          (["--partition", "lognormal", "--lognormal-sigma", "-1"], "(--lognormal-sigma) must not"),
                          (["--holdout-clients", "-1"], "--holdout-clients must not be negative"),
                          (["--impostor-images", "-1"], "--impostor-images must not be negative"),
                          (["--tune-steps", "-1"], "--tune-steps must not be negative"),
                          (["--patience", "-1"], "--patience must not be negative"),
                          (["--eval-clients", "0"], "--eval-clients must be at least 1"),
                          (["--min-delta", "nan"], "--min-delta must be a number >= 0")):
        assert main(["-q", "fleet", "simulate", "--out", str(tmp_path / "r"), *args]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "r").exists()  # refused before the run folder or its SYNTHETIC faces were written


@pytest.mark.parametrize("method, algorithm, fv", [("fedfr", "fedavg", False), ("fedface", "pfm", True)])
def test_method_names_the_aggregation_and_the_local_objective(tmp_path, method, algorithm, fv):
    args = build_parser().parse_args(["fleet", "simulate", "--out", str(tmp_path), "--method", method])
    config = _config(args)
    assert config.training.algorithm == algorithm and config.server.fv == fv and config.training.method.name == method


@pytest.mark.parametrize("text", ["[1, 2]", "{not json", '{"server": 3}', '{"server": {"training": {"lr": 99}}}',
                                  '{"server": {"rounds": -1}}', '{"gate": {"far": 2}, "server": {}}',
                                  '{"split": 5, "server": {}}', '{"server": {"training": {"evil": 1}}}',
                                  '{"server": {"rounds": 2.5}}', '{"server": {"seed": "x"}}',
                                  '{"server": {"max_update_bytes": -1}}', '{"gate": {"threads": [1]}, "server": {}}',
                                  '{"clients": "many", "server": {}}', '{"server": {"fv": 1}}',
                                  '{"format_version": [2], "server": {}}', '{"format_version": "2", "server": {}}',
                                  '{"format_version": 4, "public_identities": "all", "server": {}}',
                                  '{"format_version": 3, "public_identities": [0.2], "server": {}}'])
def test_a_hostile_run_config_is_refused_in_one_line(tmp_path, text):
    """config.json is read back from the run folder: whatever is written there, loading refuses it plainly."""
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match="is damaged or was not written by ffr fleet simulate") as caught:
        SimConfig.load(tmp_path / "config.json")
    assert len(str(caught.value).splitlines()) == 1


# --- the flags, checked against the spec (issue 28: "the CLI flags ... checked against it") ---------------------
# Each option of `ffr fleet simulate` and `ffr coordinator serve` is given a value other than its default, the spec
# is built as the command builds it, and the spec fields that moved are that flag's concept. Spec fields no flag of
# a command reaches are listed here with the reason, so a new field without a flag fails until it is declared.
FIXED = {  # spec fields neither command takes a flag for
    "server.training.pfm_beta": "PFM's momentum beta (FedFace eq. 1-3): the paper's 0.9",
    "server.training.dfc_views": "views of each image for the DFC fit: 2",
    "server.training.embedding_dim": "the shipped embedder's width (128): a model choice, not a round's",
    "server.training.version": "the round configuration's format (protocol.messages.TrainingConfig)",
    "server.max_update_bytes": "a deployment bound",
    "server.max_inflight_bytes": "a deployment bound",
    "server.errors_per_minute": "a deployment bound",
    "server.weight_factor": "a deployment bound",
    "server.model_dtype": "the wire's weight type",
    "server.dp_noise": "reached with --dp-clip only (DP needs a clipping norm)",
    "gate.bar.threads": "the machine's",
}
NOT_FLAGS = {  # ... and those `ffr fleet simulate` has none for
    **FIXED,
    "server.training.public_set": "a simulation's devices read the public set from --public-data",
    "server.min_clients": "1: a simulated fleet is its own quorum",
    "server.training.chunk_bytes": "serve: --chunk-kib; a simulation keeps the default",
    "split": "train/val/test fractions: fixed",
    "max_eval_pairs": "fixed",
    "progress": "the global -q",
    "rules": "a JSON file's contents (--rules FILE)",
}
SERVE_NOT_FLAGS = {  # ... and those `ffr coordinator serve` has none for
    **FIXED,
    "server.training.public_set": "set from the served public set (--public-set), not typed",
    "service.tick_seconds": "the service's clock",
    "service.start_paused": "the dashboard's and tests' (POST /api/pause)",
}
CLI_DEFAULTS = {"server.training.method.name": "fedprox",  # DEFAULT_METHOD in every command
                "server.training.method.prox_mu": 0.01,  # its own setting, which the spec's FedAvg lacks
                "server.min_clients": 1}  # a simulated fleet is its own quorum


def _subparser(parser, *path):
    import argparse

    for name in path:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


def _values(action) -> list[list[str]]:
    """Command-line tails giving `action` a value other than its default (empty: none can be made up)."""
    import argparse

    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        return [[s] for s in action.option_strings]
    if action.choices:
        return [[action.option_strings[0], str(c)] for c in action.choices if c != action.default]
    from models.cli.common import port

    if getattr(action.type, "func", action.type) is port:  # a port number (functools.partial where 0 is refused)
        return [[action.option_strings[0], "8123"]]
    kind = {"whole": int, "fraction": float}.get(getattr(action.type, "__name__", ""), action.type)  # bounded ones
    numbers = {int: [2, 3, 1, 5], float: [0.5, 2, 0.25, 1e-3, 3]}.get(kind)
    if numbers is not None:
        return [[action.option_strings[0], str(v)] for v in numbers if v != action.default]
    if action.type in (None, str) or getattr(action.type, "__name__", "") == "Path":
        return [[action.option_strings[0], "somewhere"]]
    return []


def _simulate_spec(argv):
    from fleet.config import dotted

    return dotted(_config(build_parser().parse_args(["fleet", "simulate", "--out", "/nowhere", *argv])).to_dict())


def _serve_spec(argv):
    from dataclasses import asdict

    from coordinator.cli import serve_spec
    from fleet.config import dotted

    config, settings = serve_spec(build_parser().parse_args(["coordinator", "serve", "--state", "/nowhere", *argv]))
    service = {f"service.{k}": v for k, v in asdict(config).items() if k != "gate"}
    return {**service, **dotted({"gate": asdict(config.gate), "server": settings.to_dict()})}


def _owned() -> dict:
    """Every option that is some owner's own setting (models.cli.common.Owned), with that owner."""
    from coordinator.cli import ROUND_OWNED, SERVE_OWNED
    from fleet.cli import SIM_OWNED
    from models.cli.objective import OWNED

    return {**OWNED, **ROUND_OWNED, **SIM_OWNED, **SERVE_OWNED}


def _reach(command: tuple[str, ...], spec) -> tuple[dict, dict[str, set[str]]]:
    """(the spec with no options, {flag: the spec fields it moves}); an owner's own setting is moved with its owner
    on, against the spec with only the owner on."""
    import argparse

    base, owned = spec([]), _owned()
    reach = {}
    for action in _subparser(build_parser(), *command)._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or action.dest == "help":
            continue
        owner = owned[action.option_strings[0]].turn_on() if action.option_strings[0] in owned else []
        start = spec(owner) if owner else base
        moved = set()
        for tail in _values(action):
            try:
                built = spec([*owner, *tail])
            except (SystemExit, ValueError, OSError):  # a value the option refuses (or a file that is not there)
                continue
            moved |= {k for k, v in built.items() if v != start.get(k)}
        reach[action.option_strings[-1]] = moved
    return base, reach


@pytest.mark.parametrize("command, spec, exempt", [(("fleet", "simulate"), _simulate_spec, set(NOT_FLAGS)),
                                                   (("coordinator", "serve"), _serve_spec, set(SERVE_NOT_FLAGS))])
def test_every_spec_field_has_a_flag_and_no_concept_has_two(command, spec, exempt, capsys):
    base, reach = _reach(command, spec)
    capsys.readouterr()
    reached = set().union(*reach.values())
    assert set(base) - reached <= exempt, f"spec fields no flag of {' '.join(command)} sets (give them one, or " \
                                          f"say why in NOT_FLAGS): {sorted(set(base) - reached - exempt)}"
    assert not exempt & reached, f"declared flagless but a flag sets them: {sorted(exempt & reached)}"
    single = {}
    for flag, moved in reach.items():
        if len(moved) == 1:
            single.setdefault(next(iter(moved)), []).append(flag)
    negations = {f for f in reach if f.startswith("--no-")}
    twice = {field: flags for field, flags in single.items() if len(set(flags) - negations) > 1}
    assert not twice, f"one spec field, several flags: {twice}"


def test_a_flag_both_commands_take_moves_the_same_spec_fields():
    _, simulate = _reach(("fleet", "simulate"), _simulate_spec)
    _, serve = _reach(("coordinator", "serve"), _serve_spec)
    def strip(fields: set[str]) -> set[str]:  # serve nests ServiceConfig; `method` is a simulated run's label
        return {f.removeprefix("service.") for f in fields} - {"method"}

    for flag in sorted(set(simulate) & set(serve) - {"--init", "--broker"}):  # a simulation's own fleet / broker
        assert strip(serve[flag]) == strip(simulate[flag]), flag


def test_with_no_options_the_spec_is_the_specs_defaults(tmp_path):
    """The flags' defaults are the spec's: parsed with no options, only the documented CLI choices differ."""
    from fleet.config import dotted

    parsed = _simulate_spec([])
    defaults = dotted(SimConfig().to_dict())
    differ = {k: (defaults.get(k), parsed.get(k)) for k in set(parsed) | set(defaults)
              if parsed.get(k) != defaults.get(k)}
    assert differ == {k: (defaults.get(k), v) for k, v in CLI_DEFAULTS.items()}


def test_an_owned_options_help_states_the_specs_default():
    """An owned option defaults to None (the spec's default stands), so its help is the one place the default is
    shown: it must be the spec's, for every owned option of `ffr fleet simulate`."""
    import re

    owned = _owned()
    actions = [a for a in _subparser(build_parser(), "fleet", "simulate")._actions
               if a.option_strings and a.option_strings[0] in owned]
    checked = 0
    for action in actions:
        assert action.default is None, f"{action.option_strings[0]} has a default of its own: {action.default}"
        spec = _simulate_spec(owned[action.option_strings[0]].turn_on())  # with its owner on: a method's own
        by_field = {k.rsplit(".", 1)[-1]: v for k, v in spec.items()}
        value = by_field[{"fv_timeout": "fv_timeout_s"}.get(action.dest, action.dest)]
        if value is None:  # Krum's f: computed from the round's size
            continue
        stated = re.search(r"\(default ([-\w.]+?)[:;,)]", action.help)
        assert stated, f"{action.option_strings[0]}'s help states no default"
        text = stated.group(1)
        if isinstance(value, bool):
            assert text == ("on" if value else "off"), f"{action.option_strings[0]}: help says {text}, the spec {value}"
        else:
            assert (float(text) == float(value)) if not isinstance(value, str) else text == value, \
                f"{action.option_strings[0]}: help says {text}, the spec {value}"
        checked += 1
    assert checked == len(actions) - 1 > 20  # every owned option but Krum's f
