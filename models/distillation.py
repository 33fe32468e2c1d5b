"""Embedding distillation losses: pure functions over L2-normalised (B, D) batches.

The student (MobileNetV2-128) learns the teacher's face embedding with no identity labels:
  L = L_cos + lambda * L_sim
L_cos = mean_i (1 - <s_i, t_i>) pulls each student embedding onto the teacher's embedding of
the same crop (feature distillation; the two spaces share their dimension, 128, so no
projection is needed). L_sim = mean_{i != j} (<s_i, s_j> - <t_i, t_j>)^2 matches the batch's
pairwise cosine structure, which is what verification thresholds (Tung and Mori,
"Similarity-Preserving Knowledge Distillation", ICCV 2019, eq. 2-4, on cosine similarities;
Park et al., "Relational Knowledge Distillation", CVPR 2019).
"""
from __future__ import annotations

import torch


def cosine_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """mean_i (1 - cos(s_i, t_i)); both inputs L2-normalised."""
    return (1.0 - (student * teacher).sum(dim=1)).mean()


def similarity_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Mean squared difference of the off-diagonal pairwise cosine similarities."""
    n = student.shape[0]
    if n < 2:
        return student.new_zeros(())
    diff = student @ student.T - teacher @ teacher.T
    off = ~torch.eye(n, dtype=torch.bool, device=student.device)
    return diff[off].pow(2).mean()


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, sim_weight: float = 2.0
                      ) -> tuple[torch.Tensor, dict[str, float]]:
    """L_cos + sim_weight * L_sim, and both parts for logging."""
    cos, sim = cosine_loss(student, teacher), similarity_loss(student, teacher)
    return cos + sim_weight * sim, {"cos_loss": float(cos.detach()), "sim_loss": float(sim.detach())}
