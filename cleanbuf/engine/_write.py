"""Writing a call's output (read -> plan -> **write**): rows moved into fresh tensors, then patched.

:func:`move` gathers the kept rows (``torch.index_select`` into a preallocated output; CPU rows
of at most ``SMALL_ROW_BYTES`` with numpy's ``take``; on a CUDA device the rows never leave it),
the patches write next observations, ``is_init`` and step counts into those copies, and
:class:`BufferPool` recycles the large outputs. Nothing here decides anything: the plan says which
rows, from where. The caller's batch is never written.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from tensordict import TensorDictBase

from cleanbuf.engine._compat import new_tensordict, storage_use_count
from cleanbuf.engine._kernels import RELEASED_LOST
from cleanbuf.engine._keys import Views, numpy_view

# Below this many bytes an allocation is cheap (no page faults): no pooling.
MIN_POOLED_BYTES = 1 << 20
_use_count = storage_use_count  # None where torch cannot tell: never reuse


class BufferPool:
    """One reusable output buffer per key (a large output's fresh allocation costs page faults).

    A buffer is handed out again only when nothing else references its memory: a tensor storage
    copies the rows and drops them, while a ``ListStorage`` (or a user) that keeps them keeps the
    buffer, and the pool allocates a new one rather than overwrite rows someone still holds.

    Examples:
        >>> pool = BufferPool()
        >>> a = pool.take("obs", (1024, 512), torch.float32, torch.device("cpu"))
        >>> ptr = a.data_ptr()
        >>> del a  # the caller is done with it (a tensor storage copied it)
        >>> pool.take("obs", (1000, 512), torch.float32, torch.device("cpu")).data_ptr() == ptr
        True
        >>> kept = pool.take("obs", (1000, 512), torch.float32, torch.device("cpu"))
        >>> again = pool.take("obs", (1000, 512), torch.float32, torch.device("cpu"))
        >>> again.data_ptr() == kept.data_ptr()
        False
        >>> pool.take("small", (10, 4), torch.float32, torch.device("cpu")) is None
        True
    """

    def __init__(self):
        self._buffers: dict = {}

    def take(
        self, key, shape: tuple, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """An uninitialized tensor of ``shape`` in reused memory; None for a small one."""
        rows, feature = shape[0], tuple(shape[1:])
        row_bytes = dtype.itemsize
        for d in feature:
            row_bytes *= d
        if rows * row_bytes < MIN_POOLED_BYTES:
            return None
        entry = self._buffers.get(key)
        if entry is not None:
            buf, idle = entry
            if (
                buf.dtype == dtype
                and buf.device == device
                and tuple(buf.shape[1:]) == feature
                and buf.shape[0] >= rows
                and _use_count(buf) == idle
            ):
                return buf[:rows]
        buf = torch.empty(shape, dtype=dtype, device=device)
        idle = _use_count(buf)
        if idle is not None:
            self._buffers[key] = (buf, idle)
        return buf[:rows]

    def __getstate__(self) -> dict:
        # Buffers are a cache: never pickle (or deep-copy) them.
        return {}

    def __setstate__(self, state: dict) -> None:
        self._buffers = {}


# Rows up to this size on the CPU move with numpy's take (torch's dispatch costs more).
SMALL_ROW_BYTES = 128


def index_tensor(index: np.ndarray, device=None) -> torch.Tensor:
    """A numpy row index as a tensor on ``device``, a read-only one copied (no torch warning).

    Examples:
        >>> index_tensor(np.array([2, 0])).tolist()
        [2, 0]
    """
    t = torch.from_numpy(index) if index.flags.writeable else torch.tensor(index)
    return t if device is None else t.to(device)


class RowIndex:
    """A row index kept as numpy (for the planner) and as tensors (per device).

    Args:
        index: int64 source rows, in destination order.

    Examples:
        >>> idx = RowIndex(np.array([0, 2]))
        >>> idx.on(torch.device("cpu")).tolist()
        [0, 2]
    """

    def __init__(self, index: np.ndarray):
        self.index = index
        self._tensors: dict = {}

    def __len__(self) -> int:
        return len(self.index)

    def on(self, device: torch.device) -> torch.Tensor:
        """The index as a tensor on ``device`` (cached per device)."""
        if device not in self._tensors:
            self._tensors[device] = index_tensor(self.index, device)
        return self._tensors[device]


def gather(
    x: torch.Tensor,
    rows: RowIndex,
    head: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns ``cat([head, x[rows]])`` as a contiguous tensor, in one pass.

    Args:
        x: source rows (first dimension is the row).
        rows: the rows of ``x`` to take.
        head: rows to put first (the held rows released by this call), or
            None.
        out: where to write (``len(head) + len(rows)`` rows, contiguous), or
            None for a new tensor.

    Examples:
        >>> x = torch.arange(6.0).reshape(3, 2)
        >>> gather(x, RowIndex(np.array([2, 0]))).tolist()
        [[4.0, 5.0], [0.0, 1.0]]
        >>> gather(x, RowIndex(np.array([1])), head=torch.zeros(1, 2)).tolist()
        [[0.0, 0.0], [2.0, 3.0]]
    """
    n_head = 0 if head is None else len(head)
    if out is None and n_head == 0:
        if x.nbytes <= SMALL_ROW_BYTES * len(x) and x.is_cpu:
            a = numpy_view(x)
            if a is not None:
                return torch.from_numpy(a.take(rows.index, axis=0))
        return x.index_select(0, rows.on(x.device))
    index = rows.on(x.device)
    if out is None:
        out = torch.empty((n_head + len(rows), *x.shape[1:]), dtype=x.dtype, device=x.device)
    if n_head:
        out[:n_head] = head.to(x.device)
    torch.index_select(x, 0, index, out=out[n_head:])
    return out


# From this many bytes a row, ``set_rows`` copies row by row (no temporary of all the rows).
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
    n_rel = len(rel_slots)
    if n_rel == 0 and len(emit) == n_rows:
        for k in moved:
            x = views.flat(k)
            tensors[k] = x.clone() if k in patched else x
    else:
        emit_rows = slots = None  # (made on first use: small rows are taken without them)
        size = n_rel + len(emit)
        small = SMALL_ROW_BYTES * n_rows  # take() up to this size
        for k, x in moved.items():
            a = views[k]
            if a is not None and a.nbytes <= small:
                # numpy's take; its result is also the output's numpy view for the patches.
                a = _take_small(a, emit, held[k], rel_slots, size) if n_rel else a.take(emit, 0)
                if a is not None:
                    out[k] = a
                    tensors[k] = torch.from_numpy(a)
                    continue
            if emit_rows is None:
                emit_rows, slots = RowIndex(emit), RowIndex(rel_slots)
            buf = None
            if x.nbytes >= MIN_POOLED_BYTES:
                feature = x.shape[views.batch_dims :]
                buf = pool.take(k, (size, *feature), x.dtype, x.device)
            head = held[k].index_select(0, slots.on(held[k].device)) if n_rel else None
            tensors[k] = gather(views.flat(k), emit_rows, head, buf)
    if len(hold):
        new_held = take_rows(views, moved, hold)
    return out, new_held


def take_rows(views: Views, keys, rows: np.ndarray) -> dict:
    """``{k: views[k][rows]}`` for ``keys``, as new tensors (the rows a call holds).

    Small CPU rows with numpy's take from the views the call already made,
    others with :func:`gather`.

    Examples:
        >>> views = Views({"a": torch.arange(4.0).reshape(2, 2)}, 2, 4)
        >>> take_rows(views, ["a"], np.array([3, 0]))["a"].tolist()
        [3.0, 0.0]
    """
    index, small = RowIndex(rows), SMALL_ROW_BYTES * views.n_rows
    out = {}
    for k in keys:
        a = views[k]
        if a is not None and a.nbytes <= small:
            out[k] = torch.from_numpy(a.take(rows, axis=0))
        else:
            out[k] = gather(views.flat(k), index)
    return out


def _take_small(
    a: np.ndarray, emit: np.ndarray, held: torch.Tensor, slots: np.ndarray, size: int
) -> np.ndarray | None:
    """``concatenate([held[slots], a[emit]])`` with numpy, in one output.

    None if the held rows have no numpy view of ``a``'s dtype and row shape
    (then torch moves them).
    """
    h = numpy_view(held)
    if h is None or h.dtype != a.dtype or h.shape[1:] != a.shape[1:]:
        return None
    out = np.empty((size, *a.shape[1:]), a.dtype)
    h.take(slots, axis=0, out=out[: len(slots)])
    a.take(emit, axis=0, out=out[len(slots) :])
    return out


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
    """Sets ``is_init`` at ``offset + init_pos`` and subtracts ``row_shift`` from the step counts.

    ``row_shift``: int64 per row from ``offset`` to the last row, or empty when no row shifts.
    Keys (``is_init_key``, ``step_keys``) absent from ``rows`` are left alone.
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
    """Builds a TensorDict ``[n_rows]`` from tuple-keyed leaves, skipping TensorDict's checks.

    The leaves must already have the batch size. It declares their device (``device``, or their
    common one) even when the batch had none; see docs/rules.md, 'Core rule (next-step mode)'.
    Leaves on different devices give ``device=None``.

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
