"""Issue 48's insiders: an attacker who knows the gate's settings and scales its poison to stay under them.

Real parts throughout: the edge client, Mosquitto, the coordinator's gate scoring with ONNX Runtime, SYNTHETIC faces.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from ffr.cli import main
from tests.test_collapse import FLEET


def test_the_drift_attacker_scales_its_poison_until_its_own_estimate_of_the_gate_passes():
    from coordinator.quality_gate import GateSettings
    from edge_client.adoption import check_faces
    from fleet.attacks import aimed_bar, collapse_delta, drift_delta
    from models.evaluation.separation import compare, door_scores, door_verdict, score
    from models.faces.synthetic import generate
    from models.networks.face_weights import face_global_state

    state = face_global_state()
    images, labels = generate(20, 6, seed=1)  # enough faces that a FAR of 1e-3 is a count of pairs, not one or two
    public, _ = generate(60, 1, seed=2)
    faces = check_faces(images, labels, public)
    bar, share, bound = GateSettings(), 0.5, 1.0

    def moved(delta: dict, scale: float = 1.0) -> dict:
        return {k: v + share * scale * delta[k] if v.dtype.kind == "f" else v for k, v in state.items()}

    whole = collapse_delta(state, images, bound)
    now = score(state, faces)
    assert not compare(now, score(moved(whole), faces)).ok, "the collapse at full strength is what a gate refuses"
    drift = drift_delta(state, images, bound, faces, share)
    assert drift["backbone.bn.num_batches_tracked"].dtype == state["backbone.bn.num_batches_tracked"].dtype
    ratio = np.linalg.norm(drift["backbone.embedding.weight"]) / np.linalg.norm(whole["backbone.embedding.weight"])
    assert 0 < ratio < 1, ratio
    # inside its aim on face pairs and on faces against its people's templates, so inside the gate's own bar too
    before, after = door_scores(state, faces), door_scores(moved(drift), faces)
    assert len(before[1].impostor) > 0, "the attacker's faces are labelled: it can estimate the template check"
    assert door_verdict(before, after, aimed_bar()).ok and door_verdict(before, after, bar).ok
    assert aimed_bar().far_ratio < bar.far_ratio and aimed_bar().pair_jump < bar.pair_jump


def test_the_hidden_impersonation_is_an_honest_sized_update_that_still_pulls_the_attacker_onto_the_victim():
    """What update screening sees of `impersonate-hidden`: the norm of the device's honest update and most of its
    direction; what the model gets: the attacker's faces nearer the victim's than the honest update leaves them. The
    honest update here is a small random step of the learnt weights (the attack's geometry does not depend on which
    honest step it rides)."""
    from fleet.attacks import hidden_in
    from models.evaluation.separation import embed
    from models.faces.synthetic import generate
    from models.maths.state_norms import float_names, l2_norm
    from models.networks.face_weights import face_global_state

    state = face_global_state()
    images, labels = generate(6, 6, seed=3)
    own, victim, keep = images[labels == 0], images[labels == 1][:4], images[labels > 1]
    rng = np.random.default_rng(0)
    learnt = [k for k in float_names(state) if not k.endswith(("running_mean", "running_var"))]
    honest = {k: (1e-3 * rng.normal(size=np.shape(v)) if k in learnt else np.zeros_like(v)) for k, v in state.items()}
    sent = hidden_in(honest, state, (own, victim, keep), share=0.5)
    assert np.isclose(l2_norm(sent), l2_norm(honest), rtol=1e-6)
    flat = lambda d: np.concatenate([np.ravel(d[k]) for k in learnt])  # noqa: E731
    alignment = flat(sent) @ flat(honest) / (np.linalg.norm(flat(sent)) * np.linalg.norm(flat(honest)))
    assert 0.5 < alignment < 0.95, alignment  # mostly the honest direction, yet not it

    def pull(delta: dict) -> float:
        model = {k: v + 0.5 * delta[k] if np.asarray(v).dtype.kind == "f" else v for k, v in state.items()}
        mine, theirs = embed(model, own), embed(model, victim).mean(0)
        return float(np.mean(mine @ (theirs / np.linalg.norm(theirs))))

    assert pull(sent) > pull(honest) + 0.01


def test_a_drift_attacker_in_a_fleet_is_reported_with_the_impostors_let_in_at_the_start_threshold(
        tmp_path, mosquitto):
    from coordinator.store import Store

    run = tmp_path / "drift"
    argv = [a if a != "collapse" else "drift" for a in FLEET]
    assert main(["-q", "fleet", "simulate", "--broker", mosquitto.url, *argv, "--out", str(run)]) == 0
    summary = json.loads((run / "summary.json").read_text())
    attack = summary["attack"]
    assert attack["kind"] == "drift" and len(attack["attackers"]) == 1
    far = attack["far@start"]
    assert far["start"] == summary["history"][0]["holdout_far@start"]
    assert far["last"] == summary["history"][-1]["holdout_far@start"]
    assert all(0 <= h["holdout_far@start"] <= 1 for h in summary["history"])
    store = Store(run / "coordinator")
    for r in store.rounds():  # the attacker's update is a well-formed one: it was taken in, not refused on the wire
        assert attack["attackers"][0] in {u["device_id"] for u in store.accepted_updates(r["round_id"])} \
            or r["metrics"].get("gate_excluded_devices") == attack["attackers"]
    assert "Attack `drift`" in (run / "summary.md").read_text()


@pytest.mark.parametrize("kind", ["impersonate", "impersonate-hidden"])
def test_an_impersonation_in_a_fleet_reports_its_success_rate_on_the_victims_device(tmp_path, mosquitto, kind):
    """The attacker pulls its first person onto another device's first person, four of whose photos it holds; the
    summary names both and how many of the attacker's held-out photos the victim's door would take as the victim."""
    run = tmp_path / kind
    argv = [a if a != "collapse" else kind for a in FLEET]
    assert main(["-q", "fleet", "simulate", "--broker", mosquitto.url, *argv, "--rounds", "1", "--out", str(run)]) == 0
    attack = json.loads((run / "summary.json").read_text())["attack"]
    assert attack["kind"] == kind and attack["attacker"] in attack["attackers"]
    assert attack["victim"] not in attack["attackers"] and attack["victim_person"] != attack["attacker_person"]
    assert len(attack["photos"]) == 4
    for key in ("success_rate", "success_rate_global", "success_rate_start"):
        assert 0 <= attack[key] <= 1, key
    assert "Impersonation of" in (run / "summary.md").read_text()


def _person_pulled_onto_another(pull: float):
    """Scores of 12 labelled people, 10 faces each: the current model, and a candidate in which every pair of person 3
    with person 7 scores `pull` (the rest unchanged)."""
    from models.evaluation.separation import pair_scores

    rng = np.random.default_rng(0)
    centres = rng.normal(size=(12, 64))
    labels = np.repeat(np.arange(12), 10)
    emb = centres[labels] + 0.9 * rng.normal(size=(120, 64))
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    current = pair_scores(emb, labels)
    ids = current.impostor_ids
    moved = current.impostor.copy()
    moved[((ids[:, 0] == 3) & (ids[:, 1] == 7)) | ((ids[:, 0] == 7) & (ids[:, 1] == 3))] = pull
    return current, type(current)(current.genuine, moved, ids)


def test_the_gate_refuses_one_person_pulled_onto_another_when_the_average_holds():
    """Worst case, not averages: person 3's 100 pairs with person 7 are 1.5% of the impostor pairs; all of them
    crossing the threshold keeps the overall FAR under its 2x bar, the per-person count does not."""
    from models.evaluation.separation import compare, worst_identity
    from models.evaluation.thresholds import threshold_at_far

    current, candidate = _person_pulled_onto_another(0.99)
    verdict = compare(current, candidate, far=1e-2, far_ratio=3.0, auc_margin=0.05)
    assert verdict.metrics["far_candidate"] <= verdict.metrics["far_limit"], "the average alone would pass it"
    assert not verdict.ok and verdict.reason.startswith(("person 3", "person 7")), verdict.reason
    threshold, _ = threshold_at_far(current.impostor, 1e-2)
    assert worst_identity(current, current, threshold, 1e-2, 3.0) is None
    same, untouched = _person_pulled_onto_another(-1.0)  # person 3 pushed away from 7: nobody let in
    assert compare(same, untouched, far=1e-2, far_ratio=3.0, auc_margin=0.05).ok


def test_the_gate_refuses_one_face_pulled_onto_one_other_when_every_count_holds():
    """One pair, not one person: a single impostor pair (one face of person 3, one of person 7) moved from its score
    to 0.99 is 1 crossing, inside the per-person slack; the pair check refuses it, and an even rise of every pair
    (an honest round's kind of move) is not refused by it."""
    from models.evaluation.separation import PAIR_JUMP, compare, worst_identity, worst_pair
    from models.evaluation.thresholds import threshold_at_far

    current, _ = _person_pulled_onto_another(0.0)
    ids = current.impostor_ids
    one = int(np.flatnonzero(((ids[:, 0] == 3) & (ids[:, 1] == 7)) | ((ids[:, 0] == 7) & (ids[:, 1] == 3)))[0])
    moved = current.impostor.copy()
    moved[one] = 0.99
    candidate = type(current)(current.genuine, moved, ids)
    threshold, _ = threshold_at_far(current.impostor, 1e-2)
    assert current.impostor[one] < threshold < 0.99 and 0.99 - current.impostor[one] > PAIR_JUMP
    assert worst_identity(current, candidate, threshold, 1e-2, 3.0) is None, "the per-person count lets it pass"
    verdict = compare(current, candidate, far=1e-2, far_ratio=3.0, auc_margin=0.05)
    assert not verdict.ok and verdict.reason.startswith(("people 3 and 7", "people 7 and 3")), verdict.reason
    assert verdict.metrics["pairs_jumped"] == 1
    lifted = type(current)(current.genuine + 0.05, current.impostor + 0.05, ids)
    assert worst_pair(current, lifted, threshold) is None
    assert worst_pair(current, candidate, threshold, jump=1.5) is None, "the jump is the bar"


def test_a_pair_pulled_a_little_each_round_is_refused_against_the_anchor_when_the_rises_add_up():
    """The pair check is held against the model the run started from too (the gate's and a device's anchor): one pair
    pulled 0.1 a round passes each round's check (0.1 < PAIR_JUMP), and the third step, 0.3 above the start and
    across the threshold, is refused against the start."""
    from models.evaluation.separation import PAIR_JUMP, compare
    from models.evaluation.thresholds import threshold_at_far

    start, _ = _person_pulled_onto_another(0.0)
    ids = start.impostor_ids
    one = int(np.flatnonzero(((ids[:, 0] == 3) & (ids[:, 1] == 7)) | ((ids[:, 0] == 7) & (ids[:, 1] == 3)))[0])
    steps = [start]
    for _ in range(3):
        moved = steps[-1].impostor.copy()
        moved[one] += 0.1
        steps.append(type(start)(start.genuine, moved, ids))
    bar = {"far": 1e-2, "far_ratio": 3.0, "auc_margin": 0.05}
    threshold, _ = threshold_at_far(start.impostor, bar["far"])
    assert 0.2 < PAIR_JUMP < 0.3 and steps[2].impostor[one] < threshold + 0.1 < steps[3].impostor[one]
    assert all(compare(a, b, **bar).ok for a, b in zip(steps, steps[1:])), "each round's step passes"
    assert compare(start, steps[2], **bar).ok, "two steps, 0.2 from the start, pass against it too"
    against_start = compare(start, steps[3], **bar)
    assert not against_start.ok and "rose 0.300" in against_start.reason, against_start.reason


@pytest.mark.parametrize("jump", [0.0, -0.1, 2.5, float("nan")])
def test_a_pair_jump_outside_its_range_is_refused_in_one_line(jump):
    from models.evaluation.separation import SeparationSettings

    with pytest.raises(ValueError, match="pair.jump must be"):
        SeparationSettings(pair_jump=jump)


def _embeddings_with_a_pull(share: float, people: int = 8, faces: int = 20,
                            public: int = 80) -> tuple[np.ndarray, np.ndarray]:
    """`people` x `faces` and `public` public negatives in 128-d, face-pair genuine cosine about 0.45 (CelebA-like):
    person 0's faces moved `share` of the way from their own centre onto person 1's."""
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(people, 128))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    noise = rng.normal(size=(people, faces, 128)) * 1.1 / np.sqrt(128)
    negatives = rng.normal(size=(public, 128))
    means = np.repeat(centres[:, None], faces, axis=1)
    means[0] = (1 - share) * centres[0] + share * centres[1]
    emb = np.concatenate([(means + noise).reshape(-1, 128), negatives])
    labels = np.concatenate([np.repeat(np.arange(people), faces), people + np.arange(public)])
    return emb / np.linalg.norm(emb, axis=1, keepdims=True), labels


def test_the_gate_refuses_one_of_its_people_pulled_onto_anothers_template_while_face_pairs_hold():
    """Identity canaries at the coordinator: each labelled person of the gate's faces is enrolled as a template and
    probed by every other face, as a device's door decides. 40 people x 10 faces (the gate's 400): person 0 pulled
    30% of the way onto person 1 passes the gate's bar on face pairs (overall, per person, per pair) and is refused on
    templates; no pull passes. The scorer stands in for the ONNX embedding of a real model: no real update can be
    made to move exactly one person and nothing else (a fake for a fault not otherwise caused)."""
    from coordinator.quality_gate import GateSettings, QualityGate
    from models.evaluation.separation import FaceSet, pair_scores, template_scores

    def scorer(state, faces, threads):
        emb, labels = _embeddings_with_a_pull(float(state["pull"]), people=40, faces=10, public=0)
        return pair_scores(emb, labels), template_scores(emb, labels)

    labels = np.repeat(np.arange(40), 10)
    gate = QualityGate(FaceSet(np.zeros((400, 2, 2, 3), np.uint8), labels), GateSettings(), "canaries",
                       steps=(1.0,), scorer=scorer)
    current, pulled = {"pull": np.array(0.0)}, {"pull": np.array(0.3)}
    assert GateSettings().judge(scorer(current, None, 1)[0], scorer(pulled, None, 1)[0]).ok, "pairs alone pass it"
    problem, figures = gate.check(current, "v0", pulled)
    said = "quality gate: faces against its people's templates (identity canaries): people 0 and 1"
    assert problem.startswith(said), problem
    assert figures["gate_template_far_candidate"] >= figures["gate_template_far_current"]
    assert gate.check(current, "v0", {"pull": np.array(0.0)})[0] == ""


def test_a_device_refuses_one_person_pulled_part_way_onto_anothers_template_while_face_pairs_hold():
    """The door decides on a face against a person's template, the mean of their faces, which the noise of single
    faces does not blur: person 0 pulled 30% of the way onto person 1 passes every check on face pairs (overall, per
    person, per pair) at the device's bar, and is refused on faces against templates; honest-sized (no pull) is not."""
    from edge_client.adoption import ADOPTION, door_verdict
    from models.evaluation.separation import pair_scores, template_scores

    def door(share: float):
        emb, labels = _embeddings_with_a_pull(share)
        return pair_scores(emb, labels), template_scores(emb, labels)

    current, pulled = door(0.0), door(0.3)
    assert ADOPTION.judge(current[0], pulled[0]).ok, "the face pairs alone would let it in"
    verdict = door_verdict(current, pulled)
    assert not verdict.ok and verdict.reason.startswith("faces against the enrolled people's templates: person"), \
        verdict.reason
    assert door_verdict(current, door(0.0)).ok
    templates = pulled[1]
    assert len(templates.genuine) == 160 and len(templates.impostor) == 160 * 7 + 80 * 8
    assert set(templates.impostor_ids[:, 0]) == set(range(8)), "public negatives are probes, never templates"
