"""Evaluate an embedder on a face dataset: all/sampled pairs, or LFW's pairs.txt protocol."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from models.evaluation.lfw import pair_indices, read_pairs
from models.evaluation.metrics import cosine_scores, kfold_accuracy, make_pairs, roc_report, tpir_at_fpir
from models.faces.crops import FaceCrops
from models.progress import bar_disable


def embed_all(embedder, images: np.ndarray, batch_size: int = 64, progress: bool = False) -> np.ndarray:
    chunks = range(0, len(images), batch_size)
    out = [embedder.embed(images[i:i + batch_size], batch_size)
           for i in tqdm(chunks, desc="embedding", unit="batch", disable=bar_disable(progress), leave=False)]
    return np.concatenate(out)


def scored_pairs(model, crops: FaceCrops | None, max_pairs: int, seed: int, personalised: bool = False
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(cosine scores, genuine or not, the pairs) of a torch model's embedding on `crops`' sampled pairs; None when
    there are not both kinds of pair."""
    from models.networks.embedders import TorchEmbedder

    if crops is None or len(crops) < 2 or len(np.unique(crops.labels)) < 2:
        return None
    emb = embed_all(TorchEmbedder(model, personalised), crops.images)
    pairs, same = make_pairs(crops.labels, max_pairs, seed)
    if same.all() or not same.any():
        return None
    return cosine_scores(emb, pairs), same, pairs


def verification(model, crops: FaceCrops | None, max_pairs: int, seed: int,
                 personalised: bool = False) -> tuple[dict, tuple[np.ndarray, np.ndarray] | None]:
    """AUC/EER/TAR@FAR of a torch model's embedding on `crops` (a FaceModel, or a bare embedder such as
    models.networks.face_model.global_embedder's), plus the raw scores for ROC plots."""
    scored = scored_pairs(model, crops, max_pairs, seed, personalised)
    if scored is None:
        return {}, None
    scores, same, _ = scored
    return roc_report(scores, same), (scores, same)


UNSEEN_FARS = (1e-1, 1e-2, 1e-3, 1e-4)


def unseen_people(model, crops: FaceCrops | None, max_pairs: int, seed: int) -> tuple[dict, tuple | None]:
    """The federation's first figure: AUC, EER and TAR@FAR down to 1e-4 of a model on people it never trained on,
    each of AUC and TAR@1e-3/1e-4 with a 95% bootstrap interval over people (`models.evaluation.bootstrap`);
    plus the raw scores for ROC plots. ({}, None) when there are too few people."""
    from models.evaluation.bootstrap import people_interval

    scored = scored_pairs(model, crops, max_pairs, seed)
    if scored is None:
        return {}, None
    scores, same, pairs = scored
    report = roc_report(scores, same, UNSEEN_FARS)
    report["interval"] = people_interval(scores, same, crops.labels[pairs], seed=seed)
    return report, (scores, same)


def evaluate_crops(embedder, crops: FaceCrops, pairs_file: Path | None = None, image_root: Path | None = None,
                   max_pairs: int = 200_000, seed: int = 0, progress: bool = False,
                   roc_png: Path | None = None) -> dict:
    """The `ffr eval` report for already-cropped faces."""
    emb = embed_all(embedder, crops.images, progress=progress)
    report: dict = {}
    if pairs_file is not None:
        pairs = read_pairs(pairs_file)
        idx, kept = pair_indices(pairs, crops.paths, image_root)
        if kept.sum() == 0:
            raise ValueError(f"none of the pairs in {pairs_file} name images that were read and cropped")
        same, folds = pairs.same[kept], pairs.folds[kept]
        scores = cosine_scores(emb, idx)
        accuracy, accuracy_std, threshold = kfold_accuracy(scores, same, folds)
        report.update(protocol="lfw-10-fold", accuracy=accuracy, accuracy_std=accuracy_std,
                      accuracy_threshold=threshold, pairs_skipped=int((~kept).sum()))
    else:
        idx, same = make_pairs(crops.labels, max_pairs, seed)
        scores = cosine_scores(emb, idx)
        report["protocol"] = "all-pairs" if len(idx) == len(crops) * (len(crops) - 1) // 2 else "sampled-pairs"
        folds = np.random.default_rng(seed).permutation(len(idx)) % 10  # LFW-style 10-fold accuracy
        accuracy, accuracy_std, threshold = kfold_accuracy(scores, same, folds)
        report.update(accuracy=accuracy, accuracy_std=accuracy_std, accuracy_threshold=threshold)
    report.update(roc_report(scores, same))
    if len(np.unique(crops.labels)) >= 2:
        report["identification"] = tpir_at_fpir(emb, crops.labels, seed=seed)
    report.update(n_images=len(crops), n_identities=len(crops.identities),
                  faces_not_detected=crops.report.faces_not_detected,
                  faces_aligned=crops.report.n_aligned, haar_fallbacks=crops.report.n_haar_fallback,
                  center_fallbacks=crops.report.n_center_fallback,
                  unreadable_images=len(crops.report.unreadable),
                  data_kind="synthetic" if crops.synthetic else "real")
    if roc_png is not None:
        from models.evaluation.plots import roc_png as draw

        draw({"model": (scores, same)}, roc_png, title="ROC", synthetic=crops.synthetic)
        report["roc_png"] = str(roc_png)
    return report
