"""What of the shared embedder a local round may change: the federation's guard against forgetting.

A device holds a handful of people. Two ways its round can leak that narrowness into the shared model are
switched off here, each a context the round runs inside:
  - BatchNorm in inference mode (`frozen_batchnorm`): the trunk normalises with the received model's running
    statistics and does not update them, so a few people's small batches never become the shared model's
    statistics (FedBN, Li et al., ICLR 2021, keeps them local for the same reason; here they stay global and fixed);
  - only the top of the trunk trains (`top_blocks_only`): the last `blocks` inverted-residual blocks, the embedding
    layer and its BatchNorm; the lower blocks, generic edge and texture detectors, keep the received weights.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn


def _inference_mode(module: nn.Module, _inputs) -> None:
    module.training = False


@contextmanager
def frozen_batchnorm(module: nn.Module, on: bool = True) -> Iterator[None]:
    """Inside, every BatchNorm in `module` runs as in inference, whatever `train()` set (a forward pre-hook, so a
    loop's own `model.train()` cannot undo it); its affine weights still train. Outside, nothing is left behind."""
    handles = [m.register_forward_pre_hook(_inference_mode) for m in module.modules()
               if on and isinstance(m, nn.modules.batchnorm._BatchNorm)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def top_blocks_only(embedder: nn.Module, blocks: int | None) -> Iterator[None]:
    """Inside, only the last `blocks` of `embedder.features` and what follows them train (None: everything)."""
    frozen = [] if blocks is None else [p for p in embedder.features[:max(0, len(embedder.features) - blocks)]
                                        .parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)
