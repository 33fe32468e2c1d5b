"""The simulator, the API and the dashboard read the engine through its view, as values
(coordinator/engine_view.py), never through the engine's collaborators; the house figure that counts such reaches
finds them."""
from __future__ import annotations

import ast

import numpy as np

from bench.architecture import engine_reads, modules


def test_no_reader_reaches_the_engines_collaborators():
    assert engine_reads(modules()) == []
    api = ast.parse("store = service.engine.store\nview = service.engine.view")
    assert engine_reads({"coordinator.api": api, "coordinator.service": api}) == ["coordinator.api:1 engine.store"]
    # the figure finds a reach: the simulator's old reads of the store, the norm bound and the broadcast
    old = ast.parse("rows = self.service.engine.store.rounds()\nb = engine.norms.bound\nv = engine.view.rounds()")
    assert sorted(engine_reads({"fleet.old": old})) == ["fleet.old:1 engine.store", "fleet.old:2 engine.norms"]


def test_the_view_gives_values_that_cannot_change_the_engine(tmp_path):
    from coordinator.aggregation import make_strategy
    from coordinator.engine import Engine, RoundSettings
    from coordinator.store import Store
    from protocol.auth import Signer

    state = {"w": np.ones(100, np.float32)}
    engine = Engine(Store(tmp_path), make_strategy("fedavg"), RoundSettings(), lambda *a: None, lambda: state,
                    Signer.load_or_create(tmp_path / "key.pem"))
    view = engine.view
    assert view.rounds() == [] and view.finished_rounds() == 0 and view.round(1) is None
    assert view.norm_bound() == engine.norms.bound and view.model_bytes() > 0
    view.registered().add("client-9")  # a reader's copy: the engine's devices are unchanged
    assert "client-9" not in engine.keys and view.registered() == set()
    model = view.model(0)
    model["w"][:] = 0  # the registry's copy, read from disk: the engine's global model is unchanged
    assert np.all(engine.global_state["w"] == 1) and np.all(view.model(0)["w"] == 1)
    status = view.status()
    assert status["model_version"] == 0 and "device_ids" not in status
    assert view.devices() == [] and view.count_rejections() == 0 and view.rejections(0, 10) == []
    assert [m["version"] for m in view.models()] == [0] and view.model_file(0) and view.model_file(7) is None
    assert view.evaluations() == [] and view.dropped_rounds() == {} and view.admitted_never_seen() == []
