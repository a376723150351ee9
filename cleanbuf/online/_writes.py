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
  (:mod:`cleanbuf.engine._retry`).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from tensordict import TensorDictBase

from cleanbuf.online._compat import storage_leaf, writer_slot


@dataclasses.dataclass(frozen=True)
class LastWrite:
    """A call's rows on their way into a buffer.

    Attributes:
        buffer: a weak reference to the buffer.
        write_count: the writer's count once it took the rows (moved
            before the storage writes, so also after a failed write).
        length: ``len(storage)`` the write must reach (it counts rows written).
        first: the slot of the first row.
        capacity: the storage's capacity (slots wrap around).
        n_rows: rows the call returned.
        key: the leaf compared.
        probe: that leaf's first and last rows, as the call returned them.
    """

    buffer: Any
    write_count: int
    length: int
    first: int
    capacity: int
    n_rows: int
    key: tuple
    probe: torch.Tensor

    def stored(self) -> bool | None:
        """True if the buffer holds the rows, False if not, None if it cannot tell."""
        rb = self.buffer()
        if rb is None or rb.write_count < self.write_count:
            return None  # the buffer is gone, or was emptied since
        ends = [self.first, self.first + self.n_rows - 1] if self.n_rows > 1 else [self.first]
        slots = torch.tensor(ends) % self.capacity
        if not getattr(rb.storage, "initialized", True) or len(rb.storage) < self.length:
            return False  # nothing was ever stored, or the write never counted its rows
        try:
            held = storage_leaf(rb.storage, self.key, slots)
        except Exception:  # a storage that cannot be read by index
            return None
        if not isinstance(held, torch.Tensor):
            return None  # not stored under that key (a transform after the filter)
        if held.shape != self.probe.shape or held.dtype != self.probe.dtype:
            return False
        return _same_bytes(held.detach().cpu(), self.probe)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte for byte: a NaN the call returned is stored as that NaN (``torch.equal`` says no).

    Examples:
        >>> x = torch.tensor([[float("nan"), 1.0]])
        >>> torch.equal(x, x.clone()), _same_bytes(x, x.clone())
        (False, True)
    """
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def slot_before(rb: Any) -> tuple[int, int] | None:
    """Where the buffer will write the call's rows (see :func:`writer_slot`)."""
    return None if rb is None else writer_slot(rb)


def record(rb: Any, slot: tuple[int, int], out: TensorDictBase) -> LastWrite | None:
    """What to look at later to tell whether ``out`` reached ``rb`` (None: nothing to tell)."""
    n = out.batch_size[0] if out.batch_dims else 0
    if not n or n > slot[1]:
        return None
    nxt = out.get("next", None)
    if not isinstance(nxt, TensorDictBase):
        return None
    twins = nxt.keys()
    key = next((k for k in out.keys() if k != "next" and k in twins), None)  # an observation
    value = None if key is None else out.get(key)
    if not isinstance(value, torch.Tensor):
        return None
    probe = value[:: max(n - 1, 1)].detach().cpu().clone()  # the first and the last row
    length = min(len(rb.storage) + n, slot[1])
    return LastWrite(weakref.ref(rb), rb.write_count + n, length, slot[0], slot[1], n, key, probe)
