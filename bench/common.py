"""Shared by the benchmarks: timing, machine description, and JSON + Markdown result files."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np


def faces_dir() -> Path | None:
    path = Path(os.environ.get("FFR_FACES_DIR", Path(__file__).resolve().parents[2] / "shared" / "faces"))
    return path if path.is_dir() else None


def face_set(given: Path | None, name: str = "celeba_subset") -> Path | None:
    """--data, else $FFR_FACES_DIR/NAME; None (and the reason on stderr) when neither is a folder."""
    import sys

    data = given or ((faces_dir() or Path("missing")) / name)
    if not data.is_dir():
        print(f"no face data at {data} (set FFR_FACES_DIR or --data)", file=sys.stderr)
        return None
    return data


def machine() -> dict:
    import onnxruntime
    import torch

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def time_calls(fn: Callable[[], object], repeats: int, warmup: int = 3) -> dict:
    """Median and p95 wall time of `fn()` in milliseconds."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000.0)
    return {"median_ms": float(np.median(samples)), "p95_ms": float(np.percentile(samples, 95)), "n": repeats}


def round_outcomes(run: Path) -> dict:
    """What the coordinator did with a simulated run's rounds, read from its store (the ground truth: a summary's
    history lists published rounds only): its rows, how many completed and rolled back, and the mean megabytes the
    devices uploaded per round, rolled-back rounds included (they were sent)."""
    from coordinator.store import Store

    rounds = Store(Path(run) / "coordinator").rounds()
    up = [r["metrics"].get("bytes_received", 0) for r in rounds]
    return {"rounds": rounds, "completed": sum(r["status"] == "completed" for r in rounds),
            "rolled_back": sum(r["status"] == "rolled_back" for r in rounds),
            "mb_up_per_round": sum(up) / len(up) / 1e6 if up else 0.0}


MADE_BY_MAX_CHARS = 1000
_RESULT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,119}")


def result_name(text: str) -> str:
    """argparse type for `--name`: a file name in the results folder, never a path out of it."""
    if not _RESULT_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a results name (letters, digits, '_', '.', '-'; "
                                         "up to 120, starting with a letter or digit)")
    return text


def made_by(text: str) -> str:
    """argparse type for `--made-by`: how the judged file was made, one printable line kept in the result files,
    so a verdict says which run it judged without a hand edit after the bench."""
    text = text.strip()
    if not text:
        raise argparse.ArgumentTypeError("is empty")
    if len(text) > MADE_BY_MAX_CHARS:
        raise argparse.ArgumentTypeError(f"is {len(text)} characters; at most {MADE_BY_MAX_CHARS}")
    if not text.isprintable():
        raise argparse.ArgumentTypeError("must be one line of printable characters (no newlines or control codes)")
    return text


def add_made_by(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--made-by", type=made_by, metavar="TEXT",
                        help="how the candidate was made (the run's command, samples, step), kept in the results "
                             f"as `candidate_made_by`: one line, at most {MADE_BY_MAX_CHARS} characters")


def write_results(out_dir: Path, name: str, data: dict, table: list[dict], title: str, command: str,
                  made_by: str | None = None) -> Path:
    """`name.json` with everything, `name.md` with the table a person reads; `made_by` (the run that made what was
    measured) goes under the command in both."""
    if not _RESULT_NAME.fullmatch(name):
        raise ValueError(f"results name {name[:40]!r} is not a file name in {out_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    context = {"candidate_made_by": made_by} if made_by else {}
    data = {"command": command, **context, "machine": machine(), **data, "table": table}
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=2))
    lines = [f"# {title}", "", f"`{command}`", "", *([made_by, ""] if made_by else []), _markdown_table(table), ""]
    (out_dir / f"{name}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return out_dir / f"{name}.md"


def _markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "(no rows)"
    keys = list(rows[0])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    out += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(out)
