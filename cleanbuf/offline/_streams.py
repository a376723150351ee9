"""Which env each stored row came from, recovered from the rows themselves.

A TorchRL buffer keeps no env index. What it keeps is the order of the
writes: a collector's ``[E, T]`` batch is stored either as ``E`` slots of
``T`` steps (``Collector(replay_buffer=rb)`` on a plain storage) or, by
``rb.extend(batch.reshape(-1))``, as ``E`` runs of ``T`` rows, env by env.
Within a run, each row's next observation is the next row's observation,
except where an episode ended. So:

1. **Runs.** Cut the rows where a not-done row's next observation is not
   the next row's observation (bytes). In flat data those cuts fall on
   the boundaries between envs, every ``T`` rows: ``T`` is the greatest
   common divisor of the distances between cuts. In chunked data a run is
   a slot.
2. **Envs.** Run ``k + E`` continues run ``k`` (its first observation is
   the last next observation of run ``k``, unless that row ended an
   episode): ``E`` is the smallest period for which every such pair does.

A full circular buffer starts at the writer's cursor, which may fall
inside a batch: the runs before the first whole batch are the **head**,
the surviving part of a batch the buffer overwrote.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cleanbuf.engine._orientation import same_per_row


@dataclasses.dataclass(frozen=True)
class Streams:
    """The recovered layout of rows in write order.

    Attributes:
        steps: ``T``, rows per run (per env per batch).
        envs: ``E``, runs per batch.
        head: rows before the first whole batch (the rest of a batch the
            buffer overwrote); 0 when the data starts with a whole batch.
        head_runs: the runs of the head, ``(env, start, stop)`` rows.
        tail: rows after the last whole batch (a batch written in part).
        found: False when the rows break into runs with no period: they are
            then one stream in write order, which only data of one env is.
        env: each row's env index where the data stores it (what
            ``cleanbuf clean`` writes: see :func:`stored`); then ``steps``
            is 1 and the other fields 0.
    """

    steps: int
    envs: int
    head: int
    head_runs: tuple
    tail: int
    found: bool = True
    env: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    def batches(self, n_rows: int):
        """Yields ``(start, stop)`` of each whole batch, ``E * T`` rows."""
        size = self.steps * self.envs
        for start in range(self.head, n_rows - self.tail, size):
            yield start, start + size


class Rows:
    """Observations and next observations of rows in write order, read on demand.

    Attributes:
        n: the number of rows.
        done: ``[N]`` bool (small: read whole).
        obs, next_obs: ``positions -> [len, ...]`` arrays of those rows.
        block: rows read at a time when scanning them all.
    """

    def __init__(self, n, done, obs, next_obs, block: int = 4096):
        self.n, self.done, self.obs, self.next_obs, self.block = n, done, obs, next_obs, block

    @classmethod
    def of_arrays(cls, obs: np.ndarray, next_obs: np.ndarray, done: np.ndarray) -> Rows:
        """Rows held in memory."""
        return cls(len(obs), done, obs.__getitem__, next_obs.__getitem__)

    def follows(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Per pair, whether row ``b`` continues row ``a`` (bytes)."""
        return same_per_row(self.next_obs(a), self.obs(b))


def cuts(rows: Rows) -> np.ndarray:
    """Rows ``i`` after which the stream breaks: ``i + 1`` starts another run.

    Scans the rows a block at a time.

    Examples:
        >>> obs = np.array([0, 1, 2, 10, 11, 12.0])
        >>> cuts(Rows.of_arrays(obs, obs + 1, np.zeros(6, bool)))  # 2 -> 3 is not 10
        array([2])
    """
    out = []
    for lo in range(0, rows.n - 1, rows.block):
        a = np.arange(lo, min(lo + rows.block, rows.n - 1))
        broken = ~rows.follows(a, a + 1) & ~rows.done[a]
        out.append(a[broken])
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def recover(rows: Rows, chunk: int = 1, wrapped: bool = False) -> Streams:
    """Recovers ``T``, ``E`` and the head of rows in write order.

    Args:
        rows: the rows, in write order.
        chunk: rows per storage slot (``T`` of a chunked storage; 1 for rows).
        wrapped: the rows come from a full circular buffer, so the last
            batch is whole and the first may not be.

    Returns:
        The layout. One env (``E = 1``) when nothing shows another.

    Examples:
        >>> # two envs, batches of 3 steps: env 0 counts 0.., env 1 counts 100..
        >>> t = np.arange(6.0)
        >>> obs = np.stack([t[0:3], 100 + t[0:3], t[3:6], 100 + t[3:6]]).reshape(-1)
        >>> s = recover(Rows.of_arrays(obs, obs + 1, np.zeros(12, bool)))
        >>> s.steps, s.envs, s.head, s.tail
        (3, 2, 0, 0)
        >>> s = recover(Rows.of_arrays(obs[2:], obs[2:] + 1, np.zeros(10, bool)), wrapped=True)
        >>> s.head, s.head_runs  # the rest of a batch: 1 row of env 0, 3 of env 1
        (4, ((0, 0, 1), (1, 1, 4)))
    """
    n = rows.n
    starts = cuts(rows) + 1
    if chunk > 1:
        steps, offset = chunk, 0
    elif len(starts) >= 2:
        steps = int(np.gcd.reduce(np.diff(starts)))
        offset = int(starts[0] % steps)
    elif len(starts) == 1:
        steps = n - int(starts[0]) if wrapped else int(starts[0])
        offset = int(starts[0] % steps)
    else:
        return Streams(n, 1, 0, (), 0)
    first = np.arange(offset, n - steps + 1, steps)
    envs = _period(rows, first, first + steps - 1)
    if not envs:  # no period: rows of several envs mixed in no order found
        return Streams(n, 1, 0, (), 0, found=False)
    size = steps * envs
    head, tail = (n % size, 0) if wrapped else (0, n % size)
    runs, stop, env = [], head, envs - 1
    while stop > 0:  # the head, from its end: env E-1, E-2, ...
        runs.append((env, max(stop - steps, 0), stop))
        stop, env = stop - steps, env - 1
    return Streams(steps, envs, head, tuple(reversed(runs)), tail)


def stored(env: np.ndarray) -> Streams:
    """The layout of rows whose env index is stored (one per row, write order).

    Examples:
        >>> s = stored(np.array([0, 1, 1, 0, 2]))
        >>> s.envs, s.found
        (3, True)
    """
    return Streams(1, int(env.max()) + 1 if len(env) else 1, 0, (), 0, env=env)


MAX_ENVS = 1024  # the largest env count looked for


def _period(rows: Rows, first: np.ndarray, last: np.ndarray) -> int:
    """The smallest E such that run k + E continues run k, for every k; 0 if none.

    Each candidate is tried on its first pairs, and the one that passes is
    checked on all of them, a block at a time (the reads stay bounded).
    """
    n_runs = len(first)
    for envs in range(1, min(n_runs, MAX_ENVS + 1)):
        a, b = last[:-envs], first[envs:]
        good, seen = _continue(rows, a[:64], b[:64])
        if seen and good == seen:  # a candidate: check every pair
            ok, checked = 0, 0
            for lo in range(0, len(a), rows.block):
                good, seen = _continue(rows, a[lo : lo + rows.block], b[lo : lo + rows.block])
                ok, checked = ok + good, checked + seen
            if checked and ok == checked:
                return envs
    return 1 if n_runs <= 1 else 0


def _continue(rows: Rows, a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    """(pairs where run b continues run a, pairs checked: a not done)."""
    open_ = ~rows.done[a]
    return int(rows.follows(a[open_], b[open_]).sum()), int(open_.sum())
