"""bench.batchnorm_statistics estimates BatchNorm's running statistics again and touches nothing else."""
from __future__ import annotations

import torch

from bench.batchnorm_statistics import batches, reestimated, view_kinds


def test_the_statistics_are_the_average_over_the_batches_and_the_weights_stay():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3, momentum=0.3))
    model[1].running_mean.fill_(7.0)
    weights = {k: v.clone() for k, v in model.state_dict().items() if "running" not in k and "num_batches" not in k}
    inputs = [torch.randn(16, 4) * 2 + 1 for _ in range(3)]
    with torch.no_grad():
        outputs = [model[0](x) for x in inputs]

    reestimated(model, iter(inputs))

    assert torch.allclose(model[1].running_mean, torch.stack([o.mean(0) for o in outputs]).mean(0), atol=1e-6)
    assert torch.allclose(model[1].running_var, torch.stack([o.var(0) for o in outputs]).mean(0), atol=1e-5)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert not model.training and model[1].momentum == 0.3


def test_each_view_kind_gives_full_batches_of_student_inputs():
    crops = torch.randint(0, 256, (300, 3, 112, 112), dtype=torch.uint8)
    for name, view in view_kinds(seed=0).items():
        shapes = [tuple(x.shape) for x in batches(crops, view, seed=0)]
        assert shapes == [(128, 3, 128, 128)] * 2, name  # 300 crops: two full batches, the rest left out
    clean = next(batches(crops, view_kinds(seed=0)["clean"], seed=0))
    assert clean.min() >= -1 and clean.max() <= 1


def test_a_recipe_kind_gives_the_same_views_whichever_kinds_ran_before_it():
    """One generator per kind: `--views recipe` alone reproduces the `recipe` row of a run of every kind."""
    crops = torch.randint(0, 256, (8, 3, 112, 112), dtype=torch.uint8)
    alone = view_kinds(seed=0)["recipe"](crops)
    kinds = view_kinds(seed=0)
    kinds["recipe_unblended"](crops)
    assert torch.equal(kinds["recipe"](crops), alone)
    assert not torch.equal(view_kinds(seed=1)["recipe"](crops), alone)
