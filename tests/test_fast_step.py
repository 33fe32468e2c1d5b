"""The fast training step (`models.training.fast_step`): same gradients as fp32 within bf16's tolerance, fp32 where the
CPU has no fast bf16, and evaluation untouched."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from models.networks.backbone import FaceEmbedder
from models.training.distillation import distillation_loss
from models.training.fast_step import accelerate, cpu_has_fast_bf16, optimiser_options, resolve_precision

AMX_FLAGS = "flags : fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile"
OLD_CPU_FLAGS = "flags : fpu sse2 avx2 fma"      # e.g. a Raspberry Pi-class or pre-2020 x86 device


def _gradients(model: FaceEmbedder, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    model.train()
    model.zero_grad(set_to_none=True)
    loss, _ = distillation_loss(model(x), target)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_precision_follows_the_cpus_flags_and_what_is_asked():
    assert cpu_has_fast_bf16(AMX_FLAGS) and not cpu_has_fast_bf16(OLD_CPU_FLAGS)
    assert resolve_precision("auto", "cpu", AMX_FLAGS) is torch.bfloat16
    assert resolve_precision("auto", "cpu", OLD_CPU_FLAGS) is None
    assert resolve_precision("auto", "cuda") is torch.bfloat16
    assert (
        resolve_precision("fp32", "cuda") is None and resolve_precision("bf16", "cpu", OLD_CPU_FLAGS) is torch.bfloat16
    )
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve_precision("fp8", "cpu")
    assert optimiser_options("cuda") == {"fused": True} and optimiser_options("cpu") == {"foreach": True}


@pytest.fixture(scope="module")
def face_batch(synthetic_dir):
    """The setting the step is for: the shipped face weights, face crops, a target near the model's embedding.
    (From a random initialisation the gradients are mostly noise, which any rounding moves a lot.)"""
    import numpy as np

    from models.faces.imageio import read_rgb
    from models.faces.preprocess import to_input
    from models.networks.face_weights import load_face_embedder

    model = load_face_embedder()
    x = torch.from_numpy(to_input(np.stack([read_rgb(p) for p in sorted(synthetic_dir.rglob("*.png"))[:24]])))
    with torch.no_grad():
        noise = torch.randn(len(x), 128, generator=torch.Generator().manual_seed(2))
        target = F.normalize(model.eval()(x) + 0.05 * noise, dim=1)
    return model, x, target


def _agreement(reference: torch.Tensor, ours: torch.Tensor) -> tuple[float, float]:
    cosine = F.cosine_similarity(reference, ours, dim=0)
    return float(cosine), float((ours.norm() - reference.norm()).abs() / reference.norm())


def test_the_bf16_step_gives_the_fp32_gradients_within_bf16_tolerance(face_batch):
    model, x, target = face_batch
    fast = copy.deepcopy(model)
    assert accelerate(fast, "bf16") is torch.bfloat16
    assert fast.features[0][0].weight.is_contiguous(memory_format=torch.channels_last)
    reference, ours = _gradients(copy.deepcopy(model), x, target), _gradients(fast, x, target)
    cosine, relative = _agreement(reference, ours)
    assert cosine > 0.97 and relative < 0.05, (cosine, relative)
    assert cosine < 0.99999   # it did run in bf16: the step is not the fp32 one


def test_without_fast_bf16_the_step_falls_back_to_fp32(face_batch):
    model, x, target = face_batch
    fallback = copy.deepcopy(model)
    assert accelerate(fallback, "auto", "cpu", flags=OLD_CPU_FLAGS) is None and fallback.compute_dtype is None
    cosine, relative = _agreement(_gradients(copy.deepcopy(model), x, target), _gradients(fallback, x, target))
    assert cosine > 0.9999 and relative < 1e-3, (cosine, relative)   # fp32 (channels_last changes the order only)


def test_evaluation_and_export_run_the_trunk_in_fp32_whatever_training_uses():
    torch.manual_seed(0)
    plain = FaceEmbedder(128, 1.0, pretrained=False).eval()
    fast = copy.deepcopy(plain)
    accelerate(fast, "bf16")
    fast.eval()
    x = torch.randn(4, 3, 128, 128, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.allclose(plain(x), fast(x), atol=1e-5)
