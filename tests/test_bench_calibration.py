"""bench.calibration's device draw: strangers are everyone neither enrolled nor in --data, each claims every enrolled
person; with a counted rate they get through about as often as asked."""
from __future__ import annotations

import numpy as np

from bench.calibration import draw
from edge_client.recognizer import normalise


def by_person(n_people: int, noise: float, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {f"p{i}": normalise(rng.normal(size=64) + noise * rng.normal(size=(10, 64))) for i in range(n_people)}


def test_every_stranger_claims_every_enrolled_person():
    result = draw(by_person(20, noise=0.3), enrolled=3, extra=5, far=0.01, rng=np.random.default_rng(0))
    assert result["claims"] == (20 - 3 - 5) * 3 and result["genuine"] == 3


def test_with_a_counted_rate_strangers_get_through_about_as_often_as_asked():
    by, rng = by_person(60, noise=0.3), np.random.default_rng(0)
    runs = [draw(by, enrolled=3, extra=15, far=0.01, rng=rng) for _ in range(30)]
    assert all(r["measurable"] for r in runs) and all(r["genuine_accepted"] == 3 for r in runs)
    assert sum(r["accepted"] for r in runs) / sum(r["claims"] for r in runs) <= 0.03


def test_a_model_that_cannot_tell_people_apart_lets_strangers_through():
    rng = np.random.default_rng(1)
    alike = {f"p{i}": normalise(rng.normal(size=(10, 64))) for i in range(20)}  # every face its own random point
    result = draw(alike, enrolled=3, extra=0, far=0.01, rng=np.random.default_rng(0))
    assert result["accepted"] > 0 or result["genuine_accepted"] < 3
