"""Which batch axis is time, from the data: the one axis detector, online and offline.

Within one stream a row's next observation is the next row's observation, byte for byte,
except where an episode ended; across streams it is not. :func:`time_axis` reads this from
``[A, B, ...]`` arrays, :func:`batch_time_axis` from a TensorDict. Tensors are compared on
their own device: only the per-row flags cross to the host. See docs/rules.md, "The first
write".
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from cleanbuf.engine._keys import DONE_KEYS, observation_keys
from cleanbuf.engine._options import Options

CHAINS, BREAKS = 0.9, 0.5  # share of compared pairs: an axis chains / does not
_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_per_row(a: Any, b: Any) -> np.ndarray:
    """Per row (first axis), whether two arrays or tensors hold the same bytes.

    Byte for byte: a NaN equals the same NaN, ``0.0`` does not equal ``-0.0``.
    Tensors are compared where they are; the result is a host bool array.

    Examples:
        >>> nan = float("nan")
        >>> same_per_row(np.array([[nan, 1.0], [2.0, 3.0]]), np.array([[nan, 1.0], [2.0, 4.0]]))
        array([ True, False])
        >>> same_per_row(torch.tensor([[nan], [0.0]]), torch.tensor([[nan], [-0.0]])).tolist()
        [True, False]
    """
    if isinstance(a, torch.Tensor):
        n = a.shape[0]
        width = math.prod(a.shape[1:])  # (-1 fails on 0 rows)
        a, b = a.detach().reshape(n, width), b.detach().reshape(n, width)
        if a.dtype.is_floating_point or a.dtype.is_complex or a.dtype == torch.bool:
            width = _SAME_WIDTH[a.element_size()] if not a.dtype.is_complex else torch.int64
            a, b = a.contiguous().view(width), b.contiguous().view(width)
        return (a == b).all(1).cpu().numpy() if a.shape[1] else np.ones(n, np.bool_)
    if not len(a):
        return np.zeros(0, np.bool_)
    return (_words(a) == _words(b)).all(1)


def _words(x: np.ndarray) -> np.ndarray:
    """Rows as words: uint64 where the row's bytes allow (8x fewer compares)."""
    x = np.ascontiguousarray(x).reshape(len(x), math.prod(x.shape[1:])).view(np.uint8)
    return x.view(np.uint64) if x.shape[1] % 8 == 0 else x


def _chained(obs: Any, next_obs: Any, done: np.ndarray, axis: int) -> tuple[int, int]:
    """(pairs that chain, pairs compared) along ``axis`` of ``[A, B, ...]``; done rows skipped."""
    if axis == 0:
        a, b, d = next_obs[:-1], obs[1:], done[:-1]
    else:
        a, b, d = next_obs[:, :-1], obs[:, 1:], done[:, :-1]
    open_ = ~np.asarray(d).reshape(-1)
    n = open_.size
    a, b = a.reshape(n, *a.shape[2:]), b.reshape(n, *b.shape[2:])
    if isinstance(a, torch.Tensor):
        index = torch.from_numpy(np.flatnonzero(open_)).to(a.device)
        a, b = a.index_select(0, index), b.index_select(0, index)
    else:
        a, b = a[open_], b[open_]
    return int(same_per_row(a, b).sum()), int(open_.sum())


def time_axis(obs: Any, next_obs: Any, done: Any) -> tuple[int | None, str]:
    """The time axis (0 or 1) of ``[A, B, ...]`` arrays or tensors, and the evidence.

    Along the time axis at least 90% of the compared pairs chain (a row's next observation
    is the next row's observation), along the env axis under half; done rows are not
    compared. With one entry along an axis (one step of several envs) the other axis need
    only break.

    Args:
        obs: ``[A, B, ...]`` observations (numpy or torch).
        next_obs: their next observations, the same shape.
        done: ``[A, B]`` bool, the rows that ended an episode.

    Returns:
        ``(axis, why)``; ``axis`` is None when the data does not tell.

    Examples:
        >>> t = np.arange(4.0)[:, None] + 100 * np.arange(3.0)  # [T=4, E=3]
        >>> time_axis(t, t + 1, np.zeros((4, 3), bool))[0]
        0
        >>> time_axis(torch.tensor(t.T), torch.tensor(t.T + 1), np.zeros((3, 4), bool))[0]
        1
        >>> time_axis(t[:1], t[:1] + 1, np.zeros((1, 3), bool))[0]  # one step: no chain
        0
        >>> print(time_axis(np.zeros((2, 2)), np.zeros((2, 2)), np.zeros((2, 2), bool))[1])
        both axes chain (2 of 2 and 2 of 2 pairs): constant observations tell no time axis
    """
    done = done.detach().cpu().numpy() if isinstance(done, torch.Tensor) else np.asarray(done)
    (m0, n0), (m1, n1) = (_chained(obs, next_obs, done, axis) for axis in (0, 1))
    pairs = f"{m0} of {n0} and {m1} of {n1} pairs"
    chains = [n and m / n >= CHAINS for m, n in ((m0, n0), (m1, n1))]
    breaks = [n and m / n < BREAKS for m, n in ((m0, n0), (m1, n1))]
    if chains[0] and chains[1]:
        return None, f"both axes chain ({pairs}): constant observations tell no time axis"
    for axis in (0, 1):
        other = 1 - axis
        n_other = (n0, n1)[other]
        if chains[axis] and (breaks[other] or not n_other):
            return axis, f"axis {axis} chains ({pairs} along axes 0 and 1)"
        if breaks[other] and done.shape[axis] == 1:  # one step: the other axis is the envs
            return axis, f"axis {other} does not chain and axis {axis} has one entry"
    return None, f"neither axis chains clearly ({pairs} along axes 0 and 1)"


def batch_time_axis(td: Any, options: Options) -> int | None:
    """The time axis of a 2-D TensorDict ``[A, B]``, where its data tells; else None.

    Reads the first observation key, its ``("next", ...)`` twin and the done flags
    (``options.done_key``, else ``("next", "done")``, else terminated | truncated); both
    axes need two entries. Never raises: a batch too odd to tell gets None (the cleaner's
    checks say what is wrong).

    Examples:
        >>> from tensordict import TensorDict
        >>> obs = torch.arange(8.0).reshape(4, 2, 1)  # [T=4, E=2]: obs[t + 1] follows obs[t]
        >>> td = TensorDict({"obs": obs, ("next", "obs"): obs + 2}, batch_size=[4, 2])
        >>> batch_time_axis(td, Options()), batch_time_axis(td.transpose(0, 1), Options())
        (0, 1)
    """
    if getattr(td, "batch_dims", 0) != 2 or min(td.batch_size) < 2:
        return None
    try:
        leaves = dict(td.items(include_nested=True, leaves_only=True))
        leaves = {k if isinstance(k, tuple) else (k,): v for k, v in leaves.items()}
        bookkeeping = {k for k in (options.is_init_key, options.step_count_key) if k}
        keys, obs_only = observation_keys(leaves, options.observation_keys, bookkeeping)
        obs, nxt = leaves.get(keys[0]), leaves.get(("next", *keys[0]))
        if obs_only or obs is None or nxt is None or obs.shape != nxt.shape or obs.is_meta:
            return None
        names = [options.done_key] if options.done_key is not None else DONE_KEYS
        present = [k for k in names if k in leaves]
        if options.done_key is None and DONE_KEYS[0] in present:
            present = [DONE_KEYS[0]]
        done = np.zeros(tuple(td.batch_size), np.bool_)
        for k in present:
            flag = leaves[k].detach().reshape(*td.batch_size, -1).bool().any(-1)
            done |= flag.cpu().numpy()
        return time_axis(obs, nxt, done)[0]
    except Exception:  # noqa: BLE001 - too odd to tell
        return None
