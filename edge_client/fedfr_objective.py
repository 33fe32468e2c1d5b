"""FedFR's local objective as terms that compose (Liu et al., AAAI 2022, eq. 7):

    L = alpha_1 L_cos + alpha_2 L_con + alpha_3 L_BCE

plus, for an unlabelled public set D_g, the margin that keeps its hard negatives away from the local class centres
(`models.training.fedfr.negative_margin_loss`), and FedProx's proximal term when the round asks for it.

Every term reads one step's shared batch (the local images with D_g's sampled hard negatives joined to them, one
backbone pass over both) and returns what it adds to the loss, what it adds to the loss figure a device may send
(the local images' terms only: nothing about D_g leaves the device) and its metrics. A round composes the terms its
settings turn on once (`terms_for`); a new term is one function here, as insightface's CombinedMarginLoss composes
margins, not an `if` in the step.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from edge_client.local_round import LocalRound
from models.networks.dfc import NEGATIVE
from models.training.fedfr import contrastive_loss, negative_margin_loss
from models.training.loop import Step


@dataclass
class JoinedBatch:
    """One step's images: the device's (`y` their labels) then `n_pub` of D_g's (`pick`: which), embedded once."""

    x: torch.Tensor
    y: torch.Tensor
    features: torch.Tensor
    n_pub: int
    pick: torch.Tensor | None

    @property
    def local(self) -> torch.Tensor:
        return self.features[:len(self.y)]

    @property
    def public(self) -> torch.Tensor:
        return self.features[len(self.y):]


@dataclass
class Part:
    loss: torch.Tensor
    sent: torch.Tensor | None = None  # its share of the loss figure a device may send (local images only), detached
    metrics: dict[str, float] = field(default_factory=dict)


Term = Callable[[LocalRound, JoinedBatch], Part | None]


def margin(r: LocalRound, b: JoinedBatch) -> Part:
    """alpha_1 L_cos (eq. 3): with a labelled D_g its people join as members of their own classes (balanced
    CosFace), else the local classes alone."""
    model, negatives, y = r.model, r.negatives, b.y
    if b.n_pub and negatives.centres is not None:
        labels = torch.cat([y, negatives.labels[b.pick] + model.head.n_classes])
        weight = torch.ones(len(labels)) if model.class_weights is None else \
            torch.cat([model.class_weights, torch.ones(len(negatives.centres))])[labels]
        per_row = F.cross_entropy(model.head(b.features, labels, extra=negatives.centres), labels,
                                  reduction="none") * weight
        cos_loss = per_row.sum() / weight.sum()
        local_cos = per_row[:len(y)].sum() / weight[:len(y)].sum()  # the figure that may be sent
    else:
        cos_loss = local_cos = F.cross_entropy(model.head(b.local, y), y, weight=model.class_weights)
    alpha = r.objective.method.alpha_cos
    return Part(alpha * cos_loss, alpha * local_cos.detach(), {"cos_loss": float(local_cos.detach())})


def negative_margin(r: LocalRound, b: JoinedBatch) -> Part | None:
    """An unlabelled D_g's hard negatives kept under t_HN from every local class centre (weighted as L_cos)."""
    if not b.n_pub or r.model.head.centres is None:
        return None
    neg_loss = negative_margin_loss(b.public, r.model.head.centres, r.objective.method.t_hn)
    return Part(r.objective.method.alpha_cos * neg_loss, metrics={"neg_loss": float(neg_loss.detach())})


def contrastive(r: LocalRound, b: JoinedBatch) -> Part:
    """alpha_2 L_con (eq. 5): towards the global model's feature of each local image, away from the previous local
    model's."""
    with torch.no_grad():
        local_images = b.x[:len(b.y)]
        f_global, f_previous = r.global_net(local_images), r.previous_net(local_images)
    con_loss = contrastive_loss(b.local, f_global, f_previous, r.objective.method.tau)
    alpha = r.objective.method.alpha_con
    return Part(alpha * con_loss, alpha * con_loss.detach(), {"con_loss": float(con_loss.detach())})


def dfc(r: LocalRound, b: JoinedBatch) -> Part:
    """alpha_3 L_BCE: the DFC branch's classifiers, D_g's faces a negative for every one."""
    labels = torch.cat([b.y, torch.full((b.n_pub,), NEGATIVE, dtype=b.y.dtype)])
    return Part(r.model.dfc_term(b.features, labels))


def proximal(r: LocalRound, b: JoinedBatch) -> Part:
    """FedProx's mu/2 ||w - w_global||^2 (or eq. 4's regulariser), as the round prepared it."""
    return Part(r.regulariser())


def terms_for(r: LocalRound) -> list[Term]:
    """The terms this round's settings turn on, in the order they are added."""
    terms: list[Term] = [margin]
    if r.negatives is not None and r.negatives.centres is None:
        terms.append(negative_margin)
    if r.objective.method.uses_previous_local():
        terms.append(contrastive)
    if r.model.dfc is not None:
        terms.append(dfc)
    if r.regulariser is not None:
        terms.append(proximal)
    return terms


def joined_batch(r: LocalRound, batch, weak) -> JoinedBatch:
    """The local batch with as many of D_g's sampled hard negatives as half its size (weakly augmented)."""
    x, y = batch
    negatives = r.negatives
    n_pub = 0 if negatives is None or len(negatives) == 0 else max(1, len(y) // 2)
    pick = None
    if n_pub:
        pick = torch.randint(0, len(negatives), (n_pub,), generator=r.generator)
        x = torch.cat([x, torch.stack([weak(im) for im in negatives.images[pick]])])
    return JoinedBatch(x, y, r.model.backbone(x), n_pub, pick)


def fedfr_step(r: LocalRound, batch, weak, terms: list[Term]) -> Step:
    """One step of eq. 7: the terms' sum; the figure that may be sent counts the local images' terms alone."""
    b = joined_batch(r, batch, weak)
    parts = [part for term in terms if (part := term(r, b)) is not None]
    metrics = {"con_loss": 0.0, "neg_loss": 0.0}
    for part in parts:
        metrics.update(part.metrics)
    with torch.no_grad():
        metrics["train_acc"] = float((r.model.head.logits(b.local).argmax(1) == b.y).float().mean())
    metrics["train_loss"] = float(sum(part.sent for part in parts if part.sent is not None))
    return Step(sum(part.loss for part in parts), len(b.y), metrics)
