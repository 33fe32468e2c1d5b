"""The learning curve of an `ffr pretrain` run, as a benchmark table (JSON + Markdown).

python -m bench.pretrain --run RUN_DIR --out bench/results

Reads RUN_DIR/metrics.json (written by `ffr pretrain` after every epoch): samples seen, the
distillation losses, the student's cosine to the teacher on held-out unlabelled images, and
AUC/EER on each `--eval-data` set (people never in the pretraining data).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.common import result_name, write_results
from protocol.training_parts import flatten


def curve(metrics: dict) -> list[dict]:
    """One row per history entry: per epoch for a cached run, per evaluation (every few hundred steps) online."""
    rows = []
    for h in metrics["history"]:
        when = {"epoch": h["epoch"]} if "epoch" in h else {"step": h["step"]}
        # hours of training (they add up across resumes and leave out pauses); wall time for runs that lack it
        seconds = h.get("trained_s", h.get("elapsed_s", 0.0))
        row = {**when, "samples": h["samples"], "hours": round(seconds / 3600, 2),
               "cos loss": h.get("train_cos_loss"), "sim loss": h.get("train_sim_loss"),
               "cosine to teacher (held-out)": h.get("val_teacher_cosine")}
        row.update({k: v for k, v in h.items() if k.endswith("_auc") or k.endswith("_eer")})
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="an `ffr pretrain` run folder")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", type=result_name, default="pretrain",
                        help="results file name (OUT/NAME.md and .json)")
    args = parser.parse_args(argv)
    metrics_file = args.run / "metrics.json"
    if not metrics_file.is_file():
        print(f"no metrics.json in {args.run}", file=sys.stderr)
        return 2
    metrics = json.loads(metrics_file.read_text())
    config = flatten(metrics["config"])  # a run's saved settings, in either form (protocol.training_parts)
    command = "python -m bench.pretrain " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(args.out, args.name, {"status": metrics["status"], "images": metrics["images"],
                                         "teacher": metrics["teacher"], "teacher_sha256": metrics["teacher_sha256"],
                                         "precision": metrics["precision"], "start": metrics.get("start"),
                                         "config": config},
                  curve(metrics), f"Distillation learning curve ({metrics['images']} unlabelled faces, teacher "
                  f"{metrics['teacher']}, {length(config)} of batch {config['batch_size']}, "
                  f"{views(metrics)}, from {start(metrics)} at peak lr {config['lr']})", command.strip())
    return 0


def views(metrics: dict) -> str:
    """Where the teacher's targets came from: a fresh jittered view per sample (online) or N cached views."""
    if metrics.get("mode") == "online":
        return f"teacher online on {metrics.get('device', 'cpu')} ({metrics.get('precision', '?')})"
    return f"{metrics['config'].get('views', 2)} cached views"


def start(metrics: dict) -> str:
    """The student's start: its init, and the weights file's sha256 where the run recorded one."""
    begun = metrics.get("start") or {"init": metrics["config"].get("init", "imagenet")}
    sha = begun.get("init_sha256")
    return f"{begun['init']} init" + (f" ({begun.get('init_file', 'weights')} sha256 {sha[:12]}...)" if sha else "")


def length(config: dict) -> str:
    """What decided the run's length: its time budget when it had one (the epochs then only count), else epochs."""
    budget = config.get("budget_minutes")
    return f"{budget:g} minutes of training" if budget else f"{config['epochs']} epochs"


if __name__ == "__main__":
    sys.exit(main())
