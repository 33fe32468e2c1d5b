"""bench.pair_jumps: the largest impostor-pair rises between two models' scores, and what the pair check flags."""
from __future__ import annotations

import numpy as np

from bench.pair_jumps import jumps
from models.evaluation.separation import PAIR_JUMP, Scores


def test_an_even_drift_flags_nothing_and_one_pulled_pair_is_flagged_once():
    rng = np.random.default_rng(0)
    impostor = rng.normal(0.1, 0.1, 20_000)
    current = Scores(rng.normal(0.6, 0.1, 500), impostor)
    drifted = Scores(current.genuine, impostor + rng.normal(0.0, 0.01, len(impostor)))
    honest = jumps(current, drifted)
    assert honest["flagged"] == 0 and 0 < honest["rise_max"] < 0.1 and honest["pairs"] == len(impostor)
    pulled = impostor.copy()
    pulled[7] = 0.95
    figures = jumps(current, Scores(current.genuine, pulled))
    assert figures["flagged"] == 1 and figures["accepted_rise_max"] == figures["rise_max"] > figures["bar"] == PAIR_JUMP
