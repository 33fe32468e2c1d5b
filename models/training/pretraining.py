"""`ffr pretrain`: distil the MobileNetV2-128 face embedder from a public teacher on unlabelled faces.

FedFR (Liu et al., AAAI 2022, sec. 3) starts every device from a model pretrained on public
data; this is how ours gets one without identity labels: the student learns the teacher's
embedding of each aligned crop (`models.training.distillation`), the teacher's embeddings are computed
once per image and view and cached (`models.training.distill_data`), the student sees the same view
under photometric augmentation (vectorised over the batch, `models.training.online_views`). The run
checkpoints every few minutes, stops cleanly on Ctrl-C and resumes (`--resume`) mid-epoch;
`metrics.json` holds the learning curve.

Where identities are known (`--labelled DIR`, one sub-folder per person), a CosFace margin
loss (Wang et al., CVPR 2018, eq. 4) on those images joins the distillation loss:
  L = L_cos + lambda L_sim + margin_weight * CE(s (cos theta - m 1_y))   (labelled samples only).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from models.faces.preprocess import INPUT_SIZE
from models.networks.backbone import FaceEmbedder
from models.networks.face_weights import save_embedder
from models.progress import bar_disable
from models.training.cpu_share import Yielder
from models.training.distill_data import TeacherTargets, default_cache_root, list_images, load_crops, targets_dir, view
from models.training.distillation import bank_distillation_loss, distillation_loss
from models.training.fast_step import accelerate, optimiser_options
from models.training.loop import Step, optimise, resume_from
from models.training.online_views import photometric, student_input
from protocol.training_parts import TrainerSettings, flatten

LOSSES = ("cosine", "bank")  # the cached path's; the online path's: online_distill.ONLINE_LOSSES
CROP_SIZE = 112  # the aligned sets' and the teacher's size; the student sees them at INPUT_SIZE


# the distillation recipe's optimiser (the precision: auto, bf16 where the CPU has it or on CUDA)
PRETRAIN_DEFAULTS = {"epochs": 10, "batch_size": 64, "lr": 1e-3, "weight_decay": 1e-2}


@dataclass
class PretrainConfig:
    """One distillation run's settings, cached (`Pretrainer`) or with the teacher in the loop (`OnlineDistiller`).

    The options the other path does not read are named so: `loss`, `views`, `bank_*`, `labelled`, `margin_weight`
    and `eval_data` are the cached path's; `eval_every_steps`, `jitter`, `mix_fraction`, `relight_fraction`,
    `mirrored_teacher`, `rank_weight` and `ema_decay` the online path's (`ffr pretrain` refuses a mix)."""

    data: list[str]
    teacher: str = "sface"
    teacher_spec: dict = field(default_factory=dict)  # TeacherSpec fields for an ONNX teacher; {} = SFace's
    init: str = "imagenet"          # imagenet | face (continue from the shipped weights) | none
    optimisation: TrainerSettings = field(default_factory=lambda: TrainerSettings(**PRETRAIN_DEFAULTS))  # AdamW's
    warmup_steps: int = 300
    sim_weight: float = 2.0
    loss: str = "cosine"            # cosine (L_cos + sim_weight L_sim over the batch) | bank (training.distillation)
    views: int = 8                  # cached teacher views per image: the image, its mirror, then geometric jitters
                                    # (8 won bench.distill_arms: the only arm that lifted Glint24's AUC)
    bank_weight: float = 1.0
    bank_temperature: float = 0.1
    queue_size: int = 16384         # online --loss queue: earlier teacher targets the relational term ranges over
    mix_fraction: float = 0.0       # online: the part of each batch made of two faces blended (online_views)
    relight_fraction: float = 0.0   # online: the part of each batch lit from one side, teacher too (online_views)
    mirrored_teacher: bool = False  # online: each target is the teacher's mirror-averaged embedding of its view
    rank_weight: float = 0.0        # online: weight of the pair-rank term (training.distillation.pair_rank_loss)
    ema_decay: float = 0.0          # online: ship an exponential moving average of the weights (weight_average); 0 off
    budget_minutes: float | None = None  # when set, the run stops and its schedule ends after this much training
    low_res: int | None = None      # progressive resolution: the student's input side for the first part of the run
    low_res_fraction: float = 0.75  # ... that part, of the schedule (its time budget, else its steps)
    labelled: list[str] = field(default_factory=list)  # sets with one sub-folder per person: + a margin loss
    margin_weight: float = 1.0
    device: str = "cpu"
    val_fraction: float = 0.01
    eval_data: list[str] = field(default_factory=list)
    checkpoint_every_s: float = 180.0
    max_images: int | None = None
    seed: int = 0
    yield_cpu: bool = True          # wait while the tests or a benchmark run (models.training.cpu_share)
    eval_every_steps: int = 500     # online: steps between held-out evaluations
    jitter: dict = field(default_factory=dict)  # online: online_views.ViewJitter fields; {} = defaults

    def __post_init__(self) -> None:
        """Settings that cannot work are refused here, named as `ffr pretrain` spells them."""
        checks = [(self.warmup_steps >= 0 and self.sim_weight >= 0,
                   "--warmup-steps and --sim-weight must not be negative"),
                  (self.budget_minutes is None or self.budget_minutes > 0,
                   f"--budget-minutes must be positive (got {self.budget_minutes})"),
                  (self.max_images is None or self.max_images >= 1, "--max-images must be at least 1"),
                  (self.checkpoint_every_s > 0 and self.eval_every_steps >= 1,
                   "--checkpoint-every and --eval-every must be positive"),
                  (0 < self.val_fraction < 0.5, f"the held-out fraction must be in (0, 0.5) (got {self.val_fraction})")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.views < 1:
            raise ValueError(f"--views must be at least 1 (got {self.views})")
        if not 0 <= self.mix_fraction < 1:
            raise ValueError(f"--mix-fraction must be in [0, 1) (got {self.mix_fraction})")
        if not 0 <= self.relight_fraction <= 1:
            raise ValueError(f"--relight-fraction must be in [0, 1] (got {self.relight_fraction})")
        if not 0 <= self.rank_weight < float("inf"):
            raise ValueError(f"--rank-weight must be a number not below 0 (got {self.rank_weight})")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"--ema-decay must be in [0, 1) (got {self.ema_decay}; 0 turns it off)")
        if self.queue_size < 1 or self.bank_temperature <= 0 or self.bank_weight < 0:
            raise ValueError("--queue-size and --bank-temperature must be positive, --bank-weight not negative")
        if self.teacher != "sface" and not Path(self.teacher).is_file():
            raise FileNotFoundError(f"--teacher {self.teacher}: no such ONNX file (or leave it out for SFace)")
        teacher_spec(self.teacher_spec)
        if self.low_res is not None and not (32 <= self.low_res < INPUT_SIZE and 0 < self.low_res_fraction < 1):
            raise ValueError(f"--low-res must be 32..{INPUT_SIZE - 1} px and --low-res-fraction between 0 and 1 "
                             f"(not {self.low_res} and {self.low_res_fraction})")

    def to_dict(self) -> dict:
        """The saved form (progress, metrics, checkpoints); `protocol.training_parts.flatten` reads it and the flat
        form saved before the parts alike."""
        return asdict(self)


def teacher_spec(fields: dict):
    """The teacher's input spec from its saved fields, checked (`TeacherSpec`); None: SFace's own."""
    from models.networks.teacher import TeacherSpec

    try:
        return TeacherSpec(**fields) if fields else None
    except TypeError as exc:  # a key TeacherSpec does not have (a progress.json from elsewhere)
        raise ValueError(f"the teacher spec has an unknown field: {exc}") from None


class CachedViews:
    """Batches of (student input, teacher target, identity or -1) from the crops held once in memory (uint8).

    Each sample gets a random cached view (the image, its mirror or a fixed jitter: the teacher saw exactly
    that), then
    photometric augmentation on the student's side only, vectorised over the batch (`models.training.online_views`):
    no per-image Python transform and no loader process competing with the step for the CPU's cores."""

    def __init__(self, images: np.ndarray, targets: np.ndarray, labels: np.ndarray, seed: int):
        self.images = images
        self.targets, self.labels, self.seed = targets, torch.from_numpy(labels), seed

    def batch(self, index: np.ndarray, epoch: int, step: int,
              size: int = INPUT_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng((self.seed, epoch, step))
        views = rng.integers(len(self.targets), size=len(index))
        crops = np.empty((len(index), *self.images.shape[1:]), np.uint8)
        for v in np.unique(views):
            chosen = views == v
            crops[chosen] = view(self.images[index[chosen]], int(v), index[chosen])
        crops = torch.from_numpy(crops).permute(0, 3, 1, 2)
        generator = torch.Generator().manual_seed(int(rng.integers(2 ** 62)))
        x = student_input(photometric(crops.float() / 255.0, generator), size)
        target = torch.from_numpy(self.targets[views, index].astype(np.float32))
        return x, target, self.labels[torch.from_numpy(index)]


def identity_labels(roots: list[Path]) -> dict[Path, int]:
    """Image -> identity index for labelled sets (one sub-folder per person; numbered across all sets)."""
    labels: dict[Path, int] = {}
    names: dict[tuple[Path, str], int] = {}
    for root in roots:
        for path in list_images([root]):
            parts = path.relative_to(root).parts
            if len(parts) < 2:
                raise ValueError(f"{root} is given as labelled but {path.name} is not in a per-person folder")
            labels[path] = names.setdefault((root, parts[0]), len(names))
    return labels


def student(init: str, teacher_dim: int) -> FaceEmbedder:
    """The MobileNetV2-128 student: the shipped face weights (`face`), ImageNet's trunk, or random (`none`)."""
    if teacher_dim != 128:
        raise ValueError(f"the teacher's embedding has {teacher_dim} dimensions; the student's has 128")
    if init == "face":
        from models.networks.face_weights import load_face_embedder

        return load_face_embedder()
    return FaceEmbedder(128, 1.0, pretrained=init == "imagenet")


def init_source(init: str) -> dict:
    """What the student started from, for the run's metrics: with `face`, the weights file ($FFR_FACE_WEIGHTS or the
    shipped one) and its sha256, so that a run that goes on from another run's result says which."""
    if init != "face":
        return {"init": init}
    from models.networks.face_weights import file_sha256, shipped_weights

    path = shipped_weights()
    return {"init": init, "init_file": path.name, "init_sha256": file_sha256(path)}


def lr_at_fraction(step: int, spent: float, base: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 1% of the base rate over the fraction `spent`
    of the run (of its steps, or of its time budget: Li et al., "Budgeted training", ICLR 2020)."""
    if step < warmup:
        return base * (step + 1) / warmup
    return base * (0.01 + 0.99 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, spent))))


def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    """`lr_at_fraction` over a run of `total` steps."""
    return lr_at_fraction(step, max(0, step - warmup) / max(1, total - warmup), base, warmup)


def scheduled_lr(config, step: int, total_steps: int | None, trained_s: float) -> float:
    """A distillation run's rate at `step` (cached or online: both configs have lr, warmup_steps and
    budget_minutes): over its time budget when it has one, else over its steps."""
    if config.budget_minutes:
        return lr_at_fraction(step, trained_s / (60 * config.budget_minutes), config.optimisation.lr,
                              config.warmup_steps)
    return lr_at(step, total_steps, config.optimisation.lr, config.warmup_steps)


def scheduled_size(config, step: int, total_steps: int | None, trained_s: float) -> int:
    """The student's input side at `step`: `low_res` px for the first `low_res_fraction` of the schedule, then
    the deployed size (progressive resizing, as in FixRes: Touvron et al., NeurIPS 2019: a network trained on
    smaller images adapts to the larger test size in a short final phase at that size). A step at 96 px costs
    about half one at 128 px (`bench/results/distill_arms.md`)."""
    if not config.low_res:
        return INPUT_SIZE
    spent = trained_s / (60 * config.budget_minutes) if config.budget_minutes else step / max(1, total_steps)
    return config.low_res if spent < config.low_res_fraction else INPUT_SIZE


def schedule_done(config, step: int, total_steps: int | None, trained_s: float) -> bool:
    """Whether the run's budget of training time, or else its steps, is spent."""
    if config.budget_minutes:
        return trained_s >= 60 * config.budget_minutes
    return step >= total_steps


class Pretrainer:
    def __init__(self, config: PretrainConfig, out: Path, cache_root: Path | None = None, *,
                 threads: int | None = None, progress: bool = True):
        """`threads` (torch and the teacher; default torch's) and `progress` (bars) are how this machine runs the
        spec, not part of it: a run resumed with other values is the same run."""
        from models.networks.teacher import load_teacher
        from models.training.fast_step import checked_device

        if config.mirrored_teacher or config.rank_weight or config.ema_decay:  # built for the online path only
            raise ValueError("--mirrored-teacher, --rank-weight and --ema-decay need --online")
        self.config, self.out, self.threads, self.progress = config, Path(out), threads, progress
        self.device = checked_device(config.device)
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(config.seed)
        files = list_images([Path(d) for d in config.data])
        identities = identity_labels([Path(d) for d in config.labelled])
        files += sorted(identities)
        if config.max_images:
            files = [files[i] for i in np.random.default_rng(config.seed).permutation(len(files))[:config.max_images]]
            files.sort()
        self.images, self.files, self.unreadable = load_crops(files, CROP_SIZE, threads or 2, progress)
        self.labels = np.array([identities.get(f, -1) for f in self.files], dtype=np.int64)
        self.n_identities = int(self.labels.max()) + 1 if (self.labels >= 0).any() else 0
        if len(self.files) < 2 * config.optimisation.batch_size:
            raise ValueError(f"pretraining needs at least {2 * config.optimisation.batch_size} readable face images; "
                             f"found {len(self.files)}")
        spec = teacher_spec(config.teacher_spec)
        self.teacher = load_teacher(config.teacher, threads=threads, spec=spec)
        if config.loss not in LOSSES or config.views < 2:
            raise ValueError(f"--loss must be one of {', '.join(LOSSES)} and --views at least 2")

        root = targets_dir(cache_root or default_cache_root(), self.teacher.sha256, self.files, config.views)
        self.targets = TeacherTargets.open(root, len(self.files), self.teacher.dim, views=config.views,
                                           meta={"teacher_sha256": self.teacher.sha256, "size": CROP_SIZE,
                                                 **({"teacher_spec": config.teacher_spec} if config.teacher_spec
                                                    else {})})
        order = np.random.default_rng(config.seed).permutation(len(self.files))
        n_val = max(config.optimisation.batch_size, int(len(order) * config.val_fraction))
        self.val_index, self.train_index = np.sort(order[:n_val]), np.sort(order[n_val:])
        self.model = student(self.config.init, self.teacher.dim).to(self.device)
        self.start = init_source(self.config.init)
        self.autocast = accelerate(self.model, config.optimisation.precision, config.device)
        from models.networks.heads import CosFaceHead

        self.head = CosFaceHead(128, self.n_identities).to(self.device) if self.n_identities else None
        params = list(self.model.parameters()) + (list(self.head.parameters()) if self.head is not None else [])
        self.optimiser = torch.optim.AdamW(params, lr=config.optimisation.lr,
                                           weight_decay=config.optimisation.weight_decay,
                                           **optimiser_options(config.device))
        self.steps_per_epoch = len(self.train_index) // config.optimisation.batch_size
        self.total_steps = self.steps_per_epoch * config.optimisation.epochs
        self.step, self.trained_s, self.history, self.teacher_embeddings_computed = 0, 0.0, [], 0
        self.teacher_embeddings_reused = 0  # copied from the cache of the same data with another --views
        self.eval_sets = [self._eval_set(Path(d)) for d in config.eval_data]
        self.yielder = Yielder(config.yield_cpu, notify=tqdm.write)

    def _eval_set(self, root: Path):
        """A labelled set of aligned crops for the learning curve (people the student never sees)."""
        from models.faces.crops import CropConfig, crop_index
        from models.faces.datasets import load_index

        crops = crop_index(load_index(root), CropConfig(detector="none"), progress=False, min_images=2)
        return root.name, crops

    # --- training -------------------------------------------------------------------------------------------

    def fill_targets(self) -> None:
        if not self.targets.complete:
            self.teacher_embeddings_reused += self.targets.reuse_siblings()
        self.teacher_embeddings_computed += self.targets.fill(self.teacher, self.images, progress=self.progress,
                                                             between=self.yielder)
        if self.config.loss == "bank":  # every cached view of the training images (never the held-out ones)
            bank = torch.from_numpy(self.targets.values[:, self.train_index].reshape(-1, self.teacher.dim))
            self.bank = F.normalize(bank.float(), dim=1).to(self.device)

    def done(self) -> bool:
        return schedule_done(self.config, self.step, self.total_steps, self.trained_s)

    def fit(self) -> dict:
        self.fill_targets()
        data = CachedViews(self.images, self.targets.values, self.labels, self.config.seed)
        self._last_save, start = time.time(), time.time()
        bar = tqdm(total=self.total_steps, initial=self.step, desc="distilling", unit="step",
                   disable=bar_disable(self.progress), dynamic_ncols=True)
        try:
            while not self.done():
                epoch, skip = divmod(self.step, self.steps_per_epoch)
                means = optimise(self._timed(data, epoch, skip), self._loss, self.optimiser, before=[self._set_lr],
                                 after=[lambda step: self._after_step(step, epoch, bar)],
                                 finite=lambda: f"distillation loss at step {self.step}")
                if self.step % self.steps_per_epoch == 0 or self.done():
                    self._end_epoch(epoch + 1, time.time() - start, means.result())
        finally:
            bar.close()
            self.save()
        return self.write_metrics("finished")

    def _timed(self, data: CachedViews, epoch: int, skip: int):
        """The epoch's batches from `skip` on; the clock for the time budget starts as each batch is read (after
        any pause for the tests or a benchmark)."""
        for step_index in self._epoch_batches(epoch, skip):
            self.yielder()
            self._tick = time.time()
            yield data.batch(step_index, epoch, self.step,
                             scheduled_size(self.config, self.step, self.total_steps, self.trained_s))

    def _after_step(self, step: Step, epoch: int, bar) -> bool:
        """Count, time, show and (every `checkpoint_every_s`) save the step; True once the run is done."""
        self.step += 1
        self.trained_s += time.time() - self._tick
        bar.update(1)
        bar.set_postfix(epoch=epoch + 1, **{k.removesuffix("_loss"): f"{v:.4f}" for k, v in step.metrics.items()})
        if time.time() - self._last_save > self.config.checkpoint_every_s:
            self.save()
            self._last_save = time.time()
        return self.done()

    def _epoch_batches(self, epoch: int, skip: int):
        """The epoch's shuffled training indices, one batch at a time, from batch `skip` on (for --resume)."""
        order = self.train_index[np.random.default_rng((self.config.seed, epoch)).permutation(len(self.train_index))]
        size = self.config.optimisation.batch_size
        for k in range(skip, self.steps_per_epoch):
            yield np.sort(order[k * size:(k + 1) * size])

    def _set_lr(self) -> None:
        for group in self.optimiser.param_groups:
            group["lr"] = scheduled_lr(self.config, self.step, self.total_steps, self.trained_s)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Step:
        """The distillation loss of a batch of cached views against the teacher's targets [+ the margin term]."""
        x, target, labels = batch
        self.model.train()
        x = x.to(self.device)
        target = F.normalize(target.to(self.device), dim=1)
        student = self.model(x)  # the trunk in bf16 where the hardware has it (models.training.fast_step)
        if self.config.loss == "bank":
            loss, parts = bank_distillation_loss(student.float(), target, self.bank, self.config.bank_weight,
                                                 self.config.bank_temperature)
        else:
            loss, parts = distillation_loss(student.float(), target, self.config.sim_weight)
        if self.head is not None:
            y = labels.to(self.device) if labels is not None else None
            known = y >= 0 if y is not None else None
            margin = (F.cross_entropy(self.head(student.float()[known], y[known]), y[known])
                      if known is not None and known.any() else student.new_zeros((), dtype=torch.float32))
            loss = loss + self.config.margin_weight * margin
            parts["margin_loss"] = float(margin.detach())
        return Step(loss, 1.0, parts)

    def _end_epoch(self, epoch: int, elapsed: float, running: dict[str, float]) -> None:
        """One learning-curve row: the epoch's mean training figures (this process's steps), then evaluation."""
        row = {"epoch": epoch, "step": self.step, "samples": self.step * self.config.optimisation.batch_size,
               "elapsed_s": round(elapsed, 1), "trained_s": round(self.trained_s, 1),
               **{f"train_{k}": round(v, 5) for k, v in running.items()},
               **self.evaluate()}
        self.history.append(row)
        self.save()
        self.write_metrics("running")
        tqdm.write(json.dumps(row))

    # --- evaluation -----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def embed(self, crops: np.ndarray, batch_size: int = 128) -> np.ndarray:
        from models.faces.preprocess import to_input

        self.model.eval()
        out = []
        for i in range(0, len(crops), batch_size):
            x = torch.from_numpy(to_input(crops[i:i + batch_size], INPUT_SIZE)).to(self.device)
            out.append(self.model(x).float().cpu().numpy())
        return np.concatenate(out)

    def evaluate(self) -> dict:
        """Agreement with the teacher on held-out unlabelled images, and verification on each eval set."""
        from models.evaluation.metrics import verification_report

        student = self.embed(self.images[self.val_index])
        teacher = self.targets.values[0, self.val_index].astype(np.float32)
        teacher /= np.linalg.norm(teacher, axis=1, keepdims=True)
        result = {"val_teacher_cosine": round(float((student * teacher).sum(1).mean()), 5)}
        for name, crops in self.eval_sets:
            report = verification_report(self.embed(crops.images), crops.labels)
            result[f"{name}_auc"] = round(report["auc"], 5)
            result[f"{name}_eer"] = round(report["eer"], 5)
        return result

    # --- state ----------------------------------------------------------------------------------------------

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        state = {"model": self.model.state_dict(), "optimiser": self.optimiser.state_dict(), "step": self.step,
                 "trained_s": self.trained_s,
                 "head": self.head.state_dict() if self.head is not None else None,
                 "history": self.history, "config": self.config.to_dict(), "files_key": self.targets.root.name}
        tmp = self.out / "latest.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.out / "latest.pt")
        save_embedder(self.out / "embedder.safetensors", self.model,
                      {"teacher": self.config.teacher, "teacher_sha256": self.teacher.sha256, "step": str(self.step),
                       "samples": str(self.step * self.config.optimisation.batch_size),
                       "data": json.dumps(self.config.data)})

    def resume(self) -> None:
        """Continue from latest.pt; a damaged or foreign file is refused in one line (`resume_from`)."""
        resume_from(self.out / "latest.pt", self._restore, "ffr pretrain", self.device)

    def _restore(self, state: dict) -> None:
        if state["files_key"] != self.targets.root.name:
            raise ValueError(f"{self.out} was trained on other data or another teacher; use a new --out")
        saved, now = flatten(state["config"]), flatten(self.config.to_dict())  # either saved form
        defaults = flatten(PretrainConfig(data=[]).to_dict())  # a run saved before an option existed ran its default
        for key in ("batch_size", "epochs", "teacher", "data", "labelled", "loss", "views", "budget_minutes",
                    "low_res", "low_res_fraction"):
            there = saved.get(key, defaults[key])
            if there != now[key]:
                raise ValueError(f"--{key.replace('_', '-')} differs from the run being resumed "
                                 f"({there!r} there, {now[key]!r} now)")
        self.model.load_state_dict(state["model"])
        if self.head is not None and state.get("head") is not None:
            self.head.load_state_dict(state["head"])
        self.optimiser.load_state_dict(state["optimiser"])
        self.step, self.history = int(state["step"]), list(state["history"])
        self.trained_s = float(state.get("trained_s", 0.0))

    def write_metrics(self, status: str) -> dict:
        metrics = {"status": status, "step": self.step, "total_steps": self.total_steps,
                   "samples": self.step * self.config.optimisation.batch_size, "images": len(self.files),
                   "trained_s": round(self.trained_s, 1),
                   "teacher_embeddings_computed": self.teacher_embeddings_computed,
                   "teacher_embeddings_reused": self.teacher_embeddings_reused,
                   "unreadable": [str(p) for p in self.unreadable], "teacher": self.config.teacher,
                   "teacher_sha256": self.teacher.sha256, "precision": str(self.autocast or "fp32"),
                   "start": self.start, "config": self.config.to_dict(), "history": self.history}
        tmp = self.out / "metrics.json.tmp"
        tmp.write_text(json.dumps(metrics, indent=2))
        tmp.replace(self.out / "metrics.json")
        return metrics
