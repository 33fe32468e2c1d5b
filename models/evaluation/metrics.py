"""Face verification and identification metrics over embeddings (numpy + scikit-learn).

Scores are cosine similarities; a pair is genuine when both faces are the same person.
"""
from __future__ import annotations

import math

import numpy as np
from sklearn.metrics import roc_auc_score, roc_curve

from models.evaluation.thresholds import threshold_at_far

FARS = (1e-1, 1e-2, 1e-3)


def l2_normalise(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def make_pairs(labels: np.ndarray, max_pairs: int = 200_000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs (i<j) and whether each is genuine: all pairs when few, else a seeded sample.

    When sampling, genuine and impostor pairs are drawn separately (up to half each), so the
    rare genuine pairs are not drowned out.
    """
    n = len(labels)
    if n < 2:
        raise ValueError("need at least two images to form pairs")
    total = n * (n - 1) // 2
    if total <= max_pairs:
        i, j = np.triu_indices(n, k=1)
        return np.stack([i, j], 1), labels[i] == labels[j]
    rng = np.random.default_rng(seed)
    genuine = genuine_pairs(labels)
    if len(genuine) > max_pairs // 2:
        genuine = genuine[rng.choice(len(genuine), max_pairs // 2, replace=False)]
    n_imp = max_pairs - len(genuine)
    a, b = rng.integers(0, n, 2 * n_imp), rng.integers(0, n, 2 * n_imp)
    keep = labels[a] != labels[b]
    impostor = np.unique(np.sort(np.stack([a[keep], b[keep]], 1), axis=1), axis=0)[:n_imp]
    pairs = np.concatenate([genuine, impostor])
    return pairs, labels[pairs[:, 0]] == labels[pairs[:, 1]]


def genuine_pairs(labels: np.ndarray) -> np.ndarray:
    out = []
    for label in np.unique(labels):
        idx = np.flatnonzero(labels == label)
        if len(idx) > 1:
            i, j = np.triu_indices(len(idx), k=1)
            out.append(np.stack([idx[i], idx[j]], 1))
    return np.concatenate(out) if out else np.zeros((0, 2), dtype=np.int64)


def cosine_scores(emb: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    emb = l2_normalise(emb.astype(np.float64))
    return np.einsum("ij,ij->i", emb[pairs[:, 0]], emb[pairs[:, 1]])


def eer(scores: np.ndarray, same: np.ndarray) -> tuple[float, float]:
    """Equal error rate and the threshold where false accepts equal false rejects."""
    fpr, tpr, thresholds = roc_curve(same, scores)
    fnr = 1.0 - tpr
    k = int(np.nanargmin(np.abs(fnr - fpr)))
    # interpolate between the two ROC points that bracket the crossing
    if k + 1 < len(fpr) and (fnr[k] - fpr[k]) * (fnr[k + 1] - fpr[k + 1]) < 0:
        d0, d1 = fnr[k] - fpr[k], fnr[k + 1] - fpr[k + 1]
        w = d0 / (d0 - d1)
        return float(fpr[k] + w * (fpr[k + 1] - fpr[k])), float(thresholds[k] + w * (thresholds[k + 1] - thresholds[k]))
    return float((fpr[k] + fnr[k]) / 2.0), float(min(thresholds[k], 1.0))


def tar_at_far(scores: np.ndarray, same: np.ndarray, fars=FARS) -> dict[str, float | str]:
    """True accept rate at each false accept rate; 'n/a' when too few impostors to measure it.

    A FAR of f needs at least 1/f impostor pairs for one false accept to be observable.
    """
    genuine = scores[same]
    out: dict[str, float | str] = {}
    for far in fars:
        if (~same).sum() < math.ceil(1.0 / far) or len(genuine) == 0:
            out[f"{far:g}"] = "n/a"
            continue
        threshold, _ = threshold_at_far(scores[~same], far)
        out[f"{far:g}"] = float(np.mean(genuine > threshold))
    return out


def roc_report(scores: np.ndarray, same: np.ndarray, fars=FARS) -> dict:
    """AUC, EER (and its threshold), TAR@FAR and pair counts for one set of scored pairs."""
    same = np.asarray(same, bool)
    n_gen, n_imp = int(same.sum()), int((~same).sum())
    report = {"n_genuine_pairs": n_gen, "n_impostor_pairs": n_imp}
    if n_gen == 0 or n_imp == 0:
        raise ValueError(f"need genuine and impostor pairs, got {n_gen} genuine and {n_imp} impostor")
    rate, threshold = eer(scores, same)
    report.update(auc=float(roc_auc_score(same, scores)), eer=rate, eer_threshold=threshold,
                  tar_at_far=tar_at_far(scores, same, fars))
    return report


def verification_report(emb: np.ndarray, labels: np.ndarray, max_pairs: int = 200_000, seed: int = 0) -> dict:
    pairs, same = make_pairs(labels, max_pairs, seed)
    report = roc_report(cosine_scores(emb, pairs), same)
    report.update(n_images=int(len(labels)), n_identities=int(len(np.unique(labels))))
    return report


def kfold_accuracy(scores: np.ndarray, same: np.ndarray, folds: np.ndarray) -> tuple[float, float, float]:
    """LFW protocol: per fold, the threshold that is best on the other folds; mean, std, mean threshold."""
    accuracies, thresholds = [], []
    for fold in np.unique(folds):
        train, test = folds != fold, folds == fold
        threshold = best_threshold(scores[train], same[train])
        accuracies.append(np.mean((scores[test] > threshold) == same[test]))
        thresholds.append(threshold)
    return float(np.mean(accuracies)), float(np.std(accuracies)), float(np.mean(thresholds))


def best_threshold(scores: np.ndarray, same: np.ndarray) -> float:
    """The threshold (midway between sorted scores) with the highest accuracy."""
    order = np.sort(np.unique(scores))
    candidates = np.concatenate([[order[0] - 1e-6], (order[1:] + order[:-1]) / 2.0, [order[-1] + 1e-6]])
    # accuracy(t) = (#genuine > t + #impostor <= t) / n, computed for all t at once
    gen = np.sort(scores[same])
    imp = np.sort(scores[~same])
    correct = (len(gen) - np.searchsorted(gen, candidates, side="right")) + np.searchsorted(
        imp, candidates, side="right"
    )
    return float(candidates[int(np.argmax(correct))])


def tpir_at_fpir(emb: np.ndarray, labels: np.ndarray, fpirs=FARS, enrolled_fraction: float = 0.5,
                 seed: int = 0) -> dict:
    """Open-set 1:N identification.

    Half the identities (seeded) are enrolled with their first image as gallery template;
    their other images are mated probes, every image of the other identities is a non-mated
    probe. TPIR at a threshold counts mated probes whose best match is right and above it;
    FPIR counts non-mated probes whose best match is above it.
    """
    emb = l2_normalise(emb.astype(np.float64))
    ids = np.unique(labels)
    rng = np.random.default_rng(seed)
    enrolled = rng.permutation(ids)[: max(1, int(round(len(ids) * enrolled_fraction)))]
    gallery_idx = np.array([np.flatnonzero(labels == i)[0] for i in enrolled])
    is_enrolled = np.isin(labels, enrolled)
    mated = np.setdiff1d(np.flatnonzero(is_enrolled), gallery_idx)
    non_mated = np.flatnonzero(~is_enrolled)
    out = {
        "n_gallery": int(len(gallery_idx)),
        "n_mated_probes": int(len(mated)),
        "n_non_mated_probes": int(len(non_mated)),
    }
    if len(mated) == 0 or len(non_mated) == 0:
        out["tpir_at_fpir"] = {f"{f:g}": "n/a" for f in fpirs}
        return out
    sims_m = emb[mated] @ emb[gallery_idx].T
    best_m, hit = sims_m.max(1), labels[gallery_idx][sims_m.argmax(1)] == labels[mated]
    best_n = np.sort((emb[non_mated] @ emb[gallery_idx].T).max(1))[::-1]
    out["rank1"] = float(hit.mean())
    tpir = {}
    for fpir in fpirs:
        if len(best_n) < math.ceil(1.0 / fpir):
            tpir[f"{fpir:g}"] = "n/a"
            continue
        threshold = best_n[int(math.floor(fpir * len(best_n)))]
        tpir[f"{fpir:g}"] = float(np.mean(hit & (best_m > threshold)))
    out["tpir_at_fpir"] = tpir
    return out
