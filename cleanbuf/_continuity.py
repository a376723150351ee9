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

from cleanbuf._errors import ContinuityError
from cleanbuf._move import Views, index_tensor


@dataclasses.dataclass(frozen=True)
class LastRows:
    """Per stream, the stored next observation of the last row seen.

    Attributes:
        next_obs: observation key -> tensor ``[S, *feature]``.
        open: bool ``[S]``: the stream's next row must continue that row (it
            was not done). False for streams not seen yet.
    """

    next_obs: dict = dataclasses.field(default_factory=dict)
    open: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.bool_))

    @classmethod
    def of_call(cls, rows: Views, obs_keys: list, steps: int, done: np.ndarray) -> "LastRows":
        """The last row of each stream of a time-aligned call (``steps`` rows a stream).

        Examples:
            >>> rows = Views({("next", "obs"): torch.arange(6.0)})
            >>> last = LastRows.of_call(rows, [("obs",)], 3, np.zeros(6, bool))
            >>> last.next_obs[("obs",)].tolist(), last.open.tolist()
            ([2.0, 5.0], [True, True])
        """
        last = np.arange(steps - 1, rows.n_rows or len(done), steps)
        return cls({k: _take(rows, ("next", *k), last) for k in obs_keys}, ~done[last])

    def check(self, rows: Views, obs_keys: list, steps: int, restart: np.ndarray) -> None:
        """Raises unless each stream's first row in the call continues its last row.

        Args:
            rows: the call's leaves, as rows.
            obs_keys: the observation keys.
            steps: rows per stream in the call (time-last order).
            restart: per row, it restarts its stream (empty: none does).

        Raises:
            ContinuityError: a stream's first row does not continue.
        """
        n_old = len(self.open)
        if not n_old or not np.count_nonzero(self.open):
            return
        first = np.arange(0, rows.n_rows, steps)[:n_old]
        check = self.open[: len(first)].copy()
        if len(restart):
            check &= ~restart[first]
        streams = np.flatnonzero(check)
        if not len(streams):
            return
        for k in obs_keys:
            same = _same_rows(_take(rows, k, first[streams]), _index(self.next_obs[k], streams))
            if not same.all():
                bad = int(streams[np.flatnonzero(~same)[0]])
                raise ContinuityError(
                    f"stream {bad} does not continue: the observation {_name(k)} of its first "
                    "row in this call differs from the next observation of its last row in the "
                    "previous call, and neither row ends an episode or restarts the stream. "
                    "Likely causes: batches from another producer (a MultiAsyncCollector "
                    "yields its workers' batches in turn: build the filter with "
                    "AutoresetFilter.for_env(collector), or give the collector the buffer), "
                    "a batch skipped or written twice, or a reset the rows do not show (add "
                    "InitTracker() to the env). check_continuity=False turns this check off. "
                    "Nothing was written."
                )


def _name(key: tuple) -> str:
    return repr(key[0]) if len(key) == 1 else repr(key)


def _take(rows: Views, key: tuple, index: np.ndarray) -> torch.Tensor | np.ndarray:
    a = rows[key]
    if a is not None:
        return a[index]
    return rows.flat(key).index_select(0, index_tensor(index, rows.tensors[key].device))


def _index(x, streams: np.ndarray):
    if isinstance(x, np.ndarray):
        return x[streams]
    return x.index_select(0, index_tensor(streams, x.device))


def _same_rows(a, b) -> np.ndarray:
    """Per row, whether ``a`` and ``b`` hold the same values (NaN equals NaN)."""
    if isinstance(a, np.ndarray) != isinstance(b, np.ndarray):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        b = b.to(a.device)
    n = len(a)
    if isinstance(a, np.ndarray):
        eq = a == b
        if a.dtype.kind in "fc":
            eq |= np.isnan(a) & np.isnan(b)
        return eq.reshape(n, -1).all(1)
    eq = a == b
    if a.is_floating_point() or a.is_complex():
        eq |= a.isnan() & b.isnan()
    return eq.reshape(n, -1).all(1).cpu().numpy()
