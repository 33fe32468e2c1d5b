"""bench.train_throughput end to end at its smallest: both tables written, every loop measured (the bench had
drifted from the trainer's API once, unnoticed until run)."""
from __future__ import annotations

import json

from bench import train_throughput


def test_a_tiny_run_measures_every_loop(tmp_path):
    assert train_throughput.main(["--out", str(tmp_path), "--identities", "4", "--images", "4", "--rounds", "1",
                                  "--distill-steps", "1", "--threads", "1"]) == 0
    rows = json.loads((tmp_path / "train_throughput.json").read_text())["table"]
    assert len(rows) == 4 and all(row["images_per_s"] > 0 for row in rows)
    assert rows[0]["loop"] == "bare PyTorch" and rows[0]["overhead_vs_bare"] == 0
    assert json.loads((tmp_path / "distill_step_throughput.json").read_text())["table"]
