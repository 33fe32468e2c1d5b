"""Face crops as training batches, and frozen features of them: what every trainer reads its images through.

The centralised trainer, the device's local algorithms, the tuned evaluation and FedFR's hard-negative
sampling all share these, so a device never imports the centralised trainer.
"""
from __future__ import annotations

import copy

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from models.faces import augment
from models.faces.crops import FaceCrops


class CropDataset(Dataset):
    """uint8 NHWC crops in memory -> augmented float CHW tensors."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, transform):
        self.images = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2)
        self.labels = torch.from_numpy(labels)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.transform(self.images[i]), self.labels[i]


def as_chw(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2)


@torch.no_grad()
def frozen_features(backbone: torch.nn.Module, images: np.ndarray, views: int = 1, seed: int = 0,
                    batch_size: int = 64) -> torch.Tensor:
    """Theta(x) in eval mode for `views` views of each image: the first unaugmented, the rest weakly augmented."""
    was_training = backbone.training
    backbone.eval()
    torch.manual_seed(seed)
    plain, weak = augment.plain(), augment.build("weak")
    chw, out = as_chw(images), []
    for v in range(views):
        transform = plain if v == 0 else weak
        for start in range(0, len(chw), batch_size):
            out.append(backbone(torch.stack([transform(im) for im in chw[start:start + batch_size]])))
    backbone.train(was_training)
    return torch.cat(out) if out else torch.zeros(0)


def frozen_copy(backbone: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """An eval-mode copy of `backbone` (optionally loaded with a `backbone.*` state) that no step can change."""
    net = copy.deepcopy(backbone).eval()
    if state is not None:
        net.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items()})
    for p in net.parameters():
        p.requires_grad_(False)
    return net


def train_loader(crops: FaceCrops, batch_size: int, aug: str, generator: torch.Generator) -> DataLoader:
    """Shuffled, augmented batches of the crops (`aug`: models.faces.augment's level)."""
    data = CropDataset(crops.images, crops.labels, augment.build(aug))
    # BatchNorm cannot train on a batch of one: drop a trailing single image
    drop_last = len(data) % batch_size == 1
    return DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=drop_last, generator=generator)
