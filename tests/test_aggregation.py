"""Aggregation strategies as pure functions over state dicts."""
from __future__ import annotations

import numpy as np
import pytest

from coordinator.aggregation import STRATEGIES, FedAvg, FedAvgM, FedProx, RunningMean, apply_delta, make_strategy


def _deltas():
    rng = np.random.default_rng(0)
    return [({"w": rng.normal(size=(4, 3)).astype(np.float32), "n": np.array(2, np.int64)}, float(n))
            for n in (10, 30, 60)]


def test_fedavg_is_the_sample_weighted_mean_of_deltas():
    mean = RunningMean()
    for delta, n in _deltas():
        mean.add(delta, n)
    expected = sum(d["w"].astype(np.float64) * n for d, n in _deltas()) / 100.0
    assert np.allclose(mean.mean()["w"], expected)
    global_state = {"w": np.ones((4, 3), np.float32), "n": np.array(5, np.int64)}
    new, server_state = FedAvg().aggregate(global_state, mean.mean())
    assert server_state is None
    assert new["w"].dtype == np.float32 and np.allclose(new["w"], 1.0 + expected, atol=1e-6)
    assert new["n"].dtype == np.int64 and int(new["n"]) == 7 and new["n"].shape == ()


def test_running_mean_keeps_one_model_of_memory():
    mean = RunningMean()
    for delta, n in _deltas() * 20:
        mean.add(delta, n)
    assert mean.count == 60 and set(mean.total) == {"w", "n"}  # sums only, no list of updates
    with pytest.raises(ValueError, match="positive weight"):
        mean.add(_deltas()[0][0], 0)
    with pytest.raises(ValueError, match="differ"):
        mean.add({"other": np.zeros(1)}, 1)
    with pytest.raises(ValueError, match="no updates"):
        RunningMean().mean()


def test_fedprox_server_side_is_fedavg_and_its_mu_is_the_methods_that_devices_are_sent():
    from coordinator.aggregation import strategy_for
    from coordinator.settings import RoundSettings
    from protocol import methods
    from protocol.messages import TrainingConfig

    state, delta = {"w": np.zeros(3, np.float32)}, {"w": np.ones(3)}
    assert np.array_equal(FedProx(mu=0.1).aggregate(state, delta)[0]["w"], FedAvg().aggregate(state, delta)[0]["w"])
    training = TrainingConfig(method=methods.FedProx(prox_mu=0.1))  # what the engine announces, as it is
    assert strategy_for(RoundSettings(training=training)) == FedProx(mu=0.1) and training.method.proximal_mu() == 0.1


def test_fedavgm_accumulates_server_momentum():
    strategy = FedAvgM(momentum=0.5)
    state = {"w": np.zeros(2, np.float32)}
    state, velocity = strategy.aggregate(state, {"w": np.array([1.0, 0.0])})
    assert np.allclose(state["w"], [1.0, 0.0])
    state, velocity = strategy.aggregate(state, {"w": np.array([1.0, 0.0])}, velocity)
    assert np.allclose(state["w"], [1.0 + 1.5, 0.0])  # v = 0.5 * 1 + 1
    # pure: the same call again gives the same step (the strategy kept nothing between the calls)
    again, _ = strategy.aggregate({"w": np.zeros(2, np.float32)}, {"w": np.array([1.0, 0.0])}, {"w": np.ones(2)})
    assert np.allclose(again["w"], [1.5, 0.5]) and strategy.broadcast_state(velocity) is None


@pytest.mark.parametrize("update", [{"lr": 0.1}, {"method": {"name": "fedprox", "prox_mu": -1.0}}, {"prox_mu": 0.5},
                                    {"optimisation": {"epochs": 10 ** 6}}, {"method": {"name": "fedsgd"}}])
def test_a_copied_round_configuration_is_validated_like_a_received_one(update):
    """A round configuration copied with a change (`model_copy(update=)`): pydantic's own copy would take a moved
    name (`lr`, format 2's `prox_mu`), an out-of-bound value or an unknown method without a word; a message's copy
    refuses them."""
    from protocol.messages import TrainingConfig

    with pytest.raises(ValueError):
        TrainingConfig().model_copy(update=update)
    copied = TrainingConfig().model_copy(update={"method": {"name": "fedprox", "prox_mu": 0.5}})
    assert copied.method.proximal_mu() == 0.5


def test_strategies_by_name():
    assert isinstance(make_strategy("fedprox", mu=0.2), FedProx)
    with pytest.raises(ValueError, match="unknown strategy"):
        make_strategy("fedsgd")
    assert np.array_equal(apply_delta({"w": np.zeros(2)}, {"w": np.ones(2)}, 0.5)["w"], [0.5, 0.5])


def test_the_streaming_mean_equals_numpys_mean_of_the_same_updates():
    """Folding updates one at a time (float32 accumulator, in place) gives numpy's weighted mean over all of
    them held at once, to float32 precision, including a clip applied on the fly and a weight changed later."""
    rng = np.random.default_rng(1)
    updates = [{"w": rng.standard_t(3, size=(50, 40)).astype(np.float32), "v": rng.normal(size=7).astype(np.float32),
                "n": np.array(i % 3, np.int64)} for i in range(200)]
    weights = rng.integers(1, 100, size=200).astype(float)
    scales = np.where(np.arange(200) % 5 == 0, 0.5, 1.0)
    mean = RunningMean()
    for update, weight, scale in zip(updates, weights, scales):
        mean.add(update, weight, scale)
    mean.reweight({k: v * (scales[7] if v.dtype.kind == "f" else 1) for k, v in updates[7].items()}, weights[7], 3.0)
    weights[7] = 3.0
    got = mean.mean()
    for name in ("w", "v"):
        stacked = np.stack([u[name].astype(np.float64) * s for u, s in zip(updates, scales)])
        expected = np.average(stacked, axis=0, weights=weights)
        assert got[name].dtype == np.float32
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-6)
    assert float(got["n"]) == pytest.approx(np.average([u["n"] for u in updates], weights=weights))


@pytest.mark.parametrize("codec", ["fp16", "int8", "topk"])
def test_decoded_updates_fold_in_one_pass_to_the_same_mean_and_norm(codec):
    """Updates straight from the decoder (`protocol.codecs.Decoded`, every float in one vector) take the
    one-vector paths of RunningMean and l2_norm; the result must equal the per-tensor paths on plain dicts,
    also when decoded and plain updates are mixed in one round (a restored, clipped update is a plain dict)."""
    from models.maths.state_norms import l2_norm
    from protocol.codecs import Decoded, Staging, decode_update, encode_update, layout

    rng = np.random.default_rng(2)
    shapes = {"conv.weight": (8, 4, 3, 3), "fc.weight": (16, 32), "fc.bias": (16,), "bn.running_var": (8,),
              "bn.num_batches_tracked": ()}
    kinds = {k: "i" if k.endswith("tracked") else "f" for k in shapes}
    model = {k: np.zeros(s, np.int64 if kinds[k] == "i" else np.float32) for k, s in shapes.items()}
    staging = Staging(*layout(model), codec)
    fast, slow, plain = RunningMean(), RunningMean(), []
    for i in range(12):
        d = {k: (np.array(i, np.int64) if kinds[k] == "i" else rng.normal(size=s).astype(np.float32) * 1e-3)
             for k, s in shapes.items()}
        encoded, _ = encode_update(d, codec, 0.2)
        decoded = decode_update(encoded.data, encoded.sha256, codec, *layout(model), into=staging)
        assert isinstance(decoded, Decoded) and decoded.flat is staging.flat
        as_dict = {k: np.array(v) for k, v in decoded.items()}
        assert l2_norm(decoded) == pytest.approx(l2_norm(as_dict), rel=1e-5)
        weight, scale = float(i + 1), (0.5 if i % 4 == 0 else 1.0)
        (fast.add(as_dict, weight, scale) if i == 5 else fast.add(decoded, weight, scale))
        slow.add(as_dict, weight, scale)
        plain.append((as_dict, weight * scale))
    assert fast._flat is not None and fast._layout == staging.layout, "the accumulator takes the decoder's layout"
    got, want = fast.mean(), slow.mean()
    for name in shapes:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-9)
    expected = sum(d["fc.weight"].astype(np.float64) * w for d, w in plain) / fast.weight
    np.testing.assert_allclose(got["fc.weight"], expected, rtol=1e-4, atol=1e-9)


def test_every_algorithm_the_protocol_names_has_one_strategy_and_one_command_line_choice():
    """The algorithm names are spelled once (protocol.methods.ALGORITHMS); the coordinator, the round
    configuration (which the fleet's spec nests) and the --method choices take them from there."""
    from fleet.config import SimConfig
    from protocol.messages import TrainingConfig
    from protocol.methods import ALGORITHMS, METHODS

    assert tuple(STRATEGIES) == ALGORITHMS and set(ALGORITHMS) <= set(METHODS)
    assert isinstance(SimConfig().training, TrainingConfig)
    for name in ALGORITHMS:
        assert TrainingConfig(method=METHODS[name]()).algorithm == name
    with pytest.raises(ValueError):
        TrainingConfig(method={"name": "fedsomething"})


def test_each_strategy_is_built_from_the_run_settings_it_owns():
    """`strategy_for` looks the class up by the round configuration's algorithm; each class reads its own settings."""
    from coordinator.aggregation import PFM, strategy_for
    from coordinator.settings import RoundSettings
    from protocol import methods
    from protocol.messages import TrainingConfig
    from protocol.methods import ALGORITHMS
    from protocol.training_parts import OptimiserSettings

    def built(algorithm: str, momentum: float = 0.9, lr: float = 1e-4, **settings):
        training = TrainingConfig(method={"name": algorithm, **settings}, optimisation=OptimiserSettings(lr=lr))
        return strategy_for(RoundSettings(training=training, server_momentum=momentum))

    assert type(built("fedavg")) is FedAvg
    assert built("fedprox", prox_mu=0.3) == FedProx(mu=0.3)
    assert built("fedavgm", momentum=0.5) == FedAvgM(momentum=0.5)
    assert built("pfm", lr=0.02, pfm_beta=0.7) == PFM(lr=0.02, beta=0.7)
    assert strategy_for(RoundSettings(training=TrainingConfig(method=methods.FedFace(pfm_beta=0.6)))) == PFM(beta=0.6)
    assert [built(name).name for name in ALGORITHMS] == list(ALGORITHMS)  # every name on the wire has its class
