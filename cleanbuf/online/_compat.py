"""The places where this side of cleanbuf leans on what torchrl (or CPython) do not promise.

Each function here uses a private name or an implementation detail, falls
back to public behaviour when that is gone, and has a test in
``tests/test_compat.py`` that fails when the private name disappears, so a
new release shows up there first.
"""

from __future__ import annotations

import sys
from typing import Any

from tensordict import TensorDict

from cleanbuf.engine._compat import tensordict_children


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


def writer_slot(rb: Any) -> tuple[int, int] | None:
    """Where ``rb``'s next ``extend`` writes: ``(cursor, capacity)``, or None if unknown.

    TorchRL's round-robin writers keep the next slot in ``writer._cursor``
    and write ``n`` rows at ``cursor, cursor + 1, ...`` modulo the capacity
    (``storage.max_size``). None for any other writer, a buffer that
    writes into consumed slots (``_is_consuming``), or where the names are
    gone.
    """
    from torchrl.data.replay_buffers.writers import RoundRobinWriter

    writer = getattr(rb, "_writer", None)
    if type(writer).__name__ not in ("RoundRobinWriter", "TensorDictRoundRobinWriter"):
        return None
    if not isinstance(writer, RoundRobinWriter):
        return None
    consuming = getattr(rb, "_is_consuming", None)
    try:
        if consuming is not None and consuming():
            return None
        cursor, capacity = int(writer._cursor), int(rb.storage.max_size)
    except Exception:  # a storage without a capacity, a writer without a cursor
        return None
    return (cursor, capacity) if capacity > 0 else None


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


def td_leaf(td: Any, key: Any) -> Any:
    """``td.get(key, None)``; a root key of a plain ``TensorDict`` read from its own dict.

    The public ``get`` unravels the key and checks it (a few microseconds;
    the write check reads two leaves a call).

    Examples:
        >>> import torch
        >>> td_leaf(TensorDict({"a": torch.zeros(2)}, [2]), "a").tolist()
        [0.0, 0.0]
    """
    if isinstance(key, str):
        children = tensordict_children(td) if type(td) is TensorDict else None
        if children is not None:
            return children.get(key)
    return td.get(key, None)


def storage_leaf(storage: Any, key: tuple, slots: Any = None) -> Any:
    """What a storage holds under ``key`` at ``slots``, written or not as far as its length says.

    TorchRL's ``storage.get`` stops at ``len(storage)``, which counts the
    rows written, not the slots: after a failed write the writer's cursor
    has moved past slots that ``len`` does not count, and later rows sit
    beyond it. A tensor storage keeps every slot in ``storage._storage``,
    whose one leaf is read (not every leaf: this runs at every call);
    elsewhere ``storage.get``. None where the key is not stored.

    Args:
        storage: a TorchRL storage.
        key: the leaf's key.
        slots: the slots to read (an index tensor). None: the whole leaf,
            every slot, uncopied, for a tensor storage; None for any other.
    """
    raw = getattr(storage, "_storage", None)
    if getattr(storage, "initialized", False) and hasattr(raw, "batch_size"):
        leaf = td_leaf(raw, key)
        return leaf if leaf is None or slots is None else leaf[slots]
    if slots is None:
        return None
    rows = storage.get(slots)
    return rows.get(key, None) if hasattr(rows, "batch_size") else None


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
