"""What a filter checks once, at its first write: the batch's orientation and the buffer.

Both checks run once per filter (not per call), before anything is cleaned
or written, so a refusal changes nothing:

* **orientation.** A collector's batch is ``[E, T]`` (time last); a raw
  loop's steps stacked with ``torch.stack(rows, dim=0)`` are ``[T, E]``.
  Read with the wrong axis as time, every stream is a column of different
  envs: the first call is stored wrong, and a later one fails on a reset
  row or a broken chain without saying why. Where the observations chain
  along the other axis only (:func:`~cleanbuf.engine._orientation.chain_axis`),
  the first call is refused, naming the orientation and the fix.
* **late attachment.** A filter appended to a buffer that already holds rows
  it did not write (``rb.append_transform(filt)`` after collection started)
  cleans only what comes next: it warns, naming ``cleanbuf.clean(rb)`` for
  the rows already there. A buffer that holds ``[T]``-step chunks (a
  ``Collector(replay_buffer=rb)`` without a filter) cannot take the
  filter's flat rows at all: that is refused before TorchRL's own
  batch-size error.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from tensordict import TensorDictBase

from cleanbuf.engine._errors import CleanbufWarning, LayoutError, user_stacklevel
from cleanbuf.engine._keys import DONE_KEYS, may_be_observation
from cleanbuf.engine._orientation import chain_axis
from cleanbuf.online._compat import storage_length, stored_chunk_shape


def _pair(td: TensorDictBase) -> tuple | None:
    """An observation key stored with its ``("next", ...)`` twin, or None."""
    nxt = td.get("next", None)
    if not isinstance(nxt, TensorDictBase):
        return None
    for key in td.keys():
        if key != "next" and may_be_observation((key,)) and key in nxt.keys():
            if isinstance(td.get(key), torch.Tensor):
                return key, ("next", key)
    return None


def _done(td: TensorDictBase, done_key: Any) -> torch.Tensor | None:
    """Per row, done: ``done_key``, ``("next", "done")``, else terminated | truncated."""
    keys = set(td.keys(True, True))
    names = [done_key] if done_key is not None else DONE_KEYS
    present = [k for k in names if k in keys]
    if DONE_KEYS[0] in present and done_key is None:
        present = [DONE_KEYS[0]]
    if not present:
        return None
    out = torch.zeros(td.batch_size, dtype=torch.bool)
    for k in present:
        value = td.get(k)
        if value.shape[: td.batch_dims] != td.batch_size:
            return None
        out |= value.reshape(*td.batch_size, -1).cpu().bool().any(-1)
    return out


def check_orientation(td: TensorDictBase, layout: str | None, done_key: Any) -> None:
    """Refuses a ``[A, B]`` batch whose observations chain along the axis the layout calls envs.

    Raises:
        LayoutError: the layout expects time on one axis and the data shows
            it on the other; the message names both and the fix.
    """
    if td.batch_dims != 2 or layout not in (None, "time_last", "time_first"):
        return
    pair, done = _pair(td), _done(td, done_key)
    if pair is None or done is None:
        return
    obs, nxt = td.get(pair[0]), td.get(pair[1])
    if obs.shape[:2] != td.batch_size or nxt.shape != obs.shape:
        return
    axis = chain_axis(obs.detach().cpu(), nxt.detach().cpu(), done)
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


def check_late_attachment(rb: Any, fresh: bool) -> None:
    """Says when a fresh filter's first write goes into a buffer that already holds rows.

    Args:
        rb: the buffer whose ``extend`` / ``add`` called the filter, or None.
        fresh: the filter has seen no row (not a filter restored from a
            checkpoint with its buffer, nor a copy in a worker process).

    Raises:
        LayoutError: the buffer holds ``[T]``-step chunks, which the
            filter's flat rows cannot join.

    Warns:
        CleanbufWarning: the buffer holds rows the filter did not clean.
    """
    storage = getattr(rb, "storage", None) if rb is not None else None
    if not fresh or storage is None:
        return
    try:
        n = storage_length(storage)
    except Exception:  # a storage without a length: nothing to tell
        return
    if not n:
        return
    shape = stored_chunk_shape(storage)
    if shape is not None:
        raise LayoutError(
            f"the buffer already holds {n} slot(s) of {shape} steps written without the filter "
            "(a Collector(replay_buffer=rb) before the filter was attached); the filter stores "
            "flat rows, which that storage cannot take. Clean what is stored with "
            "rows = cleanbuf.clean(rb), and attach the filter to a new buffer before its first "
            "write: ReplayBuffer(storage=..., transform=filt). Nothing was written."
        )
    warnings.warn(
        CleanbufWarning(
            f"AutoresetFilter: the buffer already held {n} row(s) when the filter first wrote "
            "into it (attached after collection started, e.g. rb.append_transform(filt)); those "
            "rows were not cleaned and stay as they are. Clean them with "
            "rows = cleanbuf.clean(rb) (a cleaned copy), or attach the filter before the first "
            "write."
        ),
        stacklevel=user_stacklevel(),
    )
