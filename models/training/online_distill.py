"""`ffr pretrain --online`: distillation with the teacher in the loop, for a GPU (and tested on CPU).

The cached path (`models.training.pretraining`) embeds two views per image once, because on 2 CPU cores
the teacher costs more than a student step. On a GPU the teacher is cheap, so here every step
draws a fresh geometric view of each crop and asks the teacher (converted to torch,
`models.networks.torch_teacher`) for that exact view (Beyer et al., CVPR 2022, "consistent" teaching).
The crops live on the device as one uint8 tensor, augmentation runs there (`models.training.online_views`),
the student's trunk runs in bf16 autocast, channels_last, with a fused AdamW (`models.training.fast_step`).

A run may be bounded by wall time (`budget_minutes`): the learning rate then decays with the
fraction of the budget spent rather than of the steps (Li et al., "Budget-constrained training",
ICLR 2020), so a run split across several 10-minute GPU leases ends its schedule on time. Its
state is saved as safetensors (no pickle) and resumes across machines.

`--loss queue` adds a relational term over a FIFO queue of earlier steps' teacher targets
(`training.distillation.queue_distillation_loss`); the queue is not saved, and refills after a resume.

`--rank-weight W` adds the pair-rank term (`training.distillation.pair_rank_loss`): each of the batch's most similar
pairs should pass the same false-accept thresholds under the student as under the teacher, each model's thresholds
an exponential mean over steps (`AcceptThresholds`), not saved, started again from the first batch after a resume.

`--relight-fraction F` lights that part of each batch from one side (`online_views.relit_faces`) before the teacher
embeds it: targets for faces in a lamp's or a window's light, which the student's colour jitter never shows.

`--mirrored-teacher` makes each target the teacher's embedding of the view and its mirror image averaged
(`models.networks.mirror.averaged`), the function every ONNX file a device runs computes: measured one view ->
mirrored, the teacher's own held-out AUC rises on every labelled set (`bench/results/mirror_averaging_teacher.md`), so
the student learns the better target, at twice the teacher's cost per step.

`--ema-decay D` keeps an exponential moving average of the student's weights (`models.training.weight_average`) and
ships it as the run's `embedder.safetensors`; the student's own last weights go beside it
(`embedder_last.safetensors`), so one run measures both at equal samples.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from tqdm import tqdm

from models.networks.face_weights import save_embedder
from models.networks.mirror import averaged
from models.progress import bar_disable
from models.training.cpu_share import Yielder
from models.training.distillation import (
    accept_thresholds,
    distillation_loss,
    pair_rank_loss,
    pair_similarities,
    queue_distillation_loss,
)
from models.training.loop import Means, Step, optimise
from models.training.online_views import ViewJitter, face_changes, photometric, student_input, teacher_views
from models.training.pretraining import (
    PretrainConfig,
    init_source,
    schedule_done,
    scheduled_lr,
    scheduled_size,
    teacher_spec,
)
from models.training.weight_average import weight_average
from protocol.training_parts import flatten

ONLINE_LOSSES = ("cosine", "queue")
STATE_FILES = ("student.safetensors", "optimiser_exp_avg.safetensors", "optimiser_exp_avg_sq.safetensors")
AVERAGE_FILE = "weight_average.safetensors"  # --ema-decay: the average and its update count, to resume it exactly
LAST_EMBEDDER = "embedder_last.safetensors"  # --ema-decay: the student's own last weights, beside the average


def load_training_crops(data: list[str], size: int, threads: int, progress: bool) -> tuple[np.ndarray, list[str]]:
    """Crops from folders of images and/or crop packs (`models.training.crop_pack`), in the order given."""
    from models.training.crop_pack import is_pack, unpack_crops
    from models.training.distill_data import list_images, load_crops

    images, names = [], []
    for item in map(Path, data):
        if is_pack(item):
            crops, kept = unpack_crops(item, threads)
        else:
            crops, files, _ = load_crops(list_images([item]), size, threads, progress)
            kept = [str(f) for f in files]
        if crops.shape[1] != size:
            raise ValueError(f"{item} holds {crops.shape[1]}-pixel crops; pretraining reads {size}-pixel ones")
        images.append(crops)
        names += [f"{item.name}/{k}" for k in kept]
    return np.concatenate(images), names


class TargetQueue:
    """The last `size` teacher targets, oldest overwritten first: the memory `--loss queue` ranges over."""

    def __init__(self, size: int, dim: int, device: torch.device):
        self.values = torch.zeros(size, dim, device=device)
        self.filled, self.next = 0, 0

    def contents(self) -> torch.Tensor:
        """A copy: the step's backward pass still needs it after `push` overwrites the queue."""
        return self.values[:self.filled].clone()

    def push(self, targets: torch.Tensor) -> None:
        targets = targets.detach().float()[-len(self.values):]
        rows = (self.next + torch.arange(len(targets), device=self.values.device)) % len(self.values)
        self.values[rows] = targets
        self.next = (self.next + len(targets)) % len(self.values)
        self.filled = min(len(self.values), self.filled + len(targets))


class AcceptThresholds:
    """The student's and the teacher's false-accept thresholds (`distillation.accept_thresholds`), each an
    exponential mean over steps as in EKD (one batch's 1e-4 threshold is a dozen pairs), the first batch's at the
    start: the bands `--rank-weight`'s term counts a pair in."""

    def __init__(self, momentum: float = 0.01):
        self.momentum = momentum
        self.student: torch.Tensor | None = None
        self.teacher: torch.Tensor | None = None

    def update(self, student_pairs: torch.Tensor, teacher_pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold in this batch's thresholds, from each model's pair similarities (`pair_similarities`); the current
        pair of thresholds."""
        with torch.no_grad():
            now = accept_thresholds(student_pairs), accept_thresholds(teacher_pairs)
            if self.student is None:
                self.student, self.teacher = now
            else:
                self.student = torch.lerp(self.student, now[0], self.momentum)
                self.teacher = torch.lerp(self.teacher, now[1], self.momentum)
        return self.student, self.teacher


def held_out_split(n: int, seed: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(held-out, training) indices of `n` crops: the student never trains on the held-out ones, which give the
    learning curve's cosine to the teacher (and let a benchmark find them again from the run's seed)."""
    order = np.random.default_rng(seed).permutation(n)
    n_val = max(min(256, n // 4), int(n * val_fraction))
    return np.sort(order[:n_val]), np.sort(order[n_val:])


class OnlineDistiller:
    """State and steps of one online distillation run; `fit` is its loop."""

    def __init__(self, config: PretrainConfig, out: Path, teacher=None, *, threads: int | None = None,
                 progress: bool = True):
        """`threads` and `progress`: how this machine runs the spec, not part of it (as `Pretrainer`'s)."""
        from models.training.fast_step import accelerate, checked_device, optimiser_options
        from models.training.pretraining import CROP_SIZE, student

        if config.loss not in ONLINE_LOSSES:
            raise ValueError(f"--online trains with --loss {' or '.join(ONLINE_LOSSES)} (not {config.loss})")
        self.config, self.out, self.threads, self.progress = config, Path(out), threads, progress
        self.teacher_agreement: float | None = None
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(config.seed)
        self.device = checked_device(config.device)
        images, self.names = load_training_crops(config.data, CROP_SIZE, threads or 2, progress)
        if config.max_images and len(images) > config.max_images:
            keep = np.sort(np.random.default_rng(config.seed).permutation(len(images))[:config.max_images])
            images, self.names = images[keep], [self.names[i] for i in keep]
        if len(images) < 2 * config.optimisation.batch_size:
            raise ValueError(f"online distillation needs at least {2 * config.optimisation.batch_size} face crops; "
                             f"found {len(images)}")
        self.val_index, train_index = held_out_split(len(images), config.seed, config.val_fraction)
        self.crops = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous().to(self.device)
        self.train_index = torch.from_numpy(train_index).to(self.device)
        self.teacher = (teacher or self._teacher(images[self.val_index[:64]])).to(self.device)
        self.model = student(config.init, self.teacher.dim).to(self.device)
        self.queue = TargetQueue(config.queue_size, self.teacher.dim, self.device) if config.loss == "queue" else None
        self.thresholds = AcceptThresholds() if config.rank_weight else None
        self.start = init_source(config.init)
        self.autocast = accelerate(self.model, config.optimisation.precision, config.device)
        self.average = weight_average(self.model, config.ema_decay)  # a copy, made after `accelerate` set its trunk
        self.optimiser = torch.optim.AdamW(self.model.parameters(), lr=config.optimisation.lr,
                                           weight_decay=config.optimisation.weight_decay,
                                           **optimiser_options(self.device))
        self.jitter = ViewJitter(**config.jitter)
        self.face_changes = face_changes(config.mix_fraction, config.relight_fraction)
        self.generator = torch.Generator(self.device)
        self.steps_per_epoch = len(train_index) // config.optimisation.batch_size
        self.total_steps = None if config.budget_minutes else self.steps_per_epoch * config.optimisation.epochs
        self.step, self.trained_s, self.history = 0, 0.0, []
        self.yielder = Yielder(config.yield_cpu, notify=tqdm.write)
        self._val_targets: list[torch.Tensor] | None = None

    def _teacher(self, check_crops: np.ndarray):
        """The ONNX teacher, converted to torch and checked against ONNX Runtime on real crops before it teaches."""
        from models.networks.teacher import load_teacher
        from models.networks.torch_teacher import check_against_onnx, to_torch

        spec = teacher_spec(self.config.teacher_spec)
        onnx_teacher = load_teacher(self.config.teacher, threads=self.threads, spec=spec)
        converted = to_torch(onnx_teacher)
        if self.device.type == "cuda":  # the teacher's targets in true fp32; the student runs in bf16 anyway
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        self.teacher_agreement = check_against_onnx(converted, onnx_teacher, check_crops, self.device)
        return converted

    # --- the loop ---------------------------------------------------------------------------------------------

    def done(self) -> bool:
        return schedule_done(self.config, self.step, self.total_steps, self.trained_s)

    def fit(self, stop_after_s: float | None = None) -> dict:
        """Train until the schedule ends or `stop_after_s` of this call passed; checkpoints on the way out."""
        started = self._last_save = time.time()
        bar = tqdm(desc="distilling online", unit="step", initial=self.step, total=self.total_steps,
                   disable=bar_disable(self.progress), dynamic_ncols=True)
        self._window = Means()  # the training figures since the last learning-curve row

        def steps():
            while not self.done() and not (stop_after_s and time.time() - started > stop_after_s):
                self.yielder()  # off the clock: paused while the tests or a benchmark run
                self._tick = time.time()
                self.generator.manual_seed(self.config.seed * 1_000_003 + self.step)
                yield self.step

        try:
            optimise(steps(), self._loss, self.optimiser, before=[self._set_lr],
                     after=[lambda step: self._after_step(step, bar)],
                     finite=lambda: f"distillation loss at step {self.step}")
        finally:
            bar.close()
            if self._window.steps:
                self._record(self._window.result())
            self.save()
        return self.write_metrics("finished" if self.done() else "paused")

    def _set_lr(self) -> None:
        self._current_lr = scheduled_lr(self.config, self.step, self.total_steps, self.trained_s)
        for group in self.optimiser.param_groups:
            group["lr"] = self._current_lr

    def _loss(self, _) -> Step:
        """One batch: jittered views -> teacher targets (no grad) -> student on a photometric copy."""
        pick = torch.randint(len(self.train_index), (self.config.optimisation.batch_size,), generator=self.generator,
                             device=self.device)
        views = teacher_views(self.crops[self.train_index[pick]], self.jitter, self.face_changes, self.generator)
        with torch.no_grad():
            target = self._teach(views)
        size = scheduled_size(self.config, self.step, self.total_steps, self.trained_s)
        x = student_input(photometric(views / 255.0, self.generator), size)
        self.model.train()
        student = self.model(x)  # the trunk in bf16 where the hardware has it (models.training.fast_step)
        loss, parts = self._objective(student.float(), target)
        return Step(loss, 1.0, {**parts, "lr": self._current_lr})

    def _teach(self, views: torch.Tensor) -> torch.Tensor:
        """The teacher's targets for float (N,3,H,W) views in 0..255: of each view alone, or mirror-averaged."""
        return averaged(self.teacher, views) if self.config.mirrored_teacher else self.teacher(views)

    def _objective(self, student: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss (--loss), plus the pair-rank term where --rank-weight is on."""
        loss, parts = self._distillation(student, target)
        if self.thresholds is None or len(student) < 2:  # a batch of one has no pairs to rank
            return loss, parts
        pairs = pair_similarities(student), pair_similarities(target)  # once a step, for the bands and the loss
        rank = pair_rank_loss(*pairs, *self.thresholds.update(*pairs))
        return loss + self.config.rank_weight * rank, {**parts, "rank_loss": float(rank.detach())}

    def _distillation(self, student: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        if self.queue is None:
            return distillation_loss(student, target, self.config.sim_weight)
        memory = self.queue.contents() if self.queue.filled else target  # the first step: the batch itself
        result = queue_distillation_loss(student, target, memory, self.config.sim_weight, self.config.bank_weight,
                                         self.config.bank_temperature)
        self.queue.push(target)
        return result

    def _after_step(self, step: Step, bar) -> None:
        """Count, time and log the step; a row every `eval_every_steps`, a checkpoint every `checkpoint_every_s`."""
        self.step += 1
        self.average.update(self.model)
        self.trained_s += time.time() - self._tick
        self._window.add(step)
        bar.update(1)
        if self.step % 20 == 0:
            bar.set_postfix(cos=f"{step.metrics['cos_loss']:.3f}", lr=f"{step.metrics['lr']:.1e}")
        if self.step % self.config.eval_every_steps == 0:
            self._record(self._window.result())
            self._window = Means()
        if time.time() - self._last_save > self.config.checkpoint_every_s:
            self.save()
            self._last_save = time.time()

    def _record(self, running: dict[str, float]) -> None:
        row = {"step": self.step, "samples": self.step * self.config.optimisation.batch_size,
               "trained_s": round(self.trained_s, 1),
               "samples_per_s": round(self.step * self.config.optimisation.batch_size / max(self.trained_s, 1e-9), 1),
               **{f"train_{k}": round(v, 5) for k, v in running.items() if k != "lr"},
               "val_teacher_cosine": self.val_teacher_cosine()}
        if self.average.updates:
            row["val_teacher_cosine_average"] = self.val_teacher_cosine(self.average.model)
        self.history.append(row)
        tqdm.write(json.dumps(row))

    @torch.no_grad()
    def val_teacher_cosine(self, model: torch.nn.Module | None = None) -> float:
        """Mean cosine between student (or `model`, the weight average) and teacher on held-out crops, unaugmented
        (the figure the CPU path logs), against the targets the run trains toward (mirror-averaged with
        `--mirrored-teacher`)."""
        model = self.model if model is None else model
        model.eval()
        batches = [torch.from_numpy(self.val_index[i:i + 256]).to(self.device)
                   for i in range(0, len(self.val_index), 256)]
        if self._val_targets is None:  # the held-out crops never change: the teacher embeds them once
            self._val_targets = [self._teach(self.crops[b].float()) for b in batches]
        cos = [(F.normalize(model(student_input(self.crops[b].float() / 255.0)).float(), dim=1) * t).sum(1)
               for b, t in zip(batches, self._val_targets)]
        return round(float(torch.cat(cos).mean()), 5)

    # --- state ------------------------------------------------------------------------------------------------

    def save(self) -> None:
        """Student and AdamW moments as safetensors (each under 16 MiB), progress as JSON; atomic renames."""
        from safetensors.torch import save_file

        self.out.mkdir(parents=True, exist_ok=True)
        state = self.optimiser.state_dict()["state"]
        tensors = [{k: v.detach().contiguous() for k, v in self.model.state_dict().items()},
                   {str(i): s["exp_avg"].contiguous() for i, s in state.items()},
                   {str(i): s["exp_avg_sq"].contiguous() for i, s in state.items()}]
        if self.average.updates:
            tensors.append(self.average.state())
        for name, values in zip((*STATE_FILES, AVERAGE_FILE), tensors):
            tmp = self.out / f"{name}.tmp"
            save_file({k: v.cpu() for k, v in values.items()}, str(tmp))
            tmp.replace(self.out / name)
        progress = {"step": self.step, "trained_s": self.trained_s, "history": self.history,
                    "config": self.config.to_dict(), "names_sha": _names_key(self.names)}
        (self.out / "progress.json.tmp").write_text(json.dumps(progress))
        (self.out / "progress.json.tmp").replace(self.out / "progress.json")
        about = {"teacher": self.config.teacher, "step": str(self.step), "mode": "online",
                 "samples": str(self.step * self.config.optimisation.batch_size), "data": json.dumps(self.config.data)}
        if self.average.updates:
            save_embedder(self.out / LAST_EMBEDDER, self.model, {**about, "weights": "last"})
            about["weights"] = f"exponential moving average, decay {self.config.ema_decay}"
        save_embedder(self.out / "embedder.safetensors", self.average.model, about)

    def resume(self) -> None:
        """Continue from the run folder's state; a damaged or foreign state is refused in one line."""
        try:
            self._load_state()
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError, RuntimeError, OSError,
                SafetensorError) as exc:
            raise ValueError(f"{self.out} holds a damaged run state ({type(exc).__name__}: {exc}); "
                             f"use a new --out or --force") from None

    def _load_state(self) -> None:
        from safetensors.torch import load_file

        progress = json.loads((self.out / "progress.json").read_text())
        if progress["names_sha"] != _names_key(self.names):
            raise ValueError(f"{self.out} was trained on other crops; use a new --out")
        saved, now = flatten(progress["config"]), flatten(self.config.to_dict())  # either saved form
        saved.setdefault("mirrored_teacher", False)  # a run saved before the option trained on one view
        saved.setdefault("ema_decay", 0.0)  # ... or before --ema-decay: no average
        for key in ("batch_size", "budget_minutes", "epochs", "seed", "low_res", "low_res_fraction",
                    "mirrored_teacher", "ema_decay"):
            if saved[key] != now[key]:
                raise ValueError(f"--{key.replace('_', '-')} differs from the run being resumed "
                                 f"({saved[key]!r} there, {now[key]!r} now)")
        model_state, exp_avg, exp_avg_sq = (load_file(str(self.out / n), device=str(self.device)) for n in STATE_FILES)
        self.model.load_state_dict(model_state)
        self.step, self.trained_s = int(progress["step"]), float(progress["trained_s"])
        if self.step < 0 or not 0 <= self.trained_s < float("inf"):
            raise TypeError(f"step {self.step} or training time {self.trained_s} out of range")
        if self.config.ema_decay and self.step:  # saved from the first step on (`save`)
            self.average.load(load_file(str(self.out / AVERAGE_FILE), device=str(self.device)))
        self.history = progress["history"]
        if exp_avg:
            params = list(self.model.parameters())
            if len(exp_avg) != len(params):
                raise ValueError(f"{self.out}: the saved optimiser state does not fit the student")
            self.optimiser.load_state_dict({
                "state": {i: {"step": torch.tensor(float(self.step)), "exp_avg": exp_avg[str(i)],
                              "exp_avg_sq": exp_avg_sq[str(i)]} for i in range(len(params))},
                "param_groups": self.optimiser.state_dict()["param_groups"]})

    def write_metrics(self, status: str) -> dict:
        metrics = {"status": status, "mode": "online", "step": self.step, "total_steps": self.total_steps,
                   "samples": self.step * self.config.optimisation.batch_size, "trained_s": round(self.trained_s, 1),
                   "images": len(self.names), "teacher": self.config.teacher, "teacher_sha256": self.teacher.sha256,
                   "teacher_agreement_with_onnxruntime": self.teacher_agreement,
                   "precision": str(self.autocast or "fp32"), "device": str(self.device), "start": self.start,
                   "config": self.config.to_dict(), "history": self.history}
        tmp = self.out / "metrics.json.tmp"
        tmp.write_text(json.dumps(metrics, indent=2))
        tmp.replace(self.out / "metrics.json")
        return metrics


def _names_key(names: list[str]) -> str:
    import hashlib

    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]
