"""The house's one optimiser loop: every trainer steps through `optimise`.

Centralised training, each local algorithm, the DFC fit, distillation (cached and online), the tuned
evaluation and the simulator's collapse attack differ only in how a batch becomes a loss and in what runs
around a step (a learning-rate schedule, PFM's global momentum, a projection, a checkpoint). Those are the
arguments here; zero-grad, backward, step, the finite-loss guard and the weighted running means are written
once. The shape follows insightface's `arcface_torch/train_v2.py`: one loop, callbacks around the step.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from models.progress import bar_disable


@dataclass
class Step:
    """What a batch gave: the loss to descend, how many samples it stands for, and figures to average."""

    loss: torch.Tensor
    weight: float = 1.0
    metrics: dict[str, float] = field(default_factory=dict)
    value: float = float("nan")  # the loss as a number, read once by `optimise` (one device sync per step)


@dataclass
class Means:
    """Weighted running means of the steps' figures (`loss` always among them)."""

    sums: dict[str, float] = field(default_factory=dict)
    weight: float = 0.0
    steps: int = 0

    def add(self, step: Step) -> None:
        for key, value in {"loss": step.value, **step.metrics}.items():
            self.sums[key] = self.sums.get(key, 0.0) + value * step.weight
        self.weight += step.weight
        self.steps += 1

    def result(self) -> dict[str, float]:
        return {k: v / max(self.weight, 1e-12) for k, v in self.sums.items()}


BeforeStep = Callable[[], None]
AfterStep = Callable[[Step], "bool | None"]  # True stops the loop after this step


def optimise(batches: Iterable[Any], loss_of: Callable[[Any], Step], optimiser: torch.optim.Optimizer, *,
             before: Sequence[BeforeStep] = (), after: Sequence[AfterStep] = (),
             finite: Callable[[], str] | None = None) -> Means:
    """Descend `loss_of(batch)` once per batch; `before` hooks run ahead of each step (schedules), `after`
    hooks once it is taken (momentum, projections, logging, checkpoints; one returning True ends the loop).
    With `finite` (naming the loss and step), a loss that is not finite stops training with that name
    rather than poisoning the weights."""
    means = Means()
    for batch in batches:
        for hook in before:
            hook()
        step = loss_of(batch)
        step.value = float(step.loss.detach())
        if finite is not None and not math.isfinite(step.value):
            raise FloatingPointError(f"{finite()} is {step.value}; lower --lr")
        optimiser.zero_grad(set_to_none=True)
        step.loss.backward()
        optimiser.step()
        means.add(step)
        if any([hook(step) for hook in after]):
            break
    return means


def train_epoch(model: torch.nn.Module, loader: Iterable[Any], optimiser: torch.optim.Optimizer,
                desc: str = "train", progress: bool = False,
                regulariser: Callable[[], torch.Tensor] | None = None,
                extra: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                after_step: Callable[[], None] | None = None) -> dict:
    """One supervised pass of a model with `losses(x, y, extra)` (networks.face_model.FaceModel); returns mean loss
    and accuracy (margin-free logits).

    `regulariser` adds a term to every step's loss (FedProx's proximal term on devices); `extra(emb, x)` a term
    on the batch's embedding (the embedding regulariser); `after_step()` runs after each optimiser step (PFM's
    global momentum).
    """
    model.train()

    def loss_of(batch) -> Step:
        x, y = batch
        loss, logits, _ = model.losses(x, y, extra)
        if regulariser is not None:
            loss = loss + regulariser()
        return Step(loss, len(y), {"train_acc": float((logits.argmax(1) == y).float().mean())})

    hooks = [] if after_step is None else [lambda _: after_step()]
    batches = tqdm(loader, desc=desc, unit="batch", disable=bar_disable(progress), leave=False)
    means = optimise(batches, loss_of, optimiser, after=hooks).result()
    return {"train_loss": means.get("loss", 0.0), "train_acc": means.get("train_acc", 0.0)}


def limited(loader: Iterable[Any], steps: int) -> Iterable[Any]:
    """Exactly `steps` batches, passing over `loader` as often as needed (none if it is empty)."""
    done = 0
    while done < steps:
        before = done
        for batch in loader:
            yield batch
            done += 1
            if done >= steps:
                return
        if done == before:
            return


def resume_from(path: Path, restore: Callable[[dict], None], writer: str, map_location: Any = "cpu") -> None:
    """Hand a run's saved state (`latest.pt`, weights only) to `restore`; a damaged or foreign file is refused in one
    line naming it (the file is read as if an attacker wrote it: every field is checked by its use). `restore`'s own
    ValueErrors (other data, a changed option) pass through as they are."""
    try:
        restore(torch.load(path, map_location=map_location, weights_only=True))
    except ValueError:
        raise
    except Exception as exc:  # pickle, zip, a missing key, a wrong shape: not a state this trainer wrote
        raise ValueError(f"{path} is damaged or was not written by {writer} ({type(exc).__name__}); use a new --out, "
                         "or --force to start over") from None
