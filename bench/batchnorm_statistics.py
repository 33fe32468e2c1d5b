"""How much the shipped embedder's verdicts hang on its BatchNorm statistics alone.

python -m bench.batchnorm_statistics --out bench/results

BatchNorm keeps running means and variances of its inputs, estimated while training: for the shipped file, on the
GPU run's last batches of the online recipe's views (geometric jitter, a quarter of the batch two faces blended,
photometric augmentation for the student; `models.training.online_views`). Every weight of the file is kept here and
only those statistics are estimated again (cumulative averages over batches, as `momentum=None` does; Ioffe and
Szegedy, ICML 2015, section 3.1: the inference statistics are the population's), on a seeded sample of the
distillation folders seen as:

- `clean`: the crops as a device embeds them (`models.faces.preprocess.to_input`);
- `recipe_unblended`: the recipe's student views without the blended faces;
- `recipe`: the recipe's student views, blends included (the control: the same distribution the file was trained
  on, estimated again on a CPU from fewer batches).

Each variant is then scored against the shipped file as `bench.ratchet` scores a candidate: the held-out people of
every labelled set, the same pairs, the AUC gain with its 95% interval. A CPU run of `ffr pretrain --online` moves
these statistics along with the weights, so the `recipe` row is the part of any CPU candidate's verdict that comes
from re-estimating them, not from learning.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch.optim.swa_utils import update_bn

from bench.common import faces_dir, result_name, write_results
from bench.held_out_sets import SETS
from bench.ratchet import compare_set
from models.networks import face_weights

DISTILLATION_FOLDERS = ("utkface_aligned", "all_age_faces_aligned", "celebahq_aligned")  # `ffr pretrain`'s data
BATCH = 128
VIEW_KINDS = ("clean", "recipe_unblended", "recipe")


def reestimated(model: torch.nn.Module, batches: Iterator[torch.Tensor]) -> torch.nn.Module:
    """`model` with every BatchNorm's running statistics replaced by their average over `batches` (network inputs;
    torch's `update_bn`, which SWA uses for the same reason); weights untouched. Returned in eval mode."""
    with torch.no_grad():
        update_bn(batches, model)
    return model.eval()


def view_kinds(seed: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Name -> uint8 (N,3,H,W) crops to the student's input, each as its docstring entry above says. Each recipe
    kind draws from a generator of its own seeded with `seed`, so a row is the same whatever other `--views` run."""
    from models.cli.commands import ONLINE_DEFAULT_MIX  # the recipe's blended share
    from models.faces.preprocess import to_input
    from models.training.online_views import ViewJitter, face_changes, photometric, student_input, teacher_views

    def recipe(mix: float) -> Callable[[torch.Tensor], torch.Tensor]:
        generator, changes = torch.Generator().manual_seed(seed), face_changes(mix_fraction=mix)

        def view(crops: torch.Tensor) -> torch.Tensor:
            views = teacher_views(crops, ViewJitter(), changes, generator)  # as `OnlineDistiller._loss` draws them
            return student_input(photometric(views / 255.0, generator))
        return view

    return {"clean": lambda c: torch.from_numpy(to_input(c.permute(0, 2, 3, 1).numpy())),
            "recipe_unblended": recipe(0.0), "recipe": recipe(ONLINE_DEFAULT_MIX)}


def sample_crops(folders: list[Path], images: int, seed: int) -> torch.Tensor:
    """A seeded sample of the folders' aligned crops, uint8 (N,3,112,112) as online distillation reads them."""
    from models.training.distill_data import list_images, load_crops
    from models.training.pretraining import CROP_SIZE

    files = list_images(folders)
    pick = np.sort(np.random.default_rng(seed).permutation(len(files))[:images])
    crops, _, _ = load_crops([files[i] for i in pick], CROP_SIZE, progress=False)
    if len(crops) < BATCH:
        raise SystemExit(f"bench.batchnorm_statistics: {len(crops)} readable crops; at least {BATCH} are needed")
    return torch.from_numpy(crops).permute(0, 3, 1, 2).contiguous()


def batches(crops: torch.Tensor, view: Callable[[torch.Tensor], torch.Tensor], seed: int) -> Iterator[torch.Tensor]:
    """Shuffled full batches of views (a short last batch would weigh as much as a full one in the average)."""
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(crops)))
    for start in range(0, len(order) - BATCH + 1, BATCH):
        yield view(crops[order[start:start + BATCH]])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, action="append",
                        help="folders of aligned crops to estimate on (default: FFR_FACES_DIR's "
                             f"{', '.join(DISTILLATION_FOLDERS)})")
    parser.add_argument("--images", type=int, default=8000, help="crops sampled from the folders (default 8000)")
    parser.add_argument("--views", nargs="+", default=list(VIEW_KINDS), choices=VIEW_KINDS)
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--name", type=result_name, default="batchnorm_statistics")
    parser.add_argument("--max-pairs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    root = faces_dir()
    if root is None:
        print("no face data: set FFR_FACES_DIR to the folder holding orl/, celeba_subset/, ...", file=sys.stderr)
        return 2
    if args.images < BATCH:
        parser.error(f"--images must be at least {BATCH}")
    torch.set_num_threads(args.threads)
    crops = sample_crops(args.data or [root / f for f in DISTILLATION_FOLDERS], args.images, args.seed)
    shipped = face_weights.load_face_embedder(face_weights.shipped_weights()).eval()
    rows = []
    for name, view in view_kinds(args.seed).items():
        if name not in args.views:
            continue
        variant = reestimated(face_weights.load_face_embedder(face_weights.shipped_weights()),
                              batches(crops, view, args.seed))
        with tempfile.TemporaryDirectory() as tmp:  # through the shipped format (fp16), as a candidate would go
            variant = face_weights.load_face_embedder(face_weights.save_embedder(Path(tmp) / "v.safetensors",
                                                                                 variant)).eval()
        rows += [{"statistics": name, **row} for set_name in args.sets
                 for row in compare_set(set_name, root / set_name, shipped, variant, args.seed, args.max_pairs)]
    command = "python -m bench.batchnorm_statistics " + " ".join(argv if argv is not None else sys.argv[1:])
    write_results(args.out, args.name, {"images": len(crops), "batch": BATCH, "shipped_sha256":
                                        face_weights.SHIPPED_SHA256}, rows,
                  f"The shipped weights with only their BatchNorm statistics estimated again ({len(crops)} "
                  "distillation crops, one view), against the shipped file on held-out people", command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
