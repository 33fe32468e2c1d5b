"""Embedding distillation losses: pure functions over L2-normalised (B, D) batches.

The student (MobileNetV2-128) learns the teacher's face embedding with no identity labels:
  L = L_cos + lambda * L_sim
L_cos = mean_i (1 - <s_i, t_i>) pulls each student embedding onto the teacher's embedding of
the same crop (feature distillation; the two spaces share their dimension, 128, so no
projection is needed). L_sim = mean_{i != j} (<s_i, s_j> - <t_i, t_j>)^2 matches the batch's
pairwise cosine structure, which is what verification thresholds (Tung and Mori,
"Similarity-Preserving Knowledge Distillation", ICCV 2019, eq. 2-4, on cosine similarities;
Park et al., "Relational Knowledge Distillation", CVPR 2019).

`bank_distillation_loss` (`ffr pretrain --loss bank`) matches relations to a memory bank of
every cached teacher view instead of the batch's 64, and weights each sample by how far the
student is from its target. `queue_distillation_loss` (`ffr pretrain --online --loss queue`) adds the same
relational term over a queue of the teacher's targets of earlier steps, the memory an online run has.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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


def hardness_weights(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per-sample weights proportional to 1 - cos(s_i, t_i), mean 1, no gradient: the batch leans toward the
    samples the student gets most wrong (as focal weighting does for classification)."""
    miss = (1.0 - (student * teacher).sum(dim=1)).detach().clamp_min(0)
    return miss / miss.mean().clamp_min(1e-8)


def bank_relational_loss(student: torch.Tensor, teacher: torch.Tensor, bank: torch.Tensor,
                         temperature: float = 0.1) -> torch.Tensor:
    """Per-sample KL(p_t || p_s) of the similarity distributions over a memory bank of teacher embeddings:
    p(j | x) = softmax_j(<e(x), b_j> / T). Relational distillation (Park et al., CVPR 2019) against every cached
    teacher view rather than the batch, as contrastive representation distillation does with its memory
    (Tian et al., "Contrastive Representation Distillation", ICLR 2020, sec. 3.3). Returns (B,)."""
    log_p_teacher = F.log_softmax(teacher @ bank.T / temperature, dim=1)
    log_p_student = F.log_softmax(student @ bank.T / temperature, dim=1)
    return (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(dim=1)


def bank_distillation_loss(student: torch.Tensor, teacher: torch.Tensor, bank: torch.Tensor,
                           rel_weight: float = 1.0, temperature: float = 0.1) -> tuple[torch.Tensor, dict[str, float]]:
    """mean_i w_i [(1 - <s_i, t_i>) + rel_weight * KL_i(bank)], w_i = `hardness_weights`; both parts logged."""
    weights = hardness_weights(student, teacher)
    cos = 1.0 - (student * teacher).sum(dim=1)
    rel = bank_relational_loss(student, teacher, bank, temperature)
    loss = (weights * (cos + rel_weight * rel)).mean()
    return loss, {"cos_loss": float(cos.mean().detach()), "bank_loss": float(rel.mean().detach())}


def queue_distillation_loss(student: torch.Tensor, teacher: torch.Tensor, queue: torch.Tensor,
                            sim_weight: float = 2.0, queue_weight: float = 1.0, temperature: float = 0.1
                            ) -> tuple[torch.Tensor, dict[str, float]]:
    """L_cos + sim_weight L_sim + queue_weight mean_i KL_i(queue): the batch's relations as `distillation_loss`,
    plus each face's similarity distribution over a FIFO queue of earlier teacher targets (MoCo's queue, He et al.,
    CVPR 2020, as a distillation memory: QUD, BMVC 2024), so a face is placed among thousands of others, not 512."""
    loss, parts = distillation_loss(student, teacher, sim_weight)
    rel = bank_relational_loss(student, teacher, queue, temperature).mean()
    return loss + queue_weight * rel, {**parts, "queue_loss": float(rel.detach())}
