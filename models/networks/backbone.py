"""Theta: the shared face embedder, a MobileNetV2 trunk with a 128-d embedding layer.

This is the only part of the model that ever leaves a device (as deltas).
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import mobilenet_v2

from models.cpu_memory import reuse_freed_memory
from models.networks.pretrained import verified_imagenet_weights


class FaceEmbedder(nn.Module):
    """MobileNetV2 features -> global average pool -> Linear -> BN -> L2-normalised embedding."""

    def __init__(self, embedding_dim: int = 128, width_mult: float = 1.0, pretrained: bool = True,
                 weights_path: str | Path | None = None, dropout: float = 0.0):
        super().__init__()
        reuse_freed_memory()  # a process that builds one computes with torch: no page faults each batch
        trunk = mobilenet_v2(weights=None, width_mult=width_mult)
        self.features = trunk.features
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.embedding = nn.Linear(trunk.last_channel, embedding_dim, bias=False)
        self.bn = nn.BatchNorm1d(embedding_dim)
        if weights_path is not None or pretrained:
            self.load_imagenet(weights_path, width_mult)

    def load_imagenet(self, weights_path: str | Path | None, width_mult: float) -> None:
        """Initialise the trunk from torchvision's ImageNet file (local, sha256-checked)."""
        if width_mult != 1.0:
            raise ValueError("ImageNet MobileNetV2 weights exist only for width_mult=1.0; use pretrained=False")
        path = verified_imagenet_weights(Path(weights_path) if weights_path else None,
                                         prefix="" if weights_path else "b0353104")
        state = torch.load(path, map_location="cpu", weights_only=True)
        trunk = {k.removeprefix("features."): v for k, v in state.items() if k.startswith("features.")}
        self.features.load_state_dict(trunk, strict=True)

    compute_dtype: torch.dtype | None = None  # the trunk's autocast dtype while training (models.training.fast_step)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = self.training and self.compute_dtype is not None
        if fast:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(x.device.type, dtype=self.compute_dtype or torch.float32, enabled=fast):
            x = self.pool(self.features(x)).flatten(1)
        x = x.to(self.embedding.weight.dtype)  # out of autocast: the embedding layer on, in the model's own dtype
        return F.normalize(self.bn(self.embedding(self.dropout(x))), dim=1)
