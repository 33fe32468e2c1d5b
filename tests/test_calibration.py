"""`ffr device calibrate`'s threshold is set on the statistic a decision uses (a face against a template), so that
no impostor it has seen would be accepted, and with too few impostors to count the rate it goes beyond the highest
seen to the fitted tail."""
from __future__ import annotations

import numpy as np
import pytest

from edge_client.recognizer import calibrate, calibration_scores, normalise


def people(n_people: int, faces: int, noise: float, seed: int = 0) -> list[np.ndarray]:
    """Unit embeddings, a model's faces in miniature: a direction every face shares (real embeddings are not
    centred), one per person, and per-face noise."""
    rng = np.random.default_rng(seed)
    common = 1.5 * rng.normal(size=128)
    return [normalise(common + rng.normal(size=128) + noise * rng.normal(size=(faces, 128))) for _ in range(n_people)]


def test_impostor_scores_are_faces_against_other_peoples_templates():
    faces = people(3, 5, noise=2.0)
    _, impostor, _ = calibration_scores(faces)
    templates = [normalise(f.mean(0)) for f in faces]
    expected = np.concatenate([f @ templates[j] for i, f in enumerate(faces) for j in range(3) if j != i])
    assert np.allclose(np.sort(impostor), np.sort(expected)) and len(impostor) == 3 * 5 * 2


def test_no_impostor_face_seen_in_calibration_would_be_accepted():
    """The decision is a probe against a template. Face-to-face impostor scores run lower than that (noisy faces,
    clean templates), so a threshold set on them let a stranger through; this one refuses every such face."""
    faces = people(3, 5, noise=1.5)
    cal = calibrate(faces, far=0.01, model_sha256="0" * 64)
    templates = [normalise(f.mean(0)) for f in faces]
    decisions = [float(f[k] @ templates[j]) for i, f in enumerate(faces) for j in range(3) if j != i
                 for k in range(len(f))]
    pairwise_max = max(float((faces[i] @ faces[j].T).max()) for i in range(3) for j in range(i + 1, 3))
    assert pairwise_max < max(decisions)  # the old statistic's threshold would have accepted some of them
    assert cal.threshold >= max(decisions) and not cal.measurable


def test_too_few_impostors_go_beyond_the_highest_seen_and_enough_count_the_rate():
    few = calibration_scores(people(2, 3, noise=2.0))[1]
    cal = calibrate(people(2, 3, noise=2.0), far=0.01, model_sha256="0" * 64)
    assert cal.threshold > few.max()  # 6 scores: the normal's 99th percentile lies above the highest
    many = people(12, 10, noise=2.0, seed=1)  # 12 x 10 x 11 = 1,320 impostor scores >= 1 / 0.01
    cal = calibrate(many, far=0.01, model_sha256="0" * 64)
    impostor = calibration_scores(many)[1]
    assert cal.measurable and np.mean(impostor > cal.threshold) <= 0.01
    assert 0.0 <= cal.expected_frr <= 1.0 and cal.genuine_pairs == 12 * 10


def _strangers(n: int, shared: float, seed: int) -> np.ndarray:
    """Faces of nobody the device knows, noisy as `people`' faces (person and face noise, std sqrt(1 + 2^2)), sharing
    `shared` of its common direction: public photos from another camera and crop share less of it and score lower
    against the device's templates."""
    common = 1.5 * np.random.default_rng(0).normal(size=128)  # `people`' direction (seed 0)
    return normalise(shared * common + np.sqrt(5.0) * np.random.default_rng(seed).normal(size=(n, 128)))


def test_public_faces_from_another_capture_are_moved_to_where_the_devices_strangers_score():
    """A threshold set on public faces that score lower than the device's own strangers let those strangers in
    (4x the promised FAR on CelebA devices); their scores are moved up to the device's own impostors' median."""
    faces = people(4, 8, noise=2.0)
    door = _strangers(3000, 1.0, seed=5)  # strangers at the door: the device's own capture
    public = _strangers(600, 0.3, seed=9)  # public faces: another capture, lower scores
    templates = np.stack([normalise(f.mean(0)) for f in faces])
    at_door = (door @ templates.T).ravel()
    moved = calibrate(faces, far=0.01, model_sha256="0" * 64, strangers=public)
    _, pooled, _ = calibration_scores(faces)
    unmoved = float(np.quantile(np.concatenate([pooled, (public @ templates.T).ravel()]), 0.99))
    assert np.mean(at_door > unmoved) > 0.02  # the old pooled threshold: over twice the promise at the door
    assert moved.threshold > unmoved and np.mean(at_door > moved.threshold) <= 0.02


def test_templates_of_all_faces_score_impostors_as_the_door_does():
    """Judged on a few held-out faces, impostors are scored against the templates the door uses (all faces)."""
    faces = people(3, 12, noise=2.0)
    templates = np.stack([normalise(f.mean(0)) for f in faces])
    few = [f[:3] for f in faces]
    _, impostor, _ = calibration_scores(few, templates=templates)
    expected = np.concatenate([f @ templates[j] for i, f in enumerate(few) for j in range(3) if j != i])
    assert np.allclose(np.sort(impostor), np.sort(expected))


def test_a_model_fitted_on_the_devices_people_is_given_the_global_models_shift_at_least():
    """A personalised model pushed the device's people apart, so their impostor scores, and the shift measured on
    them, run low; `min_shift` (the global model's) moves its public faces at least that far."""
    faces, public = people(4, 8, noise=2.0), _strangers(600, 0.3, seed=9)
    own = calibrate(faces, far=0.01, model_sha256="0" * 64, strangers=public)
    floored = calibrate(faces, far=0.01, model_sha256="0" * 64, strangers=public, min_shift=own.capture_shift + 0.1)
    assert floored.capture_shift == pytest.approx(own.capture_shift + 0.1) and floored.threshold > own.threshold
    kept = calibrate(faces, far=0.01, model_sha256="0" * 64, strangers=public, min_shift=0.0)
    assert kept.capture_shift == own.capture_shift > 0  # never below the model's own


def test_the_capture_shift_allows_for_the_error_of_a_few_peoples_median():
    """A device of few people knows its own place from a few dozen scores; a threshold too low by that error lets in
    more than one too high keeps out, so the shift adds the median's standard error, which fades with more scores."""
    from edge_client.recognizer import capture_shift

    rng = np.random.default_rng(3)
    public = rng.normal(0.10, 0.1, 20_000)
    few, many = rng.normal(0.15, 0.1, 30), rng.normal(0.15, 0.1, 30_000)
    gap = float(np.median(few) - np.median(public))
    assert capture_shift(few, public) == pytest.approx(gap + np.sqrt(np.pi / 2) * few.std() / np.sqrt(30))
    assert capture_shift(many, public) == pytest.approx(np.median(many) - np.median(public), abs=1e-3)
    assert capture_shift(public[:30] - 0.2, public) == 0.0  # never moved down
