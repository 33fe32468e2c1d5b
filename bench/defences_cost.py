"""What the defences cost an honest federation: the global models of a run at the defaults and of the same run without
the defences (`--no-gate --screen none`), scored on the same people.

    python -m bench.defences_cost --defended RUN --undefended RUN2 --out bench/results

Without a gate the simulator keeps no gate people, so the two runs' own unseen-people figures rest on different
people. Here both runs' models are scored on the defended run's unseen people (on no device, neither the gate's nor
the public set's), whom neither run trained on: AUC and TAR@FAR=1e-3 with the bootstrap interval over people
(`models.evaluation.evaluate.unseen_people`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.common import write_results


def scores(run: Path, holdout, config) -> list[dict]:
    """Every published model of `run` on the people `holdout`."""
    from coordinator.store import Store
    from fleet.evaluation import flat
    from models.evaluation.evaluate import unseen_people
    from models.networks.face_model import global_embedder

    store, rows = Store(run / "coordinator"), []
    for version in [m["version"] for m in store.models()]:
        model = global_embedder(store.load_model(version), config.training.model.width_mult)
        report, _ = unseen_people(model, holdout, config.max_eval_pairs, config.seed)
        figures, interval = flat(report), report.get("interval") or {}
        rows.append({"run": run.name, "model": f"v{version}", "auc": figures.get("auc"),
                     "auc_95%": _span(interval.get("auc")), "tar@1e-3": figures.get("tar@1e-3"),
                     "tar@1e-3_95%": _span(interval.get("tar@1e-3"))})
    return rows


def _span(bounds) -> str:
    return f"{bounds[0]:.4f}-{bounds[1]:.4f}" if bounds else ""


def main(argv: list[str] | None = None) -> int:
    from fleet.config import SimConfig
    from fleet.data import prepare

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--defended", type=Path, required=True, help="a finished `ffr fleet simulate` run at the defaults")
    p.add_argument("--undefended", type=Path, required=True, help="the same run with --no-gate --screen none")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    config = SimConfig.load(args.defended / "config.json")
    config.progress = False
    holdout = prepare(config, args.defended).holdout()
    if holdout is None:
        print(f"{args.defended} keeps no unseen people", file=sys.stderr)
        return 1
    rows = scores(args.defended, holdout, config) + scores(args.undefended, holdout, config)
    last = {run: [r for r in rows if r["run"] == run][-1] for run in (args.defended.name, args.undefended.name)}
    title = (f"The defences' cost on {len(set(holdout.labels))} people neither run trained on: last model AUC "
             f"{last[args.defended.name]['auc']:.4f} with the defences, {last[args.undefended.name]['auc']:.4f} "
             "without")
    command = "python -m bench.defences_cost " + " ".join(sys.argv[1:] if argv is None else argv)
    write_results(args.out, "defences_cost", {"people": len(set(holdout.labels)), "images": len(holdout)}, rows,
                  title, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
