"""Classification heads that train the embedding: softmax, CosFace and ArcFace.

Heads stay on the device; only the embedder is shared. Every head has one interface: `forward(embedding, label,
extra=None)` gives logits with its margin applied (`extra`: more class centres appended, FedFR's public classes),
`logits(embedding)` margin-free scores for accuracy, `n_classes`, and `centres` (the unit class centres, or None for
a head that has none), so callers never probe a head for what it holds.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

HEADS = ("cosface", "arcface", "softmax")


class SoftmaxHead(nn.Module):
    centres = None  # a linear layer: no class centres on the sphere

    def __init__(self, dim: int, n_classes: int):
        super().__init__()
        self.fc = nn.Linear(dim, n_classes)

    @property
    def n_classes(self) -> int:
        return self.fc.out_features

    def logits(self, emb: torch.Tensor) -> torch.Tensor:
        return self.fc(emb)

    def forward(self, emb: torch.Tensor, labels: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        if extra is not None:
            raise ValueError("a softmax head has no class centres to append public classes to (use cosface or "
                             "arcface)")
        return self.fc(emb)


class CosineHead(nn.Module):
    """Class centres on the unit sphere; logits are s * cos(angle to each centre)."""

    def __init__(self, dim: int, n_classes: int, s: float, m: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_classes, dim))
        nn.init.xavier_uniform_(self.weight)
        self.s, self.m = s, m

    @property
    def n_classes(self) -> int:
        return self.weight.shape[0]

    @property
    def centres(self) -> torch.Tensor:
        """The class centres (unnormalised parameters; `cosine` normalises them)."""
        return self.weight

    def cosine(self, emb: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """cos to each centre; `extra` centres (FedFR's public classes) are appended after the head's own."""
        weight = self.weight if extra is None else torch.cat([self.weight, extra.to(self.weight.dtype)])
        return F.linear(F.normalize(emb, dim=1), F.normalize(weight, dim=1)).clamp(-1.0, 1.0)

    def logits(self, emb: torch.Tensor) -> torch.Tensor:
        return self.s * self.cosine(emb)


class CosFaceHead(CosineHead):
    """CosFace (Wang et al., CVPR 2018): s * (cos(theta_y) - m) for the true class."""

    def __init__(self, dim: int, n_classes: int, s: float = 30.0, m: float = 0.35):
        super().__init__(dim, n_classes, s, m)

    def forward(self, emb: torch.Tensor, labels: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        cos = self.cosine(emb, extra)
        return self.s * (cos - self.m * F.one_hot(labels, cos.shape[1]).to(cos.dtype))


class ArcFaceHead(CosineHead):
    """ArcFace (Deng et al., CVPR 2019): s * cos(theta_y + m), linearised past pi - m."""

    def __init__(self, dim: int, n_classes: int, s: float = 30.0, m: float = 0.5):
        super().__init__(dim, n_classes, s, m)

    def forward(self, emb: torch.Tensor, labels: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        cos = self.cosine(emb, extra)
        sin = torch.sqrt((1.0 - cos * cos).clamp_min(1e-7))
        with_margin = cos * math.cos(self.m) - sin * math.sin(self.m)
        # past theta = pi - m, cos(theta + m) stops decreasing; use CosFace-style fallback there
        with_margin = torch.where(cos > math.cos(math.pi - self.m), with_margin,
                                  cos - math.sin(math.pi - self.m) * self.m)
        one_hot = F.one_hot(labels, cos.shape[1]).bool()
        return self.s * torch.where(one_hot, with_margin, cos)


def build_head(name: str, dim: int, n_classes: int, s: float | None = None, m: float | None = None) -> nn.Module:
    if name == "softmax":
        return SoftmaxHead(dim, n_classes)
    cls = {"cosface": CosFaceHead, "arcface": ArcFaceHead}.get(name)
    if cls is None:
        raise ValueError(f"unknown head {name!r}; choose one of {', '.join(HEADS)}")
    kwargs = {k: v for k, v in (("s", s), ("m", m)) if v is not None}
    return cls(dim, n_classes, **kwargs)


@torch.no_grad()
def imprint(head: nn.Module, features: torch.Tensor, labels: torch.Tensor) -> bool:
    """Set each class centre to the normalised mean of its normalised features (weight imprinting,
    Qi et al., CVPR 2018). A random head's first gradients scramble a pretrained embedding; centres
    imprinted from that embedding start the margin loss where the features already are. Classes
    without features keep their centres. Returns False for heads without class centres (softmax)."""
    if head.centres is None or len(features) == 0:
        return False
    centres, present = class_centres(features, labels, head.n_classes)
    head.weight[present] = centres[present].to(head.weight.dtype)
    return True


@torch.no_grad()
def class_centres(features: torch.Tensor, labels: torch.Tensor, n_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_classes x dim unit centres: the normalised mean of each class's normalised features,
    which classes had any features)."""
    sums = torch.zeros(n_classes, features.shape[1]).index_add_(0, labels.long(), F.normalize(features.float(), dim=1))
    present = torch.bincount(labels.long(), minlength=n_classes) > 0
    return F.normalize(sums, dim=1), present


def inverse_frequency_weights(labels: torch.Tensor, n_classes: int) -> torch.Tensor:
    """Class weights n / (K * count_k), so rare identities count as much as common ones."""
    counts = torch.bincount(labels, minlength=n_classes).float()
    weights = labels.numel() / (n_classes * counts.clamp_min(1.0))
    return torch.where(counts > 0, weights, torch.zeros_like(weights))
