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
`pair_rank_loss` (`ffr pretrain --online --rank-weight W`) adds a term on the pairs that decide acceptance at low
false-accept rates: the student should accept each at the same rates as the teacher (EKD, CVPR 2022).
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


# --- the pair-rank term (`ffr pretrain --online --rank-weight W`) -------------------------------------------------

RANK_FARS = (1e-1, 1e-2, 1e-3, 1e-4)  # the false-accept rates whose thresholds band a pair's similarity


def pair_similarities(embeddings: torch.Tensor) -> torch.Tensor:
    """The cosine similarity of every unordered pair of a batch of L2-normalised rows: (B (B - 1) / 2,)."""
    rows, cols = torch.triu_indices(len(embeddings), len(embeddings), 1, device=embeddings.device)
    return (embeddings @ embeddings.T)[rows, cols]


def accept_thresholds(similarities: torch.Tensor, fars: tuple[float, ...] = RANK_FARS) -> torch.Tensor:
    """The similarity above which each false-accept rate's share of the pairs lies (nearly every pair of an
    unlabelled batch is two people, so these are a verifier's thresholds at those rates); no gradient."""
    ranked = similarities.detach().sort(descending=True).values
    index = torch.tensor([min(int(far * len(ranked)), len(ranked) - 1) for far in fars], device=ranked.device)
    return ranked[index]


def band_counts(similarities: torch.Tensor, thresholds: torch.Tensor, temperature: float) -> torch.Tensor:
    """How many thresholds each similarity passes, softly: sum_k sigmoid((s - tau_k) / T), so a pair's count says
    at which false-accept rates its model would accept it."""
    return torch.sigmoid((similarities[:, None] - thresholds[None, :]) / temperature).sum(dim=1)


def pair_rank_loss(student_pairs: torch.Tensor, teacher_pairs: torch.Tensor, student_thresholds: torch.Tensor,
                   teacher_thresholds: torch.Tensor, top_k: int = 2000, temperature: float = 0.01) -> torch.Tensor:
    """The rank-based relation loss of evaluation-oriented distillation (Huang et al., "Evaluation-oriented
    Knowledge Distillation for Deep Face Recognition", CVPR 2022, sec. 3.2-3.3), without identity labels.

    Each pair's band count is taken against its own model's thresholds, so the student is asked to accept a pair at
    the same false-accept rates as the teacher, not to copy its similarity (the paper's flexibility for a small
    student). The critical pairs are those that decide acceptance at low rates: the `top_k` most similar pairs under
    either model (the paper takes the labelled positives and the student's hardest negatives; an unlabelled batch
    has no labels, and its most similar pairs under the teacher stand in for the positives). The pairs are
    `pair_similarities` of each model's batch, taken once a step (the thresholds are folded from the same). Returns
    mean over those pairs of (n_s - n_t)^2."""
    s, t = student_pairs, teacher_pairs
    k = min(top_k, len(s))
    critical = torch.zeros_like(s, dtype=torch.bool)
    critical[s.detach().topk(k).indices] = True
    critical[t.topk(k).indices] = True
    gap = band_counts(s[critical], student_thresholds, temperature) - band_counts(t[critical], teacher_thresholds,
                                                                                  temperature)
    return gap.pow(2).mean()
