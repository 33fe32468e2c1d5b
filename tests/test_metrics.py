"""Verification metrics on scores whose answers are known."""
from __future__ import annotations

import numpy as np
import pytest

from models.evaluation.lfw import read_pairs
from models.evaluation.metrics import (
    best_threshold,
    eer,
    kfold_accuracy,
    make_pairs,
    roc_report,
    tar_at_far,
    tpir_at_fpir,
    verification_report,
)


def test_perfect_separation():
    scores = np.array([0.9, 0.8, 0.7, 0.1, 0.2, 0.3])
    same = np.array([1, 1, 1, 0, 0, 0], bool)
    report = roc_report(scores, same)
    assert report["auc"] == 1.0 and report["eer"] == 0.0
    assert 0.3 <= report["eer_threshold"] <= 0.7
    assert report["tar_at_far"]["0.1"] == "n/a"  # 3 impostor pairs cannot measure a FAR of 1e-1


def test_eer_of_overlapping_gaussians():
    rng = np.random.default_rng(0)
    scores = np.concatenate([rng.normal(1, 1, 20000), rng.normal(-1, 1, 20000)])
    same = np.repeat([True, False], 20000)
    rate, threshold = eer(scores, same)
    assert rate == pytest.approx(0.1587, abs=0.01) and threshold == pytest.approx(0.0, abs=0.05)
    tar = tar_at_far(scores, same)
    assert tar["0.1"] == pytest.approx(0.7637, abs=0.02)  # threshold -1 + 1.2816; P(N(1,1) > 0.2816)
    assert tar["0.001"] == pytest.approx(0.1379, abs=0.02)  # threshold -1 + 3.09


def test_kfold_accuracy_picks_thresholds_on_other_folds():
    rng = np.random.default_rng(1)
    scores = np.concatenate([rng.normal(0.7, 0.1, 300), rng.normal(0.2, 0.1, 300)])
    same = np.repeat([True, False], 300)
    folds = np.tile(np.arange(10), 60)
    mean, std, threshold = kfold_accuracy(scores, same, folds)
    assert mean > 0.98 and std < 0.03 and 0.35 < threshold < 0.55
    assert best_threshold(np.array([0.1, 0.2, 0.8, 0.9]), np.array([0, 0, 1, 1], bool)) == pytest.approx(0.5)


def test_pairs_all_when_small_sampled_when_large():
    labels = np.repeat(np.arange(4), 3)
    pairs, same = make_pairs(labels)
    assert len(pairs) == 66 and same.sum() == 12
    labels = np.repeat(np.arange(200), 10)
    pairs, same = make_pairs(labels, max_pairs=5000, seed=0)
    assert len(pairs) <= 5000 and same.sum() == 2500 and (~same).sum() > 2000
    assert np.all(pairs[:, 0] != pairs[:, 1])
    again, _ = make_pairs(labels, max_pairs=5000, seed=0)
    assert np.array_equal(pairs, again)


def test_verification_and_identification_on_clustered_embeddings():
    rng = np.random.default_rng(2)
    centres = rng.normal(size=(20, 32))
    labels = np.repeat(np.arange(20), 6)
    emb = centres[labels] + 0.3 * rng.normal(size=(120, 32))
    report = verification_report(emb, labels)
    assert report["auc"] > 0.99 and report["n_identities"] == 20
    ident = tpir_at_fpir(emb, labels)
    assert ident["rank1"] > 0.95 and ident["tpir_at_fpir"]["0.1"] > 0.9
    assert ident["n_gallery"] == 10 and ident["n_non_mated_probes"] == 60
    noise = tpir_at_fpir(rng.normal(size=(120, 32)), labels)
    assert noise["rank1"] < 0.5


def test_lfw_pairs_file(tmp_path):
    lines = ["2\t2", "A\t1\t2", "B\t1\t3", "A\t1\tB\t2", "C\t4\tA\t2",
             "C\t1\t2", "B\t2\t3", "A\t2\tC\t1", "B\t1\tC\t3"]
    (tmp_path / "pairs.txt").write_text("\n".join(lines) + "\n")
    pairs = read_pairs(tmp_path / "pairs.txt")
    assert pairs.a[0] == "A/A_0001.jpg" and pairs.b[3] == "A/A_0002.jpg"
    assert pairs.same.tolist() == [True, True, False, False] * 2
    assert pairs.folds.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    (tmp_path / "bad.txt").write_text("1\t1\nA\t1\n")
    with pytest.raises(ValueError, match="expected 3 or 4"):
        read_pairs(tmp_path / "bad.txt")
