"""One round of local training on a device, as a function: global backbone in, backbone delta out.

FedAvg/FedProx: loss = margin head (local classifier) + alpha_3 * DFC branch [+ mu/2 ||w - w_global||^2]
[+ C (1 - cos(f_global(x), f_local(x))), eq. 4 of the HF-MAML paper]. HF-MAML replaces the Adam steps by
Hessian-free meta-learning steps over the same loss (`models.hfmaml`).
FedFR (eq. 7 of Liu et al., AAAI 2022): alpha_1 L_cos + alpha_2 L_con + alpha_3 L_BCE, with the hard
negatives of the device's public set D_g in the batch (a margin term against the local classes and
negatives for the DFC classifiers), and the contrastive term against the global and the previous
local model (`models.fedfr`). After the epochs the DFC branch is fitted on frozen features
(`models.dfc.fit_dfc`). Each round the local classifier's centres are first imprinted from the
received model's features (`models.heads.imprint`): a stale or random head would scramble the
embedding before it learns anything (measured: per-client TAR@1e-2 of the local backbone 0.597
with a random head, 0.693 imprinted, against 0.671 for the global model, two CelebA clients).
Only `Theta_local - Theta_global` is returned for sending; the head, the DFC branch, and everything
about D_g stay on the device (`private_metrics` are never sent).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from models.dfc import NEGATIVE, fit_dfc
from models.face_model import FaceModel, load_shareable_state, shareable_state
from models.faces import augment
from models.faces.crops import FaceCrops
from models.fast_step import accelerate
from models.fedfr import contrastive_loss, hard_negatives, negative_margin_loss
from models.heads import CosineHead, class_centres, imprint
from models.hfmaml import anchored_to, hf_maml_step
from models.pfm import apply_global_momentum
from models.public_set import PublicSet
from models.training import TrainConfig, as_chw, frozen_copy, frozen_features, train_epoch, train_loader


@dataclass
class LocalObjective:
    """The round configuration's local-objective settings (protocol.messages.TrainingConfig)."""

    alpha_cos: float = 1.0
    hard_negatives: bool = False
    t_hn: float = 0.4
    contrastive: bool = False
    alpha_con: float = 5.0
    tau: float = 0.5
    dfc_steps: int = 300
    dfc_lr: float = 1e-2
    dfc_views: int = 2
    imprint_head: bool = True
    hfmaml: bool = False          # HF-MAML local steps (models.hfmaml, eq. 1-3) instead of Adam steps
    maml_alpha: float = 0.01
    maml_beta: float = 0.01
    maml_delta: float = 1e-3
    embedding_reg: float = 0.0    # C of eq. 4: pull the local embedding toward the round's global one

    @classmethod
    def from_config(cls, config) -> LocalObjective:
        return cls(**{k: getattr(config, k) for k in cls.__dataclass_fields__})

    @property
    def fedfr_loop(self) -> bool:
        return self.hard_negatives or self.contrastive or self.alpha_cos != 1.0


@dataclass
class LocalResult:
    delta: dict[str, np.ndarray]
    n_samples: int
    metrics: dict[str, float]
    private_metrics: dict[str, float] = field(default_factory=dict)  # about D_g: logged on the device only


def proximal_term(model: FaceModel, anchor: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum ||w - w_global||^2 over the backbone's trainable parameters (FedProx, Li et al. 2020)."""
    return sum(((p - anchor[n]) ** 2).sum() for n, p in model.backbone.named_parameters())


@dataclass
class HardNegatives:
    """This round's sample of D_g: images (NCHW uint8) and, for a labelled D_g, each image's class among
    the sampled public people and those people's centres (learnable for this round, then dropped)."""

    images: torch.Tensor
    labels: torch.Tensor | None = None
    centres: torch.nn.Parameter | None = None

    def __len__(self) -> int:
        return len(self.images)


def sample_hard_negatives(backbone: torch.nn.Module, public: PublicSet, local_features: torch.Tensor,
                          t_hn: float, seed: int, labelled_classes: bool) -> HardNegatives:
    """FedFR's HN sampling under the received model; with identity labels, the sampled people's centres
    are imprinted from all their public images, so they join the classification (eq. 3)."""
    public_features = frozen_features(backbone, public.images, seed=seed)
    chosen = hard_negatives(public_features, local_features, t_hn)
    sample = HardNegatives(as_chw(public.images[chosen.numpy()]))
    if labelled_classes and public.labels is not None and len(chosen):
        classes, index = np.unique(public.labels[chosen.numpy()], return_inverse=True)
        of_sampled = np.isin(public.labels, classes)
        centres, _ = class_centres(public_features[torch.from_numpy(of_sampled)],
                                   torch.from_numpy(np.searchsorted(classes, public.labels[of_sampled])), len(classes))
        sample.labels = torch.from_numpy(index.reshape(-1)).long()
        sample.centres = torch.nn.Parameter(centres)
    return sample


def _fedfr_epoch(model: FaceModel, loader, optimiser: torch.optim.Optimizer, objective: LocalObjective,
                 negatives: HardNegatives | None, global_net, previous_net, generator: torch.Generator,
                 regulariser=None) -> dict:
    """One pass of eq. 7 over the local data, each batch joined by as many hard negatives as half its size:
    with a labelled D_g as members of their own classes (balanced CosFace, eq. 3), else as negatives to
    every local class (`negative_margin_loss`)."""
    model.train()
    weak = augment.build("weak")
    sums = {"train_loss": 0.0, "total_loss": 0.0, "cos_loss": 0.0, "con_loss": 0.0, "neg_loss": 0.0}
    correct = seen = 0
    n_local = model.head.weight.shape[0] if hasattr(model.head, "weight") else 0
    for x, y in loader:
        n_pub = 0 if negatives is None or len(negatives) == 0 else max(1, len(y) // 2)
        if n_pub:
            pick = torch.randint(0, len(negatives), (n_pub,), generator=generator)
            x = torch.cat([x, torch.stack([weak(im) for im in negatives.images[pick]])])
        features = model.backbone(x)
        f, f_pub = features[:len(y)], features[len(y):]
        if n_pub and negatives.centres is not None:
            labels = torch.cat([y, negatives.labels[pick] + n_local])
            weight = torch.ones(len(labels)) if model.class_weights is None else \
                torch.cat([model.class_weights, torch.ones(len(negatives.centres))])[labels]
            per_row = F.cross_entropy(model.head(features, labels, extra=negatives.centres), labels,
                                      reduction="none") * weight
            cos_loss = per_row.sum() / weight.sum()
            local_cos = per_row[:len(y)].sum() / weight[:len(y)].sum()  # the figure that may be sent
        else:
            cos_loss = local_cos = F.cross_entropy(model.head(f, y), y, weight=model.class_weights)
        loss = objective.alpha_cos * cos_loss
        local_loss = objective.alpha_cos * local_cos.detach()
        if n_pub and negatives.centres is None and hasattr(model.head, "weight"):
            neg_loss = negative_margin_loss(f_pub, model.head.weight, objective.t_hn)
            loss = loss + objective.alpha_cos * neg_loss
            sums["neg_loss"] += float(neg_loss.detach()) * len(y)
        if objective.contrastive:
            with torch.no_grad():
                f_global, f_previous = global_net(x[:len(y)]), previous_net(x[:len(y)])
            con_loss = contrastive_loss(f, f_global, f_previous, objective.tau)
            loss = loss + objective.alpha_con * con_loss
            local_loss = local_loss + objective.alpha_con * con_loss.detach()
            sums["con_loss"] += float(con_loss.detach()) * len(y)
        if model.dfc is not None:
            labels = torch.cat([y, torch.full((n_pub,), NEGATIVE, dtype=y.dtype)])
            loss = loss + model.config.dfc_weight * model.dfc.loss(features, labels)
        if regulariser is not None:
            loss = loss + regulariser()
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        sums["total_loss"] += float(loss.detach()) * len(y)
        sums["train_loss"] += float(local_loss) * len(y)  # local images' terms only: nothing about D_g
        sums["cos_loss"] += float(local_cos.detach()) * len(y)
        with torch.no_grad():
            correct += int((model.head.logits(f).argmax(1) == y).sum())
        seen += len(y)
    return {**{k: v / max(seen, 1) for k, v in sums.items()}, "train_acc": correct / max(seen, 1)}


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


def _hfmaml_epoch(model: FaceModel, loader, objective: LocalObjective, extra) -> dict:
    """One pass of HF-MAML over the local data (eq. 1-3): each step reads three batches and takes four
    gradients of the local loss (margin head, DFC, eq. 4's regulariser) over every trainable parameter."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    seen_logits: list = []

    def loss_fn(batch):
        loss, logits, _ = model.losses(batch[0], batch[1], extra)
        seen_logits.append(logits)
        return loss

    loss_sum = correct = seen = 0
    for triple in _batch_triples(loader):
        seen_logits.clear()
        losses = hf_maml_step(loss_fn, params, triple, objective.maml_alpha, objective.maml_beta, objective.maml_delta)
        x, y = triple[0]
        loss_sum += losses["inner_loss"] * len(y)
        correct += int((seen_logits[0].argmax(1) == y).sum())
        seen += len(y)
    return {"train_loss": loss_sum / max(seen, 1), "train_acc": correct / max(seen, 1)}


def _pfm_epochs(model: FaceModel, loader, epochs: int, lr: float, beta: float, momentum: dict[str, torch.Tensor],
                regulariser, extra) -> list[dict]:
    """PFM's local steps (Algorithm 1, lines 6-10): SGD on the backbone plus beta * M / K per step (eq. 3),
    classical momentum SGD on the classifier and the DFC branch (eq. 1-2)."""
    backbone = dict(model.backbone.named_parameters())
    others = [p for n, p in model.named_parameters() if not n.startswith("backbone.")]
    optimiser = torch.optim.SGD([{"params": list(backbone.values())}, {"params": others, "momentum": beta}], lr=lr)
    steps = epochs * len(loader)
    local_momentum = {n: momentum[f"backbone.{n}"] for n in backbone if f"backbone.{n}" in momentum}
    push = lambda: apply_global_momentum(backbone, local_momentum, lr, beta, steps)  # noqa: E731
    return [train_epoch(model, loader, optimiser, regulariser=regulariser, extra=extra, after_step=push)
            for _ in range(epochs)]


def train_round(model: FaceModel, crops: FaceCrops, global_state: dict[str, torch.Tensor], epochs: int,
                batch_size: int, lr: float, prox_mu: float = 0.0, seed: int = 0,
                objective: LocalObjective | None = None, public: PublicSet | None = None,
                previous_state: dict[str, torch.Tensor] | None = None, pfm_beta: float | None = None,
                pfm_momentum: dict[str, torch.Tensor] | None = None) -> LocalResult:
    """Train on the device's crops from the global backbone. `public` is D_g;
    `previous_state` the device's last local backbone (keys `backbone.*`), for the contrastive term.
    With `pfm_beta`, FedFace's PFM: plain SGD at `lr` for the backbone plus the global momentum
    `pfm_momentum` (keys `backbone.*`; None in the first round) spread over the round's steps, and classical
    momentum SGD for the classifier (`models.pfm`)."""
    objective = objective or LocalObjective()
    # the trunk in bf16 where the CPU has it (models.fast_step); HF-MAML's finite-difference Hessian products
    # (eq. 3) take the difference of two nearby gradients, which bf16 would drown, so it stays fp32
    accelerate(model, "fp32" if objective.hfmaml else "auto")
    load_shareable_state(model, global_state)
    start = {k: v.clone() for k, v in shareable_state(model).items()}
    anchor = {n: p.detach().clone() for n, p in model.backbone.named_parameters()}
    use_public = objective.hard_negatives and public is not None and len(public) > 0
    local_features = None
    if objective.imprint_head or use_public:
        local_features = frozen_features(model.backbone, crops.images, seed=seed)
    if objective.imprint_head:  # the head's centres from the received model, not last round's backbone
        imprint(model.head, local_features, torch.from_numpy(crops.labels))
    private: dict[str, float] = {}
    negatives = None
    if use_public:
        negatives = sample_hard_negatives(model.backbone, public, local_features, objective.t_hn, seed,
                                          isinstance(model.head, CosineHead))
        private.update({"hn_fraction": len(negatives) / len(public), "hn_sampled": float(len(negatives))})
        if negatives.centres is not None:
            private["hn_classes"] = float(len(negatives.centres))
    extra = [negatives.centres] if negatives is not None and negatives.centres is not None else []
    optimiser = torch.optim.Adam(list(model.parameters()) + extra, lr=lr)
    generator = torch.Generator().manual_seed(seed)
    loader = train_loader(crops, TrainConfig(batch_size=batch_size, aug="weak"), generator)
    regulariser = (lambda: prox_mu / 2.0 * proximal_term(model, anchor)) if prox_mu > 0 else None
    extra = None
    if objective.embedding_reg > 0:  # eq. 4 against the round's starting model
        extra = anchored_to(frozen_copy(model.backbone), objective.embedding_reg)
    if pfm_beta is not None:
        history = _pfm_epochs(model, loader, epochs, lr, pfm_beta, pfm_momentum or {}, regulariser, extra)
    elif objective.hfmaml:
        history = [_hfmaml_epoch(model, loader, objective, extra) for _ in range(epochs)]
    elif objective.fedfr_loop:
        global_net = frozen_copy(model.backbone) if objective.contrastive else None
        previous_net = frozen_copy(model.backbone, previous_state) if objective.contrastive else None
        history = [_fedfr_epoch(model, loader, optimiser, objective, negatives, global_net, previous_net, generator,
                                regulariser) for _ in range(epochs)]
    else:
        history = [train_epoch(model, loader, optimiser, regulariser=regulariser, extra=extra) for _ in range(epochs)]
    metrics = dict(history[-1])
    for key in ("neg_loss", "total_loss"):  # figures that involve D_g: the device's log only
        if key in metrics:
            private[key] = metrics.pop(key)
    if model.dfc is not None and objective.dfc_steps > 0:
        features = frozen_features(model.backbone, crops.images, objective.dfc_views, seed)
        labels = torch.from_numpy(np.tile(crops.labels, objective.dfc_views)).long()
        if negatives is not None and len(negatives):
            public_features = frozen_features(model.backbone, negatives.images.permute(0, 2, 3, 1).numpy(), seed=seed)
            features = torch.cat([features, public_features])
            labels = torch.cat([labels, torch.full((len(public_features),), NEGATIVE)])
        fit_loss = fit_dfc(model.dfc, features, labels, objective.dfc_steps, objective.dfc_lr, seed=seed)
        (private if negatives is not None else metrics)["dfc_fit_loss"] = fit_loss
    model.eval()
    end = shareable_state(model)
    delta = {k: (end[k].double() - start[k].double()).numpy() if end[k].is_floating_point()
             else (end[k] - start[k]).numpy() for k in end}  # integer buffers keep an integer delta
    return LocalResult(delta, len(crops), metrics, private)
