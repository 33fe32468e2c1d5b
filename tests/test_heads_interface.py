"""Every margin head answers the same questions (`models.networks.heads`): how many classes, which centres (None
for a head without them), logits with and without a margin, and public classes appended where it can hold them."""
from __future__ import annotations

import pytest
import torch

from models.networks.heads import HEADS, build_head, imprint


@pytest.mark.parametrize("name", HEADS)
def test_each_head_has_the_one_interface(name):
    head = build_head(name, 8, 5)
    emb, labels = torch.randn(4, 8), torch.tensor([0, 1, 2, 4])
    assert head.n_classes == 5
    assert head(emb, labels).shape == head.logits(emb).shape == (4, 5)
    extra = torch.randn(3, 8)
    if head.centres is None:
        assert name == "softmax" and not imprint(head, emb, labels)
        with pytest.raises(ValueError, match="no class centres"):
            head(emb, labels, extra=extra)
    else:
        assert head.centres.shape == (5, 8) and imprint(head, emb, labels)
        assert head(emb, labels, extra=extra).shape == (4, 8)  # the public classes after the head's own
