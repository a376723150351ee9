"""numba kernels of the compact storage's bookkeeping: links, side entries, pending rows.

:class:`~cleanbuf.online._compact.CompactStorage` keeps per slot one int32
link (``>= 0``: the slot holding this row's next observation; ``<= -2``: the
side-table entry ``-2 - link``; ``-1``: none yet), a stack of free side
entries, and per stream its newest slot (the *pending* row, whose next
observation waits in the side table for its successor). A write has two
steps around the byte comparisons, which stay with the storage (on its
device):

1. :func:`plan_links` pairs each row of the write with the next row of its
   stream, and each stream's first row with that stream's pending row of an
   earlier write (alive: not overwritten now, still in the side table);
2. :func:`commit_links`, given which pairs compared equal, frees the side
   entries of the slots overwritten and of the pending rows joined, links
   the equal pairs, and hands out side entries to the rest and to each
   stream's newest row.

Both work on host arrays (the links' host copy, the free stack, the pending
arrays, the write's slots and stream ids): a few small index arrays per
write, never observations. Nothing here knows about torch or TensorDicts.
They are checked against the readable model in ``tests/test_compact.py``
(``LinkModel``) on random streams with random write boundaries.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _ring_start(slots, size):
    """The first slot when ``slots`` are consecutive in the ring, else -1."""
    n = slots.shape[0]
    if n == 0:
        return -1
    start = slots[0]
    for i in range(n):
        if slots[i] != (start + i) % size:
            return -1
    return start


@njit(cache=True, nogil=True)
def _written(slot, start, n, size, sorted_slots):
    """Whether ``slot`` is one of the slots of this write."""
    if start >= 0:
        return (slot - start) % size < n
    j = np.searchsorted(sorted_slots, slot)
    return j < sorted_slots.shape[0] and sorted_slots[j] == slot


@njit(cache=True, nogil=True)
def _stable_order(sid):
    """``np.argsort(sid, kind="stable")``, cheap where it is sorted or spans few values."""
    n = sid.shape[0]
    ascending = True
    lo = hi = sid[0] if n else 0
    for i in range(1, n):
        if sid[i] < sid[i - 1]:
            ascending = False
        lo = min(lo, sid[i])
        hi = max(hi, sid[i])
    if ascending:  # the filter's rows: stream by stream
        return np.arange(n)
    if hi - lo > 4 * n + 64:
        return np.argsort(sid, kind="mergesort")
    count = np.zeros(hi - lo + 2, np.int64)  # a counting sort, stable
    for i in range(n):
        count[sid[i] - lo + 1] += 1
    for v in range(1, count.shape[0]):
        count[v] += count[v - 1]
    order = np.empty(n, np.int64)
    for i in range(n):
        v = sid[i] - lo
        order[count[v]] = i
        count[v] += 1
    return order


@njit(cache=True, nogil=True)
def rows_match(x, y, xi, yi, out):
    """``out[i] &= (x[xi[i]] == y[yi[i]])`` as whole rows of integer words (so: bytes).

    The storage's comparison where its rows are on the CPU (numpy views of
    them, nothing copied); elsewhere it compares on the device.
    """
    width = x.shape[1]
    for i in range(out.shape[0]):
        if not out[i]:
            continue
        r, s = xi[i], yi[i]
        for w in range(width):
            if x[r, w] != y[s, w]:
                out[i] = False
                break


@njit(cache=True, nogil=True)
def copy_rows(dst, di, src, si):
    """``dst[di[i]] = src[si[i]]``, whole rows of integer words (CPU side-table writes)."""
    for i in range(di.shape[0]):
        dst[di[i]] = src[si[i]]


@njit(cache=True, nogil=True)
def plan_links(sid, slots, link, pend_stream, pend_slot, next_slot, in_order):
    """Pairs a write's rows before anything is written.

    Args:
        sid: int64[n] the stream of each row (rows of one stream in time order).
        slots: int64[n] the slot each row goes to.
        link: int32[max_size] the links before the write.
        pend_stream: int64[p] sorted stream ids with a pending row.
        pend_slot: int64[p] their pending slots.
        next_slot: where an in-order write starts.
        in_order: the writer moves its cursor (a round-robin extend).

    Returns:
        ``(ordered, a, b, adjacent, l_pos, l_sid, j_row, j_pos, j_entry, released)``:
        whether the write continues the ring at ``next_slot`` (else rows
        linking into it must be detached first); the pairs ``a -> b`` (row
        positions) of consecutive rows of one stream, and whether every
        pair is ``b == a + 1``; each stream's last row and its stream (by
        stream id); the pending rows to join (slot, the position of their
        stream's first row here, their side entry); and how many side
        entries the overwritten slots free (each joined row that compares
        equal frees one more).
    """
    n = slots.shape[0]
    size = link.shape[0]
    ordered = True
    if n:
        ordered = in_order
        if ordered:
            for i in range(n):
                if slots[i] != (next_slot + i) % size:
                    ordered = False
                    break
    start = _ring_start(slots, size)
    sorted_slots = np.sort(slots) if start < 0 else slots[:0]
    order = _stable_order(sid)
    a = np.empty(max(n - 1, 0), np.int64)
    b = np.empty(max(n - 1, 0), np.int64)
    m = 0
    groups = 0
    for i in range(n):
        if i == 0 or sid[order[i]] != sid[order[i - 1]]:
            groups += 1
        else:
            a[m] = order[i - 1]
            b[m] = order[i]
            m += 1
    a, b = a[:m], b[:m]
    adjacent = True
    for i in range(m):
        if b[i] - a[i] != 1:
            adjacent = False
            break
    l_pos = np.empty(groups, np.int64)
    l_sid = np.empty(groups, np.int64)
    j_row = np.empty(groups, np.int64)
    j_pos = np.empty(groups, np.int64)
    j_entry = np.empty(groups, np.int64)
    g = 0
    joined = 0
    p = pend_stream.shape[0]
    for i in range(n):
        row = order[i]
        s = sid[row]
        if i + 1 == n or sid[order[i + 1]] != s:
            l_pos[g] = row
            l_sid[g] = s
            g += 1
        if p and (i == 0 or sid[order[i - 1]] != s):  # the stream's first row here
            k = np.searchsorted(pend_stream, s)
            if k < p and pend_stream[k] == s:
                r = pend_slot[k]
                if link[r] <= -2 and not _written(r, start, n, size, sorted_slots):
                    j_row[joined] = r
                    j_pos[joined] = row
                    j_entry[joined] = -2 - link[r]
                    joined += 1
    released = 0
    if start >= 0:
        for i in range(n):
            if link[slots[i]] <= -2:
                released += 1
    else:  # count each slot once
        for i in range(n):
            if (i == 0 or sorted_slots[i] != sorted_slots[i - 1]) and link[sorted_slots[i]] <= -2:
                released += 1
    return (
        ordered,
        a,
        b,
        adjacent,
        l_pos,
        l_sid,
        j_row[:joined],
        j_pos[:joined],
        j_entry[:joined],
        released,
    )


@njit(cache=True, nogil=True)
def commit_links(link, slots, a, b, eq, j_row, j_pos, ok, l_pos, l_sid, pend_stream, pend_slot,
                 free, n_free):  # fmt: skip
    """Applies a write's links after its rows are stored.

    The free stack must hold enough entries once this write's are freed
    (the caller grows it from :func:`plan_links`' count).

    Args:
        link: int32[max_size], updated in place.
        slots: int64[n] the slots written.
        a: the pairs of :func:`plan_links`: the earlier row...
        b: ...and the next row of its stream.
        eq: bool, per pair: ``b``'s observation equals ``a``'s next
            observation, byte for byte.
        j_row: the pending rows to join (slots), from :func:`plan_links`.
        j_pos: the position of their stream's first row here.
        ok: bool, per pending row: it compared equal with that row.
        l_pos: each stream's last row here (sorted by stream id).
        l_sid: its stream.
        pend_stream: the streams with a pending row before the write (sorted).
        pend_slot: their pending slots.
        free: int64[capacity] the free-entry stack, updated in place.
        n_free: entries on it.

    Returns:
        ``(n_free, side_pos, side_entry, pend_stream, pend_slot)``: the row
        positions whose next observation goes to the side table and their
        entries, and the pending rows after the write.
    """
    n = slots.shape[0]
    size = link.shape[0]
    for i in range(n):  # the overwritten slots' entries are free again
        old = link[slots[i]]
        if old <= -2:
            free[n_free] = -2 - old
            n_free += 1
        link[slots[i]] = -1
    for i in range(j_row.shape[0]):
        if ok[i]:
            r = j_row[i]
            free[n_free] = -2 - link[r]
            n_free += 1
            link[r] = slots[j_pos[i]]
    m = l_pos.shape[0]
    for i in range(a.shape[0]):
        if eq[i]:
            link[slots[a[i]]] = slots[b[i]]
        else:
            m += 1
    side_pos = np.empty(m, np.int64)
    k = 0
    for i in range(a.shape[0]):
        if not eq[i]:
            side_pos[k] = a[i]
            k += 1
    side_pos[k:] = l_pos
    side_entry = free[n_free - m : n_free].copy()
    n_free -= m
    for i in range(m):
        link[slots[side_pos[i]]] = -2 - side_entry[i]
    # pending: the earlier ones this write neither continues nor overwrites, and its own
    start = _ring_start(slots, size)
    sorted_slots = np.sort(slots) if start < 0 else slots[:0]
    p = pend_stream.shape[0]
    g = l_sid.shape[0]
    out_stream = np.empty(p + g, np.int64)
    out_slot = np.empty(p + g, np.int64)
    i = j = k = 0
    while i < p or j < g:
        if j == g or (i < p and pend_stream[i] < l_sid[j]):
            if not _written(pend_slot[i], start, n, size, sorted_slots):
                out_stream[k] = pend_stream[i]
                out_slot[k] = pend_slot[i]
                k += 1
            i += 1
        else:
            if i < p and pend_stream[i] == l_sid[j]:
                i += 1  # replaced by this write's newest row
            out_stream[k] = l_sid[j]
            out_slot[k] = slots[l_pos[j]]
            k += 1
            j += 1
    return n_free, side_pos, side_entry, out_stream[:k], out_slot[:k]


@njit(cache=True, nogil=True)
def rows_linking_into(link, slots):
    """The rows, outside ``slots``, whose link points into ``slots`` (to detach first)."""
    size = link.shape[0]
    mark = np.zeros(size, np.bool_)
    for i in range(slots.shape[0]):
        mark[slots[i]] = True
    out = np.empty(size, np.int64)
    k = 0
    for r in range(size):
        t = link[r]
        if t >= 0 and mark[t] and not mark[r]:
            out[k] = r
            k += 1
    return out[:k]


@njit(cache=True, nogil=True)
def continues_ring(slots, next_slot, size):
    """Whether ``slots`` are the ring's next ``n`` slots from ``next_slot``."""
    for i in range(slots.shape[0]):
        if slots[i] != (next_slot + i) % size:
            return False
    return True


@njit(cache=True, nogil=True)
def write_links(sid, slots, link, pend_stream, pend_slot, free, n_free, obs, nxt, side):
    """One in-order write of CPU rows with one observation key, in one call.

    :func:`plan_links`, the byte comparisons (:func:`rows_match`),
    :func:`commit_links` and the side-table writes (:func:`copy_rows`) in
    turn, for the common case: rows stored on the CPU, one observation
    key, the write continuing the ring (nothing to detach), after the rows
    are stored. ``obs`` / ``nxt`` / ``side``: word views of the rows'
    observations, their next observations and the side table.

    Returns:
        ``(need, n_free, pend_stream, pend_slot)``: ``need`` is 0 when the
        write is done; otherwise nothing was changed and the side table must
        first have ``need`` entries free once ``n_free`` more are freed
        (``n_free`` then holds that count).
    """
    plan = plan_links(sid, slots, link, pend_stream, pend_slot, 0, False)
    _, a, b, _, l_pos, l_sid, j_row, j_pos, j_entry, freed = plan
    eq = np.ones(a.shape[0], np.bool_)
    ok = np.ones(j_pos.shape[0], np.bool_)
    rows_match(nxt, obs, a, b, eq)
    rows_match(side, obs, j_entry, j_pos, ok)
    need = l_pos.shape[0]
    for i in range(eq.shape[0]):
        if not eq[i]:
            need += 1
    for i in range(ok.shape[0]):
        if ok[i]:
            freed += 1
    if n_free + freed < need:
        return need, freed, pend_stream, pend_slot
    n_free, side_pos, side_entry, pend_stream, pend_slot = commit_links(
        link, slots, a, b, eq, j_row, j_pos, ok, l_pos, l_sid, pend_stream, pend_slot, free, n_free
    )
    copy_rows(side, side_entry, nxt, side_pos)
    return 0, n_free, pend_stream, pend_slot


@njit(cache=True, nogil=True)
def gather_next(link, slots, obs, side, out):
    """``out[i]``: the next observation of slot ``slots[i]`` (words), from ``obs`` or ``side``.

    The sample path on the CPU: one pass instead of a gather, a mask and a
    scatter. A slot never written (link -1) is left as it is.
    """
    for i in range(slots.shape[0]):
        t = link[slots[i]]
        if t >= 0:
            out[i] = obs[t]
        elif t <= -2:
            out[i] = side[-2 - t]
