"""The places where the engine leans on what torch or tensordict do not promise.

Each function uses a private name, falls back to public behaviour when it is gone, and has a
test in ``tests/test_compat.py`` that fails when the private name disappears.
"""

from __future__ import annotations

from typing import Any

import torch


def tensordict_children(td: Any) -> dict | None:
    """The key -> value dict a plain ``TensorDict`` keeps (``td._tensordict``).

    Cheaper than ``items(include_nested=True, leaves_only=True)``; None where it is gone
    (the caller then walks ``items()``).

    Examples:
        >>> from tensordict import TensorDict
        >>> sorted(tensordict_children(TensorDict({"a": torch.zeros(1)}, [1])))
        ['a']
    """
    children = getattr(td, "_tensordict", None)
    return children if isinstance(children, dict) else None


def new_tensordict(nested: dict, batch_size: torch.Size, device: Any) -> Any:
    """A ``TensorDict`` of leaves known to fit ``batch_size`` and ``device``.

    ``TensorDict._new_unsafe`` (no checks, as on TorchRL's hot paths); the public
    constructor where it is gone.

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
