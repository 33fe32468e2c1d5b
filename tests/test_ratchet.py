"""The distillation ratchet's gate (bench.ratchet): hostile candidate files refused, no shipping unless better
on every set, and shipping rewrites the weights and their recorded sha256 together (on copies, never the repo's)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from bench import ratchet
from models.networks import face_weights


def _shipped_copy(tmp_path):
    path = tmp_path / "candidate.safetensors"
    shutil.copy(face_weights.shipped_weights(), path)
    return path


def _written(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _rewritten(tmp_path, change) -> str:
    state = load_file(str(face_weights.shipped_weights()))
    change(state)
    path = tmp_path / "hostile.safetensors"
    save_file(state, str(path))
    return str(path)


@pytest.mark.parametrize("hostile", ["garbage", "missing", "wrong_shape", "extra_key", "nan"])
def test_a_hostile_candidate_is_refused_in_one_line(tmp_path, hostile):
    first = next(iter(load_file(str(face_weights.shipped_weights()))))
    path = {
        "garbage": lambda: _written(tmp_path / "g.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}"),
        "missing": lambda: str(tmp_path / "nowhere.safetensors"),
        "wrong_shape": lambda: _rewritten(tmp_path, lambda s: s.__setitem__(first, np.zeros((3, 3), np.float16))),
        "extra_key": lambda: _rewritten(tmp_path, lambda s: s.__setitem__("head.weight", np.zeros(4, np.float16))),
        "nan": lambda: _rewritten(tmp_path, lambda s: s.__setitem__(
            "embedding.weight", np.full_like(s["embedding.weight"], np.nan))),
    }[hostile]()
    with pytest.raises(SystemExit) as refused:
        ratchet.load_candidate(Path(path))
    message = str(refused.value)
    assert message.startswith("bench.ratchet: ") and "\n" not in message


@pytest.mark.parametrize("existing", ['{"table": []}', "not json", "[1, 2]", '{"history": [1]}', "\xff\xfe",
                                      "[" * 100_000 + "]" * 100_000])
def test_a_results_file_without_a_verdict_history_is_refused_before_measuring_and_kept(tmp_path, existing,
                                                                                       monkeypatch):
    """`--name` pointing at another bench's result (or a damaged file): one line, nothing measured, file unchanged."""
    monkeypatch.setenv("FFR_FACES_DIR", str(tmp_path))  # a face folder exists; the refusal comes before any set
    (tmp_path / "distill_gap.json").write_bytes(existing.encode("latin-1"))
    with pytest.raises(SystemExit) as refused:
        ratchet.main(["--candidate", str(tmp_path / "nowhere.safetensors"), "--out", str(tmp_path),
                      "--name", "distill_gap"])
    message = str(refused.value)
    assert message.startswith("bench.ratchet: ") and "no verdict history" in message and "\n" not in message
    assert (tmp_path / "distill_gap.json").read_bytes() == existing.encode("latin-1")
    assert not (tmp_path / "distill_gap.md").exists()


def test_better_means_higher_auc_on_every_row():
    row = lambda before, after: {"shipped_auc": before, "candidate_auc": after}  # noqa: E731
    assert ratchet.better_everywhere([row(0.9, 0.91), row(0.5, 0.6)])
    assert not ratchet.better_everywhere([row(0.9, 0.91), row(0.5, 0.5)])  # equal is not better
    assert not ratchet.better_everywhere([row(0.9, 0.99), row(0.5, 0.49)])
    assert not ratchet.better_everywhere([])


def test_the_gain_interval_holds_zero_for_the_same_scores_and_excludes_it_for_a_clear_gain():
    rng = np.random.default_rng(0)
    people = rng.integers(0, 20, (2000, 2))
    same = people[:, 0] == people[:, 1]
    before = rng.normal(size=len(same)) + same * 1.0
    low, high = ratchet.d_auc_interval(same, people, before, before)
    assert low == high == 0.0
    noisy = before + rng.normal(scale=0.5, size=len(same))
    low, high = ratchet.d_auc_interval(same, people, noisy, before + same * 1.5)
    assert 0 < low < high


def test_shipping_writes_the_weights_and_their_sha256_together(tmp_path):
    module = tmp_path / "face_weights.py"
    shutil.copy(face_weights.__file__, module)
    target = tmp_path / "face_embedder.safetensors"
    source = _shipped_copy(tmp_path)
    candidate = ratchet.load_candidate(source)
    with torch.no_grad():
        candidate.embedding.weight.mul_(1.01)  # a different model, as a trained candidate would be
    digest = ratchet.ship(candidate, source, target, module)
    assert face_weights.file_sha256(target) == digest != face_weights.SHIPPED_SHA256
    assert f'SHIPPED_SHA256 = "{digest}"' in module.read_text()
    assert module.read_text().count("SHIPPED_SHA256 = ") == 1
    assert target.stat().st_size <= ratchet.MAX_BYTES
    reread = face_weights.load_face_embedder(target)
    assert torch.allclose(reread.embedding.weight, candidate.embedding.weight, atol=1e-3)
    assert not (tmp_path / "candidate.safetensors.tmp").exists()


def test_a_module_without_its_sha256_line_ships_nothing(tmp_path):
    module = tmp_path / "face_weights.py"
    module.write_text("# no pinned digest here\n")
    target = tmp_path / "face_embedder.safetensors"
    source = _shipped_copy(tmp_path)
    with pytest.raises(SystemExit, match="nothing shipped"):
        ratchet.ship(ratchet.load_candidate(source), source, target, module)
    assert not target.exists() and module.read_text() == "# no pinned digest here\n"


def test_the_shipped_weights_against_themselves_are_not_better(faces_dir, tmp_path, monkeypatch):
    """The whole gate on real faces (ORL): the same weights tie, a tie is not an improvement, nothing ships."""
    before = face_weights.file_sha256(face_weights.SHIPPED_WEIGHTS)
    rc = ratchet.main(["--candidate", str(_shipped_copy(tmp_path)), "--sets", "orl", "--out", str(tmp_path),
                       "--ship", "--name", "judged", "--made-by", "a copy of the shipped file"])
    assert rc == 0
    result = json.loads((tmp_path / "judged.json").read_text())
    assert result["candidate_made_by"] == result["history"][-1]["made_by"] == "a copy of the shipped file"
    assert "--made-by 'a copy of the shipped file'" in result["command"]  # the command as a shell runs it again
    assert [r["crops"] for r in result["table"]] == ["aligned (YuNet 5-point)", "Haar square"]
    assert all(r["d_auc"] == 0 and r["shipped_auc"] > 0.9 for r in result["table"])
    assert result["history"][-1]["shipped_now"] is None
    assert face_weights.file_sha256(face_weights.SHIPPED_WEIGHTS) == before


def test_a_verdict_measured_mirror_averaged_scores_as_a_device_does_and_says_so(faces_dir, tmp_path):
    """`--mirrored`: both files embed each face with its mirror, as the device's ONNX does, so the scores differ
    from one view's, the same weights still tie, and the history and the title name the way it was measured."""
    rc = ratchet.main(["--candidate", str(_shipped_copy(tmp_path)), "--sets", "orl", "--out", str(tmp_path),
                       "--mirrored", "--max-pairs", "2000"])
    assert rc == 0
    mirrored = json.loads((tmp_path / "ratchet.json").read_text())
    assert "held-out people (mirror-averaged)" in (tmp_path / "ratchet.md").read_text()
    assert ratchet.main(["--candidate", str(_shipped_copy(tmp_path)), "--sets", "orl", "--out", str(tmp_path),
                         "--max-pairs", "2000"]) == 0
    one_view = json.loads((tmp_path / "ratchet.json").read_text())
    assert [h["views"] for h in one_view["history"]] == ["mirror-averaged", "one view"]
    assert all(r["d_auc"] == 0 for r in mirrored["table"])
    haar = [(m["shipped_auc"], o["shipped_auc"]) for m, o in zip(mirrored["table"], one_view["table"])
            if m["crops"] == "Haar square"]
    assert haar and haar[0][0] != haar[0][1]


def test_an_override_is_refused_over_a_measured_loss_or_a_part_of_the_sets():
    row = lambda name, high: {"set": name, "crops": "given", "d_auc_95%_high": high}  # noqa: E731
    noisy = [row("orl", 0.01), row("glint24_aligned", 0.05)]
    assert ratchet.override_refused(noisy, complete=True) is None
    assert ratchet.override_refused(noisy, complete=False) == "only some sets were measured"
    assert "orl / given" in ratchet.override_refused([row("orl", -0.001), row("glint24_aligned", 0.05)], True)


def test_an_override_needs_a_reason_and_ship(tmp_path, capsys):
    candidate = str(_shipped_copy(tmp_path))
    for args in (["--override", "because"], ["--ship", "--override", " "]):
        with pytest.raises(SystemExit):
            ratchet.main(["--candidate", candidate, *args])
        assert "--override takes a reason" in capsys.readouterr().err


def test_the_uncalibrated_false_accepts_count_impostor_pairs_at_the_devices_default_threshold():
    from bench.ratchet import accepted
    from edge_client.recognizer import DEFAULT_THRESHOLD

    scores = np.array([DEFAULT_THRESHOLD - 0.1, DEFAULT_THRESHOLD, DEFAULT_THRESHOLD + 0.3, 0.9, -0.2])
    impostor = np.array([True, True, True, False, False])
    assert accepted(scores, impostor) == 1 / 3  # a score at the threshold is no match, as `ffr device verify` decides
    assert accepted(scores, ~impostor) == 0.5
