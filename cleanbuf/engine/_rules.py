"""What the planning kernel is asked to do in a call: the mode as named flags."""

from __future__ import annotations

import functools
from typing import NamedTuple

from cleanbuf.engine._options import Options


class Rules(NamedTuple):
    """The kernel's mode flags for one kind of call (see :mod:`cleanbuf.engine._kernels`).

    Attributes:
        reset_rows: next-step data: a reset row follows each non-joint done row.
        successor: observation-only data: a row's next observation is the
            next row's observation.
        final: same-step data: a done row's next observation is its
            final-observation entry.
        stitch: next observations are written (False for compact output).
        hold_done: a next-step done row whose next observation is not
            stored (zero- or NaN-filled, read per row from the data) waits
            for its reset row. False only where the user declares every done
            row complete (``terminal_obs_in_done_row=True``).
        drop_lost: rows whose next observation is lost are not stored.
        marks: a done, truncated, not terminated row on a call's last step
            may be only a collector's batch-end mark (next-step time-last
            batches, as TorchRL collectors write them): the next row
            decides. Where the rows carry no collector trajectory ids (raw
            loops, which never mark), only a row whose next observation is
            not stored can be one (see the planning kernel's ``marks``).

    Examples:
        >>> Rules.of(Options(mode="next_step"), False, "time_last")
        Rules(reset_rows=True, successor=False, final=False, stitch=True, hold_done=True, drop_lost=False, marks=True)
        >>> Rules.of(Options(mode="next_step"), False, "step").marks  # no marks in one step
        False
        >>> Rules.of(Options(terminal_obs_in_done_row=True), False, "time_last").hold_done
        False
    """  # noqa: E501

    reset_rows: bool
    successor: bool
    final: bool
    stitch: bool
    hold_done: bool
    drop_lost: bool
    marks: bool

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def of(options: Options, obs_only: bool, layout_kind: str | None) -> Rules:
        """The flags for calls of ``layout_kind`` rows, observation-only or not."""
        stitch = not (obs_only and options.compact)
        same_step = options.mode == "same_step"
        return Rules(
            reset_rows=not same_step,
            successor=obs_only and stitch,
            final=same_step and stitch,
            stitch=stitch,
            hold_done=stitch and (obs_only or not options.terminal_obs_in_done_row),
            drop_lost=options.on_lost_terminal_obs == "drop",
            marks=not same_step
            and layout_kind == "time_last"
            and not options.terminal_obs_in_done_row,
        )
