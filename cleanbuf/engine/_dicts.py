"""Dicts of arrays in and out: the one conversion the repair, ``clean`` and ``audit`` share.

A (nested) dict of numpy arrays or torch tensors comes in through :func:`to_tensordict` and
goes back, as the same kind of array and key style, through :func:`to_dict`. Keys may be
nested dicts, tuple keys (``("next", "done")``) or ``"/"``-joined names as in ``.npz`` files
(``"next/done"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from cleanbuf.engine._errors import InputError
from cleanbuf.engine._keys import DONE_KEYS


def key_parts(key: Any) -> tuple:
    """A dict key as a TensorDict key path; ``"next/done"`` is ``("next", "done")``.

    Examples:
        >>> key_parts("next/done"), key_parts(("next", "done")), key_parts("observation")
        (('next', 'done'), ('next', 'done'), ('observation',))
    """
    parts = key if isinstance(key, tuple) else (key,)
    return tuple(
        p for part in parts for p in (part.split("/") if isinstance(part, str) else [part])
    )


def leaves(data: Mapping, caller: str) -> dict:
    """Every array of a (nested) dict, numpy arrays or tensors, by key path.

    Args:
        data: the dict.
        caller: the call the user made, for the error messages.

    Raises:
        InputError: a value that is neither.

    Examples:
        >>> sorted(leaves({"obs": np.zeros(2), "next": {"obs": np.ones(2)}}, "f()"))
        [('next', 'obs'), ('obs',)]
    """
    out: dict = {}

    def walk(node: Mapping, prefix: tuple) -> None:
        for k, v in node.items():
            key = prefix + key_parts(k)
            if isinstance(v, Mapping):
                walk(v, key)
            elif isinstance(v, (np.ndarray, torch.Tensor)):
                out[key] = v
            else:
                raise InputError(
                    f"key {key!r} holds {type(v).__name__}; a dict passed to {caller} must "
                    "hold numpy arrays or torch tensors (nested dicts allowed)."
                )

    walk(data, ())
    return out


def to_tensordict(
    data: Mapping,
    caller: str,
    batch_dims: int | None = None,
    *,
    time_first: bool = False,
    takes_batch_dims: bool = False,
    done_key: tuple | None = None,
) -> tuple[TensorDictBase, bool]:
    """A dict of arrays as a TensorDict (sharing memory), and whether it held numpy arrays.

    Without ``batch_dims``, those of the done array, less a trailing size-1 flag dimension
    (TorchRL's ``[..., 1]``); with ``time_first``, kept when every array has it (one env
    stored CleanRL's way: done ``[T, 1]``, observations ``[T, 1, ...]``).

    Args:
        data: the dict (see the module).
        caller: the call the user made, for the error messages.
        batch_dims: the number of batch dimensions; None reads them from the done array.
        time_first: the arrays are a rollout ``[T, E, ...]``.
        takes_batch_dims: the caller takes ``batch_dims=`` (the errors say so).
        done_key: the done key the user named (``done_key=``), read first.

    Raises:
        InputError: no done array (and no ``batch_dims``), arrays that disagree on the
            batch shape, values that are not arrays, numpy mixed with torch.

    Examples:
        >>> td, as_numpy = to_tensordict(
        ...     {"obs": np.zeros((4, 2, 3)), "next/done": np.zeros((4, 2, 1), bool)}, "f()"
        ... )
        >>> td.batch_size, as_numpy
        (torch.Size([4, 2]), True)
    """
    arrays = leaves(data, caller)
    kinds = {isinstance(v, np.ndarray) for v in arrays.values()}
    if len(kinds) > 1:
        raise InputError(
            f"the dict passed to {caller} mixes numpy arrays and torch tensors; pass one "
            "kind, so that the result comes back as the same kind."
        )
    tensors = {k: torch.as_tensor(v) for k, v in arrays.items()}
    wanted = DONE_KEYS if done_key is None else (done_key,)
    done = next((tensors[k] for k in wanted if k in tensors), None)
    if batch_dims is None:
        if done is None:
            raise InputError(
                f"no done key in the dict passed to {caller}: expected "
                f"{' or '.join(repr('/'.join(k)) for k in wanted)} (nested dicts and tuple keys "
                f"work too), found keys {sorted('/'.join(k) for k in tensors)}. Add the done "
                "flags, a bool array with one flag per row ([N], or [N, 1] as TorchRL stores "
                "it; [T, E] for a rollout), or name the key that holds them with done_key= "
                "(cleaning needs the episode ends)."
            )
        batch_dims = done.dim()
        if batch_dims > 1 and done.shape[-1] == 1:
            one_env = time_first and all(
                v.shape[:batch_dims] == done.shape for v in tensors.values()
            )
            batch_dims -= not one_env
    ref = done if done is not None else next(iter(tensors.values()), torch.zeros(0))
    first = tuple(ref.shape[:batch_dims])
    bad = {str(k): list(v.shape) for k, v in tensors.items() if v.shape[:batch_dims] != first}
    if bad:
        raise InputError(
            f"arrays disagree on the batch shape: expected {list(first)} first for every "
            f"key (from the {'done key' if done is not None else 'first key'}), got the "
            f"shapes {bad}. Fix the shapes" + (" or pass batch_dims=." if takes_batch_dims else ".")
        )
    td = TensorDict(batch_size=list(first))
    for k, v in tensors.items():
        td.set(k, v)
    return td, kinds != {False}


def slash_named(data: Any) -> bool:
    """The dict names nested keys as ``.npz`` files do (``"next/done"``), flat.

    Examples:
        >>> slash_named({"next/done": 0}), slash_named({"next": {"done": 0}})
        (True, False)
    """
    return (
        isinstance(data, Mapping)
        and any(isinstance(k, str) and "/" in k for k in data)
        and not any(isinstance(v, Mapping) for v in data.values())
    )


def to_dict(td: TensorDictBase, as_numpy: bool, slash: bool = False) -> dict:
    """A TensorDict's leaves as a nested dict (``"/"``-named with ``slash``).

    Examples:
        >>> td = TensorDict({("next", "done"): torch.zeros(2, dtype=torch.bool)}, [2])
        >>> to_dict(td, as_numpy=True)["next"]["done"].dtype
        dtype('bool')
        >>> list(to_dict(td, as_numpy=False, slash=True))
        ['next/done']
    """
    out: dict = {}
    for k, v in td.items(include_nested=True, leaves_only=True):
        k = k if isinstance(k, tuple) else (k,)
        value = v.numpy() if as_numpy else v
        if slash:
            out["/".join(k)] = value
            continue
        node = out
        for part in k[:-1]:
            node = node.setdefault(part, {})
        node[k[-1]] = value
    return out
