"""Which done rows of stored joint-reset data ended with their whole batch of envs.

TorchRL's ``GymEnv(name, num_envs=N)`` resets its envs together when all
of them are done on one step. Such a done row is followed by the next
episode's first row, not by a reset row, and its terminal observation is
lost. The filter reads this from the done flags of each step of an
``[E, T]`` batch. Stored rows are flat, so the offline clean works the
flag out per row, from the env and step the recovered layout gives each
row, and hands it to the cleaner as ``joint_key``:

* a step where every env has a row (a whole write): joint when all its
  rows are done, the filter's own rule;
* a step of a write the buffer partly overwrote (or only partly holds),
  where some envs' rows are gone: not joint if a row there is not done;
  if every row there is done, each is joint when the row after it in its
  env is not a reset row (reward 0, not done). Only that case needs the
  reward signature; it is *undecided* where the audit is not sure of it.
"""

from __future__ import annotations

import numpy as np

from cleanbuf.offline._streams import Streams


def joint_rows(
    done: np.ndarray,
    reward_zero: np.ndarray,
    streams: Streams,
    positions: list,
) -> tuple[np.ndarray, np.ndarray]:
    """Per row (write order), whether it is a done row of a joint reset.

    Args:
        done: ``[N]`` done flags, write order.
        reward_zero: ``[N]`` whether each row's reward is exactly 0.
        streams: the recovered layout (``E`` envs, ``T`` steps a write,
            the head of a wrapped buffer).
        positions: per env, its rows' positions, time order.

    Returns:
        ``(joint, undecided)``: ``[N]`` bools. ``undecided`` marks the done
        rows whose flag came from the reward signature alone (a step of a
        partial write whose every row is done).

    Examples:
        >>> # 2 envs, 2 steps a write, the first write half overwritten
        >>> # (env 1's rows kept). Step 1 of write 2: both done (joint).
        >>> s = Streams(steps=2, envs=2, head=2, head_runs=((1, 0, 2),), tail=0)
        >>> done = np.array([0, 1, 0, 1, 0, 1], bool)
        >>> zero = np.array([0, 0, 0, 0, 1, 0], bool)  # env 1's row 4: a reset row
        >>> pos = [np.array([2, 3]), np.array([0, 1, 4, 5])]
        >>> joint, undecided = joint_rows(done, zero, s, pos)
        >>> joint.astype(int).tolist(), undecided.astype(int).tolist()
        ([0, 0, 0, 1, 0, 1], [0, 1, 0, 0, 0, 0])
    """
    n = len(done)
    size = streams.steps * streams.envs
    q = np.arange(n) - streams.head  # head rows: the end of write -1
    step = (q // size) * streams.steps + (q % size) % streams.steps
    _, which, rows_at = np.unique(step, return_inverse=True, return_counts=True)
    done_at = np.bincount(which, weights=done, minlength=len(rows_at))
    all_done = (done_at == rows_at)[which]
    whole = (rows_at == streams.envs)[which]
    after = np.full(n, -1, np.int64)  # each row's next row in its env
    for pos in positions:
        after[pos[:-1]] = pos[1:]
    has_next = after >= 0
    nxt = after[has_next]
    reset_next = np.zeros(n, np.bool_)
    reset_next[has_next] = reward_zero[nxt] & ~done[nxt]
    undecided = done & all_done & ~whole
    joint = done & all_done & whole
    joint |= undecided & has_next & ~reset_next
    return joint, undecided
