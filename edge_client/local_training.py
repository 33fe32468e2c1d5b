"""One round of local training on a device, as a function: global backbone in, backbone delta out.

Loss = margin head (local classifier) + alpha * DFC branch (FedFR) [+ mu/2 ||w - w_global||^2
for FedProx]. Only `Theta_local - Theta_global` is returned for sending; the head and the
DFC branch are updated in place and stay on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from models.face_model import FaceModel, load_shareable_state, shareable_state
from models.faces.crops import FaceCrops
from models.training import TrainConfig, train_epoch, train_loader


@dataclass
class LocalResult:
    delta: dict[str, np.ndarray]
    n_samples: int
    metrics: dict[str, float]


def proximal_term(model: FaceModel, anchor: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum ||w - w_global||^2 over the backbone's trainable parameters (FedProx, Li et al. 2020)."""
    return sum(((p - anchor[n]) ** 2).sum() for n, p in model.backbone.named_parameters())


def train_round(model: FaceModel, crops: FaceCrops, global_state: dict[str, torch.Tensor], epochs: int,
                batch_size: int, lr: float, prox_mu: float = 0.0, seed: int = 0) -> LocalResult:
    load_shareable_state(model, global_state)
    start = {k: v.clone() for k, v in shareable_state(model).items()}
    anchor = {n: p.detach().clone() for n, p in model.backbone.named_parameters()}
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    loader = train_loader(crops, TrainConfig(batch_size=batch_size, aug="weak"), torch.Generator().manual_seed(seed))
    regulariser = (lambda: prox_mu / 2.0 * proximal_term(model, anchor)) if prox_mu > 0 else None
    history = [train_epoch(model, loader, optimiser, regulariser=regulariser) for _ in range(epochs)]
    model.eval()
    end = shareable_state(model)
    delta = {k: (end[k].double() - start[k].double()).numpy() if end[k].is_floating_point()
             else (end[k] - start[k]).numpy() for k in end}  # integer buffers keep an integer delta
    return LocalResult(delta, len(crops), history[-1])
