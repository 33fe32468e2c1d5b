"""Preprocessing (numpy, shared with the device) and the design's weak/strong augmentations."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from models.faces import augment, synthetic
from models.faces.preprocess import to_input


def test_to_input_is_128_rgb_in_minus_one_one():
    crop = synthetic.render(0, 0, 0, size=100)
    x = to_input(crop)
    assert x.shape == (1, 3, 128, 128) and x.dtype == np.float32
    assert -1.0 <= x.min() and x.max() <= 1.0
    assert to_input(np.full((2, 128, 128, 3), 255, np.uint8)).min() == 1.0
    with pytest.raises(ValueError):
        to_input(np.zeros((128, 128), np.uint8))


@pytest.mark.parametrize("name", ["weak", "strong"])
def test_augmentations_keep_shape_and_range_and_vary(name):
    torch.manual_seed(0)
    image = torch.from_numpy(synthetic.render(0, 0, 0)).permute(2, 0, 1)
    transform = augment.build(name)
    outs = [transform(image) for _ in range(4)]
    assert all(o.shape == (3, 128, 128) and o.dtype == torch.float32 for o in outs)
    assert all(-1.0 - 1e-6 <= o.min() and o.max() <= 1.0 + 1e-6 for o in outs)
    assert any(not torch.allclose(outs[0], o) for o in outs[1:])
    plain = augment.build("none")(image)
    assert torch.allclose(plain, torch.from_numpy(to_input(synthetic.render(0, 0, 0))[0]), atol=1e-6)


def test_strong_is_stronger_than_weak():
    torch.manual_seed(0)
    image = torch.from_numpy(synthetic.render(0, 2, 0)).permute(2, 0, 1)
    plain = augment.build("none")(image)
    change = {n: np.mean([float((augment.build(n)(image) - plain).abs().mean()) for _ in range(20)])
              for n in ("weak", "strong")}
    assert change["strong"] > change["weak"] * 1.3


def test_unknown_augmentation_is_rejected():
    with pytest.raises(ValueError, match="unknown augmentation"):
        augment.build("extreme")
