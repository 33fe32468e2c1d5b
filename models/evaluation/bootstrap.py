"""How sure a verification figure is: a bootstrap over people, not over pairs.

Pairs of one person's photos are not independent draws: a model that fails on three people fails on every pair
they are in. So the interval resamples people (with replacement) and lets each pair count as often as its people
were drawn: a genuine pair of person p c_p times, an impostor pair of p and q c_p * c_q times (the pairs the
resampled population would have, up to the pairs between a person's own copies). With 20 people the interval is
wide, which is the point: a change inside it is not a change.
"""
from __future__ import annotations

import numpy as np
from sklearn.metrics import roc_auc_score

LEVEL = 0.95
RESAMPLES = 200


def far_name(far: float) -> str:
    """'tar@1e-3': how the reports name TAR at a FAR."""
    return "tar@" + f"{far:.0e}".replace("e-0", "e-")


def weighted_tar_at_far(scores: np.ndarray, same: np.ndarray, weights: np.ndarray, far: float) -> float | None:
    """TAR at the lowest threshold whose weighted share of impostors above it is at most `far` (None: too few)."""
    impostor, w_imp = scores[~same], weights[~same]
    total = w_imp.sum()
    if total * far < 1 or not (weights[same] > 0).any():
        return None
    order = np.argsort(-impostor)
    accepted = np.cumsum(w_imp[order]) / total
    k = int(np.searchsorted(accepted, far, side="right"))  # the k highest impostors may pass
    threshold = impostor[order][k] if k < len(order) else -np.inf
    genuine, w_gen = scores[same], weights[same]
    return float(w_gen[genuine > threshold].sum() / w_gen.sum())


def people_interval(scores: np.ndarray, same: np.ndarray, people: np.ndarray, fars: tuple[float, ...] = (1e-3, 1e-4),
                    resamples: int = RESAMPLES, seed: int = 0, level: float = LEVEL) -> dict[str, list[float] | None]:
    """{"auc": [low, high], "tar@1e-3": [low, high], ...} over `resamples` draws of people. `people`: for each pair,
    the person of each of its two images (n x 2)."""
    ids, inverse = np.unique(people, return_inverse=True)
    inverse = inverse.reshape(people.shape)
    rng = np.random.default_rng(seed)
    draws: dict[str, list[float]] = {"auc": [], **{far_name(far): [] for far in fars}}
    for _ in range(resamples):
        counts = np.bincount(rng.integers(0, len(ids), len(ids)), minlength=len(ids)).astype(np.float64)
        weights = np.where(same, counts[inverse[:, 0]], counts[inverse[:, 0]] * counts[inverse[:, 1]])
        if not (weights[same] > 0).any() or not (weights[~same] > 0).any():
            continue
        keep = weights > 0
        draws["auc"].append(float(roc_auc_score(same[keep], scores[keep], sample_weight=weights[keep])))
        for far in fars:
            value = weighted_tar_at_far(scores[keep], same[keep], weights[keep], far)
            if value is not None:
                draws[far_name(far)].append(value)
    tail = (1 - level) / 2 * 100
    return {k: [float(np.percentile(v, tail)), float(np.percentile(v, 100 - tail))] if len(v) >= resamples // 2
            else None for k, v in draws.items()}


def rate_interval(hits: np.ndarray, trials: np.ndarray, people: np.ndarray, resamples: int = RESAMPLES,
                  seed: int = 0, level: float = LEVEL) -> list[float] | None:
    """[low, high] of a rate such as a door's FAR on strangers, over draws of the probes' people: `hits` and
    `trials` per probe (a stranger's photo: the templates it passed, the templates it was tried on), `people` whose
    photo each is. One stranger who resembles an enrolled person makes most of a door's false accepts, so the rate
    measured on a few dozen strangers can be several times the promise at a threshold that keeps it (None: no
    trials)."""
    ids, who = np.unique(people, return_inverse=True)
    hit = np.bincount(who, weights=hits, minlength=len(ids))
    tried = np.bincount(who, weights=trials, minlength=len(ids))
    if tried.sum() <= 0:
        return None
    counts = np.random.default_rng(seed).multinomial(len(ids), np.full(len(ids), 1 / len(ids)), size=resamples)
    rates = (counts @ hit) / np.maximum(counts @ tried, 1e-12)
    tail = (1 - level) / 2 * 100
    return [float(np.percentile(rates, tail)), float(np.percentile(rates, 100 - tail))]
