"""Training-time augmentation, exactly as the design document specifies (torchvision v2).

Inputs are uint8 CHW tensors of 128x128 face crops; outputs are float tensors in [-1, 1].
"""
from __future__ import annotations

import torch
from torchvision.transforms import v2

from models.faces.preprocess import MEAN, STD

AUGMENTATIONS = ("weak", "strong", "none")


def _to_input() -> list:
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize([MEAN] * 3, [STD] * 3)]


def weak() -> v2.Compose:
    return v2.Compose([
        v2.RandomHorizontalFlip(0.5),
        v2.RandomRotation(10),
        v2.ColorJitter(brightness=0.1, contrast=0.1, saturation=0.1, hue=0.05),
        *_to_input(),
    ])


def strong() -> v2.Compose:
    return v2.Compose([
        v2.RandomHorizontalFlip(0.5),
        v2.RandomRotation(30),
        v2.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.3, hue=0.15),
        v2.RandomAffine(degrees=0, translate=(0.1, 0.1), scale=(0.9, 1.1), shear=10),
        v2.RandomPerspective(distortion_scale=0.2),
        v2.GaussianBlur(kernel_size=5, sigma=(0.1, 2.0)),
        *_to_input(),
        v2.RandomErasing(p=0.3, scale=(0.02, 0.15), ratio=(0.3, 3.3)),
    ])


def plain() -> v2.Compose:
    """No augmentation: evaluation and the 'none' setting."""
    return v2.Compose(_to_input())


def build(name: str) -> v2.Compose:
    if name not in AUGMENTATIONS:
        raise ValueError(f"unknown augmentation {name!r}; choose one of {', '.join(AUGMENTATIONS)}")
    return {"weak": weak, "strong": strong, "none": plain}[name]()
