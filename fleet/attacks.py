"""Malicious devices for robustness experiments: the real edge client with a poisoned delta.

A fleet run with `--malicious 0.2 --attack scaled|sign-flip|wipe` makes that fraction of the
training clients (fixed by the seed) send, instead of their honest backbone delta d:
- `scaled`: 1000 d, with its true sample count (boosting, Bhagoji et al., ICML 2019);
- `sign-flip`: -10 d (Fang et al., USENIX Security 2020's sign-flipping, amplified);
- `wipe`: -w_global with a self-reported sample count of 10^15 (set the model to zero).
Everything else about them (admission, signatures, protocol) is honest: this is what one
registered, compromised device can do, the case the coordinator's defences are for.
"""
from __future__ import annotations

import random

import numpy as np

ATTACKS = ("scaled", "sign-flip", "wipe")


def malicious_clients(clients: list[int], fraction: float, seed: int) -> set[int]:
    """round(fraction x n) of the clients, chosen by the seed."""
    count = int(round(fraction * len(clients)))
    return set(random.Random(seed + 7919).sample(sorted(clients), count)) if count else set()


def poison(attack: str, delta: dict[str, np.ndarray], n_samples: int,
           global_state: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
    """The poisoned (delta, sample count) a malicious device sends instead of its honest one."""
    floating = {k for k, v in delta.items() if np.issubdtype(v.dtype, np.floating)}
    if attack == "scaled":
        return {k: v * 1000.0 if k in floating else v for k, v in delta.items()}, n_samples
    if attack == "sign-flip":
        return {k: v * -10.0 if k in floating else v for k, v in delta.items()}, n_samples
    if attack == "wipe":
        return {k: -np.asarray(global_state[k], dtype=np.float64) if k in floating else v
                for k, v in delta.items()}, 10 ** 15
    raise ValueError(f"unknown attack {attack!r}; choose one of {', '.join(ATTACKS)}")
