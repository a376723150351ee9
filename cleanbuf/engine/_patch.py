"""Building a call's output: moving rows, writing next observations and bookkeeping.

Everything here writes into fresh tensors made for the output (or the held
rows); the caller's batch is never written.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from tensordict import TensorDictBase

from cleanbuf.engine._compat import new_tensordict
from cleanbuf.engine._kernels import RELEASED_LOST
from cleanbuf.engine._move import SMALL_ROW_BYTES, RowIndex, Views, gather, index_tensor
from cleanbuf.engine._pool import MIN_POOLED_BYTES, BufferPool

# From this many bytes a row, ``set_rows`` copies row by row: no slower
# than one fancy-index assignment there, and it needs no temporary of all
# the rows, which the memory benchmark sees at its peak (bench/README.md).
ROW_LOOP_BYTES = 16 * 1024


def move(
    moved: dict,
    views: Views,
    held: dict,
    rel_slots: np.ndarray,
    emit: np.ndarray,
    hold: np.ndarray,
    n_rows: int,
    patched: set,
    pool: BufferPool,
):
    """Gathers the rows to emit (after the released held rows) and the rows to hold.

    When a call emits every row in order and releases none, nothing moves:
    the output leaves are views of the batch, except the ``patched`` ones,
    which are copied so that the caller's batch is never written.

    Args:
        moved: the call's leaves to move (key -> tensor, as in the batch).
        views: the call's leaves as rows (a superset of ``moved``).
        held: the held rows from earlier calls.
        rel_slots: the held rows released by this call (slots into ``held``).
        emit: the call's rows to emit, in order.
        hold: the call's rows to hold.
        n_rows: rows in the call.
        patched: keys whose output rows will be written afterwards.
        pool: reusable output buffers.

    Returns:
        ``(out, new_held)``: the output leaves with their numpy views
        (:class:`Views`), and a dict from key to tensor.
    """
    out, new_held = Views({}), {}
    tensors = out.tensors
    hold_rows = RowIndex(hold)
    if len(rel_slots) == 0 and len(emit) == n_rows:
        for k in moved:
            x = views.flat(k)
            tensors[k] = x.clone() if k in patched else x
    else:
        emit_rows, slots = RowIndex(emit), RowIndex(rel_slots)
        size = len(rel_slots) + len(emit)
        small = 0 if len(rel_slots) else SMALL_ROW_BYTES * n_rows  # take() up to this size
        for k, x in moved.items():
            a = views[k] if small else None
            if a is not None and a.nbytes <= small:
                # Small rows on the CPU: numpy's take (see _move), whose
                # result is kept as the output's numpy view for the patches.
                out[k] = a = a.take(emit, axis=0)
                tensors[k] = torch.from_numpy(a)
                continue
            buf = None
            if x.nbytes >= MIN_POOLED_BYTES:
                feature = x.shape[views.batch_dims :]
                buf = pool.take(k, (size, *feature), x.dtype, x.device)
            head = held[k].index_select(0, slots.on(held[k].device)) if len(slots) else None
            tensors[k] = gather(views.flat(k), emit_rows, head, buf)
    if len(hold_rows):
        for k in moved:
            new_held[k] = gather(views.flat(k), hold_rows)
    return out, new_held


def write_next_obs(
    out: Views, n_rel, leaves: Views, obs_keys, sel, released_src, final_of, policy, obs_only
):
    """Writes ``("next", k)`` for the output rows whose next observation this call knows.

    Args:
        out: the output leaves (``out.tensors[k]`` holds the released held
            rows first, then the emitted rows).
        n_rel: how many released held rows come first.
        leaves: the call's leaves as rows (the sources).
        obs_keys: the observation keys.
        sel: the call's :class:`cleanbuf.engine._kernels.Selection`.
        released_src: per released held row, the row of this call that holds
            its next observation, or ``RELEASED_LOST`` / ``RELEASED_AS_IS`` /
            ``RELEASED_STORED`` (the last two: left as stored).
        final_of: observation key -> final-observation leaf key (same-step).
        policy: the lost-observation policy ("nan", "keep", "drop").
        obs_only: the data has no ``("next", k)``: create the leaf (every
            output row is then written).
    """
    stitched, stitched_src, lost, final = sel.stitched, sel.stitched_src, sel.lost, sel.final
    # The rows whose final entries hold their next observations.
    final_src = sel.emit[final] if len(final) else final
    if n_rel:  # output positions: the released held rows come first
        stitched, lost, final = n_rel + stitched, n_rel + lost, n_rel + final
        rel_pos = np.flatnonzero(released_src >= 0)
        rel_lost = np.flatnonzero(released_src == RELEASED_LOST)
        if len(rel_lost):
            lost = np.concatenate([rel_lost, lost])
        released_src = released_src[rel_pos]
    for k in obs_keys:
        nk = ("next", *k)
        if obs_only:
            out.tensors[nk] = torch.empty_like(out.tensors[k])
        if len(stitched):
            set_rows(out, nk, stitched, leaves, k, stitched_src)
        if n_rel and len(rel_pos):
            set_rows(out, nk, rel_pos, leaves, k, released_src)
        if len(final):
            set_rows(out, nk, final, leaves, final_of[k], final_src)
        if len(lost):
            if policy == "nan":
                fill_rows(out, nk, lost, math.nan)
            elif obs_only:  # "keep": the producer left nothing; zeros, as TorchRL fills
                fill_rows(out, nk, lost, 0)


def fix_bookkeeping(rows: Views, offset, init_pos, row_shift, is_init_key, step_keys) -> None:
    """Sets ``is_init`` and shifts the step counts of the given rows.

    ``is_init`` at ``offset + init_pos``; ``row_shift`` is subtracted from
    the step counts (``step_keys``) of rows ``offset:``, where those keys
    exist.

    ``row_shift`` is int64 per row from ``offset`` on (to the last row), or
    empty when no row shifts.
    """
    if len(init_pos) and is_init_key in rows.tensors:
        fill_rows(rows, is_init_key, offset + init_pos if offset else init_pos, True)
    if not len(row_shift):
        return
    shift = row_shift  # reshaped to the counts' dimensions (the same for both, usually)
    for key in step_keys:
        if key not in rows.tensors:
            continue
        a = rows[key]
        x = rows.tensors[key] if a is None else a
        if shift.ndim != x.ndim:
            shift = row_shift.reshape((-1,) + (1,) * (x.ndim - 1))
        if a is not None:
            a = a[offset:]
            np.subtract(a, shift, out=a, casting="unsafe")
        else:
            x[offset:] -= index_tensor(shift, x.device).to(x.dtype)


def set_rows(dst: Views, dst_key, pos: np.ndarray, src: Views, src_key, rows: np.ndarray) -> None:
    """``dst[dst_key][pos] = src[src_key][rows]``, on the destination's device.

    Examples:
        >>> dst, src = Views({"a": torch.zeros(3)}), Views({"b": torch.tensor([5.0, 6.0, 7.0])})
        >>> set_rows(dst, "a", np.array([0, 2]), src, "b", np.array([2, 1]))
        >>> dst.tensors["a"].tolist()
        [7.0, 0.0, 6.0]
    """
    d, s = dst[dst_key], src[src_key]
    if d is not None and s is not None:
        if s.nbytes >= ROW_LOOP_BYTES * len(s):  # large rows: no temporary copy
            for p, r in zip(pos.tolist(), rows.tolist()):
                d[p] = s[r]
        else:
            d[pos] = s[rows]
        return
    d, s = dst.flat(dst_key), src.flat(src_key)
    d[index_tensor(pos, d.device)] = s.index_select(0, index_tensor(rows, s.device)).to(d.device)


def fill_rows(dst: Views, key, pos: np.ndarray, value) -> None:
    """``dst[key][pos] = value``.

    Examples:
        >>> dst = Views({"a": torch.zeros(3)})
        >>> fill_rows(dst, "a", np.array([1]), 2.0)
        >>> dst.tensors["a"].tolist()
        [0.0, 2.0, 0.0]
    """
    d = dst[key]
    if d is not None:
        if d.ndim > 1 and d.size == len(d):  # one value per row: numpy's faster 1-D path
            d = d.reshape(len(d))
        d[pos] = value
    else:
        t = dst.flat(key)
        t[index_tensor(pos, t.device)] = value


def as_td(leaves: dict, n_rows: int, device=None) -> TensorDictBase:
    """Builds a TensorDict ``[n_rows]`` from tuple-keyed leaves.

    The leaves were made here with the right batch size and device, so the
    TensorDict's checks are skipped (:func:`cleanbuf.engine._compat.new_tensordict`).

    The TensorDict declares the device its leaves share (``device``, or the
    leaves' common device when ``device`` is None), even when the batch
    came without one, as TorchRL's collectors yield it. A storage compares
    that device with its own and, when they differ, runs ``to()`` over every
    leaf first, a third of a plain MuJoCo-like ``extend`` when measured.
    Leaves on different devices keep ``device=None``.

    Args:
        leaves: tuple key -> tensor of ``n_rows`` rows.
        n_rows: the batch size.
        device: the device every leaf is on (that of the batch), or None.

    Examples:
        >>> td = as_td({("a",): torch.zeros(2), ("next", "b"): torch.ones(2, 3)}, 2)
        >>> td["next", "b"].shape, td.device
        (torch.Size([2, 3]), device(type='cpu'))
        >>> as_td({("a",): torch.zeros(2), ("b",): torch.zeros(2, device="meta")}, 2).device is None
        True
    """
    if device is None:
        device = common_device(leaves)
    batch = torch.Size([n_rows])
    nested: dict = {}
    for k, v in leaves.items():
        node = nested
        for part in k[:-1]:
            node = node.setdefault(part, {})
        node[k[-1]] = v
    return new_tensordict(nested, batch, device)


def common_device(leaves: dict) -> torch.device | None:
    """The device every leaf is on; None if they differ or there is no leaf.

    Examples:
        >>> common_device({("a",): torch.zeros(1), ("b",): torch.ones(1)})
        device(type='cpu')
        >>> common_device({}) is None
        True
    """
    device = None
    for v in leaves.values():
        if device is None:
            device = v.device
        elif v.device != device:
            return None
    return device
