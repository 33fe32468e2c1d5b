"""bench.distill_gap end to end on tiny SYNTHETIC stand-ins: every candidate on every set's same faces, the teacher's
figures shared by all, and a damaged student found to agree with the teacher less than the shipped one."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import distill_gap


def test_agreement_is_one_for_the_same_embedding_and_zero_for_orthogonal_ones():
    emb = np.eye(4, dtype=np.float32)
    assert distill_gap.agreement(emb, emb) == {"cosine_mean": 1.0, "cosine_p10": 1.0}
    assert distill_gap.agreement(emb, np.roll(emb, 1, axis=1))["cosine_mean"] == 0.0


def test_a_label_names_a_candidate_and_a_bare_file_is_named_by_its_stem():
    assert distill_gap.candidate("9M (H100)=/w/a.safetensors") == ("9M (H100)", Path("/w/a.safetensors"))
    assert distill_gap.candidate("/w/b.safetensors")[0] == "b"


@pytest.mark.parametrize("mirrored", [False, True])
def test_a_tiny_run_measures_each_student_on_the_same_faces(tmp_path, monkeypatch, mirrored):
    from models.faces.synthetic import write_dataset
    from models.networks import face_weights

    faces = tmp_path / "faces"
    write_dataset(faces / "glint24_aligned", n_identities=12, n_images=4, seed=1)
    for i, image in enumerate(sorted(write_dataset(tmp_path / "unlabelled", 10, 4, seed=2).rglob("*.png"))):
        flat = faces / distill_gap.DISTILLATION_SETS[i % 2]  # the unlabelled sets are flat folders
        flat.mkdir(exist_ok=True)
        shutil.copy(image, flat / f"{i:02d}.png")
    damaged = face_weights.load_face_embedder()
    with torch.no_grad():
        for p in damaged.parameters():
            p.add_(torch.randn_like(p) * p.std().nan_to_num(0.1))
    face_weights.save_embedder(tmp_path / "damaged.safetensors", damaged)
    monkeypatch.setenv("FFR_FACES_DIR", str(faces))
    out = tmp_path / "results"
    assert distill_gap.main(["--out", str(out), "--sets", "glint24_aligned", "--sample", "20", "--candidate",
                             f"shipped={face_weights.SHIPPED_WEIGHTS}",
                             f"damaged={tmp_path / 'damaged.safetensors'}", "--made-by", "noise on every weight",
                             *(["--mirrored"] if mirrored else [])]) == 0
    results = json.loads((out / "distill_gap.json").read_text())
    assert results["settings"]["mirrored"] is mirrored
    table = results["table"]
    rows = {(row["weights"], row["set"].split(" (")[0]): row for row in table}
    sets = ("distillation faces, held out", "distillation faces, trained on", "glint24_aligned")
    assert set(rows) == {(w, s) for w in ("shipped", "damaged") for s in sets}
    # the online run's own split of these 40 crops: 10 held out (a quarter, as for any set under 1,024), 20 of the
    # other 30 sampled
    assert (rows["shipped", sets[0]]["faces"], rows["shipped", sets[1]]["faces"]) == (10, 20)
    assert rows["shipped", "glint24_aligned"]["teacher_auc"] == rows["damaged", "glint24_aligned"]["teacher_auc"]
    for s in sets:
        assert rows["shipped", s]["cosine_mean"] > rows["damaged", s]["cosine_mean"] + 0.1
    assert "damaged" in (out / "distill_gap.md").read_text()
    assert "\nnoise on every weight\n" in (out / "distill_gap.md").read_text()
    views = "each face averaged with its mirror" if mirrored else "one view of each face"
    title = f"# How close the student is to its teacher, per set ({views})"
    assert (out / "distill_gap.md").read_text().startswith(title)


def test_missing_distillation_data_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FFR_FACES_DIR", str(tmp_path))
    assert distill_gap.main(["--out", str(tmp_path / "results"), "--sets", "orl"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "utkface_aligned" in err and "--distillation-data" in err
    assert not (tmp_path / "results").exists()


def test_a_distillation_face_s_age_comes_from_its_set_s_file_name():
    assert distill_gap.face_age("utkface_aligned/26_1_2_20170116174525125.jpg") == 26  # UTKFace
    assert distill_gap.face_age("13320A80.jpg") == 80                                   # All-Age-Faces
    assert distill_gap.face_age("person0/003.png") is None


def test_mirrored_rows_are_the_same_for_a_face_and_its_mirror_as_a_device_scores_them():
    """--mirrored: student and teacher both average each face with its mirror, so a set and its mirror image give one
    row; one view does not (the flip changes both models' embeddings), so the test fails if either side is not
    averaged. Real shipped weights, real SFace teacher, SYNTHETIC faces."""
    from bench.mirror_averaging import TeacherViews
    from models.faces.synthetic import generate
    from models.networks import face_weights

    images, labels = generate(n_identities=4, n_images=3, seed=3, size=112)
    flipped = np.ascontiguousarray(images[:, :, ::-1])
    pairs, same = distill_gap.make_pairs(labels, 1000, 0)
    models = {"shipped": face_weights.load_face_embedder()}
    teachers = {mirror: TeacherViews(mirror, threads=2) for mirror in (False, True)}

    def rows(faces, mirror):
        return distill_gap.set_rows("s", faces, 4, pairs, same, models, teachers[mirror])[0]

    for mirror in (False, True):
        for model_rows in (distill_gap.student_embeddings(models["shipped"], images, mirror),
                           teachers[mirror].embed(images)):
            assert model_rows.shape == (len(images), 128) and np.allclose(np.linalg.norm(model_rows, axis=1), 1)
    one, one_flipped = rows(images, False), rows(flipped, False)
    both, both_flipped = rows(images, True), rows(flipped, True)
    assert np.abs(distill_gap.student_embeddings(models["shipped"], images)
                  - distill_gap.student_embeddings(models["shipped"], flipped)).max() > 1e-3
    assert np.abs(teachers[False].embed(images) - teachers[False].embed(flipped)).max() > 1e-3
    assert one != both
    for key in ("cosine_mean", "cosine_p10", "student_auc", "teacher_auc", "score_rank_corr"):
        assert abs(both[key] - both_flipped[key]) <= 1e-4, key
    assert one_flipped["cosine_mean"] != one["cosine_mean"] or one_flipped["teacher_auc"] != one["teacher_auc"]
