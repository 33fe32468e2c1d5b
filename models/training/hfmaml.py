"""HF-MAML for federated face recognition, and its embedding regulariser: pure functions over parameters.

Hessian-free MAML (Per-FedAvg's HF variant: Fallah, Mokhtari, Ozdaglar, "Personalized Federated
Learning with Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020) as the
face-recognition paper in ../shared/papers/000 applies it ("Meta-Learning for Federated Face
Recognition in Imbalanced Data Regimes"), one local step being

    w~ = w - alpha * grad f(w, D)                                            (eq. 2)
    w  <- w - beta * (I - alpha * H(w, D'')) grad f(w~, D')                   (eq. 1)
    H(w, D'') v ~ [grad f(w + delta v, D'') - grad f(w - delta v, D'')] / 2 delta   (eq. 3)

so a step costs four gradients and no Hessian. Eq. 4 regularises the local embedding toward the
round's starting (global) model: loss + C * (1 - cos(f_global(x), f_local(x))).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

Params = Sequence[torch.nn.Parameter]
Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[Batch], torch.Tensor]


def gradients(loss_fn: LossFn, params: Params, batch: Batch) -> tuple[list[torch.Tensor], float]:
    """d loss / d params on one batch (parameters that the loss does not reach get zeros), and the loss."""
    loss = loss_fn(batch)
    grads = torch.autograd.grad(loss, list(params), allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)], float(loss.detach())


def fd_hessian_vector_product(loss_fn: LossFn, params: Params, vector: Sequence[torch.Tensor], batch: Batch,
                              delta: float = 1e-3) -> list[torch.Tensor]:
    """Eq. 3: H(w) v by central differences of two gradients at w +- delta v; w is restored bit for bit."""
    start = [p.detach().clone() for p in params]
    _shift(params, vector, delta)
    plus, _ = gradients(loss_fn, params, batch)
    _shift(params, vector, -2.0 * delta)
    minus, _ = gradients(loss_fn, params, batch)
    _restore(params, start)
    return [(a - b) / (2.0 * delta) for a, b in zip(plus, minus)]


def hf_maml_step(loss_fn: LossFn, params: Params, batches: tuple[Batch, Batch, Batch], alpha: float, beta: float,
                 delta: float = 1e-3) -> dict[str, float]:
    """One HF-MAML update of `params` in place (eq. 1-3) from three batches D, D', D'' of the device's data."""
    inner, outer, hessian = batches
    start = [p.detach().clone() for p in params]
    grad_inner, inner_loss = gradients(loss_fn, params, inner)
    _shift(params, grad_inner, -alpha)                     # w~ (eq. 2)
    grad_outer, outer_loss = gradients(loss_fn, params, outer)
    _restore(params, start)
    hvp = fd_hessian_vector_product(loss_fn, params, grad_outer, hessian, delta)
    with torch.no_grad():
        for p, g, h in zip(params, grad_outer, hvp):
            p.sub_(beta * (g - alpha * h))                 # eq. 1
    return {"inner_loss": inner_loss, "outer_loss": outer_loss}


def embedding_regulariser(local: torch.Tensor, global_: torch.Tensor, weight: float) -> torch.Tensor:
    """Eq. 4's term C * mean(1 - cos(f_global(x), f_local(x))): zero when the local model embeds as the global one."""
    return weight * (1.0 - F.cosine_similarity(local, global_.detach(), dim=1)).mean()


def anchored_to(start_net: Callable[[torch.Tensor], torch.Tensor], weight: float
                ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Eq. 4 as a training step's `extra(emb, x)` term, pulling each embedding towards `start_net`'s of the same x."""
    return lambda emb, x: embedding_regulariser(emb, start_net(x), weight)


def _shift(params: Params, vector: Sequence[torch.Tensor], scale: float) -> None:
    with torch.no_grad():
        for p, v in zip(params, vector):
            p.add_(v, alpha=scale)


def _restore(params: Params, values: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
