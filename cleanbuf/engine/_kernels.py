"""numba kernels on plain arrays: one call's stream ends, planning scan and row selection.

Every call runs one kernel, :func:`one_pass`, on arrays the read step
(:meth:`cleanbuf.engine._read.Reader.read`) fills; :func:`cleanbuf.engine._cleaner.plan_call`
names its result (:class:`KernelResult`). No TensorDicts, keys or torch here.
The Python callers validate the input; the kernels assume it well-formed and
never raise. ``tests/reference.py`` (a row-by-row cleaner) checks them.

Row codes written by :func:`plan` (the low three bits of one byte per row;
``INIT_BIT`` and ``SHIFT_BIT`` carry the bookkeeping fixes):

* ``EMIT``: emitted as it is.
* ``DROP``: a reset row.
* ``HOLD``: waits in the carry for its next observation's source, not in this
  call (its successor, or a done row's reset row), until a later call or
  ``flush``.
* ``STITCHED``: emitted, its next observation from a later row of this call
  (``next_src``).
* ``LOST``: emitted (or dropped), its next observation gone: a joint-reset
  done row not ``stored``, a same-step done row without a final
  observation, a row whose successor is a restart.
* ``FINAL``: a same-step done row, its next observation its final entry.

The flags of :func:`plan` select the mode:

=======================  ==========  =========  =====  ======  =========
data                     reset_rows  successor  final  stitch  hold_done
=======================  ==========  =========  =====  ======  =========
next-step                1           0          0      1       1 [*]_
next-step, obs-only      1           1          0      1       1
next-step, compact       1           0          0      0       0
same-step                0           0          1      1       0
same-step, obs-only      0           1          1      1       0
=======================  ==========  =========  =====  ======  =========

.. [*] Except a ``stored`` done row: emitted at once (docs/rules.md, "Core rule").
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
from numba import njit

from cleanbuf.engine._options import Options

EMIT = 0
DROP = 1
HOLD = 2
STITCHED = 3
LOST = 4
FINAL = 5
CODE_MASK = 7
INIT_BIT = 8  # set is_init on this row
SHIFT_BIT = 16  # subtract 1 from this row's step counts
# The rows of the carry state (int64[5, S], see plan).
PENDING, WAITING, NEED_INIT, SHIFT, MARKED = range(5)
# MARKED bits: an undecided mark (its group done with it or not), and its next
# observation stored (complete whatever comes next). (4, once "marks seen", is unused.)
MARK, JOINT_MARK, STORED = 1, 2, 8
# The values of plan's marks: which batch-end rows may be a collector's mark.
NO_MARKS, ANY_MARKS, UNSTORED_MARKS = 0, 1, 2
# What plan's released_src says of a held row, besides its source row.
RELEASED_LOST = -2  # released with its next observation lost (a restart cut it off)
RELEASED_AS_IS = -3  # released as stored (its end was only a collector's mark)
RELEASED_STORED = -4  # released as stored (a real end whose terminal obs it holds)
# An empty row index, shared (read-only) wherever a call has no such rows.
NO_ROWS = np.zeros(0, np.int64)
NO_ROWS.flags.writeable = False


@njit(cache=True, nogil=True)
def plan(n, steps, stream, done, stored, joint, group, final_ok, final_default, reward, restart,
         terminated, truncated, marks, cont, carry, reset_rows, successor, final, stitch,
         hold_done):  # fmt: skip
    """Plans one call from flags and the carry state, in one pass over the rows.

    Reads flag bytes only (and the reward, for the reset-row check), never
    observations.

    Args:
        n: rows in the call.
        steps: rows per stream in time-last order (row ``i`` is in stream
            ``i // steps``); 0 to read ``stream`` instead.
        stream: int64[N] stream index of each row (0 <= s < S), read when
            ``steps`` is 0; rows of a stream in time order, streams interleaved.
        done: bool[N], the row ends an episode.
        stored: bool[N] or empty (none): per done row, its next observation
            is stored, so it is the terminal one (neither zero- nor NaN-filled:
            :func:`cleanbuf.engine._read.stored_rows`; docs/rules.md, "Core rule").
        joint: bool[N] or empty: a done row at a step where its whole reset
            group is done, so no reset row follows (flat rows: ``joint_key``).
        group: time-last rows: the reset group size (consecutive streams reset
            together when all are done at one step), read from ``done``; 0: none.
        final_ok: bool[N] or empty (then ``final_default`` for every row):
            the row's final-observation entry is present (same-step mode).
        final_default: see ``final_ok``.
        reward: numeric[N] or empty (check off): the reset-row check's rewards
            (a reset row's must be exactly 0).
        restart: bool[N] or empty: the row follows a real reset (``is_init``).
            It restarts the stream where no reset row is expected, or where it
            is the stream's first row in the call and fails the reset-row check
            (a collector reset between calls): a waiting row's next observation
            is then lost, and nothing of the old episode carries over.
        terminated: bool[N] or empty: the terminated flags (marks only).
        truncated: bool[N] or empty: the truncated flags (marks only).
        marks: time-last rows: which done, truncated, not terminated rows on
            the call's last step may be a collector's batch-end mark, held
            undecided until the stream's next row (``restart``, else ``cont``)
            decides (docs/rules.md, "Batch-end marks"). ``NO_MARKS`` (False):
            none; ``ANY_MARKS`` (True): any (rows with trajectory ids);
            ``UNSTORED_MARKS``: only those not ``stored`` (rows without ids).
        cont: uint8[S] or empty: per stream, 1 where this call's first row
            continues the last call's last row (observation equal, byte for byte).
        carry: int64[5, S], per stream: ``PENDING``, a reset row comes next;
            ``WAITING``, the held row waits for the stream's next row;
            ``NEED_INIT``, the next kept row gets ``is_init``; ``SHIFT``, the
            episode began with a dropped reset row (step counts one too high);
            ``MARKED``, bits: the pending done row is an undecided mark
            (``MARK``; ``JOINT_MARK``: its whole group was done with it, so a
            real end is a joint reset), ``STORED`` (its next observation
            is stored). The others are 0 or 1.
        reset_rows: next-step mode: a reset row follows each non-joint done row.
        successor: observation-only data: a row's next observation is the next
            row's observation (with ``final``, a done row's is its final entry).
        final: same-step mode: a done row's next observation is its final entry.
        stitch: next observations are written (False: compact output, no row
            waits).
        hold_done: next-step mode: a done row not ``stored`` waits for its
            reset row. False: every done row is emitted as stored
            (``terminal_obs_in_done_row=True``, ``[T, E]`` rollout repairs).

    Returns:
        ``(code, next_src, released_src, carry, n_drop, n_lost, n_next_lost,
        n_done, bad_row)``: the per-row code byte; per-row source of the next
        observation (``STITCHED`` rows only; empty when ``steps > 0``: the next
        row); per stream, what becomes of its held row from an earlier call (a
        source row, ``RELEASED_*``, or -1: still held); the new carry (a fresh
        array; the input is untouched); the call's counts of reset rows, lost
        terminal observations (done rows), lost next observations (other
        rows) and completed episodes; the first supposed reset row that fails
        the check (-1 if none; the rest is then meaningless).
    """
    n_streams = carry.shape[1]
    carry = carry.copy()
    pending = carry[PENDING]  # views: writing them writes the new carry
    waiting = carry[WAITING]
    need_init = carry[NEED_INIT]
    shift = carry[SHIFT]
    marked = carry[MARKED]
    has_restart = restart.shape[0] > 0
    has_stored = stored.shape[0] > 0
    check = reward.shape[0] > 0
    mark, joint, joint_marks = _end_kinds(
        steps, group, done, stored, joint, terminated, truncated, marks
    )
    has_mark = mark.shape[0] > 0
    has_joint = joint.shape[0] > 0
    code = np.empty(n, np.int8)
    # Time-last rows: the source is the next row (select_rows knows it).
    next_src = np.empty(n if steps == 0 else 0, np.int64)
    released_src = np.full(n_streams, -1, np.int64)
    open_row = np.full(n_streams, -1, np.int64)
    seen = np.zeros(n_streams, np.bool_)
    n_drop = n_lost = n_next_lost = n_done = 0
    bad_row = -1
    for i in range(n):
        s = i // steps if steps > 0 else stream[i]
        fresh = has_restart and restart[i]
        force = False  # a restart, whatever the row looks like
        first = not seen[s]
        seen[s] = True
        lost_code = RELEASED_LOST  # what a restart makes of a held row
        if marked[s] & (MARK | JOINT_MARK):
            # The stream's last row was a batch-end mark: this row decides.
            if marked[s] & STORED:
                lost_code = RELEASED_STORED
            fresh, force, real = _decide_mark(s, fresh, has_restart, cont, first, marked, pending)
            if real:
                n_done += 1  # a real episode end; go on as after any done row
            elif not successor:  # only a mark (observation-only rows take this row's obs)
                _close(s, EMIT, RELEASED_AS_IS, open_row, waiting, code, released_src)
        # A reset row may carry a collector's mark, which is not its own end.
        ends = done[i] and not (has_mark and mark[i])
        if force or (
            fresh and (not pending[s] or (first and (ends or (check and reward[i] != 0))))
        ):
            # A restart (not the expected reset row; see restart above).
            o = _close(s, LOST, lost_code, open_row, waiting, code, released_src)
            if o >= 0:
                n_lost += done[o]
                n_next_lost += not done[o]
            pending[s] = need_init[s] = shift[s] = 0
        # This row is the source of the next observation of the row before it.
        o = open_row[s]
        if o >= 0:
            code[o] = (code[o] & ~CODE_MASK) | STITCHED
            if steps == 0:
                next_src[o] = i
            open_row[s] = -1
        elif waiting[s]:
            released_src[s] = i
            waiting[s] = False
        if reset_rows and pending[s]:
            if ends or (check and reward[i] != 0):
                bad_row = i
                break
            code[i] = DROP
            n_drop += 1
            pending[s] = 0
            need_init[s] = shift[s] = 1
            continue
        c = EMIT
        if need_init[s]:
            c |= INIT_BIT
            need_init[s] = False
        if shift[s]:
            c |= SHIFT_BIT
        row_stored = has_stored and stored[i]
        is_mark = has_mark and mark[i]
        if done[i]:
            if is_mark:
                # counted, and the shift ended, once decided
                marked[s] |= JOINT_MARK if joint_marks.shape[0] and joint_marks[i] else MARK
                if row_stored:
                    marked[s] |= STORED
            else:
                n_done += 1
                shift[s] = 0
            if reset_rows:
                if has_joint and joint[i]:
                    # No reset row comes: lost, unless the row holds it.
                    code[i] = c if row_stored else c | LOST
                    n_lost += not row_stored
                    continue
                pending[s] = True
            elif final:
                ok = final_ok[i] if final_ok.shape[0] else final_default
                code[i] = c | (FINAL if ok else LOST)
                n_lost += not ok
                continue
        elif not successor:
            code[i] = c
            continue
        if stitch and (successor or (done[i] and hold_done and (is_mark or not row_stored))):
            code[i] = c | HOLD
            open_row[s] = i
        else:
            code[i] = c
    waiting[open_row >= 0] = 1  # rows still open wait for a later call
    return code, next_src, released_src, carry, n_drop, n_lost, n_next_lost, n_done, bad_row


@njit(cache=True, nogil=True, inline="always")
def _close(s, row_code, released, open_row, waiting, code, released_src):
    """Ends stream ``s``'s wait for the row that completes its last row.

    The row open in this call gets ``row_code``; one held from an earlier call
    gets ``released`` (a source row or ``RELEASED_*``).

    Returns:
        The open row that was closed, or -1.
    """
    o = open_row[s]
    if o >= 0:
        code[o] = (code[o] & ~CODE_MASK) | row_code
        open_row[s] = -1
    elif waiting[s]:
        released_src[s] = released
        waiting[s] = False
    return o


@njit(cache=True, nogil=True, inline="always")
def _decide_mark(s, fresh, has_restart, cont, first, marked, pending):
    """Decides stream ``s``'s undecided batch-end mark from its next row (see :func:`plan`).

    Returns:
        ``(fresh, force, real)``: whether the row restarts the stream (to be
        checked as a reset row), whether it restarts it whatever it looks
        like (after a joint reset no reset row comes), and whether the mark
        was a real episode end. Only a mark: the stream expects no reset row.
    """
    was_joint = (marked[s] & JOINT_MARK) != 0
    real = fresh if has_restart else (cont.shape[0] > 0 and first and cont[s] == 0)
    if not real:
        pending[s] = False
        marked[s] = 0
        return fresh, False, False
    marked[s] = 0
    if has_restart:
        return fresh, False, True
    # Read from the bytes alone: this row is a reset row or a restart, which
    # the reset-row check tells apart.
    return True, was_joint, True


@njit(cache=True, nogil=True)
def _end_kinds(steps, group, done, stored, joint, terminated, truncated, marks):
    """The possible batch-end marks, the joint resets, and the marks whose group ended together.

    ``joint`` as given (flat rows), or read from the done flags of each step
    (time-aligned rows with ``group``).
    """
    n = done.shape[0]
    mark = _batch_end_marks(n, steps, done, stored, terminated, truncated, marks)
    joint_marks = mark[:0]
    if group > 0 and steps > 0:
        joint = _joint_rows(n, steps, group, done, mark, False)
        if mark.shape[0] > 0:
            joint_marks = _joint_rows(n, steps, group, done, mark, True)
    return mark, joint, joint_marks


@njit(cache=True, nogil=True)
def _batch_end_marks(n, steps, done, stored, terminated, truncated, marks):
    """Per row, a possible batch-end mark (see :func:`plan`), or empty if none can be."""
    if marks == NO_MARKS or steps == 0 or truncated.shape[0] == 0:
        return np.zeros(0, np.bool_)
    has_terminated = terminated.shape[0] > 0
    unstored_only = marks == UNSTORED_MARKS and stored.shape[0] > 0
    mark = np.zeros(n, np.bool_)
    for i in range(steps - 1, n, steps):
        if done[i] and truncated[i] and not (has_terminated and terminated[i]):
            mark[i] = not (unstored_only and stored[i])
    return mark


@njit(cache=True, nogil=True)
def _joint_rows(n, steps, group, done, mark, marks_count):
    """Per time-last row, done at a step where its whole reset group is done.

    A batch-end mark counts as done only with ``marks_count`` (a mark that
    hid a real joint reset shows it in the next call).
    """
    has_mark = mark.shape[0] > 0
    joint = np.zeros(n, np.bool_)
    span = group * steps
    for start in range(0, n - span + 1, span):
        for t in range(steps):
            together = True
            for i in range(start + t, start + span, steps):
                if not done[i] or (has_mark and mark[i] and not marks_count):
                    together = False
                    break
            if together:
                for i in range(start + t, start + span, steps):
                    joint[i] = True
    return joint


@njit(cache=True, nogil=True)
def stream_ends(  # noqa: PLR0913 - one pass over every end of a call
    obs, next_obs, steps, last_next, first_before, open_before, restart, ids, ids_before
):
    """Reads the first and last row of each stream of a time-aligned call.

    For the continuity check, the batch-end mark decisions and the retry
    fingerprint. The rows come as unsigned words (uint8 to uint64): the
    caller views each row's bytes as the widest word that divides them.

    Args:
        obs: uint[N, B], the rows' observations as words (time-last: row
            ``i`` belongs to stream ``i // steps``).
        next_obs: uint[N, B], their stored next observations.
        steps: rows per stream.
        last_next: uint[S0, B], the previous call's last next observation
            of its first ``S0`` streams (S0 may be 0), words as ``obs``.
        first_before: uint[S1, B], the previous call's first observations.
        open_before: bool[S2], per stream, the previous call's last row was
            not done (its next row must continue it); empty to check nothing.
        restart: bool[N] or empty, per row of ``obs``, the row restarts its
            stream (``is_init``).
        ids: uint[N, C] or empty ``[0, 0]``, further words of the
            fingerprint (the rows' trajectory ids), read like ``obs``.
        ids_before: uint[S3, C], the previous call's first ``ids``.

    Returns:
        ``(first, last, cont, same_first, broken, first_ids)``: copies of each
        stream's first observation and last next observation (uint[S, B], as
        ``obs``); per stream, 1 where its first observation equals
        ``last_next`` (0 where it differs or the stream is new); whether every
        first row equals ``first_before`` (and ``ids_before``): the last
        call's batch again; the first stream that was open, does not continue
        and does not restart (-1 if none); a copy of each stream's first
        ``ids`` (uint[S, C], ``[0, 0]`` without ids).
    """
    n_streams = obs.shape[0] // steps
    width = obs.shape[1]
    first = np.empty((n_streams, width), obs.dtype)
    last = np.empty((n_streams, width), obs.dtype)
    cont = np.zeros(n_streams, np.uint8)
    same_first = first_before.shape[0] == n_streams and first_before.shape[1] == width
    known = last_next.shape[0] if last_next.shape[1] == width else 0
    n_open = min(open_before.shape[0], n_streams)
    restarts = restart.shape[0] > 0
    broken = -1
    id_width = ids.shape[1] if ids.shape[0] > 0 else 0
    first_ids = np.empty((n_streams if ids.shape[0] > 0 else 0, id_width), ids.dtype)
    if ids.shape[0] > 0 and (ids_before.shape[0] != n_streams or ids_before.shape[1] != id_width):
        same_first = False
    # Copies, then branch-free OR-reductions of XORs: both vectorise (early exits would not).
    for s in range(n_streams):
        a, b = s * steps, s * steps + steps - 1
        for j in range(width):
            first[s, j] = obs[a, j]
        for j in range(width):
            last[s, j] = next_obs[b, j]
        for j in range(first_ids.shape[1]):
            first_ids[s, j] = ids[a, j]
    for s in range(n_streams):
        equal = False
        if s < known:
            diff = obs.dtype.type(0)
            for j in range(width):
                diff |= first[s, j] ^ last_next[s, j]
            equal = diff == 0
        cont[s] = equal
        if same_first:
            diff = obs.dtype.type(0)
            for j in range(width):
                diff |= first[s, j] ^ first_before[s, j]
            id_diff = ids.dtype.type(0)
            for j in range(id_width):
                id_diff |= first_ids[s, j] ^ ids_before[s, j]
            same_first = diff == 0 and id_diff == 0
        if broken < 0 and not equal and s < n_open and open_before[s]:
            if not (restarts and restart[s * steps]):
                broken = s
    return first, last, cont, same_first, broken, first_ids


@njit(cache=True, nogil=True)
def read_fills(x, rows, floating, signed, zero, nan):
    """Reads which of ``rows`` a producer filled in: all zeros, or marked missing.

    Marked missing: any NaN (floating point), or -1 in every element (signed
    integers: TorchRL's fill for integer observations). Reads only ``rows``.

    Args:
        x: [N, W] the rows' values (one observation key, flattened).
        rows: int64[R] the rows to read.
        floating: ``x`` holds floating-point values (NaN possible).
        signed: ``x`` holds signed integers (-1 fills possible).
        zero: bool[R], updated in place: cleared where the row holds a
            nonzero element (a row is zero-filled only if every key's is 0).
        nan: bool[R], updated in place: set where the row is marked missing
            (a row is marked if any key's is).
    """
    for j in range(rows.shape[0]):
        row = x[rows[j]]
        minus = signed and row.shape[0] > 0
        for v in row:
            if floating and v != v:
                nan[j] = True
                zero[j] = False
                minus = False
                break
            if v != 0:
                zero[j] = False
            if minus and v != -1:
                minus = False
            if not floating and not zero[j] and not minus:
                break
        if minus:
            nan[j] = True


class Selection(NamedTuple):
    """The rows of one call, as :func:`select_rows` returns them (see there)."""

    emit: np.ndarray
    hold: np.ndarray
    stitched: np.ndarray
    stitched_src: np.ndarray
    lost: np.ndarray
    final: np.ndarray
    emit_init: np.ndarray
    hold_init: np.ndarray
    emit_shift: np.ndarray
    hold_shift: np.ndarray


@njit(cache=True, nogil=True)
def select_rows(code, next_src, drop_lost):
    """Splits planned rows into the rows to emit now and the rows to hold.

    Args:
        code: int8[N] row code bytes from :func:`plan`.
        next_src: int64[N] next-observation sources from :func:`plan`, or
            empty when each row's source is the next row.
        drop_lost: drop ``LOST`` rows instead of emitting them.

    Returns:
        The fields of :class:`Selection`, int64 arrays: the row indices to
        emit and to hold (input order); the positions within ``emit`` of
        ``STITCHED`` rows and their source rows; the positions within
        ``emit`` of ``LOST`` and ``FINAL`` rows; the positions within
        ``emit`` and ``hold`` whose ``is_init`` must be set; per emitted and
        per held row, 1 where its step counts must drop by one (each of
        these two is empty when no such row shifts).
    """
    n = code.shape[0]
    # First pass: the size of each part.
    n_emit = n_hold = n_stitched = n_lost = n_final = n_emit_init = n_hold_init = 0
    emit_shifts = hold_shifts = False
    for i in range(n):
        c = code[i] & CODE_MASK
        init = (code[i] & INIT_BIT) != 0
        shifted = (code[i] & SHIFT_BIT) != 0
        if c == HOLD:
            n_hold += 1
            n_hold_init += init
            hold_shifts |= shifted
        elif c != DROP and (c != LOST or not drop_lost):
            n_emit += 1
            n_emit_init += init
            emit_shifts |= shifted
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
    emit_shift = np.zeros(n_emit if emit_shifts else 0, np.int64)
    hold_shift = np.zeros(n_hold if hold_shifts else 0, np.int64)
    # Second pass: fill them; each counter is the next free place in its part.
    n_emit = n_hold = n_stitched = n_lost = n_final = n_emit_init = n_hold_init = 0
    for i in range(n):
        c = code[i] & CODE_MASK
        init = (code[i] & INIT_BIT) != 0
        shifted = (code[i] & SHIFT_BIT) != 0
        if c == HOLD:
            if init:
                hold_init[n_hold_init] = n_hold
                n_hold_init += 1
            if hold_shifts and shifted:
                hold_shift[n_hold] = 1
            hold[n_hold] = i
            n_hold += 1
        elif c != DROP and (c != LOST or not drop_lost):
            if c == STITCHED:
                stitched[n_stitched] = n_emit
                stitched_src[n_stitched] = next_src[i] if next_src.shape[0] else i + 1
                n_stitched += 1
            elif c == LOST:
                lost[n_lost] = n_emit
                n_lost += 1
            elif c == FINAL:
                final[n_final] = n_emit
                n_final += 1
            if init:
                emit_init[n_emit_init] = n_emit
                n_emit_init += 1
            if emit_shifts and shifted:
                emit_shift[n_emit] = 1
            emit[n_emit] = i
            n_emit += 1
    return (
        emit,
        hold,
        stitched,
        stitched_src,
        lost,
        final,
        emit_init,
        hold_init,
        emit_shift,
        hold_shift,
    )


@njit(cache=True, nogil=True)
def plan_rows(n, steps, stream, done, stored, joint, group, final_ok, final_default, reward,
              restart, terminated, truncated, marks, cont, carry, reset_rows, successor, final,
              stitch, hold_done, drop_lost):  # fmt: skip
    """:func:`plan`, then :func:`select_rows`, in one call from Python.

    The arguments are those of the two (``drop_lost``: :func:`select_rows`).

    Returns:
        ``(selection, released_src, carry, n_drop, n_lost, n_next_lost,
        n_done, bad_row)``: the fields of :class:`Selection` (a tuple) and
        the rest of :func:`plan`'s results. When ``bad_row >= 0`` the
        selection is empty.
    """
    code, next_src, released_src, carry, n_drop, n_lost, n_next_lost, n_done, bad_row = plan(
        n, steps, stream, done, stored, joint, group, final_ok, final_default, reward, restart,
        terminated, truncated, marks, cont, carry, reset_rows, successor, final, stitch, hold_done,
    )  # fmt: skip
    if bad_row >= 0:
        code = code[:0]
    selection = select_rows(code, next_src, drop_lost)
    return selection, released_src, carry, n_drop, n_lost, n_next_lost, n_done, bad_row


@njit(cache=True, nogil=True)
def one_pass(n, steps, stream, done, fills, floating, signed, stored, joint, group, final_ok,
             final_default, reward, restart, terminated, truncated, marks, obs, next_obs,
             ends_steps, last_next, first_before, open_before, ends_restart, ids, ids_before,
             carry, reset_rows, successor, final, stitch, hold_done, drop_lost):  # fmt: skip
    """Everything a call decides, in one call from Python.

    :func:`stream_ends` (skipped where ``obs`` is empty: observation-only
    rows, flat rows with a stream key), then which done rows hold their next
    observation (:func:`read_fills` over ``fills``), then :func:`plan_rows`
    with the ends' ``cont``. A call with nothing to clean runs
    :func:`stream_ends` alone instead.

    Args:
        n: rows in the call.
        steps: rows per stream (row ``i`` belongs to stream ``i // steps``);
            0 to read ``stream`` instead (see :func:`plan`).
        stream: as :func:`plan`.
        done: bool[N], the rows' done flags.
        fills: [N, W] the one observation key's next observations (booleans
            as uint8), read on done rows (zero-, NaN- or all -1 signed-filled:
            not stored); empty ``[0, 0]`` to take ``stored`` as given.
        floating: ``fills`` holds floating-point values.
        signed: ``fills`` holds signed integers.
        stored: bool[N] or empty, used where ``fills`` is empty (see
            :func:`plan`). Writeable (the kernel assigns one of that type).
        joint: as :func:`plan`.
        group: as :func:`plan`.
        final_ok: as :func:`plan`.
        final_default: as :func:`plan`.
        reward: as :func:`plan`.
        restart: as :func:`plan`.
        terminated: as :func:`plan`.
        truncated: as :func:`plan`.
        marks: as :func:`plan`.
        obs: as :func:`stream_ends`; empty ``[0, 0]``: no stream ends.
        next_obs: as :func:`stream_ends`.
        ends_steps: :func:`stream_ends`'s ``steps``: ``steps`` where ``obs``
            holds every row, 1 where it holds each stream's first (and
            ``next_obs`` its last).
        last_next: as :func:`stream_ends`.
        first_before: as :func:`stream_ends`.
        open_before: as :func:`stream_ends`.
        ends_restart: :func:`stream_ends`'s ``restart``, per row of ``obs``
            (empty: continuity is not checked).
        ids: as :func:`stream_ends`.
        ids_before: as :func:`stream_ends`.
        carry: as :func:`plan`.
        reset_rows: as :func:`plan`.
        successor: as :func:`plan`.
        final: as :func:`plan`.
        stitch: as :func:`plan`.
        hold_done: as :func:`plan`.
        drop_lost: as :func:`select_rows`.

    Returns:
        ``(ends, planned)``: :func:`stream_ends`'s results (empty arrays,
        no break, where ``obs`` is empty) and :func:`plan_rows`'s.
    """
    if obs.shape[0] > 0:
        ends = stream_ends(obs, next_obs, ends_steps, last_next, first_before, open_before,
                           ends_restart, ids, ids_before)  # fmt: skip
    else:
        none = np.empty((0, obs.shape[1]), obs.dtype)
        ends = (none, none.copy(), np.zeros(0, np.uint8), False, -1,
                np.empty((0, ids.shape[1]), ids.dtype))  # fmt: skip
    if fills.shape[0] > 0:
        n_done = 0
        for i in range(n):
            n_done += done[i]
        stored = np.zeros(n if n_done else 0, np.bool_)
        if n_done:
            done_rows = np.empty(n_done, np.int64)
            j = 0
            for i in range(n):
                if done[i]:
                    done_rows[j] = i
                    j += 1
            zero = np.ones(n_done, np.bool_)
            nan = np.zeros(n_done, np.bool_)
            read_fills(fills, done_rows, floating, signed, zero, nan)
            for j in range(n_done):
                stored[done_rows[j]] = not (zero[j] or nan[j])
    planned = plan_rows(
        n, steps, stream, done, stored, joint, group, final_ok, final_default, reward, restart,
        terminated, truncated, marks, ends[2], carry, reset_rows, successor, final, stitch,
        hold_done, drop_lost,
    )  # fmt: skip
    return ends, planned


class Rules(NamedTuple):
    """The kernel's mode flags for one kind of call (see :mod:`cleanbuf.engine._kernels`).

    Attributes:
        reset_rows: next-step data: a reset row follows each non-joint done row.
        successor: observation-only data: a row's next observation is the next row's.
        final: same-step data: a done row's next observation is its final entry.
        stitch: next observations are written (False for compact output).
        hold_done: a next-step done row not stored waits for its reset row; False for
            compact output and, on full transitions, ``terminal_obs_in_done_row=True``.
        drop_lost: rows whose next observation is lost are not stored.
        marks: batch-end rows may be a collector's mark, decided by the next row
            (next-step time-last batches; :func:`plan`'s ``marks``).

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


class KernelResult(NamedTuple):
    """What :func:`one_pass` planned for one call (its ``planned`` result, named).

    Attributes:
        sel: the rows to emit and to hold, and the patches they need.
        released_src: int64[S], per stream: the call's row holding its held
            row's next observation, ``RELEASED_*`` (lost, as is, stored), or
            -1 (nothing released).
        carry: the new carry state, int64[5, S] (a fresh array).
        n_drop: reset rows dropped.
        n_lost: done rows whose terminal observation is lost.
        n_next_lost: other rows whose next observation is lost.
        n_done: episode ends completed in this call.
        bad_row: the first row that fails the reset-row check, or -1 (then
            ``sel`` is empty).
    """

    sel: Selection
    released_src: np.ndarray
    carry: np.ndarray
    n_drop: int
    n_lost: int
    n_next_lost: int
    n_done: int
    bad_row: int
