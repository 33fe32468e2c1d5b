"""Issue 48's screening: each update judged against the round's others (FLAME's clustering and median-norm clip).

The engine tests run the real coordinator engine (`tests.test_trust.Harness`: real store, real signed messages) with
the screen on; the deltas are numpy arrays shaped as a small backbone's, not trained ones, so that which update
points elsewhere is known.
"""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.robust import l2_norm
from coordinator.settings import RoundSettings
from coordinator.update_screen import Flame, majority_cluster, sketch
from protocol.messages import TrainingConfig
from tests.test_trust import GLOBAL, Dev, Harness

COMMON = {k: np.random.default_rng(7).normal(size=v.shape).astype(np.float32) for k, v in GLOBAL.items()
          if v.dtype.kind == "f"}


def alike(seed: int, size: float = 0.01, share: float = 0.5) -> dict:
    """An honest-looking update: the direction every honest device shares, plus its own (cosine about `share`)."""
    rng = np.random.default_rng(seed)
    delta = {k: (size * (np.sqrt(share) * v + np.sqrt(1 - share) * rng.normal(size=v.shape))).astype(np.float32)
             for k, v in COMMON.items()}
    return {**delta, "backbone.bn.num_batches_tracked": np.array(1, dtype=np.int64)}


def elsewhere(seed: int, size: float = 0.01) -> dict:
    """An update pointing away from the honest direction (a collapse, a sign flip, a payload of its own)."""
    return {k: (-v if v.dtype.kind == "f" else v) for k, v in alike(seed, size, share=0.9).items()}


def test_the_sketch_keeps_the_cosine_of_two_updates():
    a, b = alike(1), alike(2)
    full = sum(float(np.vdot(a[k], b[k])) for k in COMMON) / (l2_norm(a) * l2_norm(b))
    sa, sb = sketch(a), sketch(b)
    assert float(sa @ sb / (np.linalg.norm(sa) * np.linalg.norm(sb))) == pytest.approx(full, abs=0.06)


@pytest.mark.parametrize("n", [5, 10, 30])
def test_updates_that_are_all_equally_alike_are_all_admitted(n):
    """FLAME's HDBSCAN alone left 10-35% of such updates out; the screen widens its cluster to them."""
    rows = np.stack([sketch(alike(i, share=0.3)) for i in range(n)])
    assert majority_cluster(rows).rows == list(range(n))


def test_a_minority_pointing_elsewhere_is_left_out():
    rows = np.stack([sketch(d) for d in [elsewhere(0), *[alike(i) for i in range(1, 8)], elsewhere(9)]])
    assert majority_cluster(rows).rows == list(range(1, 8))


def test_the_admitted_are_clipped_to_their_median_norm_and_a_round_of_three_is_not_screened():
    deltas = {f"d{i}": alike(i, size=0.01 * (3 if i == 0 else 1)) for i in range(5)}
    screening = Flame().screen(list(deltas), {k: sketch(v) for k, v in deltas.items()},
                               {k: l2_norm(v) for k, v in deltas.items()})
    median = float(np.median([l2_norm(v) for v in deltas.values()]))
    above = sorted(k for k, v in deltas.items() if l2_norm(v) > median)
    assert screening.admitted == sorted(deltas) and "d0" in above and screening.metrics["screen_clipped"] == len(above)
    for k in deltas:
        assert screening.scales[k] * l2_norm(deltas[k]) == pytest.approx(min(median, l2_norm(deltas[k])))
    three = {k: deltas[k] for k in ("d0", "d1", "d2")}
    small = Flame().screen(list(three), {k: sketch(v) for k, v in three.items()},
                           {k: l2_norm(v) for k, v in three.items()})
    assert small.admitted == sorted(three) and small.scales == {}


def test_the_engine_publishes_the_round_without_the_update_pointing_elsewhere(tmp_path):
    h = Harness(tmp_path, min_clients=5, screen="flame")
    devs = [Dev(h, f"dev{i}").join() for i in range(5)]
    h.open_round()
    honest = [alike(i) for i in range(4)]
    for dev, delta in zip(devs, honest):
        dev.upload(delta)
    devs[4].upload(elsewhere(4))
    h.engine.tick()
    (row,) = h.engine.store.rounds()
    assert row["status"] == "completed", row
    metrics = row["metrics"]
    assert metrics["screen_excluded_devices"] == ["dev4"] and metrics["screen_alignment"]["dev4"] < 0
    median = float(np.median([l2_norm(d) for d in honest]))
    expected = {k: np.mean([d[k] * min(1.0, median / l2_norm(d)) for d in honest], axis=0) for k in COMMON}
    for k in COMMON:
        assert np.allclose(h.engine.global_state[k] - GLOBAL[k], expected[k], atol=1e-5), k
    # the norm bound learns from the updates that made the round, not from the one left out
    assert len(h.engine.norms.history) == 4


def test_without_the_screen_the_same_update_enters_the_round(tmp_path):
    h = Harness(tmp_path, min_clients=5, screen="none")
    devs = [Dev(h, f"dev{i}").join() for i in range(5)]
    h.open_round()
    for i, dev in enumerate(devs[:4]):
        dev.upload(alike(i))
    devs[4].upload(elsewhere(4))
    h.engine.tick()
    (row,) = h.engine.store.rounds()
    assert row["status"] == "completed" and "screen_excluded" not in row["metrics"]
    assert len(h.engine.norms.history) == 5


def test_screening_is_on_by_default_and_off_under_dp_whose_accounting_does_not_cover_it():
    assert RoundSettings().screen == "flame"
    assert RoundSettings(training=TrainingConfig(dp_clip=1.0)).screen == "none"
    with pytest.raises(ValueError, match="--screen none"):
        RoundSettings(screen="flame", training=TrainingConfig(dp_clip=1.0))
    with pytest.raises(ValueError, match="unknown update screen"):
        RoundSettings(screen="krum")
