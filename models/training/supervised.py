"""Centralised training: the upper bound every federated run is compared against.

Design defaults: 20 epochs, batch 32, Adam at 1e-4, early stopping after 10 epochs without
a better validation loss, weak augmentation. Starting from the shipped face weights, every step
also pays an anchor: C * mean(1 - cos(f(x), f_0(x))) to the starting embedder f_0 (HF-MAML's
eq. 4 regulariser, as in Li and Hoiem's "Learning without Forgetting", TPAMI 2018), so a few
dozen people teach the model their faces without making it forget everyone else's (the
README gives what it is worth). Each epoch writes `latest.pt` (enough to
resume exactly) and, when validation loss improves, `best.pt`; `metrics.json` is rewritten
every epoch so an interrupted run still says where it got to. From a trained start with selection people
(`TrainingSplit.select`), the run ends by moving best.pt's backbone only as far from the start as pays on
those people (WiSE-FT, models.training.interpolation).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from models.evaluation.evaluate import verification
from models.faces import augment
from models.faces.crops import FaceCrops
from models.faces.splits import TrainingSplit
from models.networks.face_model import FaceModel, ModelConfig, load_checkpoint, save_checkpoint
from models.networks.heads import imprint, inverse_frequency_weights
from models.training.crop_batches import CropDataset, frozen_copy, frozen_features, train_loader
from models.training.fast_step import accelerate, optimiser_options
from models.training.hfmaml import anchored_to
from models.training.interpolation import choose_alpha, interpolate
from models.training.loop import resume_from, train_epoch
from models.training.tracking import NullTracker, Tracker
from protocol.training_parts import TrainerSettings, flatten, nest

# design defaults: 20 epochs, batch 32, Adam at 1e-4, no weight decay
TRAINER_DEFAULTS = {"epochs": 20, "batch_size": 32, "lr": 1e-4}


@dataclass
class TrainConfig:
    """`ffr train`'s settings: the optimiser and model parts every configuration shares (`protocol.training_parts`),
    then what only centralised training has. Saved forms: `to_dict`, read back by `from_dict` (also the flat form
    written before the parts)."""

    optimisation: TrainerSettings = field(default_factory=lambda: TrainerSettings(**TRAINER_DEFAULTS))
    model: ModelConfig = field(default_factory=ModelConfig)  # the classes come from the data (build_model)
    patience: int = 10
    aug: str = "weak"
    class_weighted: bool = False
    anchor_weight: float | None = None  # C of the anchor to the starting embedder; None: 10 from face weights, else 0
    seed: int = 0
    max_eval_pairs: int = 100_000
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """Settings that cannot work are refused here (the parts check their own), named as `ffr train` spells them."""
        checks = [(self.patience >= 0, f"--patience must not be negative (got {self.patience})"),
                  (self.max_eval_pairs >= 1, f"--max-eval-pairs must be at least 1 (got {self.max_eval_pairs})")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.anchor_weight is None:
            self.anchor_weight = FACE_ANCHOR_WEIGHT if self.model.init == "face" else 0.0
        if not self.anchor_weight >= 0:  # also refuses nan
            raise ValueError(f"anchor_weight must be >= 0, not {self.anchor_weight}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> TrainConfig:
        """From `to_dict`'s form, or the flat one a run or checkpoint saved before the parts."""
        raw = nest(raw, {"optimisation": (TrainerSettings, TRAINER_DEFAULTS), "model": (ModelConfig, {})})
        return cls(**{**raw, "optimisation": TrainerSettings(**raw.get("optimisation", TRAINER_DEFAULTS)),
                      "model": ModelConfig.from_dict(raw.get("model", {}))})


# chosen by a sweep of `bench.verify_quality --anchor-weight C`: the figures are in the README
# ("Fine-tuning keeps what the face weights know")
FACE_ANCHOR_WEIGHT = 10.0


def build_model(config: TrainConfig, train: FaceCrops) -> FaceModel:
    n_classes = len(train.identities)
    weights = None
    if config.class_weighted:
        weights = inverse_frequency_weights(torch.from_numpy(train.labels), n_classes).tolist()
    return FaceModel(config.model.with_classes(n_classes, weights))


@torch.inference_mode()
def validation_loss(model: FaceModel, crops: FaceCrops, batch_size: int = 128) -> dict:
    if len(crops) == 0:
        return {}
    model.eval()
    data = CropDataset(crops.images, crops.labels, augment.plain())
    loss_sum, correct = 0.0, 0
    for x, y in DataLoader(data, batch_size=batch_size):
        loss, logits, _ = model.losses(x, y)
        loss_sum += float(loss) * len(y)
        correct += int((logits.argmax(1) == y).sum())
    return {"val_loss": loss_sum / len(crops), "val_acc": correct / len(crops)}


class Trainer:
    """Runs epochs, checkpoints, early-stops and tracks; resumable from `latest.pt`."""

    def __init__(self, config: TrainConfig, split: TrainingSplit, out_dir: Path, tracker: Tracker | None = None,
                 progress: bool = True):
        self.config, self.split, self.out, self.progress = config, split, Path(out_dir), progress
        self.tracker = tracker or NullTracker()
        self.out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(config.seed)
        self.model = build_model(config, split.train)
        self.precision = accelerate(self.model, config.optimisation.precision)
        if config.model.imprint_head and config.model.init != "none":
            self._imprint()
        # taken before any step (and before a resume loads later weights): the model training started from
        self.start_net = frozen_copy(self.model.backbone) if config.anchor_weight > 0 else None
        # with selection people and a trained start, the run ends by choosing how far to move from it (_interpolate)
        # (the anchor's frozen copy already holds those weights: one copy of the start, not two)
        self.start_state = None
        if split.select is not None and config.model.init != "none":
            self.start_state = (self.start_net.state_dict() if self.start_net is not None else
                                {k: v.detach().clone() for k, v in self.model.backbone.state_dict().items()})
        self.interpolation: dict | None = None
        self.optimiser = torch.optim.Adam(self.model.parameters(), lr=config.optimisation.lr,
                                          weight_decay=config.optimisation.weight_decay,
                                          **optimiser_options("cpu"))
        self.generator = torch.Generator().manual_seed(config.seed)
        self.history: list[dict] = []
        self.best_loss, self.best_epoch, self.bad_epochs, self.start_epoch = float("inf"), None, 0, 1
        self.status = "running"
        self.tracker_run_id: str | None = None

    def _imprint(self) -> None:
        """A pretrained embedding starts with its classifier where its features are, not at random."""
        features = frozen_features(self.model.backbone, self.split.train.images, seed=self.config.seed)
        imprint(self.model.head, features, torch.from_numpy(self.split.train.labels))

    @property
    def eval_crops(self) -> FaceCrops:
        """Verification is measured on unseen identities when there are any, else on validation images."""
        return self.split.holdout if self.split.holdout is not None else self.split.val

    def resume(self) -> None:
        """Continue from latest.pt; a damaged or foreign file is refused in one line (`resume_from`)."""
        resume_from(self.out / "latest.pt", self._restore, "ffr train")

    def _restore(self, payload: dict) -> None:
        if payload["identities"] != self.split.train.identities:
            raise ValueError("the data differs from the run being resumed (other identities); use a new --out")
        self.model.load_state_dict(payload["model_state"])
        self.optimiser.load_state_dict(payload["optimiser_state"])
        self.generator.set_state(payload["generator_state"])
        torch.set_rng_state(payload["torch_rng_state"])
        self.history = payload["history"]
        self.best_loss, self.best_epoch = payload["best_loss"], payload["best_epoch"]
        self.bad_epochs, self.start_epoch = payload["bad_epochs"], payload["epoch"] + 1
        self.tracker_run_id = payload.get("tracker_run_id")

    def _checkpoint(self, name: str, epoch: int) -> None:
        save_checkpoint(self.out / name, self.model, epoch=epoch, optimiser_state=self.optimiser.state_dict(),
                        generator_state=self.generator.get_state(), torch_rng_state=torch.get_rng_state(),
                        history=self.history, best_loss=self.best_loss, best_epoch=self.best_epoch,
                        bad_epochs=self.bad_epochs, identities=self.split.train.identities,
                        train_config=self.config.to_dict(), tracker_run_id=self.tracker.run_id)

    def fit(self) -> dict:
        cfg = self.config
        self.tracker.start(self.out.name, flatten(cfg.to_dict()), self.tracker_run_id)
        loader = train_loader(self.split.train, cfg.optimisation.batch_size, cfg.aug, self.generator)
        try:
            for epoch in range(self.start_epoch, cfg.optimisation.epochs + 1):
                if self.bad_epochs >= cfg.patience:
                    self.status = "early_stopped"
                    break
                self._run_epoch(epoch, loader)
            else:
                self.status = "completed" if self.bad_epochs < cfg.patience else "early_stopped"
        except KeyboardInterrupt:
            self.status = "interrupted"
            self._write_metrics()
            self.tracker.end("KILLED")
            raise
        return self._finish()

    def _run_epoch(self, epoch: int, loader: DataLoader) -> None:
        cfg = self.config
        started = time.perf_counter()
        anchor = anchored_to(self.start_net, cfg.anchor_weight) if self.start_net is not None else None
        row = {"epoch": epoch, **train_epoch(self.model, loader, self.optimiser,
                                             f"epoch {epoch}/{cfg.optimisation.epochs}", self.progress, extra=anchor)}
        row["train_seconds"] = time.perf_counter() - started
        row.update(validation_loss(self.model, self.split.val))
        report, _ = verification(self.model, self.eval_crops, cfg.max_eval_pairs, cfg.seed)
        row.update({f"val_{k}": report[k] for k in ("auc", "eer") if k in report})
        monitored = row.get("val_loss", row["train_loss"])
        if monitored < self.best_loss:
            self.best_loss, self.best_epoch, self.bad_epochs = monitored, epoch, 0
        else:
            self.bad_epochs += 1
        self.history.append(row)
        self._checkpoint("latest.pt", epoch)
        if self.best_epoch == epoch:
            self._checkpoint("best.pt", epoch)
        self.tracker.log_metrics(row, epoch)
        self._write_metrics()
        if self.progress:
            shown = " ".join(f"{k}={v:.4f}" for k, v in row.items() if k != "epoch" and isinstance(v, float))
            tqdm.write(f"epoch {epoch}: {shown}")

    def _interpolate(self, best: FaceModel, payload: dict) -> FaceModel:
        """WiSE-FT's alpha (models.training.interpolation) by verification AUC on the selection people, written
        into best.pt: what the run hands on is never worse than its start on those people, who were never trained
        on. Only the backbone moves; the margin head and the DFC branch stay as trained (DFC works on the backbone's
        embedding, so it goes on personalising the chosen one)."""
        if "interpolation" in payload:  # already chosen (a finished run resumed): best.pt holds the result
            record = payload["interpolation"]
            if not (isinstance(record, dict) and isinstance(record.get("alpha"), float) and 0 <= record["alpha"] <= 1):
                raise ValueError(f"{self.out / 'best.pt'}: its interpolation record is damaged; use a new --out")
            self.interpolation = record
            return best
        tuned = {k: v.clone() for k, v in best.backbone.state_dict().items()}

        def score(alpha: float) -> float | None:
            best.backbone.load_state_dict(interpolate(self.start_state, tuned, alpha))
            report, _ = verification(best, self.split.select, self.config.max_eval_pairs, self.config.seed)
            return report.get("auc")

        alpha, scores = choose_alpha(score)
        best.backbone.load_state_dict(interpolate(self.start_state, tuned, alpha))
        self.interpolation = {"alpha": alpha, "select_auc": {str(a): v for a, v in scores.items()},
                              "select_identities": len(self.split.select.identities)}
        kept = {k: v for k, v in payload.items() if k not in ("model_config", "model_state")}
        save_checkpoint(self.out / "best.pt", best, **{**kept, "interpolation": self.interpolation})
        return best

    def _finish(self) -> dict:
        best, payload = load_checkpoint(self.out / "best.pt")
        if self.start_state is not None:
            best = self._interpolate(best, payload)
        report, curve = verification(best, self.eval_crops, self.config.max_eval_pairs, self.config.seed)
        if curve is not None:
            from models.evaluation.plots import roc_png

            roc_png({f"best (epoch {self.best_epoch})": curve}, self.out / "roc.png",
                    synthetic=self.eval_crops.synthetic)
        metrics = self._write_metrics(final=report)
        from models.evaluation.plots import training_curves_png

        self.tracker.log_artifact(training_curves_png(self.history, self.out / "curves.png", self.best_epoch,
                                                      synthetic=self.eval_crops.synthetic))
        if curve is not None:
            self.tracker.log_artifact(self.out / "roc.png")
        self.tracker.log_metrics({f"final_{k}": v for k, v in report.items()}, self.history[-1]["epoch"])
        self.tracker.log_artifact(self.out / "metrics.json")
        self.tracker.end()
        return metrics

    def _write_metrics(self, final: dict | None = None) -> dict:
        split = self.split
        metrics = {
            "status": self.status,
            "data_kind": "synthetic" if split.train.synthetic else "real",
            "config": self.config.to_dict(),
            "data": {"train_images": len(split.train), "val_images": len(split.val),
                     "train_identities": len(split.train.identities),
                     "holdout_identities": len(split.holdout.identities) if split.holdout else 0,
                     "holdout_images": len(split.holdout) if split.holdout else 0,
                     "select_identities": len(split.select.identities) if split.select else 0,
                     "crops": split.train.report.summary()},
            "evaluated_on": "held-out identities" if split.holdout is not None else "validation images",
            "best_epoch": self.best_epoch,
            "best_val_loss": None if self.best_epoch is None else self.best_loss,
            "interpolation": self.interpolation,
            "epochs_run": len(self.history),
            "history": self.history,
            "tracking_run_id": self.tracker.run_id,
        }
        if final is not None:
            metrics["final"] = final
        (self.out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        return metrics
