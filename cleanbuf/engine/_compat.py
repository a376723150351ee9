"""The places where the engine leans on what torch or tensordict do not promise.

Each function uses a private name, falls back to public behaviour when it is gone, and has a
test in ``tests/test_compat.py`` that fails when the private name disappears.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from tensordict import TensorDict


def _children_getter() -> Any:
    """``operator.attrgetter("_tensordict")`` where plain TensorDicts keep their children there.

    A C call: the walk of every batch pays no Python frame per node for it. Where the private
    name is gone, a getter that gives None (the caller then walks ``items()``).
    """
    if isinstance(getattr(TensorDict({}, []), "_tensordict", None), dict):
        return operator.attrgetter("_tensordict")
    return lambda td: None


children_of = _children_getter()
"""The key -> value dict a plain ``TensorDict`` keeps (``td._tensordict``), or None.

Cheaper than ``items(include_nested=True, leaves_only=True)``. For ``type(td) is TensorDict``
only.

Examples:
    >>> sorted(children_of(TensorDict({"a": torch.zeros(1)}, [1])))
    ['a']
"""


def _public_tensordict(nested: dict, batch_size: torch.Size, device: Any) -> Any:
    return TensorDict(nested, batch_size=batch_size, device=device)


def _tensordict_maker() -> Any:
    """``TensorDict._new_unsafe`` (no checks, as on TorchRL's hot paths), else the constructor."""
    unsafe = getattr(TensorDict, "_new_unsafe", None)
    return unsafe if unsafe is not None else _public_tensordict


new_tensordict = _tensordict_maker()
"""``new_tensordict(nested, batch_size, device)``: a ``TensorDict`` of leaves known to fit.

Examples:
    >>> new_tensordict({"a": torch.zeros(2)}, torch.Size([2]), None).batch_size
    torch.Size([2])
"""


def storage_use_count(t: torch.Tensor) -> int | None:
    """How many tensors share ``t``'s memory, plus one for the query itself.

    ``torch._C._storage_Use_Count``; None where it is gone (the buffer pool then never
    reuses a buffer: safe).

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
