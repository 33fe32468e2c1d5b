"""One round of device training: what changes, what is returned, and what FedProx does."""
from __future__ import annotations

import numpy as np
import torch
from pydantic import BaseModel

from edge_client.local_training import train_round
from models.faces.crops import CropConfig, crop_index
from models.faces.datasets import load_index
from models.networks.face_model import FaceModel, ModelConfig, shareable_state
from protocol.messages import TrainingConfig
from protocol.methods import FedProx
from protocol.training_parts import OptimiserSettings


def _round(synthetic_dir, prox_mu: float):
    torch.manual_seed(0)
    crops = crop_index(load_index(synthetic_dir), CropConfig(detector="none"), use_cache=False, progress=False)
    model = FaceModel(ModelConfig(n_classes=len(crops.identities), width_mult=0.35, pretrained=False, dfc=True))
    global_state = {k: v.clone() for k, v in shareable_state(model).items()}
    head_before = model.head.weight.detach().clone()
    dfc_before = model.dfc.transform.weight.detach().clone()
    settings = TrainingConfig(method=FedProx(), optimisation=OptimiserSettings(epochs=1, batch_size=16, lr=1e-2))
    # mu = 50 is beyond what a round announcement may carry (10): set here past that check (pydantic's own, unvalidated
    # copy; a message's model_copy validates), as a strong pull
    method = BaseModel.model_copy(settings.method, update={"prox_mu": prox_mu})
    result = train_round(model, crops, global_state, BaseModel.model_copy(settings, update={"method": method}))
    return model, global_state, result, head_before, dfc_before


def test_only_the_backbone_delta_is_returned(synthetic_dir):
    model, global_state, result, head_before, dfc_before = _round(synthetic_dir, 0.0)
    assert set(result.delta) == set(global_state)
    assert result.n_samples == 60 and 0.0 <= result.metrics["train_acc"] <= 1.0
    assert result.delta["backbone.bn.num_batches_tracked"].dtype == np.int64
    local = shareable_state(model)
    for name, delta in result.delta.items():
        if delta.dtype.kind == "f":
            assert np.allclose(global_state[name].double().numpy() + delta, local[name].double().numpy(), atol=1e-6)
    assert not torch.equal(model.head.weight, head_before) and not torch.equal(model.dfc.transform.weight, dfc_before)


def test_fedprox_keeps_the_local_model_closer_to_the_global_one(synthetic_dir):
    drift = {}
    for mu in (0.0, 50.0):
        _, _, result, _, _ = _round(synthetic_dir, mu)
        drift[mu] = sum(float(np.sum(d.astype(np.float64) ** 2)) for n, d in result.delta.items()
                        if d.dtype.kind == "f" and "running" not in n)
    assert drift[50.0] < drift[0.0]


def test_imprint_sets_each_centre_to_its_class_mean_and_leaves_absent_classes():
    from models.networks.heads import CosFaceHead, SoftmaxHead, imprint

    head = CosFaceHead(2, 3)
    before = head.weight.detach().clone()
    features = torch.tensor([[2.0, 0.0], [0.0, 5.0], [0.0, 1.0], [1.0, 1.0]])
    labels = torch.tensor([0, 0, 0, 1])
    assert imprint(head, features, labels)
    expected0 = torch.nn.functional.normalize(torch.tensor([1.0, 2.0]), dim=0)  # mean of the unit vectors
    assert torch.allclose(head.weight[0], expected0, atol=1e-6)
    assert torch.allclose(head.weight[1], torch.tensor([0.5 ** 0.5, 0.5 ** 0.5]), atol=1e-6)
    assert torch.equal(head.weight[2], before[2])
    assert not imprint(SoftmaxHead(2, 3), features, labels)


def test_a_round_starts_from_centres_imprinted_by_the_received_model(synthetic_dir):
    from models.training.crop_batches import frozen_features

    crops = crop_index(load_index(synthetic_dir), CropConfig(detector="none"), use_cache=False, progress=False)
    torch.manual_seed(0)
    model = FaceModel(ModelConfig(n_classes=len(crops.identities), width_mult=0.35, pretrained=False))
    global_state = {k: v.clone() for k, v in shareable_state(model).items()}
    features = torch.nn.functional.normalize(frozen_features(model.backbone, crops.images), dim=1)
    means = torch.stack([features[torch.from_numpy(crops.labels == c)].mean(0) for c in range(len(crops.identities))])
    for imprinted in (True, False):
        train_round(model, crops, global_state,  # lr 1e-9: the head barely moves
                    TrainingConfig(imprint_head=imprinted, dfc_steps=0, epochs=1, batch_size=16, lr=1e-9))
        cosine = torch.nn.functional.cosine_similarity(model.head.weight.detach(), means).min()
        assert (cosine > 0.999) == imprinted
        model.head.weight.data.normal_()  # a stale head, as after another model's round
