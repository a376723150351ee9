"""What a filter checks once, at its first write: the batch's orientation and the buffer.

Both checks run once per filter (not per call), before anything is cleaned
or written, so a refusal changes nothing:

* **orientation.** A collector's batch is ``[E, T]`` (time last); a raw
  loop's steps stacked with ``torch.stack(rows, dim=0)`` are ``[T, E]``.
  Read with the wrong axis as time, every stream is a column of different
  envs: the first call is stored wrong, and a later one fails on a reset
  row or a broken chain without saying why. Where the observations chain
  along the other axis only (:func:`~cleanbuf.engine._orientation.batch_time_axis`),
  the first call is refused, naming the orientation and the fix.
* **late attachment.** A filter appended to a buffer that already holds rows
  it did not write (``rb.append_transform(filt)`` after collection started)
  cleans only what comes next: it warns, naming the ``cleanbuf.clean``
  call that returns a cleaned copy of the rows already there. A buffer
  that holds ``[T]``-step chunks (a ``Collector(replay_buffer=rb)``
  without a filter) cannot take the
  filter's flat rows at all: that is refused before TorchRL's own
  batch-size error.
"""

from __future__ import annotations

import warnings
from typing import Any

from tensordict import TensorDictBase

from cleanbuf.engine._errors import CleanbufWarning, LayoutError, user_stacklevel
from cleanbuf.engine._options import Options
from cleanbuf.engine._orientation import batch_time_axis
from cleanbuf.online._compat import storage_length, stored_chunk_shape


def check_orientation(td: TensorDictBase, options: Options) -> None:
    """Refuses a ``[A, B]`` batch whose observations chain along the axis the layout calls envs.

    Raises:
        LayoutError: the layout expects time on one axis and the data shows
            it on the other; the message names both and the fix.
    """
    layout = options.layout
    if td.batch_dims != 2 or layout not in (None, "time_last", "time_first"):
        return
    axis = batch_time_axis(td, options)
    expected = 0 if layout == "time_first" else 1
    if axis is None or axis == expected:
        return
    a, b = td.batch_size
    if expected == 1:
        raise LayoutError(
            f"the batch {[a, b]} looks time-first, [T={a}, E={b}]: its observations chain "
            "along dim 0 (a row's next observation is the observation of the row below it) "
            "and not along dim 1. The filter reads a 2-D batch as [E, T], time last, as a "
            "TorchRL collector yields it; steps stacked with torch.stack(rows, dim=0) are "
            "[T, E]. Fix: stack with torch.stack(rows, dim=1), or pass layout='time_first'. "
            "Nothing was written."
        )
    raise LayoutError(
        f"the batch {[a, b]} looks time-last, [E={a}, T={b}]: its observations chain along "
        "dim 1 and not along dim 0, but layout='time_first' reads dim 0 as time. Fix: leave "
        "the layout out (a collector's [E, T] batch), or stack steps with "
        "torch.stack(rows, dim=0). Nothing was written."
    )


def check_late_attachment(rb: Any, fresh: bool) -> int:
    """Says when a fresh filter's first write goes into a buffer that already holds rows.

    Args:
        rb: the buffer whose ``extend`` / ``add`` called the filter, or None.
        fresh: the filter has seen no row (not a filter restored from a
            checkpoint with its buffer, nor a copy in a worker process).

    Raises:
        LayoutError: the buffer holds ``[T]``-step chunks, which the
            filter's flat rows cannot join.

    Returns:
        The rows the buffer held (0: none, or not a fresh filter's first
        write); the filter keeps it as ``rows_before_attach``, where
        :func:`cleanbuf.clean` reads it.

    Warns:
        CleanbufWarning: the buffer holds rows the filter did not clean.
    """
    storage = getattr(rb, "storage", None) if rb is not None else None
    if not fresh or storage is None:
        return 0
    try:
        n = storage_length(storage)
    except Exception:  # a storage without a length: nothing to tell
        return 0
    if not n:
        return 0
    shape = stored_chunk_shape(storage)
    if shape is not None:
        raise LayoutError(
            f"the buffer already holds {n} slot(s) of {shape} steps written without the filter "
            "(a Collector(replay_buffer=rb) before the filter was attached); the filter stores "
            "flat rows, which that storage cannot take. Clean what is stored with "
            "rows = cleanbuf.clean(rb), and attach the filter to a new buffer before its first "
            "write: ReplayBuffer(storage=..., transform=filt). Nothing was written."
        )
    capacity = getattr(storage, "max_size", None)
    if isinstance(capacity, int) and n >= capacity:  # full: the filter's rows overwrite them
        fix = (
            "The buffer is full, so the filter's rows overwrite them oldest first: clean them "
            "before attaching the filter, rows = cleanbuf.clean(rb)"
        )
    else:  # they are the buffer's first n rows, in write order, until it wraps
        fix = (
            f"Clean them (the buffer's first {n} rows) with rows = cleanbuf.clean(rb[:{n}], "
            'layout="flat"), a cleaned copy (their envs read from the rows)'
        )
    warnings.warn(
        CleanbufWarning(
            f"AutoresetFilter: the buffer already held {n} row(s) when the filter first wrote "
            "into it (attached after collection started, e.g. rb.append_transform(filt)); those "
            f"rows were not cleaned and stay as they are. {fix}. The filter does not see them, "
            "so where an env's last row among them ended an episode, the first row the filter "
            "stores of that env is its reset row (a bogus transition, reward 0), stored as it "
            "came: cleaning the rows above does not reach it. Attach the filter before the "
            "first write to store none."
        ),
        stacklevel=user_stacklevel(),
    )
    return n
