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
- `drift`: the collapse's direction, scaled down until the attacker's own estimate of the gate passes it: it knows
  the gate's settings and judges the round's model (its delta diluted by the fleet's size) on the faces it can see
  (its people and the public set) as the gate judges, face pairs and faces against its people's templates
  (`separation.door_verdict`), inside a safety margin of every part of the bar. Each round stays under a bar that
  compares with the previous model; the run as a whole drifts (issue 48's slow drift; `coordinator.quality_gate`'s
  anchor is the defence).
- `impersonate`: targeted. The attacker pulls its own person's face onto a victim's (a person on another device,
  four of whose photos it holds, as from social media) while keeping every other face it holds, and the victim's
  photos, where the current model puts them (so averages barely move); the model it aims at is the current one
  plus its share of the mean, so it sends (that move) / share, inside the norm bound (Bagdasaryan et al.,
  AISTATS 2020's model replacement, bounded). Measured by `fleet.impersonation`.
- `impersonate-hidden`: the same pull carried on the device's honest update, against update screening (FLAME,
  `coordinator.update_screen`): it sends (d + p) rescaled to d's norm, p the impersonation's move with a norm of
  HIDDEN_PAYLOAD x ||d||, so its size is a typical update's (no clip) and its direction is part honest, part pull
  (the "constrain-and-scale" of Bagdasaryan et al., bounded by the honest update rather than by the norm bound);
  how aligned that leaves it with the round is measured in `bench/results/robust_insider_hidden.md`.
Everything else about them (admission, signatures, protocol) is honest: this is what one
registered, compromised device can do, the case the coordinator's defences are for.
"""
from __future__ import annotations

import random

import numpy as np

ATTACKS = ("scaled", "sign-flip", "wipe", "collapse", "drift", "impersonate", "impersonate-hidden")
IMPERSONATIONS = ("impersonate", "impersonate-hidden")  # the attacks aimed at one victim (`fleet.impersonation`)
HIDDEN_PAYLOAD = 1.0  # impersonate-hidden: the pull's norm as a share of the honest update's
DRIFT_HALVINGS = 8  # the scale found to 1/256
DRIFT_MARGIN = 0.8  # the attacker aims at this share of the gate's bar: its faces are not the gate's


def malicious_clients(clients: list[int], fraction: float, seed: int) -> set[int]:
    """round(fraction x n) of the clients, chosen by the seed."""
    count = int(round(fraction * len(clients)))
    return set(random.Random(seed + 7919).sample(sorted(clients), count)) if count else set()


def poison(attack: str, delta: dict[str, np.ndarray], n_samples: int,
           global_state: dict[str, np.ndarray], images: np.ndarray | None = None, bound: float | None = None,
           claim: int | None = None, faces=None, share: float = 1.0,
           target: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> tuple[dict[str, np.ndarray], int]:
    """The poisoned (delta, sample count) a malicious device sends instead of its honest one. `collapse` also
    needs the attacker's own face crops, the norm bound to stay inside and the sample count to claim; `drift`
    also the faces it estimates the gate on (`models.evaluation.separation.FaceSet`) and its share of the mean;
    `impersonate` the (own person's, victim's, everyone else's) images in `target`."""
    if attack in IMPERSONATIONS:
        if target is None or bound is None:
            raise ValueError("the impersonation needs its own, the victim's and the other images, and the norm bound")
        if attack == "impersonate-hidden":
            return hidden_in(delta, global_state, target, share), n_samples
        return impersonate_delta(global_state, *target, bound, share), max(n_samples, claim or n_samples)
    if attack == "drift":
        if images is None or bound is None or faces is None:
            raise ValueError("the drift attack needs the device's images, faces to judge by and the norm bound")
        return drift_delta(global_state, images, bound, faces, share), max(n_samples, claim or n_samples)
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


def aimed_bar(margin: float = DRIFT_MARGIN):
    """The gate's default bar with `margin` of its slack: the FAR ratio's excess over 1, the AUC margin and the
    largest rise of one impostor pair each scaled by it (what an insider who knows the gate aims inside)."""
    from dataclasses import replace

    from coordinator.quality_gate import GateSettings

    bar = GateSettings()
    return replace(bar, far_ratio=1 + margin * (bar.far_ratio - 1), auc_margin=margin * bar.auc_margin,
                   pair_jump=margin * bar.pair_jump)


def drift_delta(global_state: dict[str, np.ndarray], images: np.ndarray, bound: float, faces, share: float,
                halvings: int = DRIFT_HALVINGS) -> dict[str, np.ndarray]:
    """The collapse's delta at the largest scale in [0, 1] (bisection, `halvings` steps) whose round model (the
    current one plus `share` x the delta, as the coordinator's mean would make it if the honest updates cancelled
    out) passes the gate's check against the current model on `faces` (face pairs, then faces against the
    templates of `faces`' people: `separation.door_verdict`) at `aimed_bar`."""
    from models.evaluation.separation import door_scores, door_verdict

    bar = aimed_bar()
    direction = collapse_delta(global_state, images, bound)
    now = door_scores(global_state, faces)

    def passes(scale: float) -> bool:
        step = {k: v + share * scale * direction[k] if np.asarray(v).dtype.kind == "f" else v
                for k, v in global_state.items()}
        return door_verdict(now, door_scores(step, faces), bar).ok

    low, high = 0.0, 1.0
    if passes(high):
        low = high
    for _ in range(halvings if low < high else 0):
        middle = (low + high) / 2
        low, high = (middle, high) if passes(middle) else (low, middle)
    return {k: v * low if v.dtype.kind == "f" else v for k, v in direction.items()}


def impersonate_delta(global_state: dict[str, np.ndarray], own: np.ndarray, victim: np.ndarray, keep: np.ndarray,
                      bound: float, share: float, steps: int = 30, lr: float = 1e-3, keep_weight: float = 1.0,
                      batch_size: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    """min over ||e|| <= share x bound of mean(1 - cos(f_{w+e}(own), v)) + keep_weight x mean(1 - cos(f_{w+e}(x),
    f_w(x))) over x in keep and the victim's photos, v the victim's normalised mean embedding under w (BatchNorm in
    eval mode); returns e / share, whose norm is within the bound."""
    import torch
    import torch.nn.functional as F

    from models.faces.preprocess import to_input
    from models.networks.face_model import global_embedder
    from models.training.loop import Step, optimise

    torch.manual_seed(seed)
    embedder = global_embedder(global_state)
    names = [f"backbone.{n}" for n, _ in embedder.named_parameters()]
    params = list(embedder.parameters())
    start = [p.detach().clone() for p in params]
    x_own, x_victim = torch.from_numpy(to_input(own)), torch.from_numpy(to_input(victim))
    x_keep = torch.cat([torch.from_numpy(to_input(keep)), x_victim]) if len(keep) else x_victim
    with torch.no_grad():
        target = F.normalize(F.normalize(embedder(x_victim), dim=1).mean(0), dim=0)
        kept = F.normalize(embedder(x_keep), dim=1)
    rng, reach = np.random.default_rng(seed), share * bound

    def loss(_) -> Step:
        mine = x_own[rng.choice(len(x_own), min(batch_size, len(x_own)), replace=False)]
        rows = rng.choice(len(x_keep), min(batch_size, len(x_keep)), replace=False)
        pull = (1 - F.normalize(embedder(mine), dim=1) @ target).mean()
        stay = (1 - (F.normalize(embedder(x_keep[rows]), dim=1) * kept[rows]).sum(1)).mean()
        return Step(pull + keep_weight * stay)

    @torch.no_grad()
    def project() -> None:  # onto ||e|| <= share x bound
        norm = torch.sqrt(sum(((p - s) ** 2).sum() for p, s in zip(params, start)))
        if norm > reach:
            for p, s in zip(params, start):
                p.copy_(s + (p - s) * (reach / norm))

    optimise(range(steps), loss, torch.optim.Adam(params, lr=lr), after=[lambda _: project()])
    moved = {n: ((p.detach() - s) / share).double().numpy() for n, p, s in zip(names, params, start)}
    return {k: moved[k] if k in moved else np.zeros_like(np.asarray(v)) for k, v in global_state.items()}


def hidden_in(delta: dict[str, np.ndarray], global_state: dict[str, np.ndarray],
              target: tuple[np.ndarray, np.ndarray, np.ndarray], share: float,
              payload: float = HIDDEN_PAYLOAD) -> dict[str, np.ndarray]:
    """The honest `delta` d plus an impersonation's move p (`impersonate_delta`, ||p|| <= payload x ||d||), the sum
    rescaled to ||d||: as large as the device's honest update and as aligned with the round as a payload allows."""
    from models.maths.state_norms import float_names, l2_norm

    size = l2_norm(delta)
    if size == 0:
        return delta
    pull = impersonate_delta(global_state, *target, payload * size, share)
    learnt = set(float_names(delta))
    sent = {k: np.asarray(v, np.float64) + pull[k] if k in learnt else v for k, v in delta.items()}
    scale = size / l2_norm(sent)
    return {k: v * scale if k in learnt else v for k, v in sent.items()}
