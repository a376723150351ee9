"""The places where this side of cleanbuf leans on what torchrl (or CPython) do not promise.

Each function here uses a private name or an implementation detail, falls
back to public behaviour when that is gone, and has a test in
``tests/test_compat.py`` that fails when the private name disappears, so a
new release shows up there first.
"""

from __future__ import annotations

import operator
import sys
from typing import Any


def calling_replay_buffer(max_frames: int = 12) -> Any | None:
    """The TorchRL ``ReplayBuffer`` whose ``extend`` / ``add`` is running the caller.

    A TorchRL transform is not told which buffer it serves; the filter
    needs it once, to check that the buffer's storage takes flat rows. It
    looks up the call stack for a frame whose ``self`` is a replay buffer
    (``sys._getframe``, CPython's and PyPy's). None when there is none (the
    transform called directly) or frames cannot be read.

    Examples:
        >>> calling_replay_buffer() is None
        True
    """
    from torchrl.data import ReplayBuffer

    getframe = getattr(sys, "_getframe", None)
    if getframe is None:
        return None
    frame = getframe(1)
    for _ in range(max_frames):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, ReplayBuffer):
            return owner
        frame = frame.f_back
    return None


def gym_wrapper_vector_env(wrapper: Any) -> Any | None:
    """The Gymnasium env a TorchRL ``GymWrapper`` wraps, if it is a batched one.

    TorchRL keeps it in ``wrapper._env`` (and whether it is batched in
    ``_is_batched``) and offers no public accessor. None for a single env;
    raises ``AttributeError`` where the private names are gone (``for_env``
    then asks for an explicit mode).
    """
    batched = getattr(wrapper, "_is_batched", None)
    if batched is None:
        batched = bool(wrapper.batch_size)
    return wrapper._env if batched else None


def collector_compact_next_keys(collector: Any) -> list:
    """The ``("next", ...)`` keys a ``Collector(compact_obs=True)`` leaves out.

    ``collector._compact_next_keys``; an empty list where it is gone (the
    user then declares ``observation_keys``).
    """
    return list(getattr(collector, "_compact_next_keys", ()))


def reports_writes(rb: Any) -> bool:
    """Whether ``rb``'s writer tells the storage's attached entities of each write.

    TorchRL's round-robin writers call ``entity.mark_update(index)`` for
    every entity attached to the storage (``storage.attach``), after the
    storage wrote the rows (``_mark_update_entities``). False for any other
    writer (one that writes out of order, or that might not report) and for
    a buffer that writes into consumed slots (``_is_consuming``).
    """
    from torchrl.data.replay_buffers.writers import RoundRobinWriter

    writer = getattr(rb, "_writer", None)
    if type(writer).__name__ not in ("RoundRobinWriter", "TensorDictRoundRobinWriter"):
        return False
    if not isinstance(writer, RoundRobinWriter) or not callable(
        getattr(writer, "_mark_update_entities", None)
    ):
        return False
    consuming = getattr(rb, "_is_consuming", None)
    try:
        return not (consuming is not None and consuming())
    except Exception:  # noqa: BLE001 - a buffer too odd to tell
        return False


writer_position = operator.attrgetter("_cursor", "_write_count")  # (a C call: every extend)
"""``writer_position(writer)``: where a round-robin writer writes next, ``(cursor, write count)``.

Its ``extend`` moves both before the storage writes (TorchRL does so for
workers sharing the writer), so a write that fails leaves them past
slots that hold nothing (:func:`rewind_writer`). Only for a writer that
:func:`reports_writes` accepted (a ``RoundRobinWriter``).
"""


def rewind_writer(writer: Any, position: tuple[int, int], n_rows: int) -> bool:
    """Puts a round-robin writer back to ``position``, if one extend of ``n_rows`` moved it.

    The extend of those rows failed: written again, they go to the same
    slots, and none of the slots the failed extend passed is left holding
    nothing (which a sampler would then draw). Returns whether it moved
    the writer back (not where anything else wrote since).
    """
    cursor, count = position
    if writer._write_count != count + n_rows:
        return False
    writer._cursor, writer._write_count = cursor, count
    return True


def attached_entities(storage: Any) -> list | None:
    """The entities attached to a TorchRL storage (``storage._attached_entities``), or None."""
    entities = getattr(storage, "_attached_entities", None)
    if not isinstance(entities, list) or not callable(getattr(storage, "attach", None)):
        return None
    return entities


def storage_length(storage: Any) -> int:
    """``len(storage)``: the rows a storage counts as written.

    A TorchRL tensor storage's ``__len__`` is wrapped to keep
    ``torch.compile`` out (several microseconds a call, and the write
    check reads it twice a call); it returns ``storage._len``, read here
    directly where it is there.

    Examples:
        >>> from torchrl.data import LazyTensorStorage
        >>> storage_length(LazyTensorStorage(4))
        0
    """
    length = getattr(storage, "_len", None)
    return length if isinstance(length, int) else len(storage)


def stored_chunk_shape(storage: Any) -> list | None:
    """The ``[T]`` shape of each slot of a storage filled with chunks, else None.

    A ``Collector(replay_buffer=rb)`` writing into a 1-D tensor storage
    stores each env's ``[T]`` steps as one slot: the storage's tensors
    then have more batch dims (``storage._storage``) than the storage's
    own ``ndim``. None for rows, an uninitialized storage, or where the
    private name is gone.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage
        >>> storage = LazyTensorStorage(4)
        >>> storage.set(range(2), TensorDict({"a": torch.zeros(2, 5)}, [2, 5]))
        >>> stored_chunk_shape(storage)
        [5]
    """
    raw = getattr(storage, "_storage", None)
    dims = getattr(raw, "batch_dims", 1)
    return list(raw.batch_size[1:]) if dims > getattr(storage, "ndim", 1) else None
