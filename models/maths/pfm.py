"""FedFace's Partially Federated Momentum (Liu et al., "FedFace: ... Partially Federated Momentum and Federated
Validation", ../shared/papers/004, Algorithm 1), as pure functions.

Classifiers keep classical local momentum (eq. 1-2: PyTorch's SGD momentum). For the shared backbone
the server keeps a global momentum M and sends it with the global model; each local step adds it
evenly (eq. 3):  theta <- theta - eta * (g + beta * M / K),  K the round's local steps. After
aggregation the server does not apply M; it re-estimates it from the global model's change (eq. 5-6):
M_r = (Theta_{r-1} - Theta_r) / eta. With one device and one step per round this is exactly
centralised momentum SGD: M_r = g + beta * M_{r-1}.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the device side uses torch; the coordinator imports this module without it
    import torch

NOT_TRAINED = ("running_mean", "running_var", "num_batches_tracked")  # buffers: no gradient, no momentum


def apply_global_momentum(params: dict[str, torch.nn.Parameter], momentum: dict[str, torch.Tensor], lr: float,
                          beta: float, steps: int) -> None:
    """Eq. 3's momentum part of one local step, in place: theta -= eta * beta * M / K (the gradient part is the
    optimiser's plain SGD step). Parameters without a momentum tensor (the first round) are left alone."""
    import torch

    scale = lr * beta / max(1, steps)
    with torch.no_grad():
        for name, p in params.items():
            m = momentum.get(name)
            if m is not None:
                p.sub_(scale * m.to(p.dtype))


def global_momentum(
    previous: dict[str, np.ndarray], current: dict[str, np.ndarray], lr: float
) -> dict[str, np.ndarray]:
    """Eq. 6: M_r = (Theta_{r-1} - Theta_r) / eta over the trained (floating, non-buffer) tensors."""
    return {k: ((previous[k].astype(np.float64) - current[k]) / lr).astype(current[k].dtype) for k in current
            if np.issubdtype(current[k].dtype, np.floating) and not k.endswith(NOT_TRAINED)}
