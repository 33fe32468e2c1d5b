"""Partitions: disjoint, complete, shaped as requested, deterministic, and clear when impossible."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ffr.cli import main
from models.faces.partition import Partition, PartitionError, allocate, client_shares, partition
from models.faces.splits import stratified_split as split_images

IDS = [f"person{i:04d}" for i in range(1000)]


def _placed(p: Partition) -> list[str]:
    return [i for ids in p.clients for i in ids] + p.holdout_identities


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "lognormal", "equal"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_identity_is_placed_exactly_once(scheme, seed):
    p = partition(IDS, 10, scheme, seed=seed, alpha=0.1)
    placed = _placed(p)
    assert sorted(placed) == IDS and len(set(placed)) == len(placed)
    assert all(len(ids) >= 1 for ids in p.clients)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "lognormal", "equal"])
def test_deterministic_by_seed(scheme):
    assert partition(IDS, 10, scheme, seed=4) == partition(IDS, 10, scheme, seed=4)
    assert partition(IDS, 10, scheme, seed=4).clients != partition(IDS, 10, scheme, seed=5).clients


def test_sizes_follow_the_requested_distribution():
    iid = partition(IDS, 10, "iid", holdout_fraction=0.1)
    assert {len(c) for c in iid.clients} == {90}
    equal = partition(IDS[:95], 10, "equal", holdout_fraction=0.0)
    assert {len(c) for c in equal.clients} == {9} and len(equal.holdout_identities) == 5
    for scheme, kwargs in (("dirichlet", {"alpha": 0.5}), ("lognormal", {"mu": 3.0, "sigma": 1.0})):
        p = partition(IDS, 10, scheme, seed=3, holdout_fraction=0.0, **kwargs)
        sizes = np.array([len(c) for c in p.clients]) / len(IDS)
        rng = np.random.default_rng(3)
        rng.permutation(len(IDS))  # the same draws partition() made, in the same order
        expected = client_shares(scheme, 10, rng, **kwargs)
        assert np.abs(sizes - expected).max() < 0.011, (scheme, sizes, expected)
    small = [len(c) for c in partition(IDS, 10, "dirichlet", alpha=0.05, seed=0).clients]
    large = [len(c) for c in partition(IDS, 10, "dirichlet", alpha=100.0, seed=0).clients]
    assert np.std(small) > 5 * np.std(large), "a small alpha must be far more skewed than a large one"
    x100 = partition(IDS, 10, "dirichlet", alpha=1.0, alpha_x100=True, seed=0)
    assert x100.params["alpha_x100"] and np.std([len(c) for c in x100.clients]) < np.std(small)


def test_allocate_keeps_one_each_and_the_total():
    counts = allocate(12, np.array([0.97, 0.01, 0.01, 0.01]))
    assert counts.sum() == 12 and counts.min() >= 1 and counts[0] == 9
    with pytest.raises(PartitionError, match="cannot give each of 5 clients"):
        allocate(4, np.ones(5))


def test_impossible_partitions_are_clear_errors():
    with pytest.raises(PartitionError, match="cannot give each of 10 clients an identity"):
        partition(IDS[:8], 10, "dirichlet", holdout_fraction=0.0)
    with pytest.raises(PartitionError, match="cannot give each"):
        partition(IDS[:8], 10, "equal", holdout_fraction=0.0)
    with pytest.raises(PartitionError, match="has none"):
        partition(IDS, 3, "attribute")
    with pytest.raises(PartitionError, match="unknown partition"):
        partition(IDS, 3, "random")
    with pytest.raises(PartitionError, match="leave none"):
        partition(IDS, 3, heldout_clients=3)


def test_attribute_rules():
    attributes = {i: {"Male": 1 if k % 2 else -1, "Eyeglasses": 1 if k % 3 == 0 else -1} for k, i in enumerate(IDS)}
    rules = [{"where": {"Eyeglasses": 1}}, {"where": {"Male": 1}}, {"where": {"Male": -1}}]
    p = partition(IDS, 3, "attribute", holdout_fraction=0.0, identity_attributes=attributes, rules=rules)
    assert all(attributes[i]["Eyeglasses"] == 1 for i in p.clients[0])
    assert all(attributes[i]["Male"] == 1 and attributes[i]["Eyeglasses"] == -1 for i in p.clients[1])
    assert sorted(_placed(p)) == IDS
    with pytest.raises(PartitionError, match="unknown attributes"):
        partition(IDS, 1, "attribute", identity_attributes=attributes, rules=[{"where": {"Bald": 1}}])


def test_per_identity_image_split_is_stratified():
    labels = np.repeat(np.arange(5), 10)
    split = split_images(labels, (0.7, 0.1, 0.2), seed=0)
    for label in range(5):
        assert np.bincount(split[labels == label], minlength=3).tolist() == [7, 1, 2]
    assert split_images(np.array([0, 1, 1]), seed=0)[0] == 0  # a single image stays in training


def test_saved_partition_repeats_exactly(tmp_path):
    p = partition(IDS, 4, "lognormal", seed=9, heldout_clients=1)
    assert Partition.load(p.save(tmp_path / "p.json")) == p and len(p.heldout_clients) == 1


def test_fleet_partition_command(capsys, synthetic_dir, tmp_path):
    assert main(["-q", "fleet", "partition", "--data", str(synthetic_dir), "--clients", "3", "--json",
                 "--holdout-identities", "0.1", "--out", str(tmp_path / "p.json")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["n_clients"] == 3 and sum(r["identities"] for r in summary["clients"]) == 9
    assert summary["holdout_identities"] == 1 and summary["imbalance_ratio"] >= 1.0
    assert (tmp_path / "p.json").exists()
    assert main(["-q", "fleet", "partition", "--data", str(tmp_path / "missing"), "--clients", "3"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["-q", "fleet", "partition", "--data", str(synthetic_dir), "--clients", "30"]) == 2
    assert "cannot give each of 30 clients" in capsys.readouterr().err
    assert main(["-q", "fleet", "partition", "--data", str(synthetic_dir), "--partition", "attribute"]) == 2
    assert "no per-image attributes" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["{not json", "[]", '{"scheme": "iid"}',
                                  '{"scheme": "iid", "params": {}, "seed": 0, "clients": [[1, 2]]}',
                                  '{"scheme": "iid", "params": {}, "seed": 0, "clients": [["a"]], '
                                  '"heldout_clients": [7]}'])
def test_a_damaged_saved_partition_is_refused_in_one_line(tmp_path, text):
    """A run folder's partition.json is read back on resume: damaged or foreign, it is named."""
    (tmp_path / "partition.json").write_text(text)
    with pytest.raises(PartitionError, match="partition.json is damaged or was not written by ffr fleet"):
        Partition.load(tmp_path / "partition.json")
