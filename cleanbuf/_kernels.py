"""numba kernels on plain arrays: the planning scan and the row selection.

Nothing here knows about TensorDicts, keys or torch. Validation happens in the
Python callers (``_cleaner.py``) before a kernel runs; the kernels assume
well-formed input and never raise. Every kernel is checked against the
row-by-row reference cleaner in ``tests/reference.py`` on random streams.

Row codes written by :func:`plan_next_step` (one per input row):

* ``EMIT``: a real transition, emitted in this call.
* ``DROP``: a reset row (the artifact after a done row); never emitted.
* ``HOLD``: a done row whose reset row is not in this call; held in the
  carry state until a later call (or ``flush``) releases it.
* ``STITCHED``: a done row whose reset row is in this call; emitted with its
  next observation taken from that reset row.
* ``LOST``: a done row at a step where its whole reset group was done
  (TorchRL's joint full reset): no reset row follows, its terminal
  observation is gone.
"""

from __future__ import annotations

import numpy as np
from numba import njit

EMIT = 0
DROP = 1
HOLD = 2
STITCHED = 3
LOST = 4


@njit(cache=True, nogil=True)
def plan_next_step(stream, done, joint, reward_zero, pending, need_init, shift):
    """Plans one call of next-step data from flags and the carry state.

    Args:
        stream: int64[N], dense stream index of each row (0 <= s < S). Rows of
            one stream are in time order; streams may interleave freely.
        done: bool[N], the row ends an episode.
        joint: bool[N], the row is a done row at a step where its whole reset
            group is done (no reset row follows it).
        reward_zero: bool[N], the row's reward is exactly zero (the reset-row
            signature check; all True when the check is off).
        pending: bool[S] carry, a done row of the stream awaits its reset row.
        need_init: bool[S] carry, the next kept row starts an episode that an
            auto-reset began (its ``is_init`` must be set).
        shift: int64[S] carry, amount to subtract from ``step_count`` in the
            stream's current episode.

    Returns:
        A tuple ``(code, next_src, init_fix, row_shift, released_src,
        pending, need_init, shift, bad_row)``: per-row code (see the module
        docstring); per-row source row of the next observation (the reset
        row, for ``STITCHED`` rows, else -1); per-row flag "set is_init";
        per-row step-count shift; per-stream source row for the stream's
        held row from an earlier call (-1 if not released); the new carry
        arrays (fresh copies, the inputs are untouched); and the index of the
        first supposed reset row that fails the signature check (-1 if none;
        the other outputs are then meaningless).
    """
    n = stream.shape[0]
    n_streams = pending.shape[0]
    pending = pending.copy()
    need_init = need_init.copy()
    shift = shift.copy()
    code = np.full(n, EMIT, np.int8)
    next_src = np.full(n, -1, np.int64)
    init_fix = np.zeros(n, np.bool_)
    row_shift = np.zeros(n, np.int64)
    released_src = np.full(n_streams, -1, np.int64)
    open_done = np.full(n_streams, -1, np.int64)
    bad_row = -1
    for i in range(n):
        s = stream[i]
        if pending[s]:
            # The successor of a done row: the auto-reset artifact.
            if done[i] or not reward_zero[i]:
                bad_row = i
                break
            code[i] = DROP
            if open_done[s] >= 0:
                code[open_done[s]] = STITCHED
                next_src[open_done[s]] = i
                open_done[s] = -1
            else:
                released_src[s] = i
            pending[s] = False
            need_init[s] = True
            shift[s] = 1
            continue
        init_fix[i] = need_init[s]
        need_init[s] = False
        row_shift[i] = shift[s]
        if done[i]:
            shift[s] = 0
            if joint[i]:
                code[i] = LOST
            else:
                code[i] = HOLD
                pending[s] = True
                open_done[s] = i
    return (
        code,
        next_src,
        init_fix,
        row_shift,
        released_src,
        pending,
        need_init,
        shift,
        bad_row,
    )


@njit(cache=True, nogil=True)
def select_rows(code, drop_lost):
    """Splits planned rows into the rows to emit now and the rows to hold.

    Args:
        code: int8[N] row codes from :func:`plan_next_step`.
        drop_lost: drop ``LOST`` rows instead of emitting them.

    Returns:
        ``(emit, hold)``: int64 row indices, each in input order.
    """
    n = code.shape[0]
    n_emit = 0
    n_hold = 0
    for i in range(n):
        c = code[i]
        if c == HOLD:
            n_hold += 1
        elif c == EMIT or c == STITCHED or (c == LOST and not drop_lost):
            n_emit += 1
    emit = np.empty(n_emit, np.int64)
    hold = np.empty(n_hold, np.int64)
    a = 0
    b = 0
    for i in range(n):
        c = code[i]
        if c == HOLD:
            hold[b] = i
            b += 1
        elif c == EMIT or c == STITCHED or (c == LOST and not drop_lost):
            emit[a] = i
            a += 1
    return emit, hold
