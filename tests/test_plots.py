"""The pictures people read: labels that tell people apart, legends that hide nothing, SYNTHETIC marked."""
from __future__ import annotations

import numpy as np
from PIL import Image

from fleet.plots import client_bars_figure, confusion_png
from models.evaluation.plots import SYNTHETIC_NOTE, plt, save_png, tick_labels


def test_numbered_names_keep_distinct_short_labels():
    names = [f"synthetic_{i:04d}" for i in range(20)]
    labels = tick_labels(names)
    assert len(set(labels)) == 20 and all(len(label) <= 12 for label in labels)
    assert labels[7].endswith("07")
    assert tick_labels(["ann", "bob"]) == ["ann", "bob"]
    long = ["a_very_long_person_name_one", "a_very_long_person_name_two"]
    assert len(set(tick_labels(long))) == 2


def test_the_confusion_plot_uses_them(tmp_path, monkeypatch):
    seen = []
    original = plt.Axes.set_xticks
    monkeypatch.setattr(plt.Axes, "set_xticks", lambda self, ticks, labels=None, **kw: (
        seen.append(labels), original(self, ticks, labels, **kw))[1])
    names = [f"synthetic_{i:04d}" for i in range(6)]
    confusion_png(np.eye(6), names, 1.0, tmp_path / "c.png")
    assert seen and len(set(seen[0])) == 6


def test_the_client_legend_covers_no_bar():
    rows = [{"client": k, "held_out": False, "global": {"tar@1e-2": 0.95}, "local": {"tar@1e-2": 0.97},
             "local+dfc": {"tar@1e-2": 0.99}} for k in range(3)]
    fig = client_bars_figure(rows, ["global", "local", "local+dfc"])
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    bars = [patch.get_window_extent() for patch in ax.patches]
    assert bars and not any(legend.overlaps(bar) for bar in bars)
    plt.close(fig)


def test_synthetic_figures_say_so(tmp_path):
    fig, _ = plt.subplots()
    save_png(fig, tmp_path / "s.png", synthetic=True)
    fig, _ = plt.subplots()
    save_png(fig, tmp_path / "r.png")
    assert Image.open(tmp_path / "s.png").text["Description"] == SYNTHETIC_NOTE
    assert "SYNTHETIC" not in Image.open(tmp_path / "r.png").text.get("Description", "")
