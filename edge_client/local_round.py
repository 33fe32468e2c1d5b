"""What a local algorithm gets in a round (`LocalRound`): the model loaded with the global backbone, the round's
batches and settings, and the terms the round prepared. `edge_client.local_training` builds it; the algorithms
(`edge_client.local_algorithms`) and FedFR's objective (`edge_client.fedfr_objective`) read it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from models.networks.face_model import FaceModel
from protocol.messages import TrainingConfig


@dataclass
class LocalRound:
    """What a local algorithm gets: the model loaded with the global backbone, the round's batches and
    settings, and the terms the round prepared (FedProx's regulariser, eq. 4's embedding anchor, D_g's
    sampled hard negatives, the frozen global and previous local backbones)."""

    model: FaceModel
    loader: torch.utils.data.DataLoader
    epochs: int
    lr: float
    objective: TrainingConfig  # the round's announced settings: the local objective's terms and weights
    generator: torch.Generator
    regulariser: Callable[[], torch.Tensor] | None = None
    extra: Callable | None = None
    negatives: object | None = None  # edge_client.local_training.HardNegatives
    global_net: torch.nn.Module | None = None
    previous_net: torch.nn.Module | None = None
    pfm_momentum: dict[str, torch.Tensor] | None = None

    def adam(self) -> torch.optim.Optimizer:
        """Adam over the model and, with a labelled D_g, the sampled public people's centres."""
        centres = getattr(self.negatives, "centres", None)
        return torch.optim.Adam(list(self.model.parameters()) + ([centres] if centres is not None else []), lr=self.lr)
