"""What averaging each face with its mirror buys and costs, through the ONNX file a device installs.

python -m bench.mirror_averaging --out bench/results [--weights FILE.safetensors] [--sets ...]
python -m bench.mirror_averaging --out bench/results --model teacher --name mirror_averaging_teacher

The embedder (the shipped weights unless `--weights`) is built twice with the torch-free builder
(`ffr device install-model --default`'s path): one view, and mirror-averaged (`models.networks.mirror`).
Both score the same pairs of every labelled set's held-out 30% of people (identities 70/30, seed 0, as
`bench.verify_quality` and `bench.ratchet`), each crop kind those benches use. Per row: AUC with the 95%
interval of the gain (a paired bootstrap over the held-out people), EER, TAR@FAR=1e-2 and 1e-3, and the share of
impostor pairs a device accepts before `ffr device calibrate` has run (`DEFAULT_THRESHOLD`). The cost: the
embedder's median milliseconds per aligned face at one and two threads, each way. `--model teacher` measures the
teacher both ways instead (aligned or given crops only): whether distilling toward its mirror-averaged embedding
is an arm worth a GPU's time.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.common import faces_dir, result_name, time_calls, write_results
from bench.held_out_sets import SETS, crop_kinds, d_auc_interval, held_out_pairs
from bench.ratchet import accepted
from bench.verify_quality import measure
from models.evaluation.metrics import cosine_scores, l2_normalise
from models.networks import face_weights
from models.networks.mirror import averaged_crops
from models.runtime import OnnxEmbedder

VIEWS = {"one view": False, "mirror-averaged": True}


class TeacherViews:
    """The teacher (SFace, as `bench.verify_quality` runs it) on each crop alone or averaged with its mirror, in numpy:
    whether a mirror-averaged target would teach better than the one the student learns now."""

    def __init__(self, mirror: bool, threads: int):
        from models.networks.teacher import load_teacher

        self.teacher, self.mirror = load_teacher("sface", threads=threads), mirror

    def embed(self, crops: np.ndarray, batch_size: int = 64) -> np.ndarray:
        return averaged_crops(self.teacher.embed, crops) if self.mirror else l2_normalise(self.teacher.embed(crops))


def embedders_for(model: str, weights: Path, folder: Path, threads: int) -> dict:
    """One view and mirror-averaged, of our embedder (the device's ONNX) or of the teacher."""
    if model == "teacher":
        return {view: TeacherViews(mirror, threads) for view, mirror in VIEWS.items()}
    return build(weights, folder, threads)


def build(weights: Path, folder: Path, threads: int) -> dict[str, OnnxEmbedder]:
    """The device's ONNX embedder, each way, from the same weights."""
    import onnx

    from models.networks.embedder_onnx import build_embedder_onnx

    state, _ = face_weights.read_embedder_numpy(weights)
    out = {}
    for view, mirror in VIEWS.items():
        path = folder / f"{'mirror' if mirror else 'plain'}.onnx"
        onnx.save(build_embedder_onnx(state, {"weights": weights.name}, mirror=mirror), str(path))
        out[view] = OnnxEmbedder(path, threads)
    return out


def compare_set(name: str, root: Path, embedders: dict, seed: int, max_pairs: int, teacher: bool = False
                ) -> list[dict]:
    """Both views on the set's held-out people, the same pairs, each crop kind (the teacher: aligned or given only,
    as `bench.verify_quality` measures it)."""
    rows = []
    for crops, config in crop_kinds(name)[:1] if teacher else crop_kinds(name):
        held, pairs, same = held_out_pairs(root, config, seed, max_pairs)
        plain, mirrored = (cosine_scores(e.embed(held.images), pairs) for e in embedders.values())
        low, high = d_auc_interval(same, np.asarray(held.labels)[pairs], plain, mirrored, seed=seed)
        for view, scores in zip(VIEWS, (plain, mirrored)):
            rows.append({"set": name, "crops": crops, "identities": len(held.identities), "view": view,
                         **measure(scores, same), "far@uncalibrated": accepted(scores, ~same),
                         "d_auc": "", "d_auc_95%_low": "", "d_auc_95%_high": ""})
        rows[-1].update({"d_auc": rows[-1]["auc"] - rows[-2]["auc"], "d_auc_95%_low": low, "d_auc_95%_high": high})
        print(rows[-2], rows[-1], sep="\n", flush=True)
    return rows


def cost(model: str, weights: Path, folder: Path, repeats: int) -> list[dict]:
    """Median and p95 milliseconds per aligned face (batch of one), each way, at one and two threads."""
    face = np.random.default_rng(0).integers(0, 256, (1, 128, 128, 3), dtype=np.uint8)
    rows = []
    for threads in (1, 2):
        for view, embedder in embedders_for(model, weights, folder, threads).items():
            timed = time_calls(lambda e=embedder: e.embed(face), repeats)
            rows.append({"view": view, "threads": threads, "median_ms": timed["median_ms"], "p95_ms": timed["p95_ms"]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, default=None, help="an embedder file (default: the shipped weights)")
    parser.add_argument("--model", choices=("ffr-edge", "teacher"), default="ffr-edge",
                        help="whose embeddings: ours through the device's ONNX, or the teacher's (SFace)")
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", type=result_name, default="mirror_averaging")
    parser.add_argument("--max-pairs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="threads while scoring the sets")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per view and thread count")
    args = parser.parse_args(argv)
    root = faces_dir()
    if root is None:
        print("no face data: set FFR_FACES_DIR to the folder holding orl/, celeba_subset/, ...", file=sys.stderr)
        return 2
    weights = face_weights.shipped_weights() if args.weights is None else args.weights
    try:
        face_weights.checked_embedder(weights)
    except (ValueError, FileNotFoundError) as exc:
        print(f"bench.mirror_averaging: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        embedders = embedders_for(args.model, weights, Path(tmp), args.threads)
        rows = [r for name in args.sets for r in compare_set(name, root / name, embedders, args.seed,
                                                             args.max_pairs, teacher=args.model == "teacher")]
        timing = cost(args.model, weights, Path(tmp), args.repeats)
    gained = [r for r in rows if r["view"] == "mirror-averaged"]
    verdict = (f"mirror averaging: AUC higher on {sum(r['d_auc'] > 0 for r in gained)} of {len(gained)} rows, "
               f"interval wholly above zero on {sum(r['d_auc_95%_low'] > 0 for r in gained)}, "
               f"wholly below on {sum(r['d_auc_95%_high'] < 0 for r in gained)}")
    print(verdict)
    for row in timing:
        print(row)
    command = "python -m bench.mirror_averaging " + " ".join(argv if argv is not None else sys.argv[1:])
    whose = "the teacher (SFace)" if args.model == "teacher" else "through the device's ONNX"
    path = write_results(args.out, args.name, {"model": args.model, "weights": str(weights), "verdict": verdict,
                                               "cost": timing}, rows,
                         f"Mirror averaging on held-out people, {whose}: {verdict}", command)
    with path.with_suffix(".md").open("a") as md:
        md.write("\n## Cost: the embedder per aligned face (batch of one)\n\n"
                 "| view | threads | median_ms | p95_ms |\n|---|---|---|---|\n"
                 + "".join(f"| {r['view']} | {r['threads']} | {r['median_ms']:.3f} | {r['p95_ms']:.3f} |\n"
                           for r in timing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
