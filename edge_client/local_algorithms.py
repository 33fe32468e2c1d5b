"""The device's local algorithms: one `fit` each, looked up by the name of the round's method (`protocol.methods`).

Every one runs the same round (`edge_client.local_training.train_round` prepares it and takes the delta
after) and steps through the house's one loop (`models.training.loop.optimise`); what differs is the loss
and the update rule:
  - `supervised`: margin head + DFC branch by Adam [+ FedProx's mu/2 ||w - w_global||^2, Li et al. 2020];
  - `fedfr`: eq. 7 of Liu et al. (AAAI 2022), alpha_1 L_cos + alpha_2 L_con + alpha_3 L_BCE with the hard
    negatives of D_g in each batch, its terms composed in `edge_client.fedfr_objective`;
  - `hfmaml`: Hessian-free meta-learning steps over the supervised loss (eq. 1-3 of the HF-MAML paper,
    `models.training.hfmaml`);
  - `pfm`: FedFace's PFM (Algorithm 1, lines 6-10): SGD plus the global momentum (`models.maths.pfm`).
A new method's steps are a function of `LocalRound` (its settings are `r.objective.method`), entered in
`LOCAL_ALGORITHMS` under the method's name.
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


def supervised(r: LocalRound) -> list[dict]:
    """FedAvg's and FedProx's local steps: Adam on the margin head's and the DFC branch's loss."""
    optimiser = r.adam()
    return [train_epoch(r.model, r.loader, optimiser, regulariser=r.regulariser, extra=r.extra)
            for _ in range(r.epochs)]


def fedfr(r: LocalRound) -> list[dict]:
    """FedFR's eq. 7, each batch joined by as many hard negatives as half its size; with none of its terms on (an
    ablation's baseline row), FedAvg's steps."""
    if r.objective.method.plain():
        return supervised(r)
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
    model, method = r.model, r.objective.method
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
        losses = hf_maml_step(loss_fn, params, triple, method.maml_alpha, method.maml_beta, method.maml_delta)
        x, y = triple[0]
        loss_sum += losses["inner_loss"] * len(y)
        correct += int((seen_logits[0].argmax(1) == y).sum())
        seen += len(y)
    return {"train_loss": loss_sum / max(seen, 1), "train_acc": correct / max(seen, 1)}


def pfm(r: LocalRound) -> list[dict]:
    """PFM's local steps: SGD on the backbone plus beta * M / K per step (eq. 3), classical momentum SGD on the
    classifier and the DFC branch (eq. 1-2)."""
    model, beta = r.model, r.objective.method.pfm_beta
    backbone = dict(model.backbone.named_parameters())
    others = [p for n, p in model.named_parameters() if not n.startswith("backbone.")]
    optimiser = torch.optim.SGD([{"params": list(backbone.values())}, {"params": others, "momentum": beta}],
                                lr=r.lr)
    steps = r.epochs * len(r.loader)
    momentum = r.pfm_momentum or {}
    local_momentum = {n: momentum[f"backbone.{n}"] for n in backbone if f"backbone.{n}" in momentum}
    push = lambda: apply_global_momentum(backbone, local_momentum, r.lr, beta, steps)  # noqa: E731
    return [train_epoch(model, r.loader, optimiser, regulariser=r.regulariser, extra=r.extra, after_step=push)
            for _ in range(r.epochs)]


# the local steps of each method, by its name (protocol.methods.METHODS: every name has an entry)
LOCAL_ALGORITHMS: dict[str, Callable[[LocalRound], list[dict]]] = {
    "fedavg": supervised, "fedprox": supervised, "fedavgm": supervised, "pfm": pfm, "fedface": pfm, "fedfr": fedfr,
    "hfmaml": hfmaml}
