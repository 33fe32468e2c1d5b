"""bench.verify_quality end to end on a tiny SYNTHETIC stand-in for one set: every row, the fine-tuned row's
WiSE-FT alpha and its gain over the shipped row with an interval."""
from __future__ import annotations

import json

from bench import verify_quality


def test_a_tiny_run_writes_every_row_and_the_fine_tuned_gain(tmp_path, monkeypatch):
    from models.faces.synthetic import write_dataset

    faces = tmp_path / "faces"
    write_dataset(faces / "glint24_aligned", n_identities=12, n_images=5, seed=1)
    monkeypatch.setenv("FFR_FACES_DIR", str(faces))
    out = tmp_path / "results"
    assert verify_quality.main(["--out", str(out), "--sets", "glint24_aligned", "--epochs", "1", "--no-peer",
                                "--select-identities", "0.3", "--threads", "1"]) == 0
    result = json.loads((out / "verify_quality.json").read_text())
    assert result["select_identities"] == 0.3
    rows = {row["model"].split(" (")[0]: row for row in result["table"]}
    assert set(rows) == {"ffr-edge, ImageNet init", "ffr-edge, face init", "ffr-edge, face init + fine-tuned",
                         "teacher: SFace"}
    tuned = rows["ffr-edge, face init + fine-tuned"]
    assert "chosen on 2 kept-out people" in tuned["model"]  # round(0.3 x the 8 training people)
    low, high = (float(x) for x in tuned["gain_95%"].split(" to "))
    assert low <= tuned["auc_gain_vs_shipped"] <= high or low == high
    assert abs(tuned["auc_gain_vs_shipped"] - (tuned["auc"] - rows["ffr-edge, face init"]["auc"])) < 1e-12
    assert rows["ffr-edge, face init"]["auc_gain_vs_shipped"] == ""
    assert "gain_95%" in (out / "verify_quality.md").read_text()
