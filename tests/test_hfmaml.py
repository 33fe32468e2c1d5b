"""HF-MAML (eq. 1-3) and the embedding regulariser (eq. 4) of the HF-MAML face paper, on tiny real networks."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from models.training.hfmaml import embedding_regulariser, fd_hessian_vector_product, gradients, hf_maml_step


def _tiny(dtype):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)
    batches = [(torch.randn(24, 6, dtype=dtype), torch.randint(0, 4, (24,))) for _ in range(3)]
    return net, batches, (lambda b: F.cross_entropy(net(b[0]), b[1]))


def _exact_hvp(loss_fn, params, vector, batch):
    grads = torch.autograd.grad(loss_fn(batch), params, create_graph=True)
    return torch.autograd.grad(sum((g * v).sum() for g, v in zip(grads, vector)), params)


def _rel(a, b) -> float:
    return float(torch.sqrt(sum(((x - y) ** 2).sum() for x, y in zip(a, b))) / torch.sqrt(sum((y**2).sum() for y in b)))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_finite_difference_hessian_vector_product_matches_autograd(dtype):
    net, batches, loss_fn = _tiny(dtype)
    params = list(net.parameters())
    before = [p.detach().clone() for p in params]
    vector = [torch.randn_like(p) for p in params]
    approx = fd_hessian_vector_product(loss_fn, params, vector, batches[0], delta=1e-3)
    assert _rel(approx, _exact_hvp(loss_fn, params, vector, batches[0])) < 1e-3
    assert all(torch.equal(p, b) for p, b in zip(params, before)), "the weights are left as they were"


def test_one_hf_maml_step_is_eq_1_with_the_exact_hessian_up_to_the_approximation():
    net, batches, loss_fn = _tiny(torch.float64)
    params = list(net.parameters())
    start = [p.detach().clone() for p in params]
    alpha, beta = 0.05, 0.1
    # eq. 1-2 by hand, with autograd's exact Hessian-vector product
    g, _ = gradients(loss_fn, params, batches[0])
    with torch.no_grad():
        for p, gi in zip(params, g):
            p.sub_(alpha * gi)
    g_outer, _ = gradients(loss_fn, params, batches[1])
    with torch.no_grad():
        for p, s in zip(params, start):
            p.copy_(s)
    hvp = _exact_hvp(loss_fn, params, g_outer, batches[2])
    expected = [s - beta * (go - alpha * h) for s, go, h in zip(start, g_outer, hvp)]
    hf_maml_step(loss_fn, params, tuple(batches), alpha, beta, delta=1e-4)
    assert _rel([p.detach() for p in params], expected) < 1e-6
    assert _rel([p.detach() - s for p, s in zip(params, start)], [e - s for e, s in zip(expected, start)]) < 1e-3
    # and the second-order term matters: plain first-order MAML would land elsewhere
    first_order = [s - beta * go for s, go in zip(start, g_outer)]
    assert _rel([p.detach() - s for p, s in zip(params, start)], [e - s for e, s in zip(first_order, start)]) > 1e-3


def test_the_embedding_regulariser_is_zero_when_local_equals_global():
    from models.networks.backbone import FaceEmbedder

    torch.manual_seed(0)
    local = FaceEmbedder(128, 0.35, pretrained=False).double().eval()  # float64: no rounding to hide behind
    global_ = FaceEmbedder(128, 0.35, pretrained=False).double().eval()
    global_.load_state_dict(local.state_dict())
    x = torch.randn(4, 3, 128, 128, dtype=torch.float64)
    term = embedding_regulariser(local(x), global_(x), weight=5.0)
    assert float(term.detach()) == pytest.approx(0.0, abs=1e-12)
    grads = torch.autograd.grad(term, [p for p in local.parameters()], allow_unused=True)
    assert max(float(g.abs().max()) for g in grads if g is not None) < 1e-6, "and exerts no pull"
    with torch.no_grad():
        next(local.parameters()).add_(0.1 * torch.randn_like(next(local.parameters())))
    moved = embedding_regulariser(local(x), global_(x), weight=5.0)
    assert float(moved.detach()) > 1e-4 and float(embedding_regulariser(local(x), global_(x), 0.0).detach()) == 0.0


def test_a_device_round_with_hf_maml_and_the_regulariser(tmp_path):
    from conftest import device_datasets

    from edge_client.local_training import train_round
    from models.faces.crops import CropConfig, crop_index
    from models.faces.datasets import load_index
    from models.networks.face_model import FaceModel, ModelConfig, from_numpy_state, initial_global_state
    from protocol.messages import TrainingConfig

    data = device_datasets(tmp_path, 1, ids_per_device=3, images=4)[0]
    crops = crop_index(load_index(data), CropConfig(detector="none"), use_cache=False, progress=False)
    state = from_numpy_state(initial_global_state(width_mult=0.35, init="none"))
    results = {}
    for reg in (0.0, 10.0):
        model = FaceModel(ModelConfig(n_classes=3, width_mult=0.35, pretrained=False, dfc=False))
        objective = TrainingConfig(hfmaml=True, embedding_reg=reg, maml_beta=0.05, dfc_steps=0, epochs=1,
                                   batch_size=4, lr=1e-3)
        results[reg] = train_round(model, crops, state, objective, seed=0)
    for result in results.values():
        assert np.isfinite(result.metrics["train_loss"]) and 0 <= result.metrics["train_acc"] <= 1
        assert any(np.abs(v).max() > 0 for v in result.delta.values())
    assert set(results[0.0].delta) == set(state) and all(k.startswith("backbone.") for k in results[0.0].delta)


def test_hf_maml_through_the_cli(tmp_path, mosquitto):
    from ffr.cli import main

    out = tmp_path / "run"
    rc = main(
        [
            "-q",
            "fleet",
            "simulate",
            "--clients",
            "2",
            "--rounds",
            "1",
            "--method",
            "hfmaml",
            "--embedding-reg",
            "1.0",
            "--maml-beta",
            "0.02",
            "--synthetic-identities",
            "8",
            "--synthetic-images",
            "10",
            "--tune-steps",
            "2",
            "--holdout-identities",
            "0.25",
            "--width-mult",
            "0.35",
            "--init",
            "none",
            "--batch-size",
            "8",
            "--broker",
            mosquitto.url,
            "--no-centralised",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_completed"] == 1 and summary["history"][1]["updates"] == 2
    config = json.loads((out / "config.json").read_text())
    local = config["server"]["training"]  # the nested spec: the local round devices were sent
    assert local["method"] == {"name": "hfmaml", "embedding_reg": 1.0, "maml_alpha": 0.01, "maml_beta": 0.02,
                               "maml_delta": 0.001}
    tuned = summary["personalized"]["training_clients"]["tuned"]  # the paper's "tuned": global + a few local batches
    assert tuned["clients"] == 2 and tuned["auc"]["std"] >= 0 and "| tuned |" in (out / "summary.md").read_text()


def test_bad_hfmaml_combinations_are_refused(tmp_path, capsys):
    from ffr.cli import main

    assert main(["-q", "fleet", "simulate", "--method", "fedfr", "--embedding-reg", "1", "--public-data", str(tmp_path),
                 "--out", str(tmp_path / "run")]) == 2
    assert "--embedding-reg has no effect without --method fedavg, fedprox" in capsys.readouterr().err
