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

SHARED = ["--rounds", "3", "--fraction", "0.5", "--round-timeout", "60", "--method", "fedprox", "--prox-mu", "0.2",
          "--server-momentum", "0.5", "--local-epochs", "2", "--batch-size", "8", "--lr", "0.001", "--no-dfc",
          "--width-mult", "0.5", "--codec", "int8", "--combine", "median", "--norm-factor", "2", "--norm-ceiling",
          "0.2", "--dp-delta", "1e-6", "--fv-candidates", "4", "--fv-phi", "0.5", "--fv-epsilon", "0.01",
          "--fv-timeout", "30", "--t-hn", "0.2", "--tau", "0.3", "--dfc-steps", "7", "--seed", "5"]


def test_serve_and_simulate_read_the_same_flags_into_the_same_spec(tmp_path):
    """Every option both commands take builds the same RoundSettings and TrainingConfig: one name, one meaning."""
    parser = build_parser()
    serve = parser.parse_args(["coordinator", "serve", "--state", str(tmp_path / "s"), *SHARED])
    fleet = parser.parse_args(["fleet", "simulate", "--out", str(tmp_path / "r"), *SHARED])
    served = round_settings(serve, training_config(serve), min_clients=1).to_dict()
    simulated = _config(fleet).server.to_dict()
    assert served["training"].pop("chunk_bytes") == 256 * 1024  # `serve --chunk-kib`, which a simulation lacks
    simulated["training"].pop("chunk_bytes")
    assert served == simulated
    assert simulated["rounds"] == 3 and simulated["training"]["lr"] == 0.001 and simulated["combine"] == "median"
    assert simulated["training"]["algorithm"] == "fedprox" and simulated["training"]["prox_mu"] == 0.2


def test_the_spec_round_trips_and_resuming_refuses_only_what_may_not_change(tmp_path):
    config = SimConfig(clients=3, server=RoundSettings(rounds=2, training=TrainingConfig(lr=1e-3)))
    config.save(tmp_path / "config.json")
    loaded = SimConfig.load(tmp_path / "config.json")
    assert loaded == config and loaded.training.lr == 1e-3 and loaded.seed == 0
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
    assert config.training.epochs == 2 and config.training.lr == 0.01 and config.seed == 3
    assert config.training.hard_negatives and not config.training.contrastive  # --method fedfr's defaults
    assert config.training.dfc_weight == 10.0 and config.gate.far == 0.01 and config.gate.limit == 50


def test_each_part_refuses_what_cannot_work_with_the_flag_it_came_from(tmp_path, capsys):
    from ffr.cli import main

    for args, message in ((["--fv-phi", "2"], "--fv-phi must be in (0, 1]"),
                          (["--lr", "5"], "--lr"),
                          (["--dp-noise", "1"], "needs a clipping norm")):
        for command in (["coordinator", "serve", "--state", str(tmp_path / "s")],
                        ["fleet", "simulate", "--out", str(tmp_path / "r")]):
            assert main(["-q", *command, *args]) == 2
            err = capsys.readouterr().err
            assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("method, algorithm, fv", [("fedfr", "fedavg", False), ("fedface", "pfm", True)])
def test_method_names_the_aggregation_and_the_local_objective(tmp_path, method, algorithm, fv):
    args = build_parser().parse_args(["fleet", "simulate", "--out", str(tmp_path), "--method", method])
    config = _config(args)
    assert config.training.algorithm == algorithm and config.server.fv == fv and config.method == method


@pytest.mark.parametrize("text", ["[1, 2]", "{not json", '{"server": 3}', '{"server": {"training": {"lr": 99}}}',
                                  '{"server": {"rounds": -1}}', '{"gate": {"far": 2}, "server": {}}',
                                  '{"split": 5, "server": {}}', '{"server": {"training": {"evil": 1}}}'])
def test_a_hostile_run_config_is_refused_in_one_line(tmp_path, text):
    """config.json is read back from the run folder: whatever is written there, loading refuses it plainly."""
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match="is damaged or was not written by ffr fleet simulate") as caught:
        SimConfig.load(tmp_path / "config.json")
    assert len(str(caught.value).splitlines()) == 1
