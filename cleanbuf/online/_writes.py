"""Whether the rows a filter's call returned reached the buffer: TorchRL's writer says so.

A replay buffer runs the filter, then writes what the filter returned; if
that write fails (a full disk, a storage that raises) the filter has
already moved on. TorchRL's round-robin writers tell every entity attached
to the storage, after each write that succeeded, which slots it wrote
(``storage.attach(entity)``; the writer then calls
``entity.mark_update(index)``, as it does for a prioritized sampler). The
filter attaches a :class:`WriteMarks` counter to its buffer's storage, and
before its next call, its flush, its stats and its state it reads whether
the count moved since its last call returned rows:

- moved: stored; the same batch written again is a duplicate (a
  :class:`~cleanbuf.ContinuityError`), never a retry;
- did not move: the write failed; the cleaner goes back to before that
  call (the rows it released are held again), as if it never came: a retry
  stores them, and another batch is refused as a skipped one;
- unknown (another writer, a consuming buffer, copies of the filter in
  worker processes or Ray actors): the cleaner's own rule stays
  (the undo of :class:`cleanbuf.engine._cleaner.Cleaner`).

No row of the storage is read.
"""

from __future__ import annotations

from typing import Any

from cleanbuf.online._compat import attached_entities, reports_writes


class WriteMarks:
    """Counts the writes TorchRL's writer reports to a storage's attached entities.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(8))
        >>> marks = marks_of(rb)
        >>> _ = rb.extend(TensorDict({"a": torch.zeros(3)}, [3]))
        >>> marks.writes, marks_of(rb) is marks  # one per storage
        (1, True)
    """

    __slots__ = ("writes",)

    def __init__(self):
        self.writes = 0

    def mark_update(self, index: Any) -> None:
        """Called by the writer after a write that succeeded."""
        self.writes += 1

    def __getstate__(self) -> dict:
        return {"writes": self.writes}

    def __setstate__(self, state: dict) -> None:
        self.writes = state["writes"]


def marks_of(rb: Any) -> WriteMarks | None:
    """The write counter attached to ``rb``'s storage (attached on first use).

    None where the buffer's writer does not report its writes (see
    :func:`~cleanbuf.online._compat.reports_writes`): the filter cannot
    tell a failed write there.
    """
    if rb is None or not reports_writes(rb):
        return None
    entities = attached_entities(rb.storage)
    if entities is None:
        return None
    marks = next((e for e in entities if type(e) is WriteMarks), None)
    if marks is None:
        marks = WriteMarks()
        rb.storage.attach(marks)
    return marks
