"""Samples/s of the distillation step on this CPU, before and after each speed change, side by side in one run.

Called by `python -m bench.train_throughput` (its second table). Each row adds one change to the row
above it; rows are measured in alternating rounds so drift in the machine's load hits all of them:
- before: crops through a DataLoader worker with per-image torchvision transforms, fp32, contiguous;
- crops held once as a uint8 tensor, augmentation vectorised over the batch (`models.training.online_views`);
- channels_last; the trunk in bf16 (where the CPU has AMX or AVX-512 BF16, `models.training.fast_step`);
- a foreach AdamW; torch.compile of the student.
"""
from __future__ import annotations

import copy
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from models.faces.preprocess import INPUT_SIZE, MEAN, STD
from models.networks.backbone import FaceEmbedder
from models.training.distillation import distillation_loss
from models.training.fast_step import cpu_has_fast_bf16
from models.training.loop import Step, optimise
from models.training.online_views import photometric, student_input


def per_image_augmentation() -> v2.Compose:
    """The student's augmentation before it was vectorised (torchvision v2, one image at a time)."""
    return v2.Compose([
        v2.RandomApply([v2.ColorJitter(0.3, 0.3, 0.2, 0.03)], p=0.5), v2.RandomGrayscale(p=0.05),
        v2.RandomApply([v2.GaussianBlur(5, sigma=(0.1, 1.2))], p=0.1), v2.ToDtype(torch.float32, scale=True),
        v2.Normalize([MEAN] * 3, [STD] * 3), v2.RandomErasing(p=0.1, scale=(0.02, 0.08))])


class _Crops(Dataset):
    def __init__(self, crops: torch.Tensor):
        self.crops, self.transform = crops, per_image_augmentation()

    def __len__(self) -> int:
        return len(self.crops)

    def __getitem__(self, i: int):
        return self.transform(self.crops[i])


def _loader_batches(crops: torch.Tensor, batch: int):
    loader = DataLoader(_Crops(crops), batch_size=batch, shuffle=True, drop_last=True, num_workers=1,
                        persistent_workers=True)
    while True:
        for x in loader:
            yield F.interpolate(x, size=(INPUT_SIZE, INPUT_SIZE), mode="bilinear", align_corners=False)


def _tensor_batches(crops: torch.Tensor, batch: int):
    generator = torch.Generator().manual_seed(0)
    while True:
        pick = torch.randint(len(crops), (batch,), generator=generator)
        yield student_input(photometric(crops[pick].float() / 255.0, generator))


def _variant(base: FaceEmbedder, channels_last: bool, bf16: bool, foreach: bool, compile_: bool):
    model = copy.deepcopy(base).train()
    if channels_last:
        model.features.to(memory_format=torch.channels_last)
    model.compute_dtype = torch.bfloat16 if bf16 else None
    if not bf16 and channels_last:  # the trunk's own switch is bf16; channels_last alone is set by hand here
        forward = model.forward
        model.forward = lambda x: forward(x.contiguous(memory_format=torch.channels_last))
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=foreach)
    return (torch.compile(model) if compile_ else model), optimiser


ROWS = [  # (change, tensor batches, channels_last, bf16, foreach, compile)
    ("before: DataLoader + per-image transforms, fp32", False, False, False, False, False),
    ("+ uint8 tensor, vectorised augmentation", True, False, False, False, False),
    ("+ channels_last", True, True, False, False, False),
    ("+ bf16 trunk (autocast)", True, True, True, False, False),
    ("+ foreach AdamW", True, True, True, True, False),
    ("+ torch.compile", True, True, True, True, True),
]


def distill_step_rows(batch: int = 64, steps: int = 8, rounds: int = 2, n_crops: int = 512) -> tuple[list, dict]:
    rng = np.random.default_rng(0)
    crops = torch.from_numpy(rng.integers(0, 256, (n_crops, 3, 112, 112), dtype=np.uint8))
    target = F.normalize(torch.randn(batch, 128, generator=torch.Generator().manual_seed(1)), dim=1)
    base = FaceEmbedder(128, 1.0, pretrained=False)
    bf16 = cpu_has_fast_bf16()
    runs, rates = [], {name: [] for name, *_ in ROWS}
    for name, tensors, cl, half, foreach, comp in ROWS:
        if half and not bf16:
            continue
        try:
            model, optimiser = _variant(base, cl, half, foreach, comp)
            batches = (_tensor_batches if tensors else _loader_batches)(crops, batch)
            _step(model, optimiser, next(batches), target)  # warm-up (and compilation)
            runs.append((name, model, optimiser, batches))
        except Exception as exc:  # noqa: BLE001 - a change that does not run here is reported, not fatal
            rates[name] = [f"failed: {type(exc).__name__}"]
    for _ in range(rounds):
        for name, model, optimiser, batches in runs:
            start = time.perf_counter()
            for _ in range(steps):
                _step(model, optimiser, next(batches), target)
            rates[name].append(steps * batch / (time.perf_counter() - start))
    before = max(rates[ROWS[0][0]])
    table = []
    for name, *_ in ROWS:
        values = rates[name]
        if not values:
            table.append({"distillation step": name, "samples_per_s": "n/a (no fast bf16 on this CPU)",
                          "vs_before": ""})
        elif isinstance(values[0], str):
            table.append({"distillation step": name, "samples_per_s": values[0], "vs_before": ""})
        else:
            table.append({"distillation step": name, "samples_per_s": max(values), "vs_before": max(values) / before})
    return table, {"fast_bf16_cpu": bf16, "batch": batch, "steps_per_round": steps, "rounds": rounds,
                   "all_samples_per_s": rates}


def _step(model, optimiser, x: torch.Tensor, target: torch.Tensor) -> None:
    optimise([(x, target)], lambda batch: Step(distillation_loss(model(batch[0]), batch[1])[0]), optimiser)
