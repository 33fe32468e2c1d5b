"""How well a backbone keeps people apart on a fixed set of faces, torch-free (numpy, onnx, ONNX Runtime).

Both ends of a federation use it to refuse a model that would accept impostors. A device that
poisons from inside the norm bound can pull every embedding together (the collapse attack,
`fleet.attacks`): ranking metrics drop a little, but every score rises, so a threshold that was
calibrated on the old model now accepts everyone. The decisive figure is therefore the candidate's
false-accept rate at the *current* model's operating threshold (the threshold devices hold does not
move when the model does), with the AUC as a second check on the ranking itself:
- the coordinator's quality gate (`coordinator.quality_gate`) scores each candidate global model
  before it is published and rolls the round back when it fails;
- a device (`edge_client.adoption`) scores a new global model on its own people and public
  negatives before verifying with it, and keeps its last good model when it fails.

Genuine pairs come from identity labels, or, for an unlabelled set (public faces of nobody's
people), from each image and its mirror image; impostor pairs are images of different people
(for an unlabelled set, every pair of distinct images).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from models.evaluation.thresholds import threshold_at_far
from models.typed_fields import check_types

BACKBONE_PREFIX = "backbone."
DEGENERATE_THRESHOLD = 0.98  # a current model whose FAR threshold is this high maps every face to about one point
DEFAULT_LIMIT = 400  # faces: 80k impostor pairs, a FAR of 1e-3 measured on ~80 of them; ~3 s per model on 2 cores
PAIR_JUMP = 0.25  # cosine; an honest round moves no impostor pair this far (bench/results/pair_jumps.md)
PAIR_SIGMAS = 8.0  # ... nor further than this many robust deviations of all pairs' rises (honest: at most about 5)


@dataclass(frozen=True)
class SeparationSettings:
    """The bar a candidate model must clear against the current one (`compare`), and the faces it is judged on.
    One spec for both ends: the defaults are the coordinator's quality gate; a device judges with more slack
    (`edge_client.adoption.ADOPTION`)."""

    far: float = 1e-3          # the operating point devices calibrate for
    far_ratio: float = 2.0     # the candidate may accept at most this x the current model's impostors there
    auc_margin: float = 0.01   # ... and lose at most this much AUC
    pair_jump: float = PAIR_JUMP  # no impostor pair may cross the threshold by rising more than this (`worst_pair`)
    limit: int = DEFAULT_LIMIT  # faces scored, at most
    seed: int = 0              # which faces, when there are more than `limit`
    threads: int | None = None

    def __post_init__(self):
        check_types(self)
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"gate threads must be at least 1, got {self.threads}")
        if not 0 < self.far < 0.5:
            raise ValueError(f"gate FAR must be in (0, 0.5), got {self.far}")
        if self.far_ratio < 1:
            raise ValueError(f"gate FAR ratio must be at least 1, got {self.far_ratio}")
        if not 0 <= self.auc_margin < 1:
            raise ValueError(f"gate AUC margin must be in [0, 1), got {self.auc_margin}")
        if not 0 < self.pair_jump <= 2:
            raise ValueError(f"gate pair jump must be in (0, 2], got {self.pair_jump}")
        if self.limit < 3:
            raise ValueError(f"the gate needs at least 3 faces, got a limit of {self.limit}")

    def judge(self, current: Scores, candidate: Scores) -> Verdict:
        """`compare` at this bar."""
        return compare(current, candidate, self.far, self.far_ratio, self.auc_margin, pair_jump=self.pair_jump)


@dataclass(frozen=True)
class FaceSet:
    """Aligned face crops (N, H, W, 3 RGB uint8) and their identities (None: an unlabelled set)."""

    images: np.ndarray
    labels: np.ndarray | None = None

    def __post_init__(self):
        if self.images.ndim != 4 or self.images.shape[-1] != 3 or self.images.dtype != np.uint8:
            raise ValueError(f"face images must be N x H x W x 3 uint8, got {self.images.shape} {self.images.dtype}")
        if len(self.images) < 3:
            raise ValueError(f"need at least 3 face images to score a model, got {len(self.images)}")
        if self.labels is not None and len(self.labels) != len(self.images):
            raise ValueError("one identity label per image")


@dataclass(frozen=True)
class Scores:
    """Genuine and impostor cosine scores of one model on one face set; for a labelled set, the two identities of
    each impostor pair (`impostor_ids`, m x 2), which the per-identity check reads."""

    genuine: np.ndarray
    impostor: np.ndarray
    impostor_ids: np.ndarray | None = None

    @property
    def auc(self) -> float:
        return auc(self.genuine, self.impostor)


@dataclass(frozen=True)
class Verdict:
    """Whether a candidate may replace the current model; `reason` says why not; `metrics` are for the record."""

    ok: bool
    reason: str
    metrics: dict


def embedder_session(state: dict[str, np.ndarray], threads: int | None = 1):
    """An ONNX Runtime session of the backbone in `state` (keys with or without the `backbone.` prefix)."""
    import onnxruntime as ort

    from models.networks.embedder_onnx import build_embedder_onnx

    plain = {k.removeprefix(BACKBONE_PREFIX): np.asarray(v) for k, v in state.items()}
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return ort.InferenceSession(build_embedder_onnx(plain).SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def embed(state: dict[str, np.ndarray], images: np.ndarray, threads: int | None = 1) -> np.ndarray:
    """L2-normalised embeddings of the crops under the backbone in `state` (the device's preprocessing)."""
    return _embed(embedder_session(state, threads), images)


def _embed(session, images: np.ndarray, batch_size: int = 64) -> np.ndarray:
    from models.faces.preprocess import to_input

    name = session.get_inputs()[0].name
    out = [session.run(None, {name: to_input(images[i:i + batch_size])})[0] for i in range(0, len(images), batch_size)]
    emb = np.concatenate(out).astype(np.float64)
    return emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)


def pair_scores(emb: np.ndarray, labels: np.ndarray | None, mirrored: np.ndarray | None = None) -> Scores:
    """Cosine scores of every pair: same label = genuine, else impostor; unlabelled: image-mirror pairs are
    the genuine ones (`mirrored`: the mirror images' embeddings, row for row)."""
    sim = emb @ emb.T
    upper = np.triu_indices(len(emb), 1)
    if labels is None:
        if mirrored is None:
            raise ValueError("an unlabelled set needs its mirror images' embeddings for genuine pairs")
        return Scores(np.einsum("ij,ij->i", emb, mirrored), sim[upper])
    same = (labels[:, None] == labels[None, :])[upper]
    ids = np.stack([labels[upper[0]], labels[upper[1]]], axis=1)[~same]
    return Scores(sim[upper][same], sim[upper][~same], ids)


def leave_one_out_scores(faces: np.ndarray) -> np.ndarray:
    """Each of one person's face embeddings (two or more, normalised) against their template made without it: the
    genuine scores of a face-to-template decision, none of them flattered by the face itself."""
    without_each = faces.sum(0, keepdims=True) - faces  # row i: the template made without face i, unnormalised
    return np.sum(faces * without_each, axis=1) / np.maximum(np.linalg.norm(without_each, axis=1), 1e-12)


def template_scores(emb: np.ndarray, labels: np.ndarray) -> Scores:
    """The scores a device's door decides on: a face against a person's template (the normalised mean of their faces,
    `edge_client.recognizer.template_of`). People: the labels with two faces or more; any other face (a public
    negative) is only a probe. Genuine: each of a person's faces against their template made without it; impostor:
    each face against every other person's template, `impostor_ids` (the template's person, the face's). Averaging
    cancels the noise a pair has, so one person pulled part of the way onto another's template crosses the threshold
    here before their face pairs do."""
    people = [k for k in np.unique(labels) if np.sum(labels == k) >= 2]
    genuine, impostor, ids = [], [], []
    for k in people:
        own = emb[labels == k]
        genuine.append(leave_one_out_scores(own))
        template = own.sum(0) / max(float(np.linalg.norm(own.sum(0))), 1e-12)
        others = labels != k
        impostor.append(emb[others] @ template)
        ids.append(np.stack([np.full(int(others.sum()), k), labels[others]], axis=1))
    if not people:
        return Scores(np.zeros(0), np.zeros(0), np.zeros((0, 2), labels.dtype))
    return Scores(np.concatenate(genuine), np.concatenate(impostor), np.concatenate(ids))


def score(state: dict[str, np.ndarray], faces: FaceSet, threads: int | None = 1) -> Scores:
    """The model's genuine and impostor scores on `faces` (face pairs only: `door_scores` adds the templates)."""
    return pair_scores(*_embedded(state, faces, threads))


def door_scores(state: dict[str, np.ndarray], faces: FaceSet, threads: int | None = 1) -> tuple[Scores, Scores]:
    """(face-pair scores, face-to-template scores) of `faces` under the model in `state`, embedded once: what a door
    decides on is a face against a person's template. An unlabelled set has no templates (empty scores)."""
    emb, labels, mirrored = _embedded(state, faces, threads)
    templates = Scores(np.zeros(0), np.zeros(0)) if labels is None else template_scores(emb, labels)
    return pair_scores(emb, labels, mirrored), templates


def _embedded(state: dict[str, np.ndarray], faces: FaceSet,
              threads: int | None) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(embeddings, labels, the mirror images' embeddings for an unlabelled set's genuine pairs, else None)."""
    session = embedder_session(state, threads)  # built once for the images and their mirror images
    emb = _embed(session, faces.images)
    mirrored = _embed(session, faces.images[:, :, ::-1]) if faces.labels is None else None
    return emb, faces.labels, mirrored


def door_verdict(reference: tuple[Scores, Scores], candidate: tuple[Scores, Scores], settings: SeparationSettings,
                 templates_of: str = "the enrolled people's templates") -> Verdict:
    """The bar on face pairs, then on faces against templates (`door_scores`): one person pulled onto another's
    template is refused there even while their face pairs and the averages hold. The device's adoption check and the
    coordinator's quality gate (its people's templates are its identity canaries) both judge with it."""
    pairs = settings.judge(reference[0], candidate[0])
    if not pairs.ok or not len(reference[1].impostor):
        return pairs
    templates = settings.judge(reference[1], candidate[1])
    metrics = {**pairs.metrics, **{f"template_{k}": v for k, v in templates.metrics.items()}}
    if not templates.ok:
        return Verdict(False, f"faces against {templates_of}: {templates.reason}", metrics)
    return Verdict(True, "", metrics)


def auc(genuine: np.ndarray, impostor: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U with tied ranks averaged), numpy only."""
    if len(genuine) == 0 or len(impostor) == 0:
        return float("nan")
    values = np.concatenate([genuine, impostor])
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(len(values), dtype=np.float64)
    ranks[order] = np.arange(1, len(values) + 1)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    ranks = (sums / counts)[inverse]  # ties share their mean rank
    u = ranks[:len(genuine)].sum() - len(genuine) * (len(genuine) + 1) / 2.0
    return float(u / (len(genuine) * len(impostor)))


def compare(current: Scores, candidate: Scores, far: float = 1e-3, far_ratio: float = 2.0,
            auc_margin: float = 0.01, mean_margin: float = 0.15, pair_jump: float = PAIR_JUMP) -> Verdict:
    """May `candidate` replace `current`? Not when, at the current model's threshold for `far`, it accepts more
    than `far_ratio` x the impostors the current model accepts there (never judged below `far` itself), or
    when its AUC is more than `auc_margin` below the current model's. A current model that separates nobody
    (its threshold at or above DEGENERATE_THRESHOLD, e.g. a random initialisation) is not judged: any model
    may replace it, and the figures say so (`skipped`). With too few impostor pairs to measure `far` (a device
    with a handful of people), the false-accept test becomes one on the mean impostor score, which a collapse
    drives towards 1: it may rise by at most `mean_margin`. Then the worst cases, which an average hides: one person
    (`worst_identity`) and one pair (`worst_pair`, a rise across the threshold beyond `pair_jump`)."""
    threshold, measurable = threshold_at_far(current.impostor, far)
    far_now = float(np.mean(current.impostor > threshold))
    far_new = float(np.mean(candidate.impostor > threshold))
    auc_now, auc_new = current.auc, candidate.auc
    limit = far_ratio * max(far_now, far)
    metrics = {"threshold": threshold, "far_current": far_now, "far_candidate": far_new, "far_limit": limit,
               "auc_current": auc_now, "auc_candidate": auc_new,
               "impostor_mean_current": float(current.impostor.mean()),
               "impostor_mean_candidate": float(candidate.impostor.mean()),
               "genuine_pairs": int(len(candidate.genuine)), "impostor_pairs": int(len(candidate.impostor))}
    if threshold >= DEGENERATE_THRESHOLD:  # nothing to protect: no device can hold a working threshold for it
        metrics["skipped"] = 1.0
        return Verdict(True, "", metrics)
    rise = metrics["impostor_mean_candidate"] - metrics["impostor_mean_current"]
    if not measurable and rise > mean_margin:
        return Verdict(
            False,
            f"the candidate's mean impostor score rose by {rise:.3f} (from "
            f"{metrics['impostor_mean_current']:.3f}; {len(current.impostor)} impostor pairs, too few "
            f"to measure FAR {far:g})",
            metrics,
        )
    if measurable and far_new > limit:
        return Verdict(
            False,
            f"the candidate accepts {far_new:.2%} of impostors at the current threshold "
            f"{threshold:.3f} (current model {far_now:.2%}, limit {limit:.2%}; mean impostor "
            f"score {metrics['impostor_mean_current']:.3f} -> {metrics['impostor_mean_candidate']:.3f})",
            metrics,
        )
    worst = worst_identity(current, candidate, threshold, far, far_ratio) or \
        worst_pair(current, candidate, threshold, pair_jump)
    if worst is not None:
        metrics.update(worst.metrics)
        return Verdict(False, worst.reason, metrics)
    # one genuine pair (or impostor pair) moving past every pair of the other kind moves the AUC by 1/n: a margin
    # below that is noise a device with a few people cannot resolve
    margin = max(auc_margin, 1.0 / max(1, min(len(candidate.genuine), len(candidate.impostor))))
    if not auc_new >= auc_now - margin:  # NaN fails too
        return Verdict(False, f"the candidate's AUC {auc_new:.4f} is more than {margin:.3g} below the current "
                              f"{auc_now:.4f}", metrics)
    return Verdict(True, "", metrics)


IDENTITY_SIGMAS = 4.0  # a person's count of crossing pairs may exceed its limit by this many Poisson deviations (+4)


def worst_identity(current: Scores, candidate: Scores, threshold: float, far: float, far_ratio: float
                   ) -> Verdict | None:
    """The person the candidate lets in most beyond the bar, as a refusal; None when every person is within it.

    An average hides one person pulled onto another (an impersonation, a collapse of two people): their pairs are a
    small share of all impostor pairs. So each person's impostor pairs (a labelled set: `Scores.impostor_ids`) are
    counted at the current threshold too: the candidate may cross at most `far_ratio` x what the current model
    crosses for that person (never judged below `far` of its pairs), plus IDENTITY_SIGMAS Poisson deviations and 4,
    so that a person with a few hundred pairs is not refused for the noise of a handful."""
    if current.impostor_ids is None or candidate.impostor_ids is None or \
            current.impostor_ids.shape != candidate.impostor_ids.shape:
        return None
    ids = current.impostor_ids
    people, index = np.unique(ids, return_inverse=True)
    index = index.reshape(ids.shape)

    def crossing(scores: np.ndarray) -> np.ndarray:
        above = scores > threshold
        return np.bincount(index[above, 0], minlength=len(people)) + np.bincount(index[above, 1],
                                                                                 minlength=len(people))

    pairs = np.bincount(index[:, 0], minlength=len(people)) + np.bincount(index[:, 1], minlength=len(people))
    now, new = crossing(current.impostor), crossing(candidate.impostor)
    limit = far_ratio * np.maximum(now, far * pairs)
    allowed = limit + IDENTITY_SIGMAS * np.sqrt(limit) + 4
    excess = new - allowed
    worst = int(np.argmax(excess))
    metrics = {"identity_worst": int(people[worst]) if np.issubdtype(people.dtype, np.integer) else str(people[worst]),
               "identity_worst_crossing": int(new[worst]), "identity_worst_allowed": float(allowed[worst]),
               "identity_worst_pairs": int(pairs[worst])}
    if excess[worst] <= 0:
        return None
    return Verdict(False, f"person {metrics['identity_worst']}: the candidate accepts {new[worst]} of their "
                          f"{pairs[worst]} impostor pairs at the current threshold {threshold:.3f} (current model "
                          f"{now[worst]}, at most {allowed[worst]:.0f}): one person pulled onto others, which the "
                          "average hides", metrics)


def pair_excess(current: Scores, candidate: Scores, jump: float = PAIR_JUMP) -> tuple[np.ndarray, float]:
    """Each impostor pair's rise beyond the pairs' common move (the median rise), and the bar it must stay under:
    `jump`, or PAIR_SIGMAS robust deviations (1.4826 x MAD) of the rises when the model moved further than one
    round (several rounds, judged against the anchor), so that the bar scales with the move as an honest one does."""
    excess = candidate.impostor - current.impostor
    excess -= np.median(excess)
    return excess, max(jump, PAIR_SIGMAS * robust_deviation(excess))


def robust_deviation(centred: np.ndarray) -> float:
    """1.4826 x the median absolute value of values already centred on their median: a standard deviation that a
    few pulled pairs do not move."""
    return 1.4826 * float(np.median(np.abs(centred)))


def worst_pair(current: Scores, candidate: Scores, threshold: float, jump: float = PAIR_JUMP) -> Verdict | None:
    """The impostor pair the candidate moved furthest across the threshold, as a refusal when it rose beyond the
    others by more than the bar (`pair_excess`); None otherwise.

    The per-person count (`worst_identity`) allows a handful of crossings for noise, so one face pulled onto one other
    (an impersonation whose faces happen to be near two of these) passes it. An honest round moves each pair's score
    a little and all of them together; a pull moves one pair far. So any single impostor pair that is accepted under
    the candidate and rose that far beyond the rest refuses it (bench/results/pair_jumps.md: honest rounds' rises)."""
    if len(current.impostor) != len(candidate.impostor) or not len(candidate.impostor):
        return None
    excess, bar = pair_excess(current, candidate, jump)
    flagged = (candidate.impostor > threshold) & (excess > bar)
    if not flagged.any():
        return None
    worst = int(np.argmax(np.where(flagged, excess, -np.inf)))
    ids = candidate.impostor_ids
    who = f"people {ids[worst, 0]} and {ids[worst, 1]}" if ids is not None and len(ids) == len(excess) \
        else f"impostor pair {worst}"
    rise = float(candidate.impostor[worst] - current.impostor[worst])
    metrics = {"pair_worst_rise": rise, "pair_worst_score": float(candidate.impostor[worst]), "pair_bar": bar,
               "pairs_jumped": int(flagged.sum())}
    return Verdict(False, f"{who}: one impostor pair's score rose {rise:.3f} to {candidate.impostor[worst]:.3f}, "
                          f"past the current threshold {threshold:.3f} and {excess[worst]:.3f} beyond the other "
                          f"pairs' move (bar {bar:.3g}): one face pulled onto another, which the averages hide",
                   metrics)
