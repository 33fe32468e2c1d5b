"""bench.fedfr compares training, not the quality gate: every row runs ungated, or every row gated on the same faces."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.fedfr import ABLATION, row_config


@pytest.mark.parametrize("gate", [False, True])
def test_every_ablation_row_runs_the_same_fleet_and_the_same_gate(tmp_path, gate):
    data, public = tmp_path / "faces", tmp_path / "public"
    data.mkdir(), public.mkdir()
    args = SimpleNamespace(clients=10, rounds=2, workers=2, centralized=True, public_data=public, public_limit=500,
                           gate=gate)
    configs = {key: row_config(args, data, "iid", row) for key, row in ABLATION.items()}
    for config in configs.values():
        config.validate()
    # ungated: no row has the gate, though the FedFR rows' public set would give it faces by default;
    # gated: every row, FedAvg included, scores on the public set's faces
    assert {(c.gate.off, c.gate.data) for c in configs.values()} == {(not gate, str(public) if gate else None)}
    assert configs["fedavg"].public_data is None
    assert {configs[k].public_data for k in ("hn", "con", "fedfr")} == {str(public)}
    assert [c.training.method.uses_public_set() for c in configs.values()] == [False, True, True, True]
    assert {(c.clients, c.partition, c.server.rounds, c.init) for c in configs.values()} == {(10, "iid", 2, "face")}
