"""FedFace's Federated Validation: the choice and the blend (eq. 8, 12, 13), the engine's exchange with a
validator (candidates out, scores in, hostile scores refused), and an FV fleet over Mosquitto in which
the validator sends nothing but scores."""
from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

from coordinator.validation import FederatedValidation, candidate_weightings, choose, local_norm
from protocol import topics
from protocol.chunks import Reassembler, from_bytes
from protocol.messages import TrainingConfig, ValidationRequest, ValidationScore
from protocol.tensors import decode


def test_choice_normalises_per_validator_and_needs_a_margin():
    scores = np.array([[0.50, 0.60, 0.40],     # validator 1 prefers candidate 2
                       [0.90, 0.91, 0.89]])    # validator 2 barely cares, but on its own scale it counts the same
    normed = local_norm(scores, 1e-3)
    assert np.allclose(normed[1], scores[1] / np.sqrt(scores[1].var() + 1e-3))
    assert choose(scores, 1e-3) == 1
    assert choose(np.array([[0.5, 0.5, 0.5]]), 1e-3) == 0, "no candidate beats the current one: keep it"
    rng = np.random.default_rng(0)
    drawn = candidate_weightings(np.array([0.25, 0.75]), 4, rng)
    assert np.array_equal(drawn[0], [0.25, 0.75]) and all(np.isclose(w.sum(), 1) and (w >= 0).all() for w in drawn)


def test_adopting_blends_by_phi_and_remembers_each_devices_factor():
    fv = FederatedValidation(phi=0.5)
    base = np.array([10.0, 30.0])
    current = fv.current(["a", "b"], base)
    assert np.allclose(current, [0.25, 0.75])
    new = fv.adopt(["a", "b"], base, current, np.array([1.0, 0.0]))
    assert np.allclose(new, [0.625, 0.375])
    assert np.allclose(fv.current(["a", "b"], base), new), "the next round starts from the adopted weighting"
    assert np.allclose(fv.current(["b", "a"], base[::-1]), new[::-1])


def _candidate(h, round_id: int, request: ValidationRequest) -> dict:
    frames = [p for t, p in h.sent if t.startswith(topics.candidate_chunks(round_id, request.candidate) + "/") and p]
    assembler = None
    for frame in frames:
        chunk = from_bytes(frame)
        assembler = assembler or Reassembler.for_chunk(chunk)
        data = assembler.add(chunk)
    return decode(data, request.model_sha256)


def test_an_fv_round_adopts_the_weighting_the_validator_prefers(tmp_path):
    from test_trust import GLOBAL, Dev, Harness

    h = Harness(tmp_path, min_clients=2, fv=True, fv_candidates=6, fv_phi=1.0, training=TrainingConfig(epochs=1))
    good, bad = Dev(h, "good").join(), Dev(h, "bad").join()
    validator = Dev(h, "validator")
    validator.send("hello", validator.hello().model_copy(update={"validator": True}))
    assert "validator" in h.engine.validators
    current = h.open_round()
    assert "validator" not in current.participants, "validators score; they are not asked to train"
    step = {k: (np.full(v.shape, 0.01, np.float32) if v.dtype.kind == "f" else np.array(0)) for k, v in GLOBAL.items()}
    good.upload(step)
    bad.upload({k: -v if v.dtype.kind == "f" else v for k, v in step.items()})
    h.engine.tick()  # all updates in: candidates go out instead of an aggregation
    requests = [b for b in h.inbox("validator") if isinstance(b, ValidationRequest)]
    assert len(requests) == 6 and h.engine.version == 0
    for request in requests:  # this validator's people like models moved toward the good update
        moved = float(np.mean(_candidate(h, current.round_id, request)["backbone.w"] - GLOBAL["backbone.w"]))
        validator.send("score", ValidationScore(round_id=current.round_id, candidate=request.candidate,
                                                score=float(1 / (1 + np.exp(-moved * 100)))))
    # hostile or mistaken scores are refused with a reason
    validator.send("score", ValidationScore(round_id=current.round_id, candidate=1, score=0.1))
    assert "already scored" in h.engine.store.rejections()[-1]["reason"]
    validator.send("score", ValidationScore(round_id=current.round_id, candidate=7, score=0.1))
    assert "has 6 candidates" in h.engine.store.rejections()[-1]["reason"]
    good.send("score", ValidationScore(round_id=current.round_id, candidate=2, score=1.0))
    assert "was not asked to validate" in h.engine.store.rejections()[-1]["reason"]
    h.engine.tick()
    row = h.engine.store.rounds()[0]
    assert row["status"] == "completed", row
    metrics = row["metrics"]
    assert metrics["fv_validators"] == 1 and metrics["fv_chosen"] != 1, "a candidate beat the plain FedAvg weighting"
    weighting = metrics["fv_weighting"]
    assert weighting["good"] > 0.5 > weighting["bad"], weighting
    expected = GLOBAL["backbone.w"] + (weighting["good"] - weighting["bad"]) * 0.01
    assert np.allclose(h.engine.global_state["backbone.w"], expected, atol=1e-5)
    assert h.engine.fv.factors["good"] > h.engine.fv.factors["bad"]
    published = {t for t, p in h.sent if "/candidate-" in t and p}
    cleared = {t for t, p in h.sent if "/candidate-" in t and not p}
    assert published and published <= cleared, "the candidates' retained chunks are cleared afterwards"


def test_a_score_outside_zero_one_is_refused_at_parse():
    from protocol.auth import Signer
    from protocol.messages import MessageError, parse, seal

    raw = seal("v", 1, ValidationScore(round_id=1, candidate=1, score=0.5), Signer.generate())
    with pytest.raises(MessageError):
        parse(raw.replace(b'"score":0.5', b'"score":1.5'))
    with pytest.raises(MessageError):
        parse(raw.replace(b'"score":0.5', b'"score":0.5,"embedding":[1,2]'))


def test_fedface_over_mosquitto_the_validator_sends_only_scores(tmp_path, mosquitto):
    from test_federated import Recorder

    from ffr.cli import main

    recorder = Recorder(mosquitto.url)
    out = tmp_path / "run"
    rc = main(["-q", "fleet", "simulate", "--clients", "4", "--holdout-clients", "1", "--rounds", "2",
               "--method", "fedface", "--fv-phi", "0.5", "--lr", "0.01", "--synthetic-identities", "12",
               "--synthetic-images", "8", "--holdout-identities", "0.2", "--width-mult", "0.35", "--init", "none",
               "--batch-size", "8", "--broker", mosquitto.url, "--no-centralised", "--out", str(out)])
    time.sleep(0.5)
    recorder.close()
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and all(h["updates"] == 3 for h in summary["history"][1:])
    from coordinator.store import Store

    rounds = Store(out / "coordinator").rounds()
    assert all(r["metrics"]["fv_validators"] == 1 and r["metrics"]["fv_candidates"] == 3 for r in rounds)
    validator = f"client-{json.loads((out / 'partition.json').read_text())['heldout_clients'][0]:03d}"
    sent = [(t, p) for t, p in recorder.messages if t.startswith(topics.device(validator, ""))
            and not t.endswith("/inbox") and p]
    kinds = {json.loads(p)["body"]["type"] for t, p in sent}
    # scores, and at the end one heartbeat saying it took the final model (its version, nothing else)
    assert {"hello", "score"} <= kinds <= {"hello", "score", "heartbeat"}, kinds
    beats = [json.loads(p)["body"] for t, p in sent if json.loads(p)["body"]["type"] == "heartbeat"]
    assert all(set(b) == {"type", "state"} and re.fullmatch(r"final v\d+", b["state"]) for b in beats), beats
    assert sum(json.loads(p)["body"]["type"] == "score" for t, p in sent) == 2 * 3, "T = 3 scores per round"
    assert not any("chunks" in t for t, p in sent), "a validator never uploads tensors"
