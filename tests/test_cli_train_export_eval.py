"""The CLI end to end: ffr train -> export -> eval, resume, ONNX parity, torch-free verification."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ffr.cli import build_parser, main
from models.faces.crops import CropConfig, crop_index
from models.faces.datasets import load_index
from models.networks.embedders import TorchEmbedder
from models.networks.face_model import load_checkpoint
from models.runtime import OnnxEmbedder

REPO = Path(__file__).resolve().parents[1]


def test_every_subcommand_has_help(capsys):
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert {"train", "export", "eval", "synth", "demo"} <= set(commands)
    for name in commands:
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        assert "usage: ffr " + name in capsys.readouterr().out


def test_train_writes_checkpoints_metrics_and_plots(trained_run):
    for name in ("best.pt", "latest.pt", "metrics.json", "curves.png", "roc.png"):
        assert (trained_run / name).is_file(), name
    metrics = json.loads((trained_run / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["epochs_run"] == 3
    assert metrics["data_kind"] == "synthetic" and metrics["evaluated_on"] == "held-out identities"
    assert metrics["config"]["optimisation"]["batch_size"] == 16 and metrics["config"]["aug"] == "weak"
    history = metrics["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    final = metrics["final"]
    assert {"auc", "eer", "eer_threshold", "tar_at_far"} <= set(final)
    # three real epochs on synthetic faces separate people never seen in training
    assert final["auc"] > 0.7, final


def test_train_defaults_follow_the_design():
    args = build_parser().parse_args(["train", "--data", "d", "--out", "o"])
    assert (args.epochs, args.batch_size, args.lr, args.patience, args.aug, args.head) == \
        (20, 32, 1e-4, 10, "weak", "cosface")
    assert args.init == "face"  # the shipped face-pretrained embedder


@pytest.mark.parametrize("init", ["face", "none"])
def test_an_imagenet_weights_file_without_init_imagenet_is_refused(tmp_path, synthetic_dir, capsys, init):
    """`--weights` is ImageNet's starting file: beside the face weights or a random start it would silently replace
    them, so it is refused in one line, before any data is read."""
    rc = main(["-q", "train", "--data", str(synthetic_dir), "--out", str(tmp_path / "run"), "--init", init,
               "--weights", str(tmp_path / "mobilenet_v2.pth"), "--no-mlflow"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--weights has no effect without --init imagenet" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_existing_run_needs_resume_or_force(trained_run, synthetic_dir, capsys):
    assert main(["-q", "train", "--data", str(synthetic_dir), "--out", str(trained_run), "--no-mlflow"]) == 2
    assert "already holds a run; pass --resume to continue it or --force" in capsys.readouterr().err


def test_interrupted_training_resumes_where_it_stopped(tmp_path, synthetic_dir, monkeypatch, capsys):
    import models.training.supervised as training

    out = tmp_path / "run"
    real_log = training.NullTracker.log_metrics

    def interrupt_after_epoch_2(self, metrics, step):  # Ctrl-C cannot be typed in CI: raise it at a known point
        real_log(self, metrics, step)
        if step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(training.NullTracker, "log_metrics", interrupt_after_epoch_2)
    base = ["-q", "train", "--data", str(synthetic_dir), "--out", str(out), "--epochs", "3", "--lr", "1e-3",
            "--no-mlflow", "--width-mult", "0.35", "--init", "none", "--batch-size", "16"]
    assert main(base) == 130
    stopped = json.loads((out / "metrics.json").read_text())
    assert stopped["status"] == "interrupted" and stopped["epochs_run"] == 2
    import shlex

    hint = shlex.split(capsys.readouterr().err.split("resume with")[1].strip())
    assert hint == ["ffr", *base[1:], "--resume"]  # every option the user gave, kept
    monkeypatch.setattr(training.NullTracker, "log_metrics", real_log)
    assert main(hint[1:]) == 0  # following the hint as printed
    done = json.loads((out / "metrics.json").read_text())
    assert done["status"] == "completed" and [h["epoch"] for h in done["history"]] == [1, 2, 3]
    assert done["history"][:2] == stopped["history"]


def test_early_stopping(tmp_path, synthetic_dir):
    out = tmp_path / "run"
    assert main(["-q", "train", "--data", str(synthetic_dir), "--out", str(out), "--epochs", "10", "--lr", "1e-9",
                 "--patience", "1", "--no-mlflow", "--width-mult", "0.35", "--init", "none"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["status"] == "early_stopped" and metrics["epochs_run"] < 10


def test_mlflow_tracking_in_sqlite(tmp_path, synthetic_dir):
    out = tmp_path / "run"
    assert main(["-q", "train", "--data", str(synthetic_dir), "--out", str(out), "--epochs", "1",
                 "--width-mult", "0.35", "--init", "none", "--head", "arcface", "--aug", "strong"]) == 0
    import mlflow

    client = mlflow.tracking.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run_id = json.loads((out / "metrics.json").read_text())["tracking_run_id"]
    run = client.get_run(run_id)
    assert run.data.params["head"] == "arcface" and run.data.params["aug"] == "strong"
    assert "train_loss" in run.data.metrics and "final_auc" in run.data.metrics


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx")
    assert main(["-q", "export", "--model", str(trained_run / "best.pt"), "--out", str(out / "generic.onnx")]) == 0
    assert main(["-q", "export", "--model", str(trained_run / "best.pt"), "--out", str(out / "pers.onnx"),
                 "--personalised"]) == 0
    return out


def test_onnx_matches_pytorch_on_every_image(trained_run, exported, synthetic_dir):
    model, _ = load_checkpoint(trained_run / "best.pt")
    crops = crop_index(load_index(synthetic_dir), CropConfig(detector="none"), use_cache=False, progress=False)
    people = model.dfc.classifiers.weight.shape[0] if model.dfc.posterior_weight > 0 else 0  # posteriors, if any
    for personalised, name, dim in ((False, "generic.onnx", 128), (True, "pers.onnx", 256 + people)):
        onnx_emb = OnnxEmbedder(exported / name).embed(crops.images, batch_size=7)  # odd batches: dynamic axis
        torch_emb = TorchEmbedder(model, personalised, mirror=True).embed(crops.images)  # the export's default
        assert onnx_emb.shape == (len(crops), dim)
        cosines = np.sum(onnx_emb * torch_emb, axis=1) / (
            np.linalg.norm(onnx_emb, axis=1) * np.linalg.norm(torch_emb, axis=1))
        assert cosines.min() >= 0.9999, (name, cosines.min())
    info = OnnxEmbedder(exported / "pers.onnx").info
    assert (info.kind, info.input_size, info.mean, info.std, info.color) == ("personalised", 128, 0.5, 0.5, "RGB")
    assert info.embedding_dim == 256 + people and info.mirror


def test_export_one_view(trained_run, tmp_path, synthetic_dir):
    """`ffr export --one-view`: each face embedded once, as the torch model alone does."""
    assert main(["-q", "export", "--model", str(trained_run / "best.pt"), "--out", str(tmp_path / "one.onnx"),
                 "--one-view"]) == 0
    model, _ = load_checkpoint(trained_run / "best.pt")
    crops = crop_index(load_index(synthetic_dir), CropConfig(detector="none"), use_cache=False, progress=False)
    embedder = OnnxEmbedder(tmp_path / "one.onnx")
    assert not embedder.info.mirror
    cosines = np.sum(embedder.embed(crops.images) * TorchEmbedder(model).embed(crops.images), axis=1)
    assert cosines.min() >= 0.9999


def test_verifier_runs_without_torch(exported, synthetic_dir):
    """A device with only the `edge` extra: block torch entirely and verify two faces."""
    script = f"""
import sys
sys.modules['torch'] = None  # any 'import torch' now fails
from models.runtime import OnnxEmbedder, cosine
from models.faces.imageio import read_rgb
from models.faces.detect import center_crop
from pathlib import Path
root = Path({str(synthetic_dir)!r})
a, b = sorted((root / 'synthetic_0000').iterdir())[:2]
c = sorted((root / 'synthetic_0001').iterdir())[0]
emb = OnnxEmbedder({str(exported / 'generic.onnx')!r})
e = emb.embed(__import__('numpy').stack([center_crop(read_rgb(p)) for p in (a, b, c)]))
print(cosine(e[0], e[1]), cosine(e[0], e[2]))
assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules if sys.modules[m] is not None)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    same, other = map(float, result.stdout.split())
    assert -1.0 <= other <= 1.0 and -1.0 <= same <= 1.0


def _eval_json(capsys, args) -> dict:
    capsys.readouterr()
    assert main(["-q", "eval", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


REQUIRED = {"auc", "eer", "eer_threshold", "tar_at_far", "n_images", "n_identities", "n_genuine_pairs",
            "n_impostor_pairs", "faces_not_detected", "accuracy", "accuracy_std"}


def test_eval_json_from_checkpoint_and_onnx_agree(capsys, trained_run, exported, synthetic_dir):
    from_pt = _eval_json(capsys, ["--model", str(trained_run / "best.pt"), "--data", str(synthetic_dir)])
    from_onnx = _eval_json(capsys, ["--model", str(exported / "generic.onnx"), "--data", str(synthetic_dir)])
    for report in (from_pt, from_onnx):
        assert REQUIRED <= set(report)
        assert report["n_images"] == 60 and report["n_identities"] == 10 and report["faces_not_detected"] == 0
        assert report["n_genuine_pairs"] == 150 and report["n_impostor_pairs"] == 1620
        assert set(report["tar_at_far"]) == {"0.1", "0.01", "0.001"}
        assert report["data_kind"] == "synthetic"
    assert from_pt["auc"] == pytest.approx(from_onnx["auc"], abs=1e-3)
    pers = _eval_json(capsys, ["--model", str(trained_run / "best.pt"), "--data", str(synthetic_dir), "--personalised"])
    assert pers["auc"] > 0.5


def test_eval_with_lfw_pairs(capsys, tmp_path, exported, synthetic_dir):
    """An LFW-layout copy of the synthetic faces with a 10-fold pairs.txt."""
    root = tmp_path / "lfw_home"
    rng = np.random.default_rng(0)
    names = sorted(p.name for p in synthetic_dir.iterdir() if p.is_dir())
    for name in names:
        (root / "lfw" / name).mkdir(parents=True)
        for k, src in enumerate(sorted((synthetic_dir / name).iterdir()), 1):
            (root / "lfw" / name / f"{name}_{k:04d}.jpg").symlink_to(src)  # .png bytes under LFW's names
    lines = ["10\t3"]
    for _ in range(10):
        for _ in range(3):
            n = names[rng.integers(len(names))]
            a, b = rng.choice(6, 2, replace=False) + 1
            lines.append(f"{n}\t{a}\t{b}")
        for _ in range(3):
            n1, n2 = rng.choice(names, 2, replace=False)
            lines.append(f"{n1}\t{rng.integers(1, 7)}\t{n2}\t{rng.integers(1, 7)}")
    (root / "pairs.txt").write_text("\n".join(lines) + "\n")
    report = _eval_json(capsys, ["--model", str(exported / "generic.onnx"), "--data", str(root), "--use-dataset-pairs",
                                 "--detector", "none"])
    assert report["protocol"] == "lfw-10-fold" and report["n_genuine_pairs"] == 30 and report["n_impostor_pairs"] == 30
    assert 0.0 <= report["accuracy"] <= 1.0 and report["accuracy_std"] >= 0.0


def test_bad_inputs_are_clear_errors(capsys, tmp_path, exported):
    assert main(["-q", "eval", "--model", str(tmp_path / "missing.onnx"), "--data", str(tmp_path)]) == 2
    assert "model not found" in capsys.readouterr().err
    assert main(["-q", "eval", "--model", str(exported / "generic.onnx"), "--data", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["-q", "export", "--model", str(tmp_path / "nope.pt"), "--out", str(tmp_path / "x.onnx")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err


def test_a_hostile_or_damaged_checkpoint_is_refused_in_one_line(trained_run, tmp_path, capsys):
    import torch

    payload = torch.load(trained_run / "best.pt", map_location="cpu", weights_only=True)
    huge = {**payload, "model_config": {**payload["model_config"], "n_classes": 10**9}}  # a billion-class head
    torch.save(huge, tmp_path / "huge.pt")
    (tmp_path / "text.pt").write_text("not a checkpoint")
    torch.save({"model_config": payload["model_config"]}, tmp_path / "no_state.pt")
    for name, says in (("huge.pt", "does not match its tensors"), ("text.pt", "not a readable PyTorch file"),
                       ("no_state.pt", "no model_config and model_state")):
        with pytest.raises(ValueError, match=says):
            load_checkpoint(tmp_path / name)
        assert main(["-q", "export", "--model", str(tmp_path / name), "--out", str(tmp_path / "x.onnx")]) == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1 and "weights_only" not in err, err
    model, _ = load_checkpoint(trained_run / "best.pt")  # the run's own file still loads
    assert model.config.n_classes == payload["model_config"]["n_classes"]


def test_resuming_from_a_damaged_state_file_is_refused_in_one_line(tmp_path, synthetic_dir, capsys):
    out = tmp_path / "run"
    out.mkdir()
    for junk in (b"not a checkpoint", b"PK\x03\x04" + bytes(200)):  # text, and a truncated zip
        (out / "latest.pt").write_bytes(junk)
        assert main(["-q", "train", "--data", str(synthetic_dir), "--out", str(out), "--resume", "--epochs", "1",
                     "--no-mlflow"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "latest.pt is damaged or was not written by ffr train" in err, err


def test_eval_takes_a_face_embedder_file_and_refuses_files_it_cannot_use(tmp_path, synthetic_dir, capsys):
    from models.networks.face_weights import SHIPPED_WEIGHTS

    data = ["--data", str(synthetic_dir), "--detector", "none", "--json"]
    assert main(["-q", "eval", "--model", str(SHIPPED_WEIGHTS), *data]) == 0  # the shipped embedder, as it is
    shipped_auc = json.loads(capsys.readouterr().out)["auc"]
    assert 0.5 < shipped_auc <= 1
    (tmp_path / "junk.onnx").write_text("not a model")
    (tmp_path / "junk.safetensors").write_bytes(bytes(64))
    for name, says in (("junk.onnx", "is not a usable ONNX model"),
                       ("junk.safetensors", "is not a MobileNetV2-128 face embedder")):
        assert main(["-q", "eval", "--model", str(tmp_path / name), *data]) == 2
        out, err = capsys.readouterr()
        assert says in err and err.count("\n") == 1 and "unexpected" not in err, err
    assert main(["-q", "eval", "--model", str(SHIPPED_WEIGHTS), "--personalised", *data]) == 2
    assert "no personalised embedding" in capsys.readouterr().err
    # a coordinator's released model (each key under `backbone.`) is the same embedder, and scores the same
    from safetensors.numpy import save_file

    from models.networks.face_weights import face_global_state

    save_file(face_global_state(), str(tmp_path / "v00002.safetensors"))
    assert main(["-q", "eval", "--model", str(tmp_path / "v00002.safetensors"), *data]) == 0
    assert json.loads(capsys.readouterr().out)["auc"] == pytest.approx(shipped_auc)


@pytest.mark.parametrize("command, option, value, says", [
    ("train", "--batch-size", "1", "--batch-size must be at least 2"), ("train", "--lr", "0", "--lr must be positive"),
    ("train", "--epochs", "0", "--epochs must be at least 1"),
    ("train", "--width-mult", "0", "--width-mult must be in [0.25, 1.4]"),
    ("pretrain", "--batch-size", "0", "--batch-size must be at least 2"),
    ("pretrain", "--lr", "-1", "--lr must be positive"),
    ("pretrain", "--device", "tpu", "--device 'tpu' is not a device here"),
    ("pretrain", "--device", "cuda:7", "PyTorch sees no such CUDA GPU")])  # no test machine has eight GPUs
def test_training_settings_that_cannot_work_are_refused_before_any_data_is_read(tmp_path, synthetic_dir, capsys,
                                                                               command, option, value, says):
    out = tmp_path / "run"
    assert main(["-q", command, "--data", str(synthetic_dir), "--out", str(out), option, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ffr {command}: error: ") and says in err and err.count("\n") == 1, err
    assert not out.exists()


def test_the_demo_refuses_what_training_would_before_writing_its_faces(tmp_path, capsys):
    assert main(["-q", "demo", "--out", str(tmp_path / "demo"), "--epochs", "0"]) == 2
    assert "--epochs must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()
