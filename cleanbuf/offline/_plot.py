"""The audit's picture (``cleanbuf audit --plot FILE.png``): what cleaning changes.

Left, per env (one integer tick each) in write order: where the reset
rows are (red) and the terminal observations lost for good (gray).
Right, side by side for each kind of artifact, how many rows hold it as
stored and once cleaned, with the count on each bar: the reset rows
and the zero-filled or wrong terminal observations go, the restored ones
appear, the lost ones are marked NaN. Data that is clean has equal bars.
"""

from __future__ import annotations

from typing import Any

import numpy as np

KINDS = (
    "reset rows",
    "terminal obs zeros",
    "terminal obs = next first",
    "terminal obs restored",
    "terminal obs NaN (lost)",
)
_LABELS = (  # KINDS, on two lines
    "reset\nrows",
    "terminal obs\nzeros",
    "terminal obs =\nnext first obs",
    "terminal obs\nrestored",
    "terminal obs\nNaN (lost)",
)


def counts(report: Any) -> dict[str, tuple[int, ...]]:
    """Rows of each kind in ``KINDS``, as stored and once cleaned with the audited options.

    Cleaning drops the reset rows, restores the terminal observations the
    reset rows or a final-observation entry hold (``recoverable``,
    ``final_stored``) and marks the others NaN (the default
    ``on_lost_terminal_obs="nan"``).
    """
    return {
        "as stored": (
            report.reset_rows,
            report.next_obs_zero,
            report.next_obs_is_reset,
            0,
            report.next_obs_nan,
        ),
        "cleaned": (0, 0, 0, report.recoverable + report.final_stored, report.lost_for_good),
    }


def figure(report: Any):
    """The picture as a matplotlib figure (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), width_ratios=(1, 1.25))
    for env, (_, done_rows, reset, lost) in enumerate(report.details):
        left.scatter(done_rows[reset], np.full(reset.sum(), env), s=10, c="tab:red")
        left.scatter(done_rows[lost], np.full(lost.sum(), env), s=10, c="tab:gray")
    envs = max(len(report.details), 1)
    if envs <= 16:
        left.set_yticks(range(envs))
    else:
        left.yaxis.set_major_locator(MaxNLocator(integer=True))
    left.set_ylim(-0.5, envs - 0.5)
    left.set(xlabel="row (write order)", ylabel="env", title="reset rows (red), lost (gray)")
    _bars(right, counts(report))
    fig.suptitle(f"cleanbuf audit: {report.source}")
    fig.tight_layout()
    return fig


def _bars(ax, by_view: dict) -> None:
    """Grouped bars, one group a kind, with each bar's count above it."""
    from matplotlib.ticker import MaxNLocator

    x = np.arange(len(KINDS))
    width = 0.4
    colors = {"as stored": "tab:red", "cleaned": "tab:green"}
    for i, (view, values) in enumerate(by_view.items()):
        bars = ax.bar(x + (i - 0.5) * width, values, width, label=view, color=colors[view])
        ax.bar_label(bars, padding=2, fontsize=8)
    ax.set_xticks(x, _LABELS, fontsize=8)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.margins(y=0.3)
    ax.set(ylabel="rows", title="artifacts as stored and once cleaned")
    ax.legend(loc="upper center", ncols=2)
