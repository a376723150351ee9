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
def plan_next_step(stream, done, joint, reward, pending, need_init, shift):
    """Plans one call of next-step data from flags and the carry state.

    Args:
        stream: int64[N], dense stream index of each row (0 <= s < S). Rows of
            one stream are in time order; streams may interleave freely.
        done: bool[N], the row ends an episode.
        joint: bool[N], the row is a done row at a step where its whole reset
            group is done (no reset row follows it).
        reward: numeric[N], nonzero where the row's reward is not exactly
            zero (the reset-row signature check; all zero when the check is
            off).
        pending: bool[S] carry, a done row of the stream awaits its reset row.
        need_init: bool[S] carry, the next kept row starts an episode that an
            auto-reset began (its ``is_init`` must be set).
        shift: int64[S] carry, amount to subtract from ``step_count`` in the
            stream's current episode.

    Returns:
        A tuple ``(code, next_src, init_fix, row_shift, released_src,
        pending, need_init, shift, counts, bad_row)``: per-row code (see the
        module docstring); per-row source row of the next observation (the
        reset row, for ``STITCHED`` rows, else -1); per-row flag "set
        is_init"; per-row step-count shift; per-stream source row for the
        stream's held row from an earlier call (-1 if not released); the new
        carry arrays (fresh copies, the inputs are untouched); int64[3]
        counts of reset rows, lost terminal observations and done rows; and
        the index of the first supposed reset row that fails the signature
        check (-1 if none; the other outputs are then meaningless).
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
    counts = np.zeros(3, np.int64)
    bad_row = -1
    for i in range(n):
        s = stream[i]
        if pending[s]:
            # The successor of a done row: the auto-reset artifact.
            if done[i] or reward[i] != 0:
                bad_row = i
                break
            code[i] = DROP
            counts[0] += 1
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
            counts[2] += 1
            shift[s] = 0
            if joint[i]:
                code[i] = LOST
                counts[1] += 1
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
        counts,
        bad_row,
    )


@njit(cache=True, nogil=True)
def select_rows(code, init_fix, row_shift, drop_lost):
    """Splits planned rows into the rows to emit now and the rows to hold.

    Args:
        code: int8[N] row codes from :func:`plan_next_step`.
        init_fix: bool[N], per-row "set is_init" from the plan.
        row_shift: int64[N], per-row step-count shift from the plan.
        drop_lost: drop ``LOST`` rows instead of emitting them.

    Returns:
        ``(emit, hold, stitched, lost, emit_init, hold_init, emit_shift,
        hold_shift)``: row indices to emit and to hold (input order); the
        positions within ``emit`` of ``STITCHED`` and ``LOST`` rows; the
        positions within ``emit`` and ``hold`` whose ``is_init`` must be set;
        the step-count shift of each emitted and held row.
    """
    n = code.shape[0]
    n_emit = 0
    n_hold = 0
    n_stitched = 0
    n_lost = 0
    n_emit_init = 0
    n_hold_init = 0
    for i in range(n):
        c = code[i]
        if c == HOLD:
            n_hold += 1
            n_hold_init += init_fix[i]
        elif c == EMIT or c == STITCHED or (c == LOST and not drop_lost):
            n_emit += 1
            n_emit_init += init_fix[i]
            n_stitched += c == STITCHED
            n_lost += c == LOST
    emit = np.empty(n_emit, np.int64)
    hold = np.empty(n_hold, np.int64)
    stitched = np.empty(n_stitched, np.int64)
    lost = np.empty(n_lost, np.int64)
    emit_init = np.empty(n_emit_init, np.int64)
    hold_init = np.empty(n_hold_init, np.int64)
    emit_shift = np.empty(n_emit, np.int64)
    hold_shift = np.empty(n_hold, np.int64)
    a = b = p = q = u = v = 0
    for i in range(n):
        c = code[i]
        if c == HOLD:
            if init_fix[i]:
                hold_init[v] = b
                v += 1
            hold[b] = i
            hold_shift[b] = row_shift[i]
            b += 1
        elif c == EMIT or c == STITCHED or (c == LOST and not drop_lost):
            if c == STITCHED:
                stitched[p] = a
                p += 1
            elif c == LOST:
                lost[q] = a
                q += 1
            if init_fix[i]:
                emit_init[u] = a
                u += 1
            emit[a] = i
            emit_shift[a] = row_shift[i]
            a += 1
    return emit, hold, stitched, lost, emit_init, hold_init, emit_shift, hold_shift
