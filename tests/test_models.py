"""Embedder, heads, DFC branch, and the line between what may leave a device and what may not."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from models.networks.backbone import FaceEmbedder
from models.networks.dfc import BinaryClassifiers, DFCBranch, fit_dfc, personalised_embedding, sphereface2_g
from models.networks.face_model import FaceModel, ModelConfig, load_shareable_state, private_state, shareable_state
from models.networks.heads import ArcFaceHead, CosFaceHead, SoftmaxHead, build_head, inverse_frequency_weights
from models.networks.pretrained import PretrainedWeightsError, imagenet_weights_path, verified_imagenet_weights
from protocol.messages import TrainingConfig


def test_embedding_is_128d_unit_norm_and_width_is_configurable():
    for width in (0.35, 1.0):
        net = FaceEmbedder(width_mult=width, pretrained=False).eval()
        emb = net(torch.randn(3, 3, 128, 128))
        assert emb.shape == (3, 128)
        assert torch.allclose(emb.norm(dim=1), torch.ones(3), atol=1e-5)
    assert sum(p.numel() for p in FaceEmbedder(width_mult=0.35, pretrained=False).parameters()) < \
        sum(p.numel() for p in FaceEmbedder(width_mult=1.0, pretrained=False).parameters())


def test_imagenet_weights_are_the_default_and_checked():
    path = verified_imagenet_weights()
    assert path.name == "mobilenet_v2-b0353104.pth"
    pretrained, scratch = FaceEmbedder(), FaceEmbedder(pretrained=False)
    state = torch.load(imagenet_weights_path(), map_location="cpu", weights_only=True)
    assert torch.equal(pretrained.features[0][0].weight, state["features.0.0.weight"])
    assert not torch.equal(scratch.features[0][0].weight, state["features.0.0.weight"])


def test_wrong_weights_file_is_refused(tmp_path):
    fake = tmp_path / "mobilenet_v2-b0353104.pth"
    fake.write_bytes(b"not the real weights")
    with pytest.raises(PretrainedWeightsError, match="does not start with b0353104"):
        verified_imagenet_weights(fake)
    with pytest.raises(ValueError, match="width_mult=1.0"):
        FaceEmbedder(width_mult=0.5, pretrained=True)


def test_cosface_and_arcface_apply_their_margins_to_the_true_class_only():
    emb = F.normalize(torch.randn(4, 16), dim=1)
    labels = torch.tensor([0, 1, 2, 0])
    cos_head = CosFaceHead(16, 3, s=10.0, m=0.3)
    cos = cos_head.cosine(emb)
    out = cos_head(emb, labels)
    one_hot = F.one_hot(labels, 3).bool()
    assert torch.allclose(out[one_hot], 10.0 * (cos[one_hot] - 0.3), atol=1e-5)
    assert torch.allclose(out[~one_hot], 10.0 * cos[~one_hot], atol=1e-5)
    arc = ArcFaceHead(16, 3, s=10.0, m=0.2)
    cos = arc.cosine(emb)
    out = arc(emb, labels)
    theta = torch.acos(cos[one_hot])
    expected = torch.where(theta + 0.2 < math.pi, torch.cos(theta + 0.2), cos[one_hot] - math.sin(math.pi - 0.2) * 0.2)
    assert torch.allclose(out[one_hot], 10.0 * expected, atol=1e-4)
    assert torch.allclose(out[~one_hot], 10.0 * cos[~one_hot], atol=1e-5)
    assert isinstance(build_head("softmax", 16, 3), SoftmaxHead)
    with pytest.raises(ValueError, match="unknown head"):
        build_head("triplet", 16, 3)


def test_inverse_frequency_weights():
    w = inverse_frequency_weights(torch.tensor([0, 0, 0, 1]), 3)
    assert torch.allclose(w, torch.tensor([4 / 9, 4 / 3, 0.0]))


def test_sphereface2_loss_matches_its_formula():
    torch.manual_seed(0)
    clf = BinaryClassifiers(8, 4, lam=0.7, r=30.0, m=0.4, t=3.0)
    x, y = torch.randn(5, 8), torch.tensor([0, 1, 2, 3, 0])
    g = sphereface2_g(clf.cosine(x), 3.0)
    b = clf.bias
    expected = 0.0
    for i in range(5):
        for k in range(4):
            if k == y[i]:
                expected += 0.7 / 30 * torch.log1p(torch.exp(-(30 * (g[i, k] - 0.4) + b)))
            else:
                expected += 0.3 / 30 * torch.log1p(torch.exp(30 * (g[i, k] + 0.4) + b))
    assert torch.allclose(clf.loss(x, y), expected / 5, atol=1e-5)
    assert torch.allclose(sphereface2_g(torch.tensor([-1.0, 0.0, 1.0]), 3.0), torch.tensor([-1.0, -0.75, 1.0]))


def test_dfc_branch_learns_and_starts_as_identity():
    torch.manual_seed(0)
    dfc = DFCBranch(16, 4)
    generic = F.normalize(torch.randn(32, 16), dim=1)
    assert torch.allclose(dfc.customise(generic), generic, atol=1e-6)  # Pi starts as the identity
    labels = torch.arange(32) % 4
    opt = torch.optim.Adam(dfc.parameters(), lr=1e-2)
    first = float(dfc.loss(generic, labels).detach())
    for _ in range(50):
        opt.zero_grad()
        dfc.loss(generic, labels).backward()
        opt.step()
    assert float(dfc.loss(generic, labels).detach()) < first * 0.5
    pers = personalised_embedding(generic, dfc.customise(generic))
    assert pers.shape == (32, 32) and torch.allclose(pers.norm(dim=1), torch.ones(32), atol=1e-5)


def test_the_branchs_classifiers_vote_for_an_enrolled_person_and_not_for_a_stranger():
    """Omega's posteriors in the personalised embedding raise a genuine pair's cosine over the halves' alone, and
    leave a stranger's cosine with an enrolled face where it was (within 0.1): 12 people as clusters in 64-d whose
    faces' cosine with their centre is about 0.7, as a face embedder's are. (With two or three people and no
    negatives each classifier also says yes to strangers: measured, the vote then changes nothing.)"""
    torch.manual_seed(0)
    centres = F.normalize(torch.randn(18, 64), dim=1)  # 0-11 enrolled, 12-17 strangers
    faces = lambda person, n: F.normalize(centres[person] + 0.12 * torch.randn(n, 64), dim=1)  # noqa: E731
    enrolled = torch.cat([faces(k, 10) for k in range(12)])
    branch = DFCBranch(64, 12, posterior_weight=0.3)
    fit_dfc(branch, enrolled, torch.arange(12).repeat_interleave(10), steps=300, lr=1e-2)
    with torch.no_grad():
        a, b, stranger = faces(0, 50), faces(0, 50), torch.cat([faces(k, 10) for k in range(12, 17)])
        custom = lambda x: personalised_embedding(x, branch.customise(x))  # noqa: E731 - FedFR's halves alone
        voted = lambda x: branch.personalise(x)  # noqa: E731
        genuine_gain = ((voted(a) * voted(b)).sum(1) - (custom(a) * custom(b)).sum(1)).mean()
        stranger_gain = ((voted(a) * voted(stranger)).sum(1) - (custom(a) * custom(stranger)).sum(1)).mean()
        assert branch.posteriors(a)[:, 0].mean() > 0.5 > branch.posteriors(stranger).max(1).values.mean()
    assert genuine_gain > 0.03 and stranger_gain < 0.1 and genuine_gain > stranger_gain + 0.03
    assert torch.allclose(voted(a).norm(dim=1), torch.ones(50), atol=1e-5) and voted(a).shape == (50, 128 + 12)


def test_the_customised_halfs_share_weighs_the_two_cosines():
    """With beta the customised half's share, a cosine of two personalised embeddings is (1 - beta) cos_Theta +
    beta cos_Pi; FedFR's equal halves are beta 0.5, and a share outside [0, 1] is refused."""
    torch.manual_seed(0)
    g, c = torch.randn(6, 16), torch.randn(6, 16)
    cos_g = (F.normalize(g[:3], dim=1) * F.normalize(g[3:], dim=1)).sum(1)
    cos_c = (F.normalize(c[:3], dim=1) * F.normalize(c[3:], dim=1)).sum(1)
    for beta in (0.0, 0.5, 0.8, 1.0):
        e = personalised_embedding(g, c, custom_weight=beta)
        assert torch.allclose((e[:3] * e[3:]).sum(1), (1 - beta) * cos_g + beta * cos_c, atol=1e-6)
        assert torch.allclose(e.norm(dim=1), torch.ones(6), atol=1e-6)
    for beta in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="custom_weight"):
            personalised_embedding(g, c, custom_weight=beta)


def test_generic_and_personalised_embeddings_are_both_available():
    model = FaceModel(ModelConfig(n_classes=3, width_mult=0.35, pretrained=False, dfc=True)).eval()
    x = torch.randn(2, 3, 128, 128)
    people = 3 if model.dfc.posterior_weight > 0 else 0  # the classifiers' vote, one posterior per person, if on
    assert model.embed(x).shape == (2, 128) and model.embed_personalised(x).shape == (2, 256 + people)
    with pytest.raises(ValueError, match="no DFC branch"):
        FaceModel(ModelConfig(n_classes=3, width_mult=0.35, pretrained=False)).embed_personalised(x)


def test_only_the_backbone_is_shareable():
    model = FaceModel(ModelConfig(n_classes=5, width_mult=0.35, pretrained=False, dfc=True))
    shared = shareable_state(model)
    assert shared and all(k.startswith("backbone.") for k in shared)
    assert set(shared) == {f"backbone.{k}" for k in model.backbone.state_dict()}
    assert not any(k.startswith(("head.", "dfc.")) for k in shared)
    private = private_state(model)
    assert {k.split(".")[0] for k in private} == {"head", "dfc"}
    assert set(shared) | set(private) == set(model.state_dict())
    # and the shareable state is exactly what a device accepts back
    other = FaceModel(ModelConfig(n_classes=2, width_mult=0.35, pretrained=False))
    load_shareable_state(other, shared)
    assert torch.equal(other.backbone.embedding.weight, model.backbone.embedding.weight)
    with pytest.raises(ValueError, match="unknown"):
        load_shareable_state(other, {**shared, "head.weight": torch.zeros(1)})


def test_an_anchored_fit_keeps_a_few_peoples_branch_from_folding_strangers_onto_them():
    """Fitted freely on three people, Pi folds faces towards their few directions, and a stranger's customised
    cosine with an enrolled face rises far above its generic one; paying for Pi's drift from the identity
    (`fit_dfc`'s anchor, `DFCBranch.drift`) keeps it near the generic cosine, and the people still apart."""
    torch.manual_seed(0)
    centres = F.normalize(torch.randn(9, 64), dim=1)  # 0-2 enrolled, 3-8 strangers
    faces = lambda person, n: F.normalize(centres[person] + 0.12 * torch.randn(n, 64), dim=1)  # noqa: E731
    enrolled, labels = torch.cat([faces(k, 10) for k in range(3)]), torch.arange(3).repeat_interleave(10)
    a, stranger = faces(0, 50), torch.cat([faces(k, 10) for k in range(3, 9)])
    generic = (a @ stranger.T).mean()
    rises, drifts = {}, {}
    for anchor in (0.0, 1.0):
        branch = DFCBranch(64, 3)
        fit_dfc(branch, enrolled, labels, steps=300, lr=1e-2, anchor=anchor)
        with torch.no_grad():
            rises[anchor] = float((branch.customise(a) @ branch.customise(stranger).T).mean() - generic)
            drifts[anchor] = float(branch.drift())
            own = branch.customise(faces(1, 50))
            assert float((branch.customise(a) @ own.T).mean()) < float((own @ own.T).mean()) - 0.3
    assert drifts[1.0] < 0.25 * drifts[0.0]
    assert rises[0.0] > 0.1 and rises[1.0] < 0.5 * rises[0.0], rises
    with pytest.raises(ValueError):
        TrainingConfig(dfc_anchor=-1.0)
