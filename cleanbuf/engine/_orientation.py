"""Which batch axis a batch's observations chain along: the time axis, from the data.

Within one stream a row's next observation is the next row's observation,
byte for byte, except where an episode ended; across streams it is not.
A collector's batch is ``[E, T]`` (time last); steps stacked with
``torch.stack(rows, dim=0)`` are ``[T, E]``. The filter expects the
first; :func:`chain_axis` tells which one a batch is, where the data says
it (checked once, at a filter's first call).
"""

from __future__ import annotations

import torch

CHAINS, BREAKS = 0.9, 0.5  # share of compared pairs: an axis chains / does not


def _rate(obs: torch.Tensor, next_obs: torch.Tensor, done: torch.Tensor, axis: int):
    """(pairs that chain, pairs compared) along ``axis`` of ``[A, B, ...]``; done rows skipped."""
    if axis == 0:
        a, b, d = next_obs[:-1], obs[1:], done[:-1]
    else:
        a, b, d = next_obs[:, :-1], obs[:, 1:], done[:, :-1]
    open_ = ~d.reshape(-1)
    a = a.reshape(open_.numel(), -1)[open_]
    b = b.reshape(open_.numel(), -1)[open_]
    same = (a == b) | (torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a == b
    return int(same.all(1).sum()), int(open_.sum())


def chain_axis(obs: torch.Tensor, next_obs: torch.Tensor, done: torch.Tensor) -> int | None:
    """The axis (0 or 1) of a ``[A, B, ...]`` batch along which observations chain.

    None when the data does not tell (both or neither axis chains, or
    fewer than two pairs to compare along either).

    Examples:
        >>> t = torch.arange(4.0)[:, None] + 100 * torch.arange(3.0)  # [T=4, E=3]
        >>> chain_axis(t, t + 1, torch.zeros(4, 3, dtype=torch.bool))
        0
        >>> chain_axis(t.T, t.T + 1, torch.zeros(3, 4, dtype=torch.bool))
        1
    """
    if obs.dim() < 2 or min(obs.shape[:2]) < 2:
        return None
    (m0, n0), (m1, n1) = (_rate(obs, next_obs, done, axis) for axis in (0, 1))
    if n0 < 2 or n1 < 2:
        return None
    chains = (m0 / n0 >= CHAINS, m1 / n1 >= CHAINS)
    breaks = (m0 / n0 < BREAKS, m1 / n1 < BREAKS)
    if chains[0] and breaks[1]:
        return 0
    if chains[1] and breaks[0]:
        return 1
    return None
