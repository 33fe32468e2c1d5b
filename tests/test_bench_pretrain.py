"""bench.pretrain reads both kinds of `ffr pretrain` run: cached (a row per epoch) and online (a row per evaluation,
as the GPU kit's runs write), and names where the student started."""
from __future__ import annotations

import json

from bench import pretrain

CONFIG = {"batch_size": 512, "lr": 0.001, "budget_minutes": 7.0, "init": "face", "views": 8, "epochs": 10}
COMMON = {"status": "finished", "images": 100, "teacher": "sface", "teacher_sha256": "ab" * 32,
          "precision": "torch.bfloat16", "config": CONFIG}


def read(tmp_path, metrics: dict) -> tuple[dict, str]:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.json").write_text(json.dumps(metrics))
    assert pretrain.main(["--run", str(run), "--out", str(tmp_path), "--name", "curve"]) == 0
    return json.loads((tmp_path / "curve.json").read_text()), (tmp_path / "curve.md").read_text()


def test_an_online_run_gives_a_row_per_evaluation_and_names_its_start(tmp_path):
    history = [{"step": 500, "samples": 256000, "trained_s": 44.7, "train_cos_loss": 0.24, "train_sim_loss": 0.0076,
                "val_teacher_cosine": 0.757},
               {"step": 1000, "samples": 512000, "trained_s": 82.4, "train_cos_loss": 0.20, "train_sim_loss": 0.0065,
                "val_teacher_cosine": 0.793}]
    start = {"init": "face", "init_file": "embedder.safetensors", "init_sha256": "cd" * 32}
    results, table = read(tmp_path, {**COMMON, "mode": "online", "device": "cuda", "start": start,
                                     "history": history})
    rows = results["table"]
    assert [r["step"] for r in rows] == [500, 1000] and rows[1]["cosine to teacher (held-out)"] == 0.793
    assert rows[1]["hours"] == round(82.4 / 3600, 2)
    assert "teacher online on cuda" in table and "sha256 cdcdcdcdcdcd" in table and "7 minutes" in table


def test_a_cached_run_gives_a_row_per_epoch(tmp_path):
    history = [{"epoch": 1, "samples": 34752, "elapsed_s": 396.0, "train_cos_loss": 0.257, "train_sim_loss": 0.0076,
                "val_teacher_cosine": 0.757, "glint24_aligned_auc": 0.942}]
    results, table = read(tmp_path, {**COMMON, "config": {**CONFIG, "views": 4}, "history": history})
    assert results["table"][0]["epoch"] == 1 and results["table"][0]["glint24_aligned_auc"] == 0.942
    assert "4 cached views, from face init at" in table


def test_a_resumed_run_counts_hours_of_training_not_wall_time_since_its_last_start(tmp_path):
    # a cached run resumed between epochs 1 and 2: elapsed_s restarts from zero, trained_s goes on
    history = [{"epoch": 1, "samples": 34752, "elapsed_s": 2896.6, "trained_s": 438.5},
               {"epoch": 2, "samples": 69504, "elapsed_s": 284.3, "trained_s": 850.4}]
    results, _ = read(tmp_path, {**COMMON, "config": {**CONFIG, "views": 4}, "history": history})
    assert [r["hours"] for r in results["table"]] == [round(438.5 / 3600, 2), round(850.4 / 3600, 2)]
