"""What makes a training step fast on the hardware at hand, in one place for every loop that trains the trunk.

`ffr pretrain` (cached and online), `ffr train` and a device's local training all call
`accelerate(model, precision, device)` once: every MobileNetV2 trunk in the model then runs its
forward in bf16 autocast while training, channels_last, where the hardware has fast bf16 (CUDA,
or a CPU with AMX or AVX-512 BF16: detected from the CPU's flags, never assumed), and in fp32
elsewhere. The embedding layer, its BatchNorm, the heads and every loss stay fp32: a CosFace logit
is s * cos(theta) with s = 64, and bf16's 8-bit mantissa would move it by ~0.25. Evaluation and
ONNX export run the trunk in fp32 whatever was set. `bench.train_throughput` measures each change.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `ffr --help` reads PRECISIONS without loading it
    import torch

PRECISIONS = ("auto", "bf16", "fp32")
FAST_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def checked_device(name: str) -> torch.device:
    """The device `--device` names, refused in one line before any data is read when it is not cpu or cuda[:N], or
    is not on this machine."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r} is not a device here: cpu, cuda or cuda:N")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"--device {name}: PyTorch sees no such CUDA GPU on this machine; use --device cpu")
    return device


def cpu_flags() -> str:
    path = Path("/proc/cpuinfo")
    return path.read_text() if path.exists() else ""


def cpu_has_fast_bf16(flags: str | None = None) -> bool:
    """AMX or AVX-512 BF16 in the CPU's flags (`/proc/cpuinfo` unless given): bf16 matrix work in hardware."""
    words = set((cpu_flags() if flags is None else flags).split())
    return any(flag in words for flag in FAST_BF16_CPU_FLAGS)


def resolve_precision(precision: str, device: str | torch.device, flags: str | None = None) -> torch.dtype | None:
    """The trunk's autocast dtype: bf16 on CUDA or a CPU with fast bf16 ("auto"), or when asked; None is fp32."""
    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if precision == "fp32":
        return None
    if precision == "bf16" or str(device).startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_fast_bf16(flags) else None


def accelerate(model: torch.nn.Module, precision: str = "auto", device: str | torch.device = "cpu",
               flags: str | None = None) -> torch.dtype | None:
    """Set every FaceEmbedder trunk in `model` to train in the resolved dtype, channels_last; returns the dtype."""
    import torch

    from models.networks.backbone import FaceEmbedder

    dtype = resolve_precision(precision, device, flags)
    for module in model.modules():
        if isinstance(module, FaceEmbedder):
            module.compute_dtype = dtype
            module.features.to(memory_format=torch.channels_last)
    return dtype


def optimiser_options(device: str | torch.device) -> dict:
    """One multi-tensor kernel per parameter group instead of one per tensor: fused on CUDA, foreach on CPU."""
    return {"fused": True} if str(device).startswith("cuda") else {"foreach": True}
