"""FedFace's Partially Federated Momentum: the bookkeeping, and a PFM round over the real broker."""
from __future__ import annotations

import copy
import json

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from coordinator.aggregation import PFM
from models.maths.pfm import apply_global_momentum


def test_pfm_with_one_client_and_one_step_per_round_is_centralised_momentum_sgd():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    batches = [(torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 3, (16,))) for _ in range(12)]
    lr, beta = 0.1, 0.9

    reference = copy.deepcopy(net)  # PyTorch's momentum SGD on the union of the data, one step per batch
    optimiser = torch.optim.SGD(reference.parameters(), lr=lr, momentum=beta)
    for x, y in batches:
        optimiser.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        optimiser.step()

    strategy, server_state = PFM(lr=lr, beta=beta), None  # the coordinator's side (eq. 4-6)
    global_state = {f"backbone.{k}": v.numpy().copy() for k, v in net.state_dict().items()}
    for x, y in batches:  # one round per batch: one device, one local step (K = 1)
        device = copy.deepcopy(net)
        device.load_state_dict({k.removeprefix("backbone."): torch.from_numpy(v) for k, v in global_state.items()})
        params = dict(device.named_parameters())
        momentum = {k.removeprefix("backbone."): torch.from_numpy(v) for k, v in (server_state or {}).items()}
        local = torch.optim.SGD(device.parameters(), lr=lr)
        local.zero_grad()
        F.cross_entropy(device(x), y).backward()
        local.step()
        apply_global_momentum(params, momentum, lr, beta, steps=1)  # the device's side (eq. 3)
        delta = {f"backbone.{k}": v.detach().numpy() - global_state[f"backbone.{k}"]
                 for k, v in device.state_dict().items()}
        global_state, server_state = strategy.aggregate(global_state, delta, server_state)
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(global_state[f"backbone.{name}"], value.numpy(), rtol=1e-9, atol=1e-12)
    from coordinator.aggregation import strategy_for
    from coordinator.settings import RoundSettings
    from protocol import methods
    from protocol.messages import TrainingConfig
    from protocol.training_parts import OptimiserSettings

    # the strategy a run's PFM settings build, beta being the one devices are sent in the method's settings
    training = TrainingConfig(method=methods.PFM(pfm_beta=beta), optimisation=OptimiserSettings(lr=lr))
    assert strategy_for(RoundSettings(training=training)) == strategy


def test_pfm_rounds_over_the_broker_send_the_momentum_and_devices_apply_it(tmp_path, mosquitto):
    from ffr.cli import main

    out = tmp_path / "run"
    rc = main(["-q", "fleet", "simulate", "--clients", "2", "--rounds", "2", "--method", "pfm", "--lr", "0.01",
               "--synthetic-identities", "8", "--synthetic-images", "6", "--holdout-identities", "0.25",
               "--width-mult", "0.35", "--init", "none", "--batch-size", "8", "--broker", mosquitto.url,
               "--no-centralised", "--server-step", "1", "--out", str(out)])  # PFM's arithmetic: the whole step
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and all(h["updates"] == 2 for h in summary["history"][1:])
    from safetensors.numpy import load_file

    from coordinator.store import Store

    store = Store(out / "coordinator")
    momentum = load_file(str(out / "coordinator" / "strategy_state.safetensors"))
    v1, v2 = store.load_model(1), store.load_model(2)
    for name, m in momentum.items():  # eq. 6 after round 2: M = (Theta_1 - Theta_2) / eta
        np.testing.assert_allclose(m, (v1[name].astype(np.float64) - v2[name]) / 0.01, rtol=1e-4, atol=1e-4)
    assert not any(k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in momentum)
    from edge_client.home import DeviceHome

    for home in sorted((out / "devices").glob("*/home")):  # round 1: no momentum yet; round 2: every parameter's
        log = {e["round_id"]: e["global_momentum_tensors"] for e in DeviceHome(home).rounds_log()}
        assert log[1] == 0 and log[2] == len(momentum) > 0, (home, log)
