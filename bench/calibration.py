"""How often a stranger's claim is accepted after `ffr device calibrate`, against the FAR it was asked for.

python -m bench.calibration --out bench/results

A device enrols a few people (photos 1-5 of each), optionally adds more people's faces with `--data`, and calibrates
at `--far`. Every other person of the set then claims to be each enrolled person with a probe of their photos 6-10
(the mean of its faces against the claimed template, as `ffr device verify` decides); the enrolled people's own
photos 6-10 are the genuine claims. Repeated over random draws of who is enrolled. The shipped weights on aligned
crops (YuNet five-point), ORL by default: its 40 people give enough strangers for every draw.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from bench.common import faces_dir, write_results


def embeddings_by_person(root: Path) -> dict:
    """Each person's unit embeddings under the shipped weights, photos in file order."""
    import torch

    from bench.verify_quality import ALIGNED
    from edge_client.recognizer import normalise
    from models.evaluation.evaluate import embed_all
    from models.faces.crops import crop_index
    from models.faces.datasets import load_index
    from models.networks.embedders import TorchEmbedder
    from models.networks.face_weights import load_face_embedder

    torch.set_num_threads(2)
    crops = crop_index(load_index(root), ALIGNED, progress=True, min_images=10)
    emb = normalise(embed_all(TorchEmbedder(load_face_embedder().eval()), crops.images))
    labels = np.asarray(crops.labels)
    return {person: emb[labels == person] for person in np.unique(labels)}


def draw(by: dict, enrolled: int, extra: int, far: float, rng: np.random.Generator) -> dict:
    """One device: calibrate on `enrolled` people (+ `extra` in --data), then every stranger claims every enrolled."""
    from edge_client.recognizer import calibrate, template_of
    from edge_client.verifier import probe_scores

    people = list(by)
    pick = [people[i] for i in rng.choice(len(people), enrolled + extra, replace=False)]
    mine, more = pick[:enrolled], pick[enrolled:]
    cal = calibrate([by[p][:5] for p in mine] + [by[p][:10] for p in more], far, "0" * 64)
    templates = np.stack([template_of(by[p][:5]) for p in mine])
    strangers = [p for p in people if p not in pick]
    scores = np.stack([probe_scores(by[p][5:10], templates) for p in strangers])
    genuine = np.array([probe_scores(by[p][5:10], templates)[k] for k, p in enumerate(mine)])
    return {"threshold": cal.threshold, "measurable": cal.measurable, "claims": scores.size,
            "accepted": int((scores > cal.threshold).sum()), "genuine": len(genuine),
            "genuine_accepted": int((genuine > cal.threshold).sum())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--set", default="orl", help="a labelled set in FFR_FACES_DIR with 10+ photos a person")
    parser.add_argument("--far", type=float, default=0.01, help="the FAR asked of calibrate (default 0.01)")
    parser.add_argument("--enrolled", type=int, default=3, help="people enrolled on the device (default 3)")
    parser.add_argument("--extra", type=int, nargs="+", default=[0, 10],
                        help="people added with --data, one row each (default 0 10)")
    parser.add_argument("--draws", type=int, default=200, help="random devices per row (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    root = faces_dir()
    if root is None or not (root / args.set).is_dir():
        print(f"no face data: set FFR_FACES_DIR to the folder holding {args.set}/", file=sys.stderr)
        return 2
    by = embeddings_by_person(root / args.set)
    rows = []
    for extra in args.extra:
        rng = np.random.default_rng(args.seed)
        runs = [draw(by, args.enrolled, extra, args.far, rng) for _ in range(args.draws)]
        claims, accepted = sum(r["claims"] for r in runs), sum(r["accepted"] for r in runs)
        rows.append({"enrolled": args.enrolled, "--data people": extra, "devices": args.draws,
                     "FAR asked": args.far, "stranger claims": claims, "accepted": accepted,
                     "FAR measured": round(accepted / claims, 4),
                     "genuine accepted": round(sum(r["genuine_accepted"] for r in runs)
                                               / sum(r["genuine"] for r in runs), 4),
                     "rate counted (share of devices)": round(float(np.mean([r["measurable"] for r in runs])), 3),
                     "threshold median": round(float(np.median([r["threshold"] for r in runs])), 4)})
    command = "python -m bench.calibration " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(args.out, "calibration", {"set": args.set}, rows,
                  f"Strangers' claims accepted after `ffr device calibrate` ({args.set}, shipped weights, aligned)",
                  command.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
