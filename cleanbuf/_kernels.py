"""numba kernels on plain arrays: the planning scan and the row selection.

Nothing here knows about TensorDicts, keys or torch. Validation happens in the
Python callers (``_cleaner.py``) before a kernel runs; the kernels assume
well-formed input and never raise. They are checked against the row-by-row
reference cleaner in ``tests/reference.py`` on random streams.

Row codes written by :func:`plan` (one per input row):

* ``EMIT``: a transition emitted in this call as it is.
* ``DROP``: a reset row (next-step mode: the artifact after a done row).
* ``HOLD``: a row waiting for its next observation's source, which is not in
  this call (its successor row, or for a done row its reset row); held in the
  carry state until a later call (or ``flush``) releases it.
* ``STITCHED``: a row whose next observation comes from a later row of this
  call (``next_src``), emitted.
* ``LOST``: a done row whose terminal observation is gone (TorchRL's joint
  reset in next-step mode; no final observation in same-step mode).
* ``FINAL``: a same-step done row whose next observation is its own
  final-observation entry, emitted.

The flags of :func:`plan` select the mode:

=======================  ==========  =========  =====  ======
data                     reset_rows  successor  final  stitch
=======================  ==========  =========  =====  ======
next-step                1           0          0      1
next-step, obs-only      1           1          0      1
next-step, compact       1           0          0      0
same-step                0           0          1      1
same-step, obs-only      0           1          1      1
=======================  ==========  =========  =====  ======
"""

from __future__ import annotations

import numpy as np
from numba import njit

EMIT = 0
DROP = 1
HOLD = 2
STITCHED = 3
LOST = 4
FINAL = 5


@njit(cache=True, nogil=True)
def plan(stream, done, joint, final_ok, reward, pending, waiting, need_init, shift,
         reset_rows, successor, final, stitch):
    """Plans one call from flags and the carry state, in one pass over the rows.

    Args:
        stream: int64[N], dense stream index of each row (0 <= s < S). Rows of
            one stream are in time order; streams may interleave freely.
        done: bool[N], the row ends an episode.
        joint: bool[N], a done row at a step where its whole reset group is
            done: no reset row follows it (next-step mode).
        final_ok: bool[N], the row's final-observation entry is present
            (same-step mode).
        reward: numeric[N], nonzero where the reward is not exactly zero (the
            reset-row signature check; all zero when the check is off).
        pending: bool[S] carry, a reset row comes next in the stream.
        waiting: bool[S] carry, the stream's held row waits for the next row
            of the stream as its next observation's source.
        need_init: bool[S] carry, the next kept row starts an episode that an
            auto-reset began (its ``is_init`` must be set).
        shift: int64[S] carry, amount to subtract from ``step_count`` in the
            stream's current episode.
        reset_rows: next-step mode: a reset row follows each non-joint done row.
        successor: observation-only data: each row's next observation is the
            next row's observation (or, with ``final``, a done row's final
            entry).
        final: same-step mode: a done row's next observation is its final
            entry.
        stitch: next observations are written (False: compact output, where
            no row waits).

    Returns:
        ``(code, next_src, init_fix, row_shift, released_src, pending,
        waiting, need_init, shift, counts, bad_row)``: per-row code (module
        docstring); per-row source row of the next observation (``STITCHED``
        rows, else -1); per-row "set is_init"; per-row step-count shift;
        per-stream source row for the stream's held row from an earlier call
        (-1 if not released); the new carry arrays (fresh copies; the inputs
        are untouched); int64[3] counts of reset rows, lost terminal
        observations and done rows; and the first supposed reset row that
        fails the signature check (-1 if none; the rest is then meaningless).
    """
    n = stream.shape[0]
    n_streams = pending.shape[0]
    pending = pending.copy()
    waiting = waiting.copy()
    need_init = need_init.copy()
    shift = shift.copy()
    code = np.full(n, EMIT, np.int8)
    next_src = np.full(n, -1, np.int64)
    init_fix = np.zeros(n, np.bool_)
    row_shift = np.zeros(n, np.int64)
    released_src = np.full(n_streams, -1, np.int64)
    open_row = np.full(n_streams, -1, np.int64)
    counts = np.zeros(3, np.int64)
    bad_row = -1
    for i in range(n):
        s = stream[i]
        # This row is the source of the next observation of the row before it.
        if open_row[s] >= 0:
            code[open_row[s]] = STITCHED
            next_src[open_row[s]] = i
            open_row[s] = -1
        elif waiting[s]:
            released_src[s] = i
            waiting[s] = False
        if reset_rows and pending[s]:
            if done[i] or reward[i] != 0:
                bad_row = i
                break
            code[i] = DROP
            counts[0] += 1
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
            if reset_rows:
                if joint[i]:
                    code[i] = LOST
                    counts[1] += 1
                    continue
                pending[s] = True
            elif final:
                if final_ok[i]:
                    code[i] = FINAL
                else:
                    code[i] = LOST
                    counts[1] += 1
                continue
        elif not successor:
            continue
        if stitch and (successor or done[i]):
            code[i] = HOLD
            open_row[s] = i
    # Rows still open wait for a later call.
    for s in range(n_streams):
        if open_row[s] >= 0:
            waiting[s] = True
    return (
        code,
        next_src,
        init_fix,
        row_shift,
        released_src,
        pending,
        waiting,
        need_init,
        shift,
        counts,
        bad_row,
    )


@njit(cache=True, nogil=True)
def select_rows(code, next_src, init_fix, row_shift, drop_lost):
    """Splits planned rows into the rows to emit now and the rows to hold.

    Args:
        code: int8[N] row codes from :func:`plan`.
        next_src: int64[N] next-observation sources from :func:`plan`.
        init_fix: bool[N], per-row "set is_init" from the plan.
        row_shift: int64[N], per-row step-count shift from the plan.
        drop_lost: drop ``LOST`` rows instead of emitting them.

    Returns:
        ``(emit, hold, stitched, stitched_src, lost, final, emit_init,
        hold_init, emit_shift, hold_shift)``: row indices to emit and to hold
        (input order); the positions within ``emit`` of ``STITCHED`` rows and
        their source rows; the positions within ``emit`` of ``LOST`` and
        ``FINAL`` rows; the positions within ``emit`` and ``hold`` whose
        ``is_init`` must be set; the step-count shift of each emitted and held
        row.
    """
    n = code.shape[0]
    n_emit = n_hold = n_stitched = n_lost = n_final = n_emit_init = n_hold_init = 0
    for i in range(n):
        c = code[i]
        if c == HOLD:
            n_hold += 1
            n_hold_init += init_fix[i]
        elif c != DROP and (c != LOST or not drop_lost):
            n_emit += 1
            n_emit_init += init_fix[i]
            n_stitched += c == STITCHED
            n_lost += c == LOST
            n_final += c == FINAL
    emit = np.empty(n_emit, np.int64)
    hold = np.empty(n_hold, np.int64)
    stitched = np.empty(n_stitched, np.int64)
    stitched_src = np.empty(n_stitched, np.int64)
    lost = np.empty(n_lost, np.int64)
    final = np.empty(n_final, np.int64)
    emit_init = np.empty(n_emit_init, np.int64)
    hold_init = np.empty(n_hold_init, np.int64)
    emit_shift = np.empty(n_emit, np.int64)
    hold_shift = np.empty(n_hold, np.int64)
    a = b = p = q = f = u = v = 0
    for i in range(n):
        c = code[i]
        if c == HOLD:
            if init_fix[i]:
                hold_init[v] = b
                v += 1
            hold[b] = i
            hold_shift[b] = row_shift[i]
            b += 1
        elif c != DROP and (c != LOST or not drop_lost):
            if c == STITCHED:
                stitched[p] = a
                stitched_src[p] = next_src[i]
                p += 1
            elif c == LOST:
                lost[q] = a
                q += 1
            elif c == FINAL:
                final[f] = a
                f += 1
            if init_fix[i]:
                emit_init[u] = a
                u += 1
            emit[a] = i
            emit_shift[a] = row_shift[i]
            a += 1
    return (emit, hold, stitched, stitched_src, lost, final, emit_init, hold_init,
            emit_shift, hold_shift)
