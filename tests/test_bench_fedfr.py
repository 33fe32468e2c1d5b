"""bench.fedfr compares training, not the quality gate: every row runs ungated, whether or not it has a public set."""
from __future__ import annotations

from types import SimpleNamespace

from bench.fedfr import ABLATION, row_config


def test_every_ablation_row_runs_the_same_fleet_without_the_gate(tmp_path):
    data, public = tmp_path / "faces", tmp_path / "public"
    data.mkdir(), public.mkdir()
    args = SimpleNamespace(clients=10, rounds=2, workers=2, centralized=True, public_data=public, public_limit=500)
    configs = {key: row_config(args, data, "iid", row) for key, row in ABLATION.items()}
    for config in configs.values():
        config.validate()
    assert all(c.no_gate for c in configs.values())
    assert configs["fedavg"].public_data is None  # no faces for a gate either way
    assert {configs[k].public_data for k in ("hn", "con", "fedfr")} == {str(public)}  # the gate's default faces
    assert [c.training.hard_negatives for c in configs.values()] == [False, True, True, True]
    assert {(c.clients, c.partition, c.server.rounds, c.init) for c in configs.values()} == {(10, "iid", 2, "face")}
