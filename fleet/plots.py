"""The simulation's pictures (PNG, 150 dpi): rounds, client bars, confusion matrix, partition."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from models.evaluation.plots import plt, save_png, tick_labels


def rounds_png(history: list[dict], best_round: int | None, centralized: dict | None, out: Path,
               synthetic: bool = False) -> Path:
    """Loss and accuracy of local training; AUC and TAR@1e-3 of the global model on unseen people per round, with
    their bootstrap intervals over people and the start's level."""
    rounds = [h["round"] for h in history]
    panels = [("local training loss", ("train_loss",)), ("local training accuracy", ("train_acc",)),
              ("AUC (global model)", ("holdout_auc", "val_auc")), ("TAR@1e-3 (global model)", ("holdout_tar@1e-3",))]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, keys) in zip(axes.flat, panels):
        for key in keys:
            values = [np.nan if h.get(key) is None else h[key] for h in history]
            if not np.all(np.isnan(values)):
                label = "unseen people" if key.startswith("holdout_") else \
                    {"val_auc": "validation"}.get(key, key)
                ax.plot(rounds, values, marker="o", ms=4, label=label)
                if key.startswith("holdout_"):  # the bootstrap interval over people, and the start to beat
                    _interval_band(ax, history, key.removeprefix("holdout_"))
                    ax.axhline(values[0], color="grey", ls=":", lw=1, label="start (round 0)")
        metric = title.split()[0].lower()
        if centralized and metric in ("auc", "tar@1e-3") and centralized.get(metric) is not None:
            ax.axhline(centralized[metric], color="black", ls=":", lw=1.2, label="centralised (unseen people)")
        if best_round is not None:
            ax.axvline(best_round, color="grey", ls="--", lw=1, label=f"best round ({best_round})")
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return save_png(fig, out, synthetic)


def _interval_band(ax, history: list[dict], metric: str) -> None:
    """The 95% interval over people of each round's unseen-people figure, where the round has one."""
    points = [(h["round"], *h["holdout_interval"][metric]) for h in history
              if (h.get("holdout_interval") or {}).get(metric)]
    if points:
        rounds, low, high = zip(*points)
        ax.fill_between(rounds, low, high, alpha=0.15, label="95% interval over people")


def client_bars_png(rows: list[dict], verifiers: list[str], out: Path, metric: str = "tar@1e-2",
                    synthetic: bool = False) -> Path:
    return save_png(client_bars_figure(rows, verifiers, metric), out, synthetic)


def client_bars_figure(rows: list[dict], verifiers: list[str], metric: str = "tar@1e-2"):
    """Per-client bars of `metric` (AUC where the client has too few impostor pairs for it); the legend sits
    beside the axes, never over a bar."""
    usable = [r for r in rows if any(v in r for v in verifiers)]
    if any(r.get(v, {}).get(metric) is None for r in usable for v in verifiers if v in r):
        metric = "auc"
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(usable) * len(verifiers)) + 1.8, 4.5))
    width = 0.8 / max(1, len(verifiers))
    x = np.arange(len(usable))
    for n, name in enumerate(verifiers):
        values = [r.get(name, {}).get(metric) or 0.0 for r in usable]
        ax.bar(x + n * width, values, width, label=name.replace("centralized", "centralised"))  # summary key
    ax.set_xticks(x + width * (len(verifiers) - 1) / 2)
    ax.set_xticklabels([f"{r['client']}{'*' if r['held_out'] else ''}" for r in usable])
    ax.set_xlabel("client (* held out of training)")
    ax.set_ylabel(metric.upper() if metric == "auc" else metric.replace("tar@", "TAR @ FAR "))
    ax.set_ylim(0, 1.02)
    ax.set_title("per-client verification: federated vs personalised")
    ax.grid(True, axis="y", alpha=0.3)
    if usable:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    else:
        ax.text(0.5, 0.5, "no client has enough test images\nfor genuine and impostor pairs", ha="center",
                va="center", transform=ax.transAxes)
    return fig


def confusion_png(matrix: np.ndarray, names: list[str], accuracy: float, out: Path, synthetic: bool = False) -> Path:
    fig, ax = plt.subplots(figsize=(7, 6))
    image = ax.imshow(matrix, cmap="Blues")
    labels = tick_labels(names)
    ax.set_xticks(range(len(names)), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(len(names)), labels, fontsize=7)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(f"1:N identification, unseen people (accuracy {accuracy:.2f})")
    fig.colorbar(image, ax=ax, fraction=0.046)
    return save_png(fig, out, synthetic)


def partition_png(summary: dict, out: Path, synthetic: bool = False) -> Path:
    rows = summary["clients"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key in zip(axes, ("identities", "images")):
        ax.bar([r["client"] for r in rows], [r[key] for r in rows],
               color=["tab:grey" if r["held_out_of_training"] else "tab:blue" for r in rows])
        ax.set_xlabel("client (grey: held out of training)")
        ax.set_ylabel(key)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{summary['scheme']} partition, imbalance ratio {summary['imbalance_ratio']:.1f}")
    return save_png(fig, out, synthetic)
