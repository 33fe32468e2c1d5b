"""The device's local algorithms: one `fit` each, chosen by name from the round's configuration.

Every one runs the same round (`edge_client.local_training.train_round` prepares it and takes the delta
after) and steps through the house's one loop (`models.training.loop.optimise`); what differs is the loss
and the update rule:
  - `supervised`: margin head + DFC branch by Adam [+ FedProx's mu/2 ||w - w_global||^2, Li et al. 2020];
  - `fedfr`: eq. 7 of Liu et al. (AAAI 2022), alpha_1 L_cos + alpha_2 L_con + alpha_3 L_BCE with the hard
    negatives of D_g in each batch (`models.training.fedfr`);
  - `hfmaml`: Hessian-free meta-learning steps over the supervised loss (eq. 1-3 of the HF-MAML paper,
    `models.training.hfmaml`);
  - `pfm`: FedFace's PFM (Algorithm 1, lines 6-10): SGD plus the global momentum (`models.maths.pfm`).
A new local algorithm is a function of `LocalRound` added to `LOCAL_ALGORITHMS`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.faces import augment
from models.maths.pfm import apply_global_momentum
from models.networks.dfc import NEGATIVE
from models.networks.face_model import FaceModel
from models.training.fedfr import contrastive_loss, negative_margin_loss
from models.training.hfmaml import hf_maml_step
from models.training.loop import Step, optimise, train_epoch
from protocol.messages import TrainingConfig


@dataclass
class LocalRound:
    """What a local algorithm gets: the model loaded with the global backbone, the round's batches and
    settings, and the terms the round prepared (FedProx's regulariser, eq. 4's embedding anchor, D_g's
    sampled hard negatives, the frozen global and previous local backbones)."""

    model: FaceModel
    loader: torch.utils.data.DataLoader
    epochs: int
    lr: float
    objective: TrainingConfig  # the round's announced settings: the local objective's terms and weights
    generator: torch.Generator
    regulariser: Callable[[], torch.Tensor] | None = None
    extra: Callable | None = None
    negatives: object | None = None  # edge_client.local_training.HardNegatives
    global_net: torch.nn.Module | None = None
    previous_net: torch.nn.Module | None = None
    pfm_beta: float = 0.9
    pfm_momentum: dict[str, torch.Tensor] | None = None

    def adam(self) -> torch.optim.Optimizer:
        """Adam over the model and, with a labelled D_g, the sampled public people's centres."""
        centres = getattr(self.negatives, "centres", None)
        return torch.optim.Adam(list(self.model.parameters()) + ([centres] if centres is not None else []), lr=self.lr)


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
    """One pass of eq. 7 over the local data: with a labelled D_g its people join as members of their own
    classes (balanced CosFace, eq. 3), else as negatives to every local class (`negative_margin_loss`)."""
    r.model.train()
    weak = augment.build("weak")
    means = optimise(r.loader, lambda batch: _fedfr_step(r, batch, weak), optimiser).result()
    keys = ("train_loss", "cos_loss", "con_loss", "neg_loss", "train_acc")
    return {"total_loss": means.get("loss", 0.0), **{k: means.get(k, 0.0) for k in keys}}


def _fedfr_step(r: LocalRound, batch, weak) -> Step:
    model, objective, negatives = r.model, r.objective, r.negatives
    x, y = batch
    n_pub = 0 if negatives is None or len(negatives) == 0 else max(1, len(y) // 2)
    if n_pub:
        pick = torch.randint(0, len(negatives), (n_pub,), generator=r.generator)
        x = torch.cat([x, torch.stack([weak(im) for im in negatives.images[pick]])])
    features = model.backbone(x)
    f, f_pub = features[:len(y)], features[len(y):]
    if n_pub and negatives.centres is not None:
        labels = torch.cat([y, negatives.labels[pick] + model.head.n_classes])
        weight = torch.ones(len(labels)) if model.class_weights is None else \
            torch.cat([model.class_weights, torch.ones(len(negatives.centres))])[labels]
        per_row = F.cross_entropy(model.head(features, labels, extra=negatives.centres), labels,
                                  reduction="none") * weight
        cos_loss = per_row.sum() / weight.sum()
        local_cos = per_row[:len(y)].sum() / weight[:len(y)].sum()  # the figure that may be sent
    else:
        cos_loss = local_cos = F.cross_entropy(model.head(f, y), y, weight=model.class_weights)
    loss, local_loss = objective.alpha_cos * cos_loss, objective.alpha_cos * local_cos.detach()
    metrics = {"cos_loss": float(local_cos.detach()), "con_loss": 0.0, "neg_loss": 0.0}
    if n_pub and negatives.centres is None and model.head.centres is not None:
        neg_loss = negative_margin_loss(f_pub, model.head.centres, objective.t_hn)
        loss = loss + objective.alpha_cos * neg_loss
        metrics["neg_loss"] = float(neg_loss.detach())
    if objective.contrastive:
        with torch.no_grad():
            f_global, f_previous = r.global_net(x[:len(y)]), r.previous_net(x[:len(y)])
        con_loss = contrastive_loss(f, f_global, f_previous, objective.tau)
        loss = loss + objective.alpha_con * con_loss
        local_loss = local_loss + objective.alpha_con * con_loss.detach()
        metrics["con_loss"] = float(con_loss.detach())
    if model.dfc is not None:
        labels = torch.cat([y, torch.full((n_pub,), NEGATIVE, dtype=y.dtype)])
        loss = loss + model.config.dfc_weight * model.dfc.loss(features, labels)
    if r.regulariser is not None:
        loss = loss + r.regulariser()
    with torch.no_grad():
        metrics["train_acc"] = float((model.head.logits(f).argmax(1) == y).float().mean())
    metrics["train_loss"] = float(local_loss)  # local images' terms only: nothing about D_g
    return Step(loss, len(y), metrics)


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
