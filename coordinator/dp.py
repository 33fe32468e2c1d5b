"""DP-FedAvg (McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language
Models", ICLR 2018, Algorithm 1): devices clip their update to L2 norm C, the coordinator
averages the round's n updates with equal weights and adds Gaussian noise N(0, (z C / n)^2)
to each coordinate. The privacy spent is user-level (epsilon, delta)-DP, accounted with the
RDP accountant of Google's `dp_accounting` (Mironov 2017; subsampled Gaussian, Mironov,
Talwar, Zhang 2019), composing one Poisson-sampled Gaussian event per round with sampling
rate q = devices sampled / devices registered. (Sampling here is a fixed-size random subset,
so the Poisson accountant is the usual approximation.) BatchNorm's running statistics are
not shared under DP: devices and coordinator zero their deltas, so the global ones stay.
"""
from __future__ import annotations

import math

import numpy as np

from models.maths.state_norms import RUNNING_STATS, State, float_names


def add_noise(mean_delta: State, n_updates: int, noise_multiplier: float, clip: float,
              rng: np.random.Generator | None = None) -> State:
    """The mean of n clipped updates plus N(0, (z C / n)^2) on every floating coordinate."""
    if noise_multiplier <= 0:
        return mean_delta
    rng = rng or np.random.default_rng()
    sigma = noise_multiplier * clip / max(1, n_updates)
    floats = {k for k in float_names(mean_delta) if not k.endswith(RUNNING_STATS)}  # those are not shared
    return {k: (v + rng.normal(0.0, sigma, np.shape(v)) if k in floats else v) for k, v in mean_delta.items()}


def noise_norm(n_parameters: int, n_updates: int, noise_multiplier: float, clip: float) -> float:
    """The expected L2 norm of the added noise (for the coordinator's sanity check of the new model)."""
    return noise_multiplier * clip / max(1, n_updates) * math.sqrt(n_parameters)


def epsilon(sampling_rates: list[float], noise_multiplier: float, delta: float) -> float:
    """User-level epsilon at `delta` after one round per sampling rate (inf without noise)."""
    if not sampling_rates:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant()
    for q in sampling_rates:
        accountant.compose(
            dp_accounting.PoissonSampledDpEvent(min(1.0, q), dp_accounting.GaussianDpEvent(noise_multiplier))
        )
    return float(accountant.get_epsilon(delta))
