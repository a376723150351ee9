"""Reading a batch: its leaves as flat rows, its done flags, its observation keys."""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDictBase

from cleanbuf._errors import InputError

NEXT = "next"
DONE_KEYS = (("next", "done"), ("next", "terminated"), ("next", "truncated"))
# Keys that live at the root and under "next" but are not observations.
NOT_OBSERVATIONS = {"done", "terminated", "truncated", "reward", "is_init", "step_count"}


def _fmt(key: tuple) -> str:
    return repr(key[0]) if len(key) == 1 else repr(key)


def flat_leaves(td: TensorDictBase, n_rows: int) -> dict:
    """Returns every tensor leaf of ``td`` reshaped to ``[n_rows, *feature]``.

    Args:
        td: the batch.
        n_rows: the number of rows (the product of the batch size).

    Returns:
        A dict from nested key (always a tuple) to tensor, in the batch's key
        order. Tensors are views where possible.

    Raises:
        InputError: a leaf is not a tensor.

    Examples:
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"a": torch.zeros(2, 3, 4)}, batch_size=[2, 3])
        >>> flat_leaves(td, 6)[("a",)].shape
        torch.Size([6, 4])
    """
    batch_ndim = td.batch_dims
    leaves = {}
    for key, value in td.items(include_nested=True, leaves_only=True):
        key = key if isinstance(key, tuple) else (key,)
        if not isinstance(value, torch.Tensor):
            raise InputError(
                f"key {_fmt(key)} holds {type(value).__name__}, not a tensor; cleanbuf "
                "moves tensor leaves only. Exclude it before the filter "
                "(data.exclude(key)) or store it as a tensor."
            )
        leaves[key] = value.reshape(n_rows, *value.shape[batch_ndim:])
    return leaves


def _row_flag(name: str, key: tuple, value: torch.Tensor, n_rows: int) -> torch.Tensor:
    if value.dtype != torch.bool:
        raise InputError(
            f"{name} key {_fmt(key)} must be torch.bool; got dtype {value.dtype}. "
            f"Fix: data.set({key!r}, data.get({key!r}).bool()) before the filter, or "
            "fix the producer."
        )
    if value.shape[1:].numel() != 1:
        raise InputError(
            f"{name} key {_fmt(key)} must hold one flag per row (shape [*batch] or "
            f"[*batch, 1]); got trailing shape {list(value.shape[1:])}. Multi-agent done "
            "flags need one env-level done; pass done_key= with such a key."
        )
    return value.reshape(n_rows)


def done_flags(leaves: dict, done_key: tuple | None, n_rows: int) -> np.ndarray:
    """Returns the per-row done flag as a bool numpy array.

    The done key is ``done_key`` if given, else ``("next", "done")``, else
    ``("next", "terminated") | ("next", "truncated")``.

    Raises:
        InputError: no done key, or a done key that is not boolean or has
            more than one flag per row.

    Examples:
        >>> done_flags({("next", "done"): torch.tensor([[False], [True]])}, None, 2)
        array([False,  True])
    """
    if done_key is not None:
        keys = [done_key]
    elif ("next", "done") in leaves:
        keys = [("next", "done")]
    else:
        keys = [k for k in DONE_KEYS[1:] if k in leaves]
    missing = [k for k in keys if k not in leaves]
    if not keys or missing:
        wanted = missing or list(DONE_KEYS)
        raise InputError(
            f"no done key: expected {wanted} in the batch, found keys "
            f"{sorted(leaves, key=str)}. Pass done_key= to name the key that marks "
            "episode ends."
        )
    flag = None
    for key in keys:
        value = _row_flag("done", key, leaves[key], n_rows)
        flag = value if flag is None else flag | value
    return flag.cpu().numpy()


def observation_keys(leaves: dict, declared: tuple | None, bookkeeping: set) -> list:
    """Returns the observation keys (root keys with a ``("next", ...)`` twin).

    Args:
        leaves: the batch leaves, from :func:`flat_leaves`.
        declared: user-declared observation keys, or None to discover them.
        bookkeeping: extra root keys that are never observations.

    Raises:
        InputError: no observation key, or a declared key missing at the
            root or under "next", or with different shapes or dtypes there.

    Examples:
        >>> leaves = {("obs",): torch.zeros(2, 3), ("next", "obs"): torch.zeros(2, 3),
        ...           ("next", "done"): torch.zeros(2, 1, dtype=torch.bool)}
        >>> observation_keys(leaves, None, set())
        [('obs',)]
    """
    if declared is None:
        keys = [
            k
            for k in leaves
            if k[0] != NEXT
            and k[-1] not in NOT_OBSERVATIONS
            and k[0] != "collector"
            and k not in bookkeeping
            and (NEXT, *k) in leaves
        ]
        if not keys:
            raise InputError(
                "no observation key: expected at least one key present both at the root "
                f"and under 'next' (like 'observation' and ('next', 'observation')); found "
                f"keys {sorted(leaves, key=str)}. Pass observation_keys=[...]; data "
                "without ('next', obs) (compact_obs=True) is not supported by this "
                "version."
            )
        return keys
    for k in declared:
        nk = (NEXT, *k)
        for key in (k, nk):
            if key not in leaves:
                raise InputError(
                    f"observation key {_fmt(key)} is missing from the batch (found "
                    f"{sorted(leaves, key=str)}). Fix observation_keys=, or store the "
                    "observation both at the root and under 'next'."
                )
        a, b = leaves[k], leaves[nk]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise InputError(
                f"observation key {_fmt(k)} has shape {list(a.shape)} and dtype {a.dtype} "
                f"but {_fmt(nk)} has shape {list(b.shape)} and dtype {b.dtype}; both must "
                "match for the next observation to be re-stitched."
            )
    return list(declared)
