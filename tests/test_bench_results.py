"""bench.common's result files: what made the measured file is kept under the command in both files, and a
`--made-by` or `--name` an operator mistypes is refused in one line before any measuring starts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import distill_gap, ratchet
from bench.common import MADE_BY_MAX_CHARS, write_results


def test_made_by_sits_under_the_command_in_both_files(tmp_path):
    write_results(tmp_path, "judged", {"verdict": "v"}, [{"set": "orl", "auc": 0.5}], "Title", "python -m x --y",
                  made_by="ffr pretrain --online (121,728 samples)")
    data = json.loads((tmp_path / "judged.json").read_text())
    assert data["candidate_made_by"] == "ffr pretrain --online (121,728 samples)" and data["verdict"] == "v"
    lines = (tmp_path / "judged.md").read_text().splitlines()
    at = lines.index("`python -m x --y`")
    assert lines[at + 2] == "ffr pretrain --online (121,728 samples)" and lines[at + 4].startswith("| set |")


def test_without_made_by_the_files_are_as_before(tmp_path):
    write_results(tmp_path, "plain", {}, [{"a": 1}], "T", "cmd")
    assert "candidate_made_by" not in json.loads((tmp_path / "plain.json").read_text())
    assert (tmp_path / "plain.md").read_text().splitlines()[4] == "| a |"


@pytest.mark.parametrize("name", ["../escape", "/tmp/abs", ".hidden", "a/b", "", "x" * 121])
def test_a_results_name_outside_the_folder_is_not_written(tmp_path, name):
    with pytest.raises(ValueError):
        write_results(tmp_path / "out", name, {}, [], "T", "cmd")
    assert not (tmp_path / "out").exists()


HOSTILE = {
    "--made-by": ["two\nlines", "x" * (MADE_BY_MAX_CHARS + 1), "   ", "clear \x1b[2J screen", "flipped \u202e text"],
    "--name": ["../escape", "/tmp/abs", ".hidden", "a/b", "x" * 121],
}


@pytest.mark.parametrize("bench", [ratchet, distill_gap], ids=["ratchet", "distill_gap"])
@pytest.mark.parametrize("option,value", [(o, v) for o, values in HOSTILE.items() for v in values])
def test_a_hostile_option_is_refused_in_one_line_before_anything_is_measured(bench, option, value, tmp_path,
                                                                              capsys):
    args = (["--candidate", str(tmp_path / "nowhere.safetensors")] if bench is ratchet else [])
    with pytest.raises(SystemExit) as refused:
        bench.main([*args, "--out", str(tmp_path / "out"), option, value])
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert option in err[-1] and "\x1b" not in err[-1]
    assert not (tmp_path / "out").exists()


def named_benches() -> list[str]:
    """Every bench with a `--name` option (its own, or `honest_round.add_fleet_options`'s), found in the sources so
    that a bench added later is checked too."""
    folder = Path(__file__).resolve().parents[1] / "bench"
    return sorted(path.stem for path in folder.glob("*.py")
                  if '"--name"' in (text := path.read_text()) or "add_fleet_options(" in text)


NAMED_BENCHES = named_benches()


def test_the_benches_with_a_name_are_found():
    assert set(NAMED_BENCHES) >= {"architecture", "batchnorm_statistics", "device", "device_checks", "distill_arms",
                                  "distill_gap", "door_far", "fedfr", "fleet", "honest_round", "liveness",
                                  "mirror_averaging", "pair_jumps", "personalisation", "pretrain", "ratchet",
                                  "robust", "two_device_serve"}


@pytest.mark.parametrize("bench", NAMED_BENCHES)
def test_every_bench_refuses_a_results_name_out_of_its_folder_before_it_runs(bench, monkeypatch, capsys):
    """Each bench's `--name` is `bench.common.result_name`: argparse refuses it, so nothing is measured first."""
    import importlib

    module = importlib.import_module(f"bench.{bench}")
    monkeypatch.setattr("sys.argv", [bench, "--name", "../escape"])
    with pytest.raises(SystemExit) as refused:
        module.main()
    assert refused.value.code == 2
    assert "--name" in capsys.readouterr().err.strip().splitlines()[-1]
