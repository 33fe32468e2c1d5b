"""An exponential moving average of the student's weights (Polyak averaging), the model a run ships when it is on.

A batch of 64 on 2 CPU cores makes each AdamW step noisy. The average over the last ~1/(1 - decay) steps keeps
where the steps lead and cancels much of their noise (Polyak & Juditsky, SIAM J. Control Optim. 1992;
Morales-Brotons, Vogels & Hendrikx, "Exponential moving average of weights in deep learning: dynamics and benefits",
TMLR 2024):
W_0 = w_0, W_{t+1} = decay W_t + (1 - decay) w_{t+1}. BatchNorm's running statistics are averaged with the
weights, so the average is one coherent model. `NoAverage` is the null object for runs without it.
"""
from __future__ import annotations

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


class WeightAverage:
    """The running average of a model's parameters and buffers (torch's `AveragedModel`, EMA form)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        if not 0 < decay < 1:
            raise ValueError(f"--ema-decay must be between 0 and 1, both excluded (got {decay})")
        self.average = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)

    @property
    def model(self) -> torch.nn.Module:
        """The averaged model: what the run's embedder file holds."""
        return self.average.module

    @property
    def updates(self) -> int:
        return int(self.average.n_averaged)

    def update(self, model: torch.nn.Module) -> None:
        """Fold in the weights after a step (the first update copies them)."""
        self.average.update_parameters(model)

    def state(self) -> dict[str, torch.Tensor]:
        """The average and its update count, as tensors for safetensors (resumable exactly)."""
        return {k: v.detach().contiguous() for k, v in self.average.state_dict().items()}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.average.load_state_dict(state)


class NoAverage:
    """A run without averaging: the model it ships is the student as it stands."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.updates = model, 0

    def update(self, model: torch.nn.Module) -> None:
        pass

    def state(self) -> dict[str, torch.Tensor]:
        return {}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        pass


def weight_average(model: torch.nn.Module, decay: float) -> WeightAverage | NoAverage:
    """`--ema-decay D`: the average at D; 0: none."""
    return WeightAverage(model, decay) if decay else NoAverage(model)
