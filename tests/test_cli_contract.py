"""The CLI's help agrees with itself: every command explains itself, every option says what it does and its
default, and one concept has one spelling (and one default) across `ffr train`, `ffr coordinator serve`,
`ffr fleet simulate`, `ffr edge run` and `ffr device` (the user-facing issue's item 10)."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import defaultdict

import pytest

from ffr.cli import build_parser, main
from models.cli.common import HelpFormatter

# Old spellings of one concept: at most one of each group may be visible in the whole CLI.
SYNONYMS = [{"--strategy", "--algorithm", "--method"}, {"--holdout-clients", "--heldout-clients"},
            {"--personalised", "--personalized"}, {"--no-centralised", "--no-centralized"},
            {"--cache-dir", "--crop-cache"}, {"--prox-mu", "--mu"}, {"--init", "--no-pretrained"},
            {"--codec", "--wire-dtype"}, {"--lognormal-mu", "--mu"}, {"--synthetic-images", "--images-per-identity"}]

# Options whose default differs between commands because their meaning does; each says why.
DEFAULTS_DIFFER = {
    "--epochs": "passes over different data: supervised training, distillation, the quick demo",
    "--lr": "Adam for supervised training, AdamW's peak for distillation, the demo's faster rate",
    "--batch-size": "distillation's larger batches feed its pairwise-similarity loss",
    "--patience": "epochs in `ffr train`, rounds in `ffr fleet simulate`",
    "--init": "`ffr pretrain` makes the face weights, so it starts from ImageNet",
    "--threads": "`ffr device` leaves the other cores to the camera; training takes them all",
    "--out": "each command's own output",
    "--synthetic-identities": "each command's scale: a dataset, the demo, a fleet",
    "--synthetic-images": "each command's scale: a dataset, the demo, a fleet",
    "--dfc": "centralised training has no device to personalise for, so DFC is opt-in there",
    "--data": "required where given, or another command's meaning of the same folder",
}


def leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("ffr",)):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(path), parser
        return
    for name, child in subs[0].choices.items():
        yield from leaves(child, (*path, name))


def options(parser: argparse.ArgumentParser):
    """The options a user sees in --help (deprecated aliases are hidden)."""
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction)]


COMMANDS = list(leaves(build_parser()))


def test_every_command_is_walked():
    names = {name for name, _ in COMMANDS}
    assert {"ffr train", "ffr demo", "ffr coordinator serve", "ffr fleet simulate", "ffr edge run",
            "ffr device enroll", "ffr device calibrate"} <= names


@pytest.mark.parametrize("name,parser", COMMANDS, ids=[n for n, _ in COMMANDS])
def test_help_explains_every_option_and_its_default(name, parser):
    assert parser.description and len(parser.description) > 20, f"{name} has no description"
    assert isinstance(parser._get_formatter(), HelpFormatter)
    text = parser.format_help()
    for action in options(parser):
        flag = action.option_strings[0]
        assert action.help, f"{name} {flag} has no help"
        shown = parser._get_formatter()._get_help_string(action) % {**vars(action), "prog": parser.prog}
        if action.default not in (None, False) and action.nargs != 0:
            assert "default" in shown.lower(), f"{name} {flag}: its default {action.default!r} is not shown"
            stated = re.search(r"default:? (-?[0-9][0-9.e+-]*)\b", shown)
            if stated and isinstance(action.default, (int, float)) and not isinstance(action.default, bool):
                assert float(stated.group(1).rstrip(".")) == pytest.approx(float(action.default)), \
                    f"{name} {flag}: help says default {stated.group(1)}, the parser uses {action.default}"
        assert flag in text


def test_one_spelling_and_one_default_per_concept_across_commands():
    spellings, dests, defaults, choices = defaultdict(set), defaultdict(set), defaultdict(set), defaultdict(set)
    for name, parser in COMMANDS:
        for action in options(parser):
            spellings[action.dest].add(tuple(action.option_strings))
            for flag in action.option_strings:
                dests[flag].add(action.dest)
            flag = action.option_strings[0]
            if not action.required:
                defaults[flag].add((repr(action.default), name))
            if action.choices:
                choices[flag].add(frozenset(action.choices))
    two_ways = {dest: s for dest, s in spellings.items() if len(s) > 1}
    assert not two_ways, f"one concept spelled two ways: {two_ways}"
    two_meanings = {flag: d for flag, d in dests.items() if len(d) > 1}
    assert not two_meanings, f"one spelling for two concepts: {two_meanings}"
    visible = set(dests)
    for group in SYNONYMS:
        assert len(group & visible) <= 1, f"synonyms visible together: {sorted(group & visible)}"
    differ = {flag: sorted(d) for flag, d in defaults.items() if len({v for v, _ in d}) > 1
              and flag not in DEFAULTS_DIFFER}
    assert not differ, f"same option, different defaults: {differ}"
    assert not {flag: c for flag, c in choices.items() if len(c) > 1}, "same option, different choices"


def test_the_method_default_and_timeout_agree_between_serve_and_fleet():
    parser = build_parser()
    serve = parser.parse_args(["coordinator", "serve"])
    fleet = parser.parse_args(["fleet", "simulate", "--out", "x"])
    for field in ("method", "prox_mu", "round_timeout", "server_momentum", "lr", "batch_size", "local_epochs",
                  "dfc", "init", "codec", "fraction", "rounds"):
        assert getattr(serve, field) == getattr(fleet, field), field


@pytest.mark.parametrize("argv,dest,value", [
    (["coordinator", "serve", "--strategy", "pfm"], "method", "pfm"),
    (["coordinator", "serve", "--mu", "0.5"], "prox_mu", 0.5),
    (["fleet", "simulate", "--out", "x", "--algorithm", "fedavg"], "method", "fedavg"),
    (["fleet", "simulate", "--out", "x", "--mu", "2"], "lognormal_mu", 2.0),
    (["fleet", "simulate", "--out", "x", "--heldout-clients", "2"], "heldout_clients", 2),
    (["fleet", "simulate", "--out", "x", "--no-centralized"], "centralized", False),
    (["fleet", "simulate", "--out", "x", "--crop-cache", "c"], "cache_dir", "c"),
    (["train", "--data", "d", "--out", "o", "--no-pretrained"], "init", "none"),
    (["export", "--model", "m", "--out", "o", "--personalized"], "personalised", True),
    (["synth", "--out", "o", "--identities", "3"], "synthetic_identities", 3),
    (["coordinator", "serve", "--wire-dtype", "fp32"], "codec", "fp32"),
])
def test_old_spellings_still_work_and_say_so_in_one_line(capsys, argv, dest, value):
    args = build_parser().parse_args(argv)
    got = getattr(args, dest)
    assert (str(got) if dest == "cache_dir" else got) == value
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "old spelling" in err[0] and argv[-2 if argv[-1] not in (
        "--no-centralized", "--no-pretrained", "--personalized") else -1] in err[0], err


def test_help_as_a_user_runs_it():
    out = subprocess.run([sys.executable, "-m", "ffr", "demo", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert "SYNTHETIC" in out.stdout and "runs/demo)" in out.stdout
    out = subprocess.run([sys.executable, "-m", "ffr", "coordinator", "serve", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert "--http-port" in out.stdout and "(default: 8080)" in out.stdout
    assert "--public-data" not in out.stdout  # serve's --method help names its own public-set flag
    assert "--strategy" not in out.stdout and "--mu " not in out.stdout


def test_a_deprecated_alias_through_main_still_runs(tmp_path, capsys):
    assert main(["synth", "--out", str(tmp_path / "d"), "--identities", "2", "--images", "2"]) == 0
    assert len([d for d in (tmp_path / "d").iterdir() if d.is_dir()]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all("old spelling" in line for line in err)


@pytest.mark.parametrize("argv, flag", [(["train", "--data", "d", "--out", "o", "--threads", "-2"], "--threads"),
                                        (["eval", "--model", "m.onnx", "--data", "d", "--threads", "0"], "--threads"),
                                        (["device", "verify", "--name", "a", "--image", "x", "--frames", "0"],
                                         "--frames"),
                                        (["device", "enroll", "--name", "a", "--image", "x", "--best", "x"], "--best"),
                                        (["coordinator", "serve", "--state", "s", "--chunk-kib", "0"], "--chunk-kib"),
                                        (["coordinator", "serve", "--state", "s", "--keepalive", "0"], "--keepalive"),
                                        (["train", "--data", "d", "--out", "o", "--holdout-identities", "1.5"],
                                         "--holdout-identities"),
                                        (["train", "--data", "d", "--out", "o", "--val-fraction", "x"],
                                         "--val-fraction"),
                                        (["fleet", "partition", "--data", "d", "--holdout-identities", "1"],
                                         "--holdout-identities"),
                                        (["eval", "--model", "m.onnx", "--data", "d", "--max-pairs", "-5"],
                                         "--max-pairs")])
def test_a_count_below_its_floor_is_refused_while_parsing(capsys, argv, flag):
    """Counts (threads, frames, crops, KiB) and fractions are refused by argparse in one line that names the
    option; before, `ffr train --threads -2` failed inside torch as an 'unexpected RuntimeError'."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and f"argument {flag}: " in err, err


@pytest.mark.parametrize("argv, says", [(["--quality", "0"], "--quality must be within 1-100"),
                                        (["--out", "crops.txt"], "--out must end in .npz")])
def test_pack_crops_refuses_like_every_other_command(tmp_path, capsys, argv, says):
    """Exit 2 and 'ffr pack-crops: error: ...', as every command says bad input (was exit 1 with no 'error:')."""
    assert main(["pack-crops", "--data", str(tmp_path), "--out", str(tmp_path / "c.npz"), *argv]) == 2
    assert capsys.readouterr().err == f"ffr pack-crops: error: {says}\n"


def test_a_path_that_cannot_be_written_is_one_line_not_a_bug_report(tmp_path, capsys):
    """OSErrors are the machine's, not a bug: 'Not a directory: PATH', never 'unexpected NotADirectoryError'."""
    (tmp_path / "a-file").write_text("")
    assert main(["-q", "synth", "--out", str(tmp_path / "a-file" / "faces")]) == 2
    err = capsys.readouterr().err
    assert err == f"ffr synth: error: Not a directory: {tmp_path / 'a-file' / 'faces'}\n", err


@pytest.mark.parametrize("name, parser", [(n, p) for n, p in COMMANDS if n.startswith(("ffr device", "ffr edge run"))],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_device_command_shows_an_example_that_parses(name, parser):
    """Issue 49: a device's --help pages end with an example, and every example is a command ffr accepts."""
    text = parser.format_help()
    said = re.search(r"examples?: (.+)", text, re.S)
    assert said, f"{name} --help has no example"
    for example in re.split(r"\s+\|\s+|\s+&&\s+", " ".join(said.group(1).split())):
        argv = example.split()
        argv = argv[:next((i for i, word in enumerate(argv) if word.startswith((">", "<"))), len(argv))]  # the shell's
        assert argv[0] == "ffr", example
        build_parser().parse_args(argv[1:])  # exits (SystemExit) on an example ffr would refuse
