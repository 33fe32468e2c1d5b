"""The GPU distillation kit (bench/gpu_distill.sh), run here on CPU exactly as a lent GPU machine runs it: the kit
holds what that machine lacks, the run goes through `python -m ffr.models_only` and writes a candidate embedder."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_distill.sh"
# what the GPU machine's image does not have (it has torch, onnx, onnxruntime, cv2, safetensors, tqdm)
ABSENT_THERE = ("pydantic", "cryptography", "fastapi", "uvicorn", "paho", "mlflow", "ray", "sklearn")


@pytest.fixture(scope="module")
def kit(synthetic_dir, tmp_path_factory) -> Path:
    faces = tmp_path_factory.mktemp("faces")
    for name, part in (("utkface_aligned", 0), ("all_age_faces_aligned", 1), ("celebahq_aligned", 2)):
        (faces / name).mkdir()
        for i, png in enumerate(sorted(synthetic_dir.rglob("*.png"))[part % 2::2][:40 if part < 2 else 20]):
            shutil.copy(png, faces / name / f"{i}.png")
    kit = tmp_path_factory.mktemp("kit") / ".gpu"
    env = {**os.environ, "FFR_GPU_KIT": str(kit), "FFR_FACES_DIR": str(faces), "PYTHON": sys.executable}
    subprocess.run(["bash", str(SCRIPT), "kit"], env=env, check=True, capture_output=True, timeout=300)
    return kit


def test_the_kit_carries_the_crops_and_the_packages_the_gpu_machine_lacks(kit):
    from models.training.crop_pack import unpack_crops

    images, names = unpack_crops(kit / "old.npz")
    assert len(images) == 60 and images.shape[1:] == (112, 112, 3)
    assert len(unpack_crops(kit / "celebahq.npz")[0]) == 20
    assert (kit / "site" / "onnx2torch" / "__init__.py").is_file()
    assert (kit / "sface.onnx").is_file()


def test_a_kit_run_distils_from_the_shipped_weights_without_the_service_libraries(kit, tmp_path):
    from models.networks import face_weights
    from models.networks.face_weights import read_embedder_numpy

    out = tmp_path / "out"
    previous = tmp_path / "previous_run.safetensors"  # INIT: go on from another run's result (here the shipped one)
    shutil.copy(face_weights.SHIPPED_WEIGHTS, previous)
    env = {**os.environ, "INIT": str(previous), "FFR_GPU_KIT": str(kit), "OUT": str(out), "PYTHON": sys.executable,
           "FFR_GPU_DEVICE": "cpu", "BATCH": "8", "WARMUP": "2", "FFR_CACHE_DIR": str(tmp_path / "cache"),
           # the run's own imports, as the GPU machine would see them: Python logs each one to stderr (-X importtime)
           "PYTHONPROFILEIMPORTTIME": "1", "EXTRA": "--threads 2"}
    done = subprocess.run(["bash", str(SCRIPT), "run", "0.05"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    assert "onnx2torch" in imported and "torch" in imported
    assert not imported & set(ABSENT_THERE), imported & set(ABSENT_THERE)
    metrics = json.loads((out / "run" / "metrics.json").read_text())
    assert metrics["status"] == "finished" and metrics["step"] > 0
    assert metrics["teacher_agreement_with_onnxruntime"] > 0.999
    assert metrics["start"] == {"init": "face", "init_file": previous.name, "init_sha256": face_weights.SHIPPED_SHA256}
    state, meta = read_embedder_numpy(out / "run" / "embedder.safetensors")
    assert meta["mode"] == "online" and state["embedding.weight"].shape == (128, 1280)


def test_a_run_without_a_kit_says_so_in_one_line(tmp_path):
    env = {**os.environ, "FFR_GPU_KIT": str(tmp_path / "none"), "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(SCRIPT), "run", "1"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "make gpu-kit" in done.stderr


def test_a_kit_whose_teacher_file_was_altered_is_refused_in_one_line(kit, tmp_path):
    """The carried SFace file is read back on the GPU machine: one changed byte and the run refuses to be taught."""
    bad = tmp_path / ".gpu"
    shutil.copytree(kit, bad)
    raw = bytearray((bad / "sface.onnx").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (bad / "sface.onnx").write_bytes(bytes(raw))
    env = {**os.environ, "FFR_GPU_KIT": str(bad), "OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
           "FFR_GPU_DEVICE": "cpu", "BATCH": "8", "FFR_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(["bash", str(SCRIPT), "run", "0.05"], env=env, capture_output=True, text=True, timeout=600)
    message = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 2 and len(message) == 1 and "sha256 differs" in message[0], done.stderr[-1500:]
    assert not (tmp_path / "out" / "run" / "embedder.safetensors").exists()


def test_a_run_split_over_two_calls_keeps_one_schedule(kit, tmp_path):
    """`run TOTAL CALL`: the first call stops after CALL minutes with its state kept where the next call finds it
    (on the device: the warm machine's working tree); the second resumes that state instead of warming up again,
    and each call still brings the run back under $OUT."""
    run = tmp_path / "kept-run"
    env = {**os.environ, "FFR_GPU_KIT": str(kit), "FFR_GPU_RUN": str(run), "PYTHON": sys.executable,
           "FFR_GPU_DEVICE": "cpu", "BATCH": "8", "WARMUP": "2", "FFR_CACHE_DIR": str(tmp_path / "cache"),
           "EXTRA": "--threads 2 --eval-every 2"}

    def call(i: int, **extra: str) -> subprocess.CompletedProcess:
        # a schedule of 10 minutes that no call reaches: each call stops after its 0.03 minutes of training (at
        # least one step), whatever the machine's load; a 0.1-minute schedule was finished by one slow first step
        return subprocess.run(["bash", str(SCRIPT), "run", "10", "0.03"],
                              env={**env, "OUT": str(tmp_path / f"out{i}"), **extra},
                              capture_output=True, text=True, timeout=600)

    lost = call(0, CONTINUE="1")  # a second call that landed on a fresh machine: nothing to go on with
    assert lost.returncode == 2 and "no run in" in lost.stderr and not run.exists()
    calls = []
    for i, extra in ((1, {}), (2, {"CONTINUE": "1"})):
        done = call(i, **extra)
        assert done.returncode == 0, done.stderr[-2000:]
        calls.append((json.loads((tmp_path / f"out{i}" / "run" / "metrics.json").read_text()), done.stderr))
    again = call(3)  # a first call again on a machine that holds a run: refused, not silently resumed
    assert again.returncode == 2 and "CONTINUE=1" in again.stderr
    (first, first_log), (second, second_log) = calls
    assert first["status"] == "paused" and 0 < first["trained_s"] < 60 * 10
    assert "going on with" not in first_log and "going on with" in second_log
    assert second["step"] > first["step"] and second["trained_s"] > first["trained_s"]
    assert second["history"][:len(first["history"])] == first["history"]  # one curve, not two
    assert (run / "progress.json").is_file()


@pytest.mark.parametrize("arm_set, expected", [
    ([], {"f_recipe": (True, False, False), "g_mirrored_teacher": (True, True, False),
          "d_rank": (True, False, True)}),  # the default set: mirror_rank
    (["s50"], {"a_cosine_old": (False, False, False), "b_cosine_celebahq": (False, False, False),
               "c_queue_celebahq": (True, False, False), "e_mix_celebahq": (False, False, False)}),
    (["relight"], {"f_recipe": (True, False, False), "h_relight": (True, False, False)}),
])
def test_the_arms_run_side_by_side_and_each_comes_back_under_out(kit, tmp_path, arm_set, expected):
    """`arms MINUTES [SET]` (issue 50): every arm of the set its own process at the same budget, each bringing back
    its weights and metrics (two files an arm: a call brings back at most eight); each arm trains as it says:
    {arm: (with the queue term, toward the mirror-averaged teacher, with the pair-rank term)}."""
    out = tmp_path / "out"
    env = {**os.environ, "FFR_GPU_KIT": str(kit), "OUT": str(out), "PYTHON": sys.executable,
           "FFR_GPU_DEVICE": "cpu", "BATCH": "8", "WARMUP": "2", "FFR_GPU_RUN": str(tmp_path / "arms"),
           "FFR_CACHE_DIR": str(tmp_path / "cache"), "EXTRA": "--threads 1 --eval-every 1"}
    done = subprocess.run(["bash", str(SCRIPT), "arms", "0.02", *arm_set], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(expected)
    assert sum(1 for _ in out.rglob("*") if _.is_file()) == 2 * len(expected) <= 8
    for arm, (queue, mirrored, rank) in expected.items():
        metrics = json.loads((out / arm / "metrics.json").read_text())
        assert metrics["status"] == "finished" and metrics["step"] > 0
        assert ("train_queue_loss" in metrics["history"][-1]) == queue
        assert metrics["config"]["mirrored_teacher"] == mirrored
        assert ("train_rank_loss" in metrics["history"][-1]) == rank == (metrics["config"]["rank_weight"] > 0)
        assert metrics["config"]["relight_fraction"] == (0.25 if arm == "h_relight" else 0.0)


def test_arms_given_epochs_train_equal_samples_each_to_the_end_of_their_schedule(kit, tmp_path):
    """EPOCHS=E: every arm makes the same passes over the kit's crops (equal samples, whatever each step costs),
    MINUTES only a guard."""
    out = tmp_path / "out"
    env = {**os.environ, "FFR_GPU_KIT": str(kit), "OUT": str(out), "PYTHON": sys.executable, "EPOCHS": "1",
           "FFR_GPU_DEVICE": "cpu", "BATCH": "8", "WARMUP": "2", "FFR_GPU_RUN": str(tmp_path / "arms"),
           "FFR_CACHE_DIR": str(tmp_path / "cache"), "EXTRA": "--threads 1 --eval-every 1"}
    done = subprocess.run(["bash", str(SCRIPT), "arms", "30"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    metrics = [json.loads((arm / "metrics.json").read_text()) for arm in sorted(out.iterdir())]
    assert len(metrics) == 3 and all(m["status"] == "finished" and m["config"]["budget_minutes"] is None
                                     for m in metrics)
    assert len({m["samples"] for m in metrics}) == 1 and metrics[0]["step"] == metrics[0]["total_steps"] > 0


def test_an_unknown_arm_set_is_refused_in_one_line_and_the_sets_are_listed(tmp_path):
    env = {**os.environ, "FFR_GPU_KIT": str(tmp_path / "no-kit"), "OUT": str(tmp_path / "out")}
    refused = subprocess.run(["bash", str(SCRIPT), "arms", "1", "nope"], env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and "no arm set 'nope'" in refused.stderr and "mirror_rank s50" in refused.stderr
    planted = tmp_path / "planted"  # a name built to run a command if it ever reached bash's indirect expansion
    hostile = subprocess.run(["bash", str(SCRIPT), "arms", "1", f"s50[$(touch {planted})]"], env=env,
                             capture_output=True, text=True)
    assert hostile.returncode == 2 and "no arm set" in hostile.stderr and not planted.exists()
    listed = subprocess.run(["bash", str(SCRIPT), "sets"], env=env, capture_output=True, text=True, check=True)
    rows = [line.split()[:2] for line in listed.stdout.splitlines()]
    assert rows[:3] == [["mirror_rank", "f_recipe"], ["mirror_rank", "g_mirrored_teacher"],
                        ["mirror_rank", "d_rank"]] and len(rows) == 9
    assert ["relight", "h_relight"] in rows
