"""PNG plots people look at: ROC curves and training curves (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.metrics import roc_curve  # noqa: E402

SYNTHETIC_NOTE = "SYNTHETIC faces (no real people): these figures show the pipeline works, not real-world accuracy"


def save_png(fig, out: Path, synthetic: bool = False, dpi: int = 150) -> Path:
    """Lay out and write a figure; one drawn from SYNTHETIC faces says so on its face and in its PNG metadata."""
    if synthetic:
        fig.text(0.5, 0.995, SYNTHETIC_NOTE, ha="center", va="top", fontsize=8, color="tab:red", weight="bold")
    fig.tight_layout(rect=(0, 0, 1, 0.97) if synthetic else (0, 0, 1, 1))
    fig.savefig(out, dpi=dpi, metadata={"Description": SYNTHETIC_NOTE if synthetic else "ffr-edge"})
    plt.close(fig)
    return out


def tick_labels(names: list[str], width: int = 12) -> list[str]:
    """Short labels that stay distinct: a prefix shared by every name ("synthetic_00") is dropped before cutting,
    and a name still too long keeps its end (where numbered names differ)."""
    if all(len(n) <= width for n in names):
        return list(names)
    import os

    common = os.path.commonprefix(list(names)) if len(names) > 1 else ""
    short = [("…" + n[len(common):]) if common else n for n in names]
    short = [s if len(s) <= width else "…" + s[-(width - 1):] for s in short]
    return short if len(set(short)) == len(short) else [f"#{i} {s}" for i, s in enumerate(short)]


def roc_png(curves: dict[str, tuple[np.ndarray, np.ndarray]], out: Path, title: str = "ROC",
            synthetic: bool = False) -> Path:
    """One ROC per (scores, same) entry, log-scaled FAR axis so 1e-3 is readable."""
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    for name, (scores, same) in curves.items():
        fpr, tpr, _ = roc_curve(same, scores)
        ax.plot(np.maximum(fpr, 1e-5), tpr, label=name)
    ax.set_xscale("log")
    ax.set_xlim(1e-4, 1)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel("false accept rate")
    ax.set_ylabel("true accept rate")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    return save_png(fig, out, synthetic)


def training_curves_png(history: list[dict], out: Path, best_epoch: int | None = None,
                        synthetic: bool = False) -> Path:
    """Loss, accuracy, AUC and EER per epoch, the best epoch marked."""
    epochs = [h["epoch"] for h in history]
    panels = [("loss", ("train_loss", "val_loss")), ("accuracy", ("train_acc", "val_acc")),
              ("AUC", ("val_auc",)), ("EER", ("val_eer",))]
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5))
    for ax, (title, keys) in zip(axes.flat, panels):
        for key in keys:
            values = [h.get(key) for h in history]
            if any(v is not None for v in values):
                ax.plot(epochs, [np.nan if v is None else v for v in values], marker="o", ms=3, label=key)
        if best_epoch is not None:
            ax.axvline(best_epoch, color="grey", ls="--", lw=1, label="best")
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return save_png(fig, out, synthetic)
