"""Malicious devices for robustness experiments: the real edge client with a poisoned delta.

A fleet run with `--malicious 0.2 --attack scaled|sign-flip|wipe` makes that fraction of the
training clients (fixed by the seed) send, instead of their honest backbone delta d:
- `scaled`: 1000 d, with its true sample count (boosting, Bhagoji et al., ICML 2019);
- `sign-flip`: -10 d (Fang et al., USENIX Security 2020's sign-flipping, amplified);
- `wipe`: -w_global with a self-reported sample count of 10^15 (set the model to zero);
- `collapse`: projected gradient ascent, on the attacker's own images, of the mean pairwise cosine of
  their embeddings (pull every face onto one point, so calibrated thresholds accept everyone), the
  delta kept inside the norm bound the coordinator enforced last round (an L2-ball projection after
  every step) and sent with the largest sample count the coordinator would accept (registered
  images x local epochs). It passes every bound: only the faces can tell (coordinator.quality_gate,
  edge_client.adoption).
Everything else about them (admission, signatures, protocol) is honest: this is what one
registered, compromised device can do, the case the coordinator's defences are for.
"""
from __future__ import annotations

import random

import numpy as np

ATTACKS = ("scaled", "sign-flip", "wipe", "collapse")


def malicious_clients(clients: list[int], fraction: float, seed: int) -> set[int]:
    """round(fraction x n) of the clients, chosen by the seed."""
    count = int(round(fraction * len(clients)))
    return set(random.Random(seed + 7919).sample(sorted(clients), count)) if count else set()


def poison(attack: str, delta: dict[str, np.ndarray], n_samples: int,
           global_state: dict[str, np.ndarray], images: np.ndarray | None = None, bound: float | None = None,
           claim: int | None = None) -> tuple[dict[str, np.ndarray], int]:
    """The poisoned (delta, sample count) a malicious device sends instead of its honest one. `collapse` also
    needs the attacker's own face crops, the norm bound to stay inside and the sample count to claim."""
    if attack == "collapse":
        if images is None or bound is None:
            raise ValueError("the collapse attack needs the device's images and the coordinator's norm bound")
        return collapse_delta(global_state, images, bound), max(n_samples, claim or n_samples)
    floating = {k for k, v in delta.items() if np.issubdtype(v.dtype, np.floating)}
    if attack == "scaled":
        return {k: v * 1000.0 if k in floating else v for k, v in delta.items()}, n_samples
    if attack == "sign-flip":
        return {k: v * -10.0 if k in floating else v for k, v in delta.items()}, n_samples
    if attack == "wipe":
        return {k: -np.asarray(global_state[k], dtype=np.float64) if k in floating else v
                for k, v in delta.items()}, 10 ** 15
    raise ValueError(f"unknown attack {attack!r}; choose one of {', '.join(ATTACKS)}")


def collapse_delta(global_state: dict[str, np.ndarray], images: np.ndarray, bound: float, steps: int = 10,
                   lr: float = 1e-3, batch_size: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    """max over ||d|| <= bound of the mean pairwise cosine of f_{w+d}(x) over the attacker's images x: Adam
    steps, each followed by the projection onto the L2 ball (BatchNorm in eval mode: its statistics stay)."""
    import torch
    import torch.nn.functional as F

    from models.faces.preprocess import to_input
    from models.networks.face_model import global_embedder
    from models.training.loop import Step, optimise

    torch.manual_seed(seed)
    embedder = global_embedder(global_state)  # eval mode: BatchNorm's statistics stay
    names = [f"backbone.{n}" for n, _ in embedder.named_parameters()]
    params = list(embedder.parameters())
    start = [p.detach().clone() for p in params]
    x_all = torch.from_numpy(to_input(images))
    rng = np.random.default_rng(seed)

    def mean_cosine(_) -> Step:
        emb = F.normalize(embedder(x_all[rng.choice(len(x_all), min(batch_size, len(x_all)), replace=False)]), dim=1)
        n = len(emb)
        return Step(-((emb @ emb.T).sum() - n) / max(1, n * (n - 1)))

    @torch.no_grad()
    def project() -> None:  # onto ||d|| <= bound
        norm = torch.sqrt(sum(((p - s) ** 2).sum() for p, s in zip(params, start)))
        if norm > bound:
            for p, s in zip(params, start):
                p.copy_(s + (p - s) * (bound / norm))

    optimise(range(steps), mean_cosine, torch.optim.Adam(params, lr=lr), after=[lambda _: project()])
    moved = {n: (p.detach() - s).double().numpy() for n, p, s in zip(names, params, start)}
    return {k: moved[k] if k in moved else np.zeros_like(np.asarray(v)) for k, v in global_state.items()}
