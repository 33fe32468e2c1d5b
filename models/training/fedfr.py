"""FedFR's local regularisers (Liu, Huang, Kao, Lin; "FedFR: Joint Optimization Federated Framework
for Generic and Personalized Face Recognition", AAAI 2022; `../shared/papers/001_281c2f73288a1b67.txt`).

Pure functions over feature tensors; the training loop that combines them is
`edge_client.local_training`. The public set D_g they use stays on the device: nothing computed
here is ever sent.

- Hard-negative sampling (sec. "Hard Negative Sampling Strategy"): keep the public faces whose
  cosine to any local face, under the round's global model, exceeds t_HN (the pretraining CosFace
  margin, 0.4).
- Contrastive regularisation (eq. 5, after MOON): pull the local feature toward the global model's
  feature of the same image, push it from the previous local model's.
- A margin term for unlabelled public faces: a hard negative should not come closer than t_HN to any
  local class proxy (the same threshold that made it hard).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

T_HN = 0.4        # the CosFace margin m of the pretraining (paper: t_HN = m)
TAU = 0.5         # temperature of eq. 5 (paper)
ALPHAS = (1.0, 5.0, 10.0)  # alpha_1 (CosFace), alpha_2 (contrastive), alpha_3 (DFC BCE): eq. 7, paper's values


@torch.no_grad()
def hard_negatives(public: torch.Tensor, local: torch.Tensor, threshold: float = T_HN,
                   block: int = 4096) -> torch.Tensor:
    """Indices of the public features whose cosine to at least one local feature exceeds `threshold`.

    Computed in blocks of public rows, so a large D_g never needs an N x M matrix in memory."""
    if len(public) == 0 or len(local) == 0:
        return torch.zeros(0, dtype=torch.long)
    local = F.normalize(local.float(), dim=1)
    keep = []
    for start in range(0, len(public), block):
        rows = F.normalize(public[start:start + block].float(), dim=1)
        best = (rows @ local.T).amax(dim=1)
        keep.append(torch.nonzero(best > threshold).flatten() + start)
    return torch.cat(keep)


def contrastive_loss(f: torch.Tensor, f_global: torch.Tensor, f_previous: torch.Tensor,
                     tau: float = TAU) -> torch.Tensor:
    """Eq. 5, -log(e^{sim(f,f_g)/tau} / (e^{sim(f,f_g)/tau} + e^{sim(f,f_prev)/tau})), minus log 2.

    The constant shift (no effect on gradients) makes the term 0 where the local, global and previous
    features agree; it grows as the local feature leaves the global one for the previous one. With
    no previous local model yet (a device's first round) pass f_previous = f_global: the term is then
    constant and pulls nothing."""
    pos = F.cosine_similarity(f, f_global.detach(), dim=1) / tau
    neg = F.cosine_similarity(f, f_previous.detach(), dim=1) / tau
    return (torch.logsumexp(torch.stack([pos, neg], dim=1), dim=1) - pos).mean() - math.log(2.0)


def negative_margin_loss(public_features: torch.Tensor, class_weights: torch.Tensor, threshold: float = T_HN,
                         scale: float = 30.0) -> torch.Tensor:
    """Unlabelled public faces as negatives to every local class: softplus(s (cos - t_HN)) / s, averaged.

    Near zero once no public face is within t_HN of a local proxy; the gradient pushes only the
    ones that are (the hard ones)."""
    if len(public_features) == 0:
        return public_features.sum() * 0.0
    cos = F.linear(F.normalize(public_features, dim=1), F.normalize(class_weights, dim=1))
    return F.softplus(scale * (cos - threshold)).mean() / scale
