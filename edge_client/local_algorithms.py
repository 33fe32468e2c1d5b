"""The device's local algorithms: one `fit` each, chosen by name from the round's configuration.

Every one runs the same round (`edge_client.local_training.train_round` prepares it and takes the delta
after) and steps through the house's one loop (`models.training.loop.optimise`); what differs is the loss
and the update rule:
  - `supervised`: margin head + DFC branch by Adam [+ FedProx's mu/2 ||w - w_global||^2, Li et al. 2020];
  - `fedfr`: eq. 7 of Liu et al. (AAAI 2022), alpha_1 L_cos + alpha_2 L_con + alpha_3 L_BCE with the hard
    negatives of D_g in each batch, its terms composed in `edge_client.fedfr_objective`;
  - `hfmaml`: Hessian-free meta-learning steps over the supervised loss (eq. 1-3 of the HF-MAML paper,
    `models.training.hfmaml`);
  - `pfm`: FedFace's PFM (Algorithm 1, lines 6-10): SGD plus the global momentum (`models.maths.pfm`).
A new local algorithm is a function of `LocalRound` added to `LOCAL_ALGORITHMS`.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from edge_client.fedfr_objective import fedfr_step, terms_for
from edge_client.local_round import LocalRound
from models.faces import augment
from models.maths.pfm import apply_global_momentum
from models.training.hfmaml import hf_maml_step
from models.training.loop import optimise, train_epoch
from protocol.messages import TrainingConfig


def supervised(r: LocalRound) -> list[dict]:
    """FedAvg's and FedProx's local steps: Adam on the margin head's and the DFC branch's loss."""
    optimiser = r.adam()
    return [train_epoch(r.model, r.loader, optimiser, regulariser=r.regulariser, extra=r.extra)
            for _ in range(r.epochs)]


def fedfr(r: LocalRound) -> list[dict]:
    """FedFR's eq. 7, each batch joined by as many hard negatives as half its size."""
    optimiser = r.adam()
    return [_fedfr_epoch(r, optimiser) for _ in range(r.epochs)]


def _fedfr_epoch(r: LocalRound, optimiser: torch.optim.Optimizer) -> dict:
    """One pass of eq. 7 over the local data, its terms composed once for the round (`edge_client.fedfr_objective`):
    with a labelled D_g its people join as members of their own classes (balanced CosFace, eq. 3), else as negatives
    to every local class."""
    r.model.train()
    weak, terms = augment.build("weak"), terms_for(r)
    means = optimise(r.loader, lambda batch: fedfr_step(r, batch, weak, terms), optimiser).result()
    keys = ("train_loss", "cos_loss", "con_loss", "neg_loss", "train_acc")
    return {"total_loss": means.get("loss", 0.0), **{k: means.get(k, 0.0) for k in keys}}


def _batch_triples(loader):
    """Consecutive batches as HF-MAML's (D, D', D''); a device with fewer than three batches reuses its own."""
    group, produced = [], False
    for batch in loader:
        group.append(batch)
        if len(group) == 3:
            yield tuple(group)
            group, produced = [], True
    if group and not produced:
        yield tuple((group * 3)[:3])


def hfmaml(r: LocalRound) -> list[dict]:
    """HF-MAML (eq. 1-3): each step reads three batches and takes four gradients of the local loss (margin
    head, DFC, eq. 4's regulariser) over every trainable parameter; its update rule is the step itself."""
    return [_hfmaml_epoch(r) for _ in range(r.epochs)]


def _hfmaml_epoch(r: LocalRound) -> dict:
    model, objective = r.model, r.objective
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    seen_logits: list = []

    def loss_fn(batch):
        loss, logits, _ = model.losses(batch[0], batch[1], r.extra)
        seen_logits.append(logits)
        return loss

    loss_sum = correct = seen = 0
    for triple in _batch_triples(r.loader):
        seen_logits.clear()
        losses = hf_maml_step(loss_fn, params, triple, objective.maml_alpha, objective.maml_beta, objective.maml_delta)
        x, y = triple[0]
        loss_sum += losses["inner_loss"] * len(y)
        correct += int((seen_logits[0].argmax(1) == y).sum())
        seen += len(y)
    return {"train_loss": loss_sum / max(seen, 1), "train_acc": correct / max(seen, 1)}


def pfm(r: LocalRound) -> list[dict]:
    """PFM's local steps: SGD on the backbone plus beta * M / K per step (eq. 3), classical momentum SGD on the
    classifier and the DFC branch (eq. 1-2)."""
    model = r.model
    backbone = dict(model.backbone.named_parameters())
    others = [p for n, p in model.named_parameters() if not n.startswith("backbone.")]
    optimiser = torch.optim.SGD([{"params": list(backbone.values())}, {"params": others, "momentum": r.pfm_beta}],
                                lr=r.lr)
    steps = r.epochs * len(r.loader)
    momentum = r.pfm_momentum or {}
    local_momentum = {n: momentum[f"backbone.{n}"] for n in backbone if f"backbone.{n}" in momentum}
    push = lambda: apply_global_momentum(backbone, local_momentum, r.lr, r.pfm_beta, steps)  # noqa: E731
    return [train_epoch(model, r.loader, optimiser, regulariser=r.regulariser, extra=r.extra, after_step=push)
            for _ in range(r.epochs)]


LOCAL_ALGORITHMS: dict[str, Callable[[LocalRound], list[dict]]] = {
    "supervised": supervised, "fedfr": fedfr, "hfmaml": hfmaml, "pfm": pfm}


def local_algorithm(objective: TrainingConfig, pfm: bool) -> str:
    """The local algorithm a round's settings ask for: PFM's steps when the federation aggregates with PFM, else
    HF-MAML's, FedFR's objective (any of its terms on, or a weighted CosFace loss), or the supervised steps
    (FedAvg, FedAvgM, FedProx)."""
    if pfm:
        return "pfm"
    if objective.hfmaml:
        return "hfmaml"
    fedfr = objective.hard_negatives or objective.contrastive or objective.alpha_cos != 1.0
    return "fedfr" if fedfr else "supervised"
