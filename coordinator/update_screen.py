"""Update screening: each update judged against the round's others before any is combined.

The norm bound and the quality gate see one update's size and the round's mean; an insider who knows them aims
below both (issue 48: a drift scaled to stay under the gate, an impersonation pulled onto a victim). Screening looks
at every update's direction instead, as FLAME does (Nguyen et al., "FLAME: Taming Backdoors in Federated Learning",
USENIX Security 2022, Algorithm 1):

1. cosine distances between the updates, clustered by HDBSCAN with a minimum cluster size of n/2 + 1: the
   majority cluster is admitted, every other update (its own cluster or noise) is left out of the round;
   the cluster is widened to the updates as aligned with it as its own members (`within_reach`: HDBSCAN alone
   cuts honest updates that are all equally alike);
2. the admitted updates are clipped to their median norm S_t (`Screening.scales`), so no admitted update weighs
   more than a typical one, whatever the ceiling of the norm bound.

FLAME's third step, Gaussian noise of sigma = lambda S_t on the model, is not taken: the quality gate and the anchor
judge the result, and noise would cost the honest rounds accuracy. Updates are compared through a count sketch
(`sketch`, Charikar, Chen, Farach-Colton, ICALP 2002), folded as each update arrives, so memory stays one short vector
per device rather than one model per device. Fewer than `min_updates` updates are not screened: a majority of two
or three is no evidence.

`NoScreen` is the null object (`--screen none`); `SCREENS` names them for the settings and the CLI.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from models.maths.state_norms import RUNNING_STATS, State, float_names

REACH_MADS = 3.0  # how far below the majority's typical alignment an update may still be admitted ...
REACH_SHARE = 1 / 3  # ... or how large a share of it it must keep, whichever admits more (measured below)
SKETCH_SIZE = 4096  # cosine through the sketch is off by about 1/sqrt(size) = 0.016: far below honest vs attack gaps


@lru_cache(maxsize=4096)  # one entry per tensor of the run's layout: a model has ~300, computed once each
def _hashes(name: str, size: int, buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """Each coordinate's bucket and sign, fixed per tensor name and size (the same for every update of a run)."""
    seed = int.from_bytes(name.encode()[-8:].rjust(8, b"\0"), "little") ^ size
    rng = np.random.default_rng(seed)
    return rng.integers(0, buckets, size, dtype=np.int32), rng.choice(np.array([-1.0, 1.0], np.float32), size)


def sketch(delta: State, buckets: int = SKETCH_SIZE) -> np.ndarray:
    """A count sketch of the update's learnt weights (BatchNorm's running statistics left out: they follow the
    device's data, not its training): inner products, hence cosines, are kept in expectation."""
    out = np.zeros(buckets, np.float64)
    for name in float_names(delta):
        if name.endswith(RUNNING_STATS):
            continue
        values = np.ravel(np.asarray(delta[name], np.float32))
        where, sign = _hashes(name, values.size, buckets)
        out += np.bincount(where, weights=values * sign, minlength=buckets)
    return out


@dataclass
class Screening:
    """The updates a round combines, each one's scale (a clip to the round's median norm), and what was done."""

    admitted: list[str]
    scales: dict[str, float] = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)


class NoScreen:
    """Every update admitted as it is (the norm bound and the gate still apply)."""

    name = "none"

    def observe(self, delta: State) -> None:
        """What it keeps of an arriving update: nothing (no sketch is computed on the intake's path)."""
        return None

    def screen(self, devices: list[str], sketches: dict[str, np.ndarray], norms: dict[str, float]) -> Screening:
        return Screening(sorted(devices))


@dataclass
class Flame:
    """FLAME's clustering and median-norm clipping (module docstring)."""

    min_updates: int = 4
    name: str = "flame"

    def observe(self, delta: State) -> np.ndarray:
        """What it keeps of an arriving update: its direction's count sketch."""
        return sketch(delta)

    def screen(self, devices: list[str], sketches: dict[str, np.ndarray], norms: dict[str, float]) -> Screening:
        """`devices`: the round's updates; `sketches`: what `observe` kept of each (one for every device)."""
        devices = sorted(devices)
        if len(devices) < self.min_updates:
            return Screening(devices, metrics={"screen": self.name, "screen_skipped": len(devices)})
        majority = majority_cluster(np.stack([sketches[d] for d in devices]))
        kept = [devices[i] for i in majority.rows]
        median = float(np.median([norms[d] for d in kept]))
        scales = {d: (median / norms[d] if norms[d] > median > 0 else 1.0) for d in kept}
        left = sorted(set(devices) - set(kept))
        aligned = {d: round(float(a), 4) for d, a in zip(devices, majority.aligned) if np.isfinite(a)}
        return Screening(kept, scales, {"screen": self.name, "screen_excluded": len(left),
                                        "screen_excluded_devices": left, "screen_clip": median,
                                        "screen_clipped": sum(s < 1.0 for s in scales.values()),
                                        "screen_reach": round(majority.reach, 4) if aligned else None,
                                        "screen_alignment": aligned})


def cosine_distances(rows: np.ndarray) -> np.ndarray:
    """1 - cosine similarity between every pair of rows (a zero row is at distance 1 from everything)."""
    lengths = np.linalg.norm(rows, axis=1, keepdims=True)
    unit = np.divide(rows, lengths, out=np.zeros_like(rows), where=lengths > 0)
    return np.clip(1.0 - unit @ unit.T, 0.0, 2.0)


@dataclass
class Majority:
    """The rows admitted, each row's alignment with the majority's direction, and the least alignment admitted."""

    rows: list[int]
    aligned: np.ndarray
    reach: float


def majority_cluster(rows: np.ndarray) -> Majority:
    """The rows in HDBSCAN's largest cluster of cosine distances, the cluster at least n/2 + 1 strong (FLAME's
    rule), widened to every row as aligned with it as its own members are (`within_reach`). When HDBSCAN finds no
    cluster (no majority agrees), every row is kept: the gate and the anchor then judge the round, as without
    screening."""
    from sklearn.cluster import HDBSCAN

    n = len(rows)
    labels = HDBSCAN(metric="precomputed", min_cluster_size=n // 2 + 1, min_samples=1,
                     allow_single_cluster=True, copy=True).fit_predict(cosine_distances(rows))
    clusters = [k for k in set(labels.tolist()) if k >= 0]
    if not clusters:
        return Majority(list(range(n)), np.full(n, np.nan), float("nan"))
    biggest = max(clusters, key=lambda k: int(np.sum(labels == k)))
    return within_reach(rows, np.flatnonzero(labels == biggest))


def within_reach(rows: np.ndarray, members: np.ndarray) -> Majority:
    """The members, and every other row whose alignment with the members' mean direction (each member's with the
    mean of the others) is within REACH_MADS robust deviations (1.4826 x MAD, over all rows: a majority is honest)
    of the median alignment, or at least REACH_SHARE of it (a MAD over five updates is no measure of spread). On 10
    CelebA devices honest updates' alignments were 0.07-0.17 and an impersonator's 0.01 and -0.02; late rounds of
    the SYNTHETIC demo had honest ones at 0.06-0.12 (2/3 of the median left two of five honest devices out).
    HDBSCAN alone cuts a continuous spread of equally alike updates (honest devices on
    different people): on 10 and 30 such updates it left out 10-35%; the rows it cut are as aligned as its
    members, an attack's are not."""
    unit = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-30)
    total, inside = unit[members].sum(0), set(members.tolist())
    aligned = np.array([_cosine(unit[i], total - unit[i] if i in inside else total) for i in range(len(rows))])
    centre = float(np.median(aligned))
    spread = max(1.4826 * float(np.median(np.abs(aligned - centre))), 1.0 / np.sqrt(rows.shape[1]))
    reach = min(centre - REACH_MADS * spread, REACH_SHARE * centre)
    return Majority(sorted(inside | {i for i in range(len(rows)) if aligned[i] >= reach}), aligned, reach)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


SCREENS = {"none": NoScreen, "flame": Flame}


def make_screen(name: str) -> NoScreen | Flame:
    if name not in SCREENS:
        raise ValueError(f"unknown update screen {name!r}; choose one of {', '.join(SCREENS)}")
    return SCREENS[name]()
