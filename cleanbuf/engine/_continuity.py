"""Stream continuity: each call's rows must continue the previous call's.

Within a stream, a row's stored next observation is the next row's
observation, byte for byte, unless the row ended an episode. So the first
row of a stream in a call must have, as its observation, the next
observation of the previous call's last row of that stream, unless that row
was done or the first row restarts the stream (``is_init``). A mismatch
means the rows are not the stream the filter thinks: another producer's
batch (a ``MultiAsyncCollector`` yields its workers' batches in turn), a
skipped or repeated batch, or a reset the rows do not show. It costs one
row comparison per stream and observation key per call.

The check needs time-aligned streams (``time_last`` and ``step`` layouts)
and full transitions (observation-only rows have no next observation to
compare; their held rows take the next call's first row as it is).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cleanbuf.engine._errors import ContinuityError, key_name
from cleanbuf.engine._move import Views, index_tensor


@dataclasses.dataclass(frozen=True)
class CallEnds:
    """The first and the last row of each stream of a time-aligned call.

    Attributes:
        first_obs: observation key -> the first rows' observations ``[S, ...]``.
        first_restart: bool ``[S]``: the first row restarts its stream.
        last_next_obs: observation key -> the last rows' next observations.
        last_open: bool ``[S]``: the last row did not end an episode.
    """

    first_obs: dict
    first_restart: np.ndarray
    last_next_obs: dict
    last_open: np.ndarray

    @classmethod
    def of_call(
        cls,
        rows: Views,
        obs_keys: list,
        first: np.ndarray,
        last: np.ndarray,
        done: np.ndarray,
        restart: np.ndarray,
    ) -> CallEnds:
        """Reads the rows ``first`` and ``last`` (one per stream) of a call.

        Examples:
            >>> rows = Views({("obs",): torch.arange(6.0), ("next", "obs"): torch.arange(1.0, 7.0)})
            >>> ends = CallEnds.of_call(rows, [("obs",)], np.array([0, 3]), np.array([2, 5]),
            ...                         np.zeros(6, bool), np.zeros(0, bool))
            >>> ends.first_obs[("obs",)].tolist(), ends.last_next_obs[("obs",)].tolist()
            ([0.0, 3.0], [3.0, 6.0])
        """
        return cls(
            {k: take_rows(rows, k, first) for k in obs_keys},
            restart[first] if len(restart) else np.zeros(len(first), np.bool_),
            {k: take_rows(rows, ("next", *k), last) for k in obs_keys},
            ~done[last],
        )


@dataclasses.dataclass(frozen=True)
class LastRows:
    """Per stream, what the stream's next row must continue (part of the carry).

    Attributes:
        next_obs: observation key -> the stored next observation of the
            stream's last row, ``[S, ...]``.
        open: bool ``[S]``: the next row must continue that row (it was
            not done). False for streams not seen yet.
    """

    next_obs: dict = dataclasses.field(default_factory=dict)
    open: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.bool_))

    @classmethod
    def of(cls, ends: CallEnds) -> LastRows:
        """The last rows of a call."""
        return cls(ends.last_next_obs, ends.last_open)

    def check(self, ends: CallEnds) -> None:
        """Raises unless each stream's first row in a call continues its last row.

        Raises:
            ContinuityError: a stream's first row does not continue.
        """
        n = min(len(self.open), len(ends.first_restart))
        if not n or not np.count_nonzero(self.open):
            return
        streams = np.flatnonzero(self.open[:n] & ~ends.first_restart[:n])
        for k, first in ends.first_obs.items():
            first, last = _index(first, streams), _index(self.next_obs[k], streams)
            if same_bytes(first, last):
                continue
            same = same_rows(first, last)
            if not same.all():
                bad = int(streams[np.flatnonzero(~same)[0]])
                raise ContinuityError(
                    f"stream {bad} does not continue: the observation {key_name(k)} of its first "
                    "row in this call differs from the next observation of its last row in the "
                    "previous call, and neither row ends an episode or restarts the stream. "
                    "Likely causes: batches from another producer (a MultiAsyncCollector "
                    "yields its workers' batches in turn: build the filter with "
                    "AutoresetFilter.for_env(collector), or give the collector the buffer), "
                    "a batch skipped or written twice, or a reset the rows do not show (add "
                    "InitTracker() to the env). check_continuity=False turns this check off. "
                    "Nothing was written."
                )


def take_rows(rows: Views, key: tuple, index: np.ndarray) -> torch.Tensor | np.ndarray:
    """A copy of rows ``index`` of ``rows[key]``, numpy where it has a view."""
    a = rows[key]
    if a is not None:
        return a[index]
    return rows.flat(key).index_select(0, index_tensor(index, rows.tensors[key].device))


def _index(x, streams: np.ndarray):
    if len(streams) == len(x):
        return x
    if isinstance(x, np.ndarray):
        return x[streams]
    return x.index_select(0, index_tensor(streams, x.device))


def same_bytes(a, b) -> bool:
    """Whether two numpy arrays hold the same bytes; False for anything else.

    The common case of :func:`same_rows`, in one comparison.
    """
    return (
        isinstance(a, np.ndarray)
        and isinstance(b, np.ndarray)
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.tobytes() == b.tobytes()
    )


def same_rows(a, b) -> np.ndarray:
    """Per row, whether ``a`` and ``b`` hold the same bytes (NaN equal to NaN).

    Examples:
        >>> same_rows(np.array([[1.0, np.nan], [2.0, 3.0]]), np.array([[1.0, np.nan], [2.0, 4.0]]))
        array([ True, False])
    """
    if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
        a, b = torch.as_tensor(a).contiguous(), torch.as_tensor(b).contiguous()
        if a.dtype != b.dtype or a.shape != b.shape or not len(a):
            return np.zeros(len(a), np.bool_)
        a, b = a.view(torch.uint8), b.to(a.device).view(torch.uint8)
        return (a.reshape(len(a), -1) == b.reshape(len(b), -1)).all(1).cpu().numpy()
    if a.dtype != b.dtype or a.shape != b.shape or not len(a):
        return np.zeros(len(a), np.bool_)
    n = len(a)
    a = np.ascontiguousarray(a).view(np.uint8).reshape(n, -1)
    b = np.ascontiguousarray(b).view(np.uint8).reshape(n, -1)
    return (a == b).all(1)
