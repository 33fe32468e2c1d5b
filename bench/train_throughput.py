"""Training images/s: the trainer's epoch loop vs a bare PyTorch loop, same model, data and batch.

python -m bench.train_throughput --out bench/results
Two tables. The distillation step (`ffr pretrain`'s, whose trunk settings `ffr train` and device
training share through `models.training.fast_step`) before and after each speed change (`bench.distill_step`).
Then the trainer's loop against a bare PyTorch loop: both loops read the same DataLoader (weak augmentation)
and take the same Adam steps; the
difference is what the trainer adds (loss parts, accuracy, progress). The full Trainer
epoch (with validation, verification metrics and checkpoints) is reported beside them.
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.common import write_results
from models.faces.crops import CropConfig, crop_index
from models.faces.datasets import load_index
from models.faces.splits import training_split
from models.faces.synthetic import write_dataset
from models.training.crop_batches import train_loader
from models.training.fast_step import accelerate, optimiser_options
from models.training.loop import train_epoch
from models.training.supervised import TrainConfig, Trainer, build_model
from protocol.training_parts import TrainerSettings


def bare_epoch(model, loader, optimiser) -> None:
    """The reference: a bare PyTorch loop, deliberately not the house's (`models.training.loop`), whose cost is
    what this bench measures."""
    model.train()
    for x, y in loader:
        loss = F.cross_entropy(model.head(model.backbone(x), y), y)
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()


def images_per_second(fn, n_images: int) -> float:
    start = time.perf_counter()
    fn()
    return n_images / (time.perf_counter() - start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--identities", type=int, default=32)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="alternating measured epochs per loop")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--distill-steps", type=int, default=8, help="measured steps per row and round")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from bench.distill_step import distill_step_rows

    distill_table, distill_data = distill_step_rows(steps=args.distill_steps)
    command = f"python -m bench.train_throughput --threads {args.threads} --distill-steps {args.distill_steps}"
    write_results(args.out, "distill_step_throughput", distill_data, distill_table,
                  "Distillation step, MobileNetV2-128 student, batch 64, 112 px crops -> 128 px, CPU: each change",
                  command)
    with tempfile.TemporaryDirectory() as tmp:
        data = write_dataset(Path(tmp) / "faces", args.identities, args.images, seed=0)
        crops = crop_index(load_index(data), CropConfig(detector="none"), use_cache=False, progress=False)
        split = training_split(crops, holdout_fraction=0.0, val_fraction=0.1)
        config = TrainConfig(optimisation=TrainerSettings(batch_size=args.batch_size, lr=1e-4))
        model = build_model(config, split.train)
        optimiser = torch.optim.Adam(model.parameters(), lr=config.optimisation.lr)
        loader = train_loader(split.train, args.batch_size, config.aug, torch.Generator().manual_seed(0))
        n = len(loader) * args.batch_size if loader.drop_last else len(split.train)
        bare_epoch(model, loader, optimiser)  # warm-up
        fast = copy.deepcopy(model)  # ffr train's trunk settings (models.training.fast_step)
        fast_dtype = accelerate(fast, "auto")
        fast_optimiser = torch.optim.Adam(fast.parameters(), lr=config.optimisation.lr, **optimiser_options("cpu"))
        bare_epoch(fast, loader, fast_optimiser)  # warm-up
        trainer_ips, bare_ips, fast_ips = [], [], []
        for _ in range(args.rounds):  # alternate so drift in machine load hits all
            trainer_ips.append(images_per_second(lambda: train_epoch(model, loader, optimiser), n))
            bare_ips.append(images_per_second(lambda: bare_epoch(model, loader, optimiser), n))
            fast_ips.append(images_per_second(lambda: train_epoch(fast, loader, fast_optimiser), n))
        # the loop's overhead, not an objective's cost: no anchor (its extra forward would count as overhead)
        full = Trainer(TrainConfig(optimisation=TrainerSettings(epochs=1, batch_size=args.batch_size, precision="fp32"),
                                   anchor_weight=0.0), split, Path(tmp) / "run", progress=False)
        start = time.perf_counter()
        full.fit()
        full_seconds = time.perf_counter() - start
    trainer, bare = max(trainer_ips), max(bare_ips)
    fast_rate = max(fast_ips)
    rows = [{"loop": "bare PyTorch", "images_per_s": bare, "overhead_vs_bare": 0.0},
            {"loop": "ffr trainer (train_epoch)", "images_per_s": trainer, "overhead_vs_bare": 1.0 - trainer / bare},
            {"loop": f"ffr trainer, fast step (trunk {fast_dtype or 'fp32'}, channels_last, foreach Adam): "
                     "what ffr train and devices now run", "images_per_s": fast_rate,
             "overhead_vs_bare": 1.0 - fast_rate / bare},
            {"loop": "ffr Trainer.fit, 1 epoch incl. validation, metrics, checkpoints",
             "images_per_s": n / full_seconds, "overhead_vs_bare": 1.0 - (n / full_seconds) / bare}]
    command = (f"python -m bench.train_throughput --identities {args.identities} --images {args.images} "
               f"--rounds {args.rounds} --batch-size {args.batch_size} --threads {args.threads}")
    write_results(args.out, "train_throughput",
                  {"train_images": n, "all_trainer_ips": trainer_ips, "all_bare_ips": bare_ips,
                   "all_fast_ips": fast_ips},
                  rows, "Training throughput, MobileNetV2-1.0, 128 px, CosFace, weak augmentation, CPU", command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
