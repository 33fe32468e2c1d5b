"""What tells whether a federated round paid: intervals over people, the server's step, what a round may change."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from coordinator.server_step import FIXED_STEP, STEPS, WHOLE, Judged, best_step, extrapolation_limit, point
from models.evaluation.bootstrap import people_interval, rate_interval, weighted_tar_at_far
from models.evaluation.metrics import cosine_scores, make_pairs, tar_at_far
from models.maths.interpolation import interpolate_arrays
from models.networks.backbone import FaceEmbedder
from models.training.trainable import frozen_batchnorm, top_blocks_only


def _scored_people(n_people: int, noise: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(n_people), 8)
    emb = rng.normal(size=(n_people, 32))[labels] + noise * rng.normal(size=(len(labels), 32))
    pairs, same = make_pairs(labels, 40_000, seed)
    return cosine_scores(emb, pairs), same, labels[pairs]


def test_weighted_tar_with_unit_weights_is_the_plain_tar():
    scores, same, _ = _scored_people(30, 1.0)
    plain = tar_at_far(scores, same, (1e-2, 1e-3))
    for far in (1e-2, 1e-3):
        assert weighted_tar_at_far(scores, same, np.ones(len(scores)), far) == pytest.approx(plain[f"{far:g}"])
    assert weighted_tar_at_far(scores[:50], same[:50], np.ones(50), 1e-4) is None  # too few impostors to say


def test_the_interval_over_people_narrows_with_more_people_and_holds_the_figure():
    from sklearn.metrics import roc_auc_score

    few, many = _scored_people(10, 1.2), _scored_people(60, 1.2)
    widths = []
    for scores, same, people in (few, many):
        interval = people_interval(scores, same, people, fars=(1e-2,), resamples=100)
        low, high = interval["auc"]
        assert low <= roc_auc_score(same, scores) <= high
        assert interval["tar@1e-2"][0] <= interval["tar@1e-2"][1]
        widths.append(high - low)
    assert widths[1] < widths[0]


def test_a_door_far_made_by_one_look_alike_has_a_wide_interval_and_one_spread_over_strangers_a_narrow_one():
    people = np.repeat(np.arange(40), 20)  # 40 strangers, 20 photos each, each photo tried on 10 templates
    trials = np.full(len(people), 10)
    lookalike = np.where(people == 0, 2, 0)  # 40 false accepts, all of one stranger: FAR 0.005
    spread = np.zeros(len(people))
    spread[::20] = 1                         # 40 false accepts, one per stranger: FAR 0.005 too
    low, high = rate_interval(lookalike, trials, people)
    assert low == 0.0 and high > 0.01        # a draw without that stranger has no false accept
    low, high = rate_interval(spread, trials, people)
    assert low == pytest.approx(0.005) == high  # every draw of strangers keeps the rate
    assert rate_interval(np.zeros(0), np.zeros(0), np.zeros(0, int)) is None


def test_the_doors_count_devices_over_twice_the_promise_and_those_beyond_their_interval():
    from fleet.doors import door_means

    def row(far, interval):
        return {"chosen": "global", "global": {"tar": 0.9, "far": far, "far_promised": 1e-3, "far_interval": interval}}

    rows = {"0": row(0.0005, [0.0, 0.001]), "1": row(0.003, [0.0, 0.008]), "2": row(0.004, [0.0025, 0.006])}
    means = door_means(rows)
    assert means["global"]["over_2x"] == 2 and means["global"]["beyond_2x"] == 1
    assert means["chosen"] == {**means["global"], "personalised": 0}


def test_the_server_step_takes_the_point_that_separates_the_held_faces_best():
    current = {"w": np.zeros(4, np.float32), "n": np.array(3)}
    aggregate = {"w": np.full(4, 8.0, np.float32), "n": np.array(5)}
    # held faces that like a short step: the AUC peaks at w = 2 (a quarter of the way)
    auc_of = lambda state: 0.9 - abs(float(state["w"][0]) - 2.0) / 100  # noqa: E731
    passes = lambda auc: lambda state: Judged(auc(state), "", {})  # noqa: E731
    state, problem, figures = best_step(current, aggregate, passes(auc_of))
    assert problem == "" and figures["server_step"] == 0.25 and np.allclose(state["w"], 2.0) and state["n"] == 5
    assert figures["server_step_auc@1"] == pytest.approx(0.84)
    # held faces that like every move: the step goes to the aggregate, and past it (FedExP's extrapolation) only as
    # far as the updates' disagreement allows (and STEPS go); equal scores go to the smaller move
    likes_all = passes(lambda s: float(s["w"][0]))
    assert best_step(current, aggregate, likes_all)[2]["server_step"] == 1.0
    assert best_step(current, aggregate, likes_all, limit=1.7)[2]["server_step"] == 1.5
    assert best_step(current, aggregate, likes_all, limit=9.0)[2]["server_step"] == max(STEPS) > 1
    assert best_step(current, aggregate, passes(lambda s: 0.5))[2]["server_step"] == 0.25
    # only points the gate passes are candidates: the best one refused, the next best is taken; none, no step
    refuse_short = lambda s: Judged(auc_of(s), "too far" if s["w"][0] < 3 else "", {})  # noqa: E731
    assert best_step(current, aggregate, refuse_short)[2]["server_step"] == 0.5
    state, problem, figures = best_step(current, aggregate, lambda s: Judged(auc_of(s), "no", {"why": 1}))
    assert state is None and problem == "no" and figures["server_step"] == 0.0 and figures["why"] == 1
    half = interpolate_arrays(current, aggregate, 0.5)
    assert half["w"].dtype == np.float32 and np.allclose(half["w"], 4.0)


def test_a_step_past_the_aggregate_extrapolates_weights_but_not_batchnorm_statistics():
    current = {"w": np.ones(3, np.float32), "bn.running_var": np.full(3, 1.0, np.float32),
               "bn.running_mean": np.zeros(3, np.float32), "bn.num_batches_tracked": np.array(4)}
    aggregate = {"w": np.full(3, 2.0, np.float32), "bn.running_var": np.full(3, 0.4, np.float32),
                 "bn.running_mean": np.ones(3, np.float32), "bn.num_batches_tracked": np.array(9)}
    far = point(current, aggregate, 2.0)
    assert np.allclose(far["w"], 3.0) and far["w"].dtype == np.float32
    # extrapolated, this variance would be -0.2: the statistics stop at the aggregate's
    assert np.allclose(far["bn.running_var"], 0.4) and np.allclose(far["bn.running_mean"], 1.0)
    assert far["bn.num_batches_tracked"] == 9
    assert point(current, aggregate, 1.0) is aggregate
    assert np.allclose(point(current, aggregate, 0.5)["bn.running_var"], 0.7)


def test_fedexp_extrapolates_only_as_far_as_the_updates_disagree():
    """eta = max(1, sum p_i ||d_i||^2 / (2 ||sum p_i d_i||^2)) on real update vectors."""
    rng = np.random.default_rng(0)
    one = rng.normal(size=1000)
    assert extrapolation_limit([np.linalg.norm(one)], [5.0], np.linalg.norm(one)) == 1.0  # a lone update
    assert extrapolation_limit([np.linalg.norm(one)] * 4, [1.0] * 4, np.linalg.norm(one)) == 1.0  # agreeing ones
    # ten nearly orthogonal updates of equal norm: their mean is a tenth as long squared, eta = 10 / 2
    updates = rng.normal(size=(10, 100_000))
    norms, mean = np.linalg.norm(updates, axis=1), np.linalg.norm(updates.mean(axis=0))
    assert extrapolation_limit(norms, [1.0] * 10, mean) == pytest.approx(5.0, rel=0.05)
    # two opposed updates of unequal weight: the weights enter both the mean and the spread
    a, b = np.ones(4), -np.ones(4)
    weights = [3.0, 1.0]
    mean = (3 * a + b) / 4
    expected = (0.75 * 4 + 0.25 * 4) / (2 * np.dot(mean, mean))
    assert extrapolation_limit([2.0, 2.0], weights, np.linalg.norm(mean)) == pytest.approx(expected)
    assert extrapolation_limit([2.0, 2.0], [1.0, 1.0], 0.0) == 1.0  # updates that cancel: no direction to extend


def _one_step(model: FaceEmbedder) -> None:
    optimiser = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model.train()
    loss = model(torch.rand(4, 3, 64, 64) * 4).sum()
    optimiser.zero_grad()
    loss.backward()
    optimiser.step()


def test_frozen_batchnorm_keeps_the_received_statistics_through_training():
    torch.manual_seed(0)
    model = FaceEmbedder(32, 0.35, pretrained=False)
    before = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    with frozen_batchnorm(model):
        _one_step(model)
    assert all(torch.equal(before[k], model.state_dict()[k]) for k in before)
    _one_step(model)  # outside, BatchNorm learns its statistics again
    assert not all(torch.equal(before[k], model.state_dict()[k]) for k in before)


def test_top_blocks_only_leaves_the_lower_trunk_as_received():
    torch.manual_seed(0)
    model = FaceEmbedder(32, 0.35, pretrained=False)
    before = {k: v.clone() for k, v in model.named_parameters()}
    with top_blocks_only(model, 2):
        _one_step(model)
    after = dict(model.named_parameters())
    lower = [k for k in before if k.startswith("features.") and int(k.split(".")[1]) < len(model.features) - 2]
    upper = [k for k in before if k not in lower]
    assert lower and all(torch.equal(before[k], after[k]) for k in lower)
    assert any(not torch.equal(before[k], after[k]) for k in upper)
    assert all(p.requires_grad for p in model.parameters())  # everything trains again outside


def _gate_and_scrambled():
    """A gate on SYNTHETIC faces it holds, the shipped model, and that model with its embedding layer scrambled
    (every feature sent elsewhere): a candidate the gate refuses taken whole."""
    from coordinator.quality_gate import GateSettings, QualityGate
    from models.evaluation.separation import FaceSet
    from models.faces.synthetic import generate
    from models.networks.face_weights import face_global_state

    images, labels = generate(12, 4, seed=5)
    gate = QualityGate(FaceSet(images, labels), GateSettings(far=1e-2, seed=0))
    current = face_global_state()
    weight = current["backbone.embedding.weight"]
    rows, columns = (np.random.default_rng(k).permutation(n) for k, n in enumerate(weight.shape, start=1))
    return gate, current, {**current, "backbone.embedding.weight": weight[rows][:, columns]}


def test_a_degrading_update_is_caught_before_publication_and_a_short_step_keeps_the_faces_apart():
    """The coordinator's gate and server step on real scoring (ONNX Runtime) of SYNTHETIC faces it holds: an update
    that scrambles the embedding layer fails the gate taken whole, and the step the coordinator would take towards
    it is a shorter one, which separates the held faces better."""
    from models.evaluation.separation import score

    gate, current, degraded = _gate_and_scrambled()
    problem, figures = gate.check(current, "v0", degraded)
    assert problem.startswith("quality gate: ") and figures["gate_auc_candidate"] < figures["gate_auc_current"]
    stepped, why, step = gate.step(current, "v0", degraded)
    assert not why and step["server_step"] < 1
    assert step[f"server_step_auc@{step['server_step']:g}"] > step["server_step_auc@1"]
    assert score(stepped, gate.faces).auc > figures["gate_auc_candidate"]
    gate.anchor_on(lambda: current)
    assert gate.start_figures() == {"gate_auc_start": pytest.approx(figures["gate_auc_current"])}


def test_a_round_whose_whole_step_overshoots_the_gate_is_published_part_of_the_way():
    """Today's order rolled such a round back (the gate refused the whole step before any shorter one was tried);
    `publishable` tries the shorter steps of the whole aggregate and publishes the best that passes."""
    from coordinator.round_aggregation import publishable

    gate, current, overshoot = _gate_and_scrambled()
    assert gate.check(current, "v0", overshoot)[0]
    published, problem, figures = publishable(gate, current, "v0", overshoot)
    assert problem == "" and figures["gate_whole_step_refused"].startswith("quality gate")
    assert 0 < figures["server_step"] < 1 and published is not overshoot and published is not current


@pytest.mark.parametrize("steps", [(FIXED_STEP,), STEPS])
def test_a_round_scores_each_point_it_judges_once(steps):
    """`publishable` judges the candidate as it would publish it, then the steps among which that point is one
    again (built anew): each point is scored once, the current model once (a spy on the real ONNX scoring)."""
    from coordinator.round_aggregation import publishable

    gate, current, _ = _gate_and_scrambled()
    gate.steps = steps
    weight = current["backbone.embedding.weight"]
    honest = {**current, "backbone.embedding.weight": (weight * 1.05).astype(weight.dtype)}
    real, scored = gate.scorer, []
    gate.scorer = lambda state, *a, **k: scored.append(1) or real(state, *a, **k)
    points = len([a for a in steps if a <= WHOLE])  # publishable's limit: the whole step
    _, problem, figures = publishable(gate, current, "v0", honest)
    assert not problem and len(scored) == 1 + points, figures
    assert gate.check(current, "v0", dict(honest)) == gate.check(current, "v0", honest)
    assert len(scored) == 1 + points  # the same weights in another dict: judged before
    gate.check(current, "v0", {**honest, "backbone.embedding.weight": weight * 1.04})
    assert len(scored) == 2 + points  # other weights: scored


def test_a_round_saved_by_leaving_updates_out_is_never_extrapolated():
    """FedExP's bound is the whole round's; once the gate has left updates out, the model it passed goes no further
    than itself, whatever the bound said (the candidates past it are not even scored)."""
    from coordinator.round_aggregation import publishable

    gate, current, poisoned = _gate_and_scrambled()
    weight = current["backbone.embedding.weight"]
    honest = {**current, "backbone.embedding.weight": (weight * 1.05).astype(weight.dtype)}
    _, problem, figures = publishable(gate, current, "v0", honest, limit=2.0)
    assert not problem and figures["server_step_limit"] == 2.0 and "server_step_auc@2" in figures
    _, problem, figures = publishable(gate, current, "v0", poisoned, lambda why, m: (honest, "", m), limit=2.0)
    assert not problem and figures["server_step_limit"] == 1.0 and figures["server_step"] <= 1.0
    assert "server_step_auc@1.5" not in figures and "server_step_auc@2" not in figures


def test_the_anchor_refuses_the_third_small_step_of_a_drift_that_passes_each_round():
    """A drift that raises every impostor score a little each round (a shift of the embedding's BatchNorm bias, as an
    insider's update could carry): each step is within the bar against the model before it, but the third takes
    the run past the bar against the model it started from. Without the anchor, the same third step passes.
    The step is the largest on a grid whose three steps each pass the plain bar (found, not fixed: how far a step
    may go depends on the shipped weights): an insider aiming just below the per-round bar."""
    from coordinator.quality_gate import GateSettings, QualityGate
    from models.evaluation.separation import FaceSet
    from models.faces.synthetic import generate
    from models.networks.face_weights import face_global_state

    images, labels = generate(12, 4, seed=5)
    start = face_global_state()
    direction = np.random.default_rng(0).standard_normal(128).astype(np.float32)
    direction /= np.linalg.norm(direction)
    faces = FaceSet(images, labels)
    plain = QualityGate(faces, GateSettings(far=1e-2, seed=0))

    def drift(size: float) -> list[dict]:
        return [{**start, "backbone.bn.bias": start["backbone.bn.bias"] + k * size * direction} for k in range(4)]

    passing = [size for size in np.arange(0.2, 3.01, 0.2)
               if all(plain.check(s0, f"v{k}", s1)[0] == "" for k, (s0, s1) in enumerate(zip(drift(size),
                                                                                            drift(size)[1:])))]
    assert passing, "no drift step passes the per-round bar three times"
    states = drift(max(passing))
    anchored = QualityGate(faces, GateSettings(far=1e-2, seed=0))
    anchored.anchor_on(lambda: start)
    verdicts = [anchored.check(states[k - 1], f"v{k - 1}", states[k]) for k in (1, 2, 3)]
    assert [why for why, _ in verdicts[:2]] == ["", ""]
    why, figures = verdicts[2]
    assert "started from" in why
    # past the bar against the start on face pairs or on the templates of the gate's people (its identity canaries)
    assert any(figures[f"gate_anchor_{kind}far_candidate"] > figures[f"gate_anchor_{kind}far_limit"]
               for kind in ("", "template_")), figures
    for kind in ("", "template_"):  # within the bar against the model before
        assert figures[f"gate_{kind}far_candidate"] <= figures[f"gate_{kind}far_limit"], figures
    assert plain.check(states[2], "v2", states[3])[0] == ""


def test_the_coordinator_keeps_a_share_of_the_public_set_it_never_serves(tmp_path):
    from models.faces.synthetic import write_dataset
    from models.public_set import build_public_set, hold_back, load_public_set

    labelled = write_dataset(tmp_path / "people", n_identities=10, n_images=3, seed=4)
    build_public_set(labelled, tmp_path / "public.safetensors")
    served, held = hold_back(tmp_path / "public.safetensors", tmp_path / "state")
    whole, a, b = (load_public_set(p) for p in (tmp_path / "public.safetensors", served, held))
    assert len(a) + len(b) == len(whole) and len(np.unique(b.labels)) == 3  # 30% of the people, whole
    rows = {bytes(x.tobytes()) for x in a.images}
    assert not any(x.tobytes() in rows for x in b.images), "no face is both served and judged on"
    assert hold_back(tmp_path / "public.safetensors", tmp_path / "state") == (served, held)  # kept, not redrawn
    flat = tmp_path / "flat"
    flat.mkdir()
    for f in sorted(labelled.rglob("*.png"))[:12]:
        (flat / f"{f.parent.name}-{f.name}").write_bytes(f.read_bytes())
    build_public_set(flat, tmp_path / "flat.safetensors")
    served, held = hold_back(tmp_path / "flat.safetensors", tmp_path / "state")
    assert load_public_set(held).labels is None and len(load_public_set(held)) == 4  # by image: round(12 x 0.3)


def test_without_faces_the_coordinator_takes_a_quarter_of_the_way_to_the_aggregate(tmp_path):
    """No gate, nothing to choose a step on: the published model is eq. 1 at `--server-step` (0.25 by default), which
    kept a two-device `serve` run from falling below the shipped model (bench/results/two_device_serve.md)."""
    from test_trust import GLOBAL, Dev, Harness, honest_delta

    from coordinator.server_step import FIXED_STEP

    h = Harness(tmp_path, min_clients=2, server_step=FIXED_STEP)
    devs = [Dev(h, f"dev{i}").join() for i in range(2)]
    h.open_round()
    for i, dev in enumerate(devs):
        dev.upload(honest_delta(i))
    h.engine.tick()
    (row,) = h.engine.store.rounds()
    assert row["status"] == "completed" and row["metrics"]["server_step"] == FIXED_STEP == 0.25
    mean = (honest_delta(0)["backbone.w"] + honest_delta(1)["backbone.w"]) / 2
    assert np.allclose(h.engine.global_state["backbone.w"], GLOBAL["backbone.w"] + FIXED_STEP * mean, atol=1e-6)


def test_a_coordinator_given_no_faces_gates_its_fixed_step_on_stand_in_faces_kept_in_its_state(tmp_path):
    """`serve` without --gate-data or --public-set: SYNTHETIC stand-in faces from a seed in its state folder (0600,
    the same faces after a restart, others for another coordinator), scored with ONNX Runtime. They refuse a
    scrambled embedding and pass a small honest-sized change; they judge only the operator's step, never choose."""
    from coordinator.quality_gate import SEED_FILE, GateSettings, GateSetup, QualityGate, stand_in_faces
    from coordinator.server_step import FIXED_STEP
    from coordinator.service import Service, ServiceConfig
    from coordinator.settings import RoundSettings
    from protocol.messages import TrainingConfig

    faces = stand_in_faces(tmp_path / "a")
    assert (tmp_path / "a" / SEED_FILE).stat().st_mode & 0o777 == 0o600
    assert np.array_equal(stand_in_faces(tmp_path / "a").images, faces.images)
    assert not np.array_equal(stand_in_faces(tmp_path / "b").images, faces.images)
    assert len(faces.images) == 400 and len(np.unique(faces.labels)) == 40
    from fleet.attacks import collapse_delta
    from models.faces.synthetic import generate

    _, current, _ = _gate_and_scrambled()
    gate = QualityGate(faces, GateSettings(), "stand-in faces", steps=(FIXED_STEP,))
    whole = collapse_delta(current, generate(20, 6, seed=1)[0], 1.0)  # the attacker's own faces, not the gate's
    collapsed = {k: v + whole[k] / FIXED_STEP if v.dtype.kind == "f" else v for k, v in current.items()}
    problem, figures = gate.check(current, "v0", collapsed)  # judged as published: a quarter of the way
    assert problem.startswith("quality gate") and figures["gate_far_candidate"] > figures["gate_far_limit"], problem
    weight = current["backbone.embedding.weight"]
    honest = {**current, "backbone.embedding.weight": (weight * 1.05).astype(weight.dtype)}
    stepped, why, figures = gate.step(current, "v0", honest, limit=2.0)
    assert not why and figures["server_step"] == FIXED_STEP
    assert [k for k in figures if k.startswith("server_step_auc@")] == [f"server_step_auc@{FIXED_STEP:g}"]
    assert np.allclose(stepped["backbone.embedding.weight"], point(current, honest, FIXED_STEP)[
        "backbone.embedding.weight"])
    (tmp_path / "a" / SEED_FILE).write_text("not a seed")
    with pytest.raises(ValueError, match="damaged"):
        stand_in_faces(tmp_path / "a")

    service = Service(ServiceConfig(state=tmp_path / "state", init="none"),
                      RoundSettings(rounds=1, min_clients=5, server_step=0.5, training=TrainingConfig(width_mult=0.25)))
    try:
        assert service.gate is not None and service.gate.source == "stand-in faces" and service.gate.steps == (0.5,)
        assert (tmp_path / "state" / SEED_FILE).is_file()
    finally:
        service.close()
    off = Service(ServiceConfig(state=tmp_path / "off", init="none", gate=GateSetup(off=True)),
                  RoundSettings(rounds=1, min_clients=5, training=TrainingConfig(width_mult=0.25)))
    try:
        assert off.gate is None
    finally:
        off.close()
