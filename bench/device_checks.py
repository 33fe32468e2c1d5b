"""Do honest rounds pass every device's adoption check? On face pairs, and on faces against templates.

A device judges each announced model on its own people and public negatives before verifying with it
(`edge_client.adoption`): on face pairs, and on each face against each enrolled person's template, what its door
decides on, so that one person pulled onto another's template is refused while the face pairs and the averages hold.
A check that refuses honest models stops the devices from gaining anything. This bench reads the published models
of finished honest runs (`ffr fleet simulate` folders), rebuilds each training device's check faces as the device
builds them (its training crops, the run's public set, its seed) and reports, for every round step (v_k -> v_k+1,
as the device judges against its last model) and the whole run (v0 -> v_k, against its anchor), whether each check
passes, and why not.

The coordinator's quality gate is replayed on the same steps: on its faces' pairs, and on each of its people's
template probed by every other face (its identity canaries).

    python -m bench.device_checks --run RUN [--run RUN2] --out bench/results
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.common import result_name, write_results
from coordinator.store import Store
from edge_client.adoption import ADOPTION, check_faces
from fleet.config import SimConfig
from fleet.data import TRAIN, prepare
from models.evaluation.separation import door_scores


def run_rows(run: Path) -> list[dict]:
    """One row per training device and step of this run's published models."""
    from models.public_set import load_public_set

    config = SimConfig.load(run / "config.json")
    config.progress = False
    data = prepare(config, run)
    public_file = run / "public_set.safetensors"
    public = load_public_set(public_file).images if public_file.is_file() else None
    store = Store(run / "coordinator")
    versions = [m["version"] for m in store.models()]
    states = {v: store.load_model(v) for v in versions}
    steps = [(a, b) for a, b in zip(versions, versions[1:])] + [(versions[0], v) for v in versions[2:]]
    rows = []
    for k in data.training_clients:
        crops = data.crops.select(data.client_mask(k, TRAIN))
        faces = check_faces(crops.images, crops.labels, public, seed=config.seed * 1000 + k)
        if faces is None:
            continue
        scored = {v: door_scores(states[v], faces) for v in versions}
        for a, b in steps:
            pairs = ADOPTION.judge(scored[a][0], scored[b][0])
            templates = ADOPTION.judge(scored[a][1], scored[b][1])
            rows.append({"run": run.name, "device": k, "step": f"v{a} -> v{b}", "pairs_ok": pairs.ok,
                         "templates_ok": templates.ok, "pairs_far": _far(pairs.metrics),
                         "templates_far": _far(templates.metrics), "why": pairs.reason or templates.reason})
    return rows


def gate_rows(run: Path) -> list[dict]:
    """The same steps at the coordinator's quality gate on the run's gate faces (`coordinator_faces`, people of no
    device, labelled: face pairs and their templates, the identity canaries), at the run's gate bar."""
    from coordinator.quality_gate import load_faces

    folder = run / "coordinator_faces"
    if not folder.is_dir():
        return []
    bar = SimConfig.load(run / "config.json").gate.bar
    faces = load_faces(folder, bar.limit, bar.seed)
    store = Store(run / "coordinator")
    versions = [m["version"] for m in store.models()]
    scored = {v: door_scores(store.load_model(v), faces) for v in versions}
    rows = []
    for a, b in [(a, b) for a, b in zip(versions, versions[1:])] + [(versions[0], v) for v in versions[2:]]:
        pairs, templates = bar.judge(scored[a][0], scored[b][0]), bar.judge(scored[a][1], scored[b][1])
        rows.append({"run": run.name, "device": "gate", "step": f"v{a} -> v{b}", "pairs_ok": pairs.ok,
                     "templates_ok": templates.ok, "pairs_far": _far(pairs.metrics),
                     "templates_far": _far(templates.metrics), "why": pairs.reason or templates.reason})
    return rows


def _far(metrics: dict) -> str:
    return f"{metrics.get('far_current', 0):.4f} -> {metrics.get('far_candidate', 0):.4f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, action="append", required=True, help="a finished `ffr fleet simulate` folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--name", type=result_name, default="device_checks")
    args = p.parse_args(argv)
    devices = [row for run in args.run for row in run_rows(run)]
    gate = [row for run in args.run for row in gate_rows(run)]
    if not devices:
        print("no published model steps to measure", file=sys.stderr)
        return 1

    def refused(rows: list[dict]) -> dict:
        return {"pairs": sum(not r["pairs_ok"] for r in rows), "templates": sum(not r["templates_ok"] for r in rows)}

    command = "python -m bench.device_checks " + " ".join(sys.argv[1:] if argv is None else argv)
    title = (f"Honest rounds at the devices' adoption checks: {len(devices)} device steps, refused on face pairs "
             f"{refused(devices)['pairs']}, on faces against templates {refused(devices)['templates']}; at the "
             f"quality gate: {len(gate)} steps, refused on face pairs {refused(gate)['pairs']}, on its people's "
             f"templates {refused(gate)['templates']}")
    write_results(args.out, args.name, {"checks": len(devices), "refused": refused(devices), "far": ADOPTION.far,
                                        "far_ratio": ADOPTION.far_ratio, "gate_checks": len(gate),
                                        "gate_refused": refused(gate)}, gate + devices, title, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
