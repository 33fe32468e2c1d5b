"""FedFR's local techniques (models.training.fedfr, models.networks.dfc.fit_dfc, edge_client.local_training)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from edge_client.local_training import RoundInputs, train_round
from models.networks.dfc import NEGATIVE, BinaryClassifiers
from models.training.fedfr import contrastive_loss, hard_negatives, negative_margin_loss
from protocol.messages import TrainingConfig


def test_hard_negatives_are_exactly_the_public_faces_above_the_threshold():
    local = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    angles = torch.tensor([0.0, 0.5, 1.2, 1.5, math.pi])  # cos to the first local: 1, .88, .36, .07, -1
    public = torch.stack([torch.cos(angles), torch.zeros(5), torch.sin(angles)], dim=1) * 3.0  # norms don't count
    public = torch.cat([public, torch.tensor([[0.0, 0.45, 0.89]])])  # cos .45 to the second local only
    assert hard_negatives(public, local, 0.4).tolist() == [0, 1, 5]
    assert hard_negatives(public, local, 0.9).tolist() == [0]
    assert hard_negatives(public, local, 0.4, block=2).tolist() == [0, 1, 5], "blocks change nothing"
    assert hard_negatives(public[:0], local).numel() == 0 and hard_negatives(public, local[:0]).numel() == 0


def test_contrastive_term_is_zero_when_features_agree_and_grows_as_they_diverge():
    torch.manual_seed(0)
    g = F.normalize(torch.randn(8, 16), dim=1)
    assert abs(float(contrastive_loss(g, g, g))) < 1e-6
    prev = F.normalize(torch.randn(8, 16), dim=1)
    values = []
    for t in (0.0, 0.3, 0.6, 1.0):  # the local feature walks from the global one to the previous one
        f = F.normalize((1 - t) * g + t * prev, dim=1)
        values.append(float(contrastive_loss(f, g, prev)))
    assert values[0] < 0 < values[-1] and all(a < b for a, b in zip(values, values[1:]))
    assert float(contrastive_loss(prev, g, prev, tau=0.1)) > float(contrastive_loss(prev, g, prev, tau=0.5))


def test_public_faces_are_negatives_for_every_one_vs_all_classifier():
    torch.manual_seed(0)
    clf = BinaryClassifiers(8, 3)
    x = torch.randn(4, 8)
    none = torch.full((4,), NEGATIVE)
    g = torch.nn.functional.softplus  # the negative term alone, as SphereFace2 writes it
    from models.networks.dfc import sphereface2_g

    logits = clf.r * (sphereface2_g(clf.cosine(x), clf.t) + clf.m) + clf.bias
    expected = ((1 - clf.lam) * g(logits)).sum(1).mean() / clf.r
    assert torch.allclose(clf.loss(x, none), expected)
    assert negative_margin_loss(x, clf.weight, 0.4) >= 0
    assert float(negative_margin_loss(x[:0], clf.weight)) == 0.0


def _two_people(faces_dir, n_train: int = 10):
    from models.faces.crops import CropConfig, crop_index
    from models.faces.datasets import load_index

    crops = crop_index(load_index(faces_dir / "glint24_aligned"), CropConfig(detector="none"), progress=False)
    people = crops.select(np.isin(crops.labels, [0, 1]))
    rng = np.random.default_rng(0)
    train = np.zeros(len(people), bool)
    for p in (0, 1):
        train[rng.choice(np.flatnonzero(people.labels == p), n_train, replace=False)] = True
    return people.select(train), people.select(~train), crops.select(np.isin(crops.labels, range(10, 24)))


def _separation(model, crops, personalised: bool) -> float:
    """d' of genuine against impostor cosines: how far apart the two people's scores lie."""
    from models.evaluation.evaluate import embed_all
    from models.networks.embedders import TorchEmbedder

    emb = embed_all(TorchEmbedder(model, personalised), crops.images)
    i, j = np.triu_indices(len(emb), 1)
    scores, same = (emb[i] * emb[j]).sum(1), crops.labels[i] == crops.labels[j]
    genuine, impostor = scores[same], scores[~same]
    return float((genuine.mean() - impostor.mean()) / np.sqrt((genuine.var() + impostor.var()) / 2))


def test_dfc_personalises_two_people_after_one_short_round(faces_dir):
    """Real faces (Glint24, two people, 10 training images each), one local epoch from the shipped model: the
    personalised embedding [Theta, Pi(Theta)] separates the two on their held-out images better than Theta."""
    from models.networks.face_model import FaceModel, ModelConfig, from_numpy_state
    from models.networks.face_weights import face_global_state

    train, held_out, _ = _two_people(faces_dir)
    separation = {}
    for steps in (0, 300):  # 0: the branch trained only beside the backbone, as before the fit existed
        torch.manual_seed(0)
        model = FaceModel(ModelConfig(n_classes=2, pretrained=False, dfc=True))
        train_round(model, train, from_numpy_state(face_global_state()),
                    TrainingConfig(dfc_steps=steps, epochs=1, batch_size=32, lr=1e-4))
        separation[steps] = _separation(model, held_out, False), _separation(model, held_out, True)
    generic, personalised = separation[300]
    assert personalised > 1.5 * generic, separation
    assert abs(separation[0][1] - separation[0][0]) < 0.05 * separation[0][0], "without the fit Pi stays ~identity"


def test_a_fedfr_round_samples_hard_negatives_and_keeps_them_on_the_device(faces_dir):
    from models.networks.face_model import FaceModel, ModelConfig, from_numpy_state
    from models.networks.face_weights import face_global_state
    from models.public_set import PublicSet

    torch.manual_seed(0)
    train, _, public = _two_people(faces_dir, 6)
    model = FaceModel(ModelConfig(n_classes=2, pretrained=False, dfc=True, dfc_weight=10.0))
    global_state = from_numpy_state(face_global_state())
    objective = TrainingConfig(hard_negatives=True, t_hn=0.3, contrastive=True, dfc_steps=50, epochs=1, batch_size=8,
                               lr=1e-4)
    result = train_round(model, train, global_state, objective,
                         inputs=RoundInputs(public=PublicSet(public.images[:400]), previous_state=global_state))
    assert set(result.delta) == set(global_state), "only the backbone's delta"
    assert 0 < result.private_metrics["hn_fraction"] <= 1 and "neg_loss" in result.private_metrics
    assert not {"hn_fraction", "hn_sampled", "neg_loss", "total_loss", "dfc_fit_loss"} & set(result.metrics), \
        "nothing about D_g is sent"
    assert abs(result.metrics["con_loss"]) < 1e-5, "previous = global: the contrastive term pulls nothing"
    assert all(np.isfinite(v).all() for v in result.delta.values())


def test_public_set_file_round_trip_and_refusals(tmp_path, synthetic_dir, capsys):
    from ffr.cli import main
    from models.public_set import PublicSetError, load_public_set

    out = tmp_path / "public.safetensors"
    assert main(["-q", "edge", "public-set", "--data", str(synthetic_dir), "--out", str(out), "--limit", "7"]) == 0
    sha = capsys.readouterr().out.split("sha256 ")[1].strip()
    public = load_public_set(out, sha)
    assert public.images.shape == (7, 128, 128, 3) and public.images.dtype == np.uint8
    names = sorted(
        {p.parent.name for p in synthetic_dir.rglob("*.png")} | {p.parent.name for p in synthetic_dir.rglob("*.jpg")}
    )
    assert public.labels is not None and public.labels.dtype == np.int64 and public.labels.max() < len(names), \
        "one folder per person: a labelled set"
    flat = tmp_path / "flat"
    flat.mkdir()
    for i, f in enumerate(sorted(synthetic_dir.rglob("*.png"))[:3]):
        (flat / f"{i}.png").write_bytes(f.read_bytes())
    assert main(["-q", "edge", "public-set", "--data", str(flat), "--out", str(tmp_path / "flat.safetensors")]) == 0
    assert load_public_set(tmp_path / "flat.safetensors").labels is None, "a flat folder: unlabelled"
    from safetensors.numpy import save_file

    save_file({"images": public.images, "labels": np.full(7, 99, np.int64)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(PublicSetError, match="identity labels"):
        load_public_set(tmp_path / "bad.safetensors")

    with pytest.raises(PublicSetError, match="sha256"):
        load_public_set(out, "0" * 64)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(PublicSetError, match="not a public set"):
        load_public_set(tmp_path / "junk.safetensors")
    assert main(["-q", "edge", "public-set", "--data", str(tmp_path / "nowhere"), "--out", str(out)]) == 2


def test_a_labelled_public_set_joins_the_classification_for_one_round(faces_dir):
    """Balanced CosFace (eq. 3): sampled public people become extra classes, their centres imprinted from all
    their public images under the received model; they live for the round only and are never sent."""
    from edge_client.local_training import sample_hard_negatives
    from models.networks.face_model import FaceModel, ModelConfig, from_numpy_state
    from models.networks.face_weights import face_global_state
    from models.public_set import PublicSet
    from models.training.crop_batches import frozen_features

    torch.manual_seed(0)
    train, _, public = _two_people(faces_dir, 6)
    pick = np.arange(0, len(public), 6)
    labelled = PublicSet(public.images[pick], (public.labels[pick] - 10).astype(np.int64))
    model = FaceModel(ModelConfig(n_classes=2, pretrained=False, dfc=True))
    global_state = from_numpy_state(face_global_state())
    model.load_state_dict(global_state, strict=False)

    local = frozen_features(model.backbone, train.images)
    sample = sample_hard_negatives(model.backbone, labelled, local, 0.3, 0, labelled_classes=True)
    chosen = hard_negatives(frozen_features(model.backbone, labelled.images), local, 0.3)
    classes = np.unique(labelled.labels[chosen.numpy()])
    assert len(sample) == len(chosen) > 0 and sample.centres.shape == (len(classes), 128)
    assert np.array_equal(classes[sample.labels.numpy()], labelled.labels[chosen.numpy()])
    features = F.normalize(frozen_features(model.backbone, labelled.images), dim=1)
    for k, c in enumerate(classes):  # each centre: the normalised mean over all of that person's public images
        expected = F.normalize(features[torch.from_numpy(labelled.labels == c)].mean(0), dim=0)
        assert torch.allclose(sample.centres[k].detach(), expected, atol=1e-5)

    result = train_round(model, train, global_state,
                         TrainingConfig(hard_negatives=True, t_hn=0.3, dfc_steps=20, epochs=1, batch_size=8, lr=1e-4),
                         inputs=RoundInputs(public=labelled))
    assert result.private_metrics["hn_classes"] == len(classes)
    assert result.private_metrics["neg_loss"] == 0.0, "labelled public faces are classes, not margin negatives"
    assert model.head.weight.shape == (2, 128), "the public centres lived for the round only"
    assert not {"hn_fraction", "hn_sampled", "hn_classes", "total_loss", "dfc_fit_loss", "neg_loss"} & \
        set(result.metrics), "nothing about D_g is sent"
    assert all(np.isfinite(v).all() for v in result.delta.values())
