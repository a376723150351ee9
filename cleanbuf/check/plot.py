"""The picture of ``cleanbuf check --plot FILE.png``: env 0's rows as stored, against the truth.

One panel per run, the truth on top, sharing the row axis (rows as the
producer stored them; at most 400, around the truth's first episode end):
the first observation component of each row (a line), each episode end (a
dotted line) with the next observation the row stored there (green: the
true terminal one, as in the truth; gray: zeros; orange: the next
episode's first observation; black on the axis: NaN), and each bogus
reset row (a red band). A run that matches the truth shows the truth's
picture, shifted by nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _kind(stored: float, truth_terminal: float | None) -> str:
    if np.isnan(stored):
        return "nan"
    if truth_terminal is not None and stored == truth_terminal:
        return "true"
    return "zero" if stored == 0 else "other"


_STYLE = {
    "true": ("tab:green", "o", "terminal obs as in the truth"),
    "zero": ("tab:gray", "x", "terminal obs zero-filled"),
    "other": ("tab:orange", "s", "terminal obs = next episode's first"),
    "nan": ("black", "v", "terminal obs NaN"),
}


def _panel(ax: Any, name: str, timeline: dict, seen: set) -> None:
    n = len(timeline["obs"])
    x = np.arange(n)
    ax.plot(x, timeline["obs"], color="tab:blue", lw=0.9)
    for t in np.flatnonzero(~timeline["real"]):
        label = None if "reset" in seen else "bogus reset row"
        seen.add("reset")
        ax.axvspan(t - 0.5, t + 0.5, color="tab:red", alpha=0.35, label=label)
    ends = np.flatnonzero(timeline["done"] & timeline["real"])
    for i, t in enumerate(ends):
        ax.axvline(t, color="0.6", ls=":", lw=0.8)
        stored = float(timeline["next"][t])
        terms = timeline["terminals"]
        kind = _kind(stored, terms[i] if i < len(terms) else None)
        color, marker, label = _STYLE[kind]
        y = 0.0 if kind == "nan" else stored
        ax.plot(
            [t + 0.5], [y], marker=marker, color=color, ls="", label=None if kind in seen else label
        )
        seen.add(kind)
    ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
    ax.tick_params(labelsize=7)


def _window(truth: dict, width: int = 400) -> tuple[float, float]:
    """At most ``width`` rows, the truth's first episode end among them (long horizons)."""
    n = len(truth["obs"])
    ends = np.flatnonzero(truth["done"])
    start = 0 if not len(ends) else max(0, min(int(ends[0]) - width // 2, n - width))
    return start - 1, min(n, start + width)


def figure(report: Any):
    """The picture as a matplotlib figure (needs matplotlib)."""
    try:
        import matplotlib
    except ImportError as err:
        from cleanbuf.engine._errors import CleanbufError

        raise CleanbufError("--plot needs matplotlib (pip install matplotlib).") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report.timelines)
    fig, axes = plt.subplots(
        len(names), 1, figsize=(11, 1.3 * len(names) + 1.0), sharex=True, squeeze=False
    )
    seen: set = set()
    for ax, name in zip(axes[:, 0], names):
        _panel(ax, name, report.timelines[name], seen)
    axes[-1, 0].set_xlim(*_window(report.timelines["truth"]))
    axes[-1, 0].set_xlabel("env 0's rows as stored; line: observation[0]")
    title = f"cleanbuf check {report.env}: env 0 as stored, against the truth (top)"
    fig.suptitle(title, fontsize=10)
    # The legend below the panels, the title above them: neither covers the other.
    bottom = 0.0
    if seen:
        legend = fig.legend(loc="lower center", ncols=5, fontsize=8, bbox_to_anchor=(0.5, 0.0))
        fig.canvas.draw()
        box = legend.get_window_extent().transformed(fig.transFigure.inverted())
        bottom = box.y1 + 0.005
    fig.tight_layout(rect=(0, bottom, 1, 1))
    return fig
