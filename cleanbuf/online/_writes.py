"""Whether the rows a filter's call returned reached the buffer: what the buffer shows.

A replay buffer runs the filter, then writes what the filter returned; if
that write fails (a full disk, a storage that raises) the filter has
already moved on. The buffer tells which happened the next time the filter
looks: a round-robin writer wrote the call's rows at the slots from its
cursor on, so the storage counts them and those slots hold them (their
first and last rows, compared on one observation leaf) when the write
succeeded; a failed write leaves the count short or the slots holding
something else. The filter looks before its next call, its flush, its stats and
its state:

- stored: the call stands; the same batch written again is a duplicate
  (a :class:`~cleanbuf.ContinuityError`), never a retry;
- failed: the cleaner goes back to before that call (the rows it released
  are held again), as if it never came: a retry stores them, and another
  batch is refused as a skipped one;
- unknown (another writer, a consuming buffer, a transform after the
  filter that changed the rows' keys): the cleaner's own rule stays
  (:class:`cleanbuf.engine._retry.Retry`).
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
from tensordict import TensorDictBase

from cleanbuf.online._compat import storage_leaf, storage_length, td_leaf, writer_slot

# buffer -> the key its last write was probed on (the rows' keys rarely change)
_PROBE_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class LastWrite(NamedTuple):
    """A call's rows on their way into a buffer.

    Attributes:
        buffer: a weak reference to the buffer.
        write_count: the writer's count once it took the rows (moved
            before the storage writes, so also after a failed write).
        length: ``len(storage)`` the write must reach (it counts rows written).
        slots: the slots of the first and the last row (one slot for one row).
        key: the leaf compared.
        row_shape: that leaf's shape per row.
        dtype: that leaf's dtype.
        probe: the bytes of that leaf's first and last rows, as the call returned them.
    """

    buffer: Any
    write_count: int
    length: int
    slots: tuple
    key: tuple
    row_shape: torch.Size
    dtype: torch.dtype
    probe: tuple

    def stored(self) -> bool | None:
        """True if the buffer holds the rows, False if not, None if it cannot tell."""
        rb = self.buffer()
        if rb is None or rb.write_count < self.write_count:
            return None  # the buffer is gone, or was emptied since
        storage = rb.storage
        if not getattr(storage, "initialized", True) or storage_length(storage) < self.length:
            return False  # nothing was ever stored, or the write never counted its rows
        try:
            leaf = storage_leaf(storage, self.key)
            if leaf is None:  # not a tensor storage: read the two slots
                leaf = storage_leaf(storage, self.key, torch.tensor(self.slots))
                slots = range(len(self.slots))
            else:
                slots = self.slots
        except Exception:  # a storage that cannot be read by index
            return None
        if not isinstance(leaf, torch.Tensor):
            return None  # not stored under that key (a transform after the filter)
        if leaf.shape[1:] != self.row_shape or leaf.dtype != self.dtype:
            return False
        return row_bytes(leaf, slots) == self.probe


def row_bytes(leaf: torch.Tensor, rows: Any) -> tuple:
    """The bytes of ``leaf``'s ``rows`` (indices along its first dimension), one per row.

    Byte for byte: a NaN the call returned is stored as that NaN, where
    ``torch.equal`` says no. A CPU leaf is read through numpy, which views
    it and copies the rows' bytes only; other leaves (another device, a
    dtype numpy lacks) row by row.

    Examples:
        >>> x = torch.tensor([[float("nan"), 1.0], [2.0, 3.0]])
        >>> torch.equal(x, x.clone()), row_bytes(x, (0,)) == row_bytes(x.clone(), (0,))
        (False, True)
        >>> row_bytes(x.bfloat16(), (1,)) == row_bytes(x.bfloat16().clone(), (1,))
        True
    """
    if leaf.is_cpu and not leaf.requires_grad:
        try:
            array = leaf.numpy()
        except (TypeError, RuntimeError):  # bfloat16, a conjugate or negative view
            pass
        else:
            return tuple([array[r].tobytes() for r in rows])
    return tuple(
        [
            leaf[r].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            for r in rows
        ]
    )


def slot_before(rb: Any) -> tuple[int, int] | None:
    """Where the buffer will write the call's rows (see :func:`writer_slot`)."""
    return None if rb is None else writer_slot(rb)


def record(rb: Any, slot: tuple[int, int], out: TensorDictBase) -> LastWrite | None:
    """What to look at later to tell whether ``out`` reached ``rb`` (None: nothing to tell)."""
    n = out.batch_size[0] if out.batch_dims else 0
    if not n or n > slot[1]:
        return None
    try:
        key = _PROBE_KEYS.get(rb)
    except TypeError:  # a buffer that cannot be a weak dictionary key
        key = None
    value = None if key is None else td_leaf(out, key)
    if not isinstance(value, torch.Tensor):  # first call, or other keys
        key = _probe_key(out)
        value = None if key is None else td_leaf(out, key)
        if not isinstance(value, torch.Tensor):
            return None
        try:
            _PROBE_KEYS[rb] = key
        except TypeError:
            pass
    first, capacity = slot
    if n > 1:  # the first and the last row
        rows, slots = (0, n - 1), (first % capacity, (first + n - 1) % capacity)
    else:
        rows, slots = (0,), (first % capacity,)
    length = min(storage_length(rb.storage) + n, capacity)
    return LastWrite(
        weakref.ref(rb),
        rb.write_count + n,
        length,
        slots,
        key,
        value.shape[1:],
        value.dtype,
        row_bytes(value, rows),
    )


def _probe_key(out: TensorDictBase) -> Any:
    """An observation key of ``out`` (a key with a ``("next", ...)`` twin), or None."""
    nxt = out.get("next", None)
    if not isinstance(nxt, TensorDictBase):
        return None
    twins = nxt.keys()
    return next((k for k in out.keys() if k != "next" and k in twins), None)
