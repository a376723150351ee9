"""The places where cleanbuf leans on what its dependencies do not promise.

Each function here uses a private name or an implementation detail of
torch, tensordict or torchrl (or of CPython), falls back to public behaviour
when that is gone, and has a test in ``tests/test_compat.py`` that fails
when the private name disappears, so a new release shows up there first.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


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


def tensordict_children(td: Any) -> dict | None:
    """The key -> value dict a plain ``TensorDict`` keeps (``td._tensordict``).

    Reading it directly is much cheaper than
    ``items(include_nested=True, leaves_only=True)``. None where it is gone:
    the caller then walks the public ``items()``.

    Examples:
        >>> from tensordict import TensorDict
        >>> sorted(tensordict_children(TensorDict({"a": torch.zeros(1)}, [1])))
        ['a']
    """
    children = getattr(td, "_tensordict", None)
    return children if isinstance(children, dict) else None


def new_tensordict(nested: dict, batch_size: torch.Size, device: Any) -> Any:
    """A ``TensorDict`` of leaves known to fit ``batch_size`` and ``device``.

    ``TensorDict._new_unsafe`` skips the checks, as TorchRL does on its own
    hot paths; the public constructor where it is gone.

    Examples:
        >>> new_tensordict({"a": torch.zeros(2)}, torch.Size([2]), None).batch_size
        torch.Size([2])
    """
    from tensordict import TensorDict

    unsafe = getattr(TensorDict, "_new_unsafe", None)
    if unsafe is not None:
        return unsafe(nested, batch_size=batch_size, device=device)
    return TensorDict(nested, batch_size=batch_size, device=device)


def storage_use_count(t: torch.Tensor) -> int | None:
    """How many tensors share ``t``'s memory, plus one for the query itself.

    ``torch._C._storage_Use_Count``; None where it is gone (the buffer pool
    then never reuses a buffer, which is safe).

    Examples:
        >>> storage_use_count(torch.zeros(3)) is not None
        True
    """
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    try:
        return count(t.untyped_storage()._cdata)
    except (AttributeError, RuntimeError):
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


def storage_tensors(storage: Any) -> Any | None:
    """The TensorDict behind a TorchRL tensor storage, every slot of it.

    ``storage._storage``: the public ``storage.get`` stops at the filled
    slots, and the offline writer gathers rows straight into the next
    ones. None where the name is gone (the writer then copies the rows).
    """
    return getattr(storage, "_storage", None)
