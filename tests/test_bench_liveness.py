"""`bench.liveness` at its smallest: real YuNet landmarks on attack and live clips made from ORL photos."""
from __future__ import annotations

import json

from bench.liveness import main


def test_it_reports_apcer_per_attack_and_bpcer(tmp_path, faces_dir):
    assert main(["--data", str(faces_dir / "orl"), "--out", str(tmp_path), "--people", "2", "--trials", "1"]) == 0
    result = json.loads((tmp_path / "liveness.json").read_text())
    assert set(result["apcer"]) == {"printed photo", "two photos shown in turn"} and 0 <= result["bpcer"] <= 1
    assert result["apcer"]["printed photo"] == 0.0, "a flat print, however it is moved, does not turn its head"
    assert "| printed photo | 2 |" in (tmp_path / "liveness.md").read_text()
