"""The per-row flags the planning kernel reads, besides the done flags.

Each returns a numpy array with one entry per row of the call, or an empty
array when the call has nothing of that kind (the kernel then skips it).
"""

from __future__ import annotations

import numpy as np
import torch

from cleanbuf.engine._checks import reset_groups, set_truncated_needs_restarts
from cleanbuf.engine._keys import row_flags
from cleanbuf.engine._layout import CallLayout
from cleanbuf.engine._move import Views
from cleanbuf.engine._options import Options

NONE = np.zeros(0, np.bool_)
NONE.flags.writeable = False


def restart_rows(options: Options, rows: Views) -> np.ndarray:
    """Per row, whether it comes after a real reset of its env.

    Read from ``is_init`` where the rows have it, else ``step_count == 0``.

    Examples:
        >>> rows = Views({("is_init",): torch.tensor([True, False])}, 1, 2)
        >>> restart_rows(Options(), rows).tolist()
        [True, False]
    """
    if options.is_init_key is not None and options.is_init_key in rows.tensors:
        return row_flags("is_init", options.is_init_key, rows)
    if options.step_count_key is not None and options.step_count_key in rows.tensors:
        count = rows.tensors[options.step_count_key]
        return (count.reshape(rows.n_rows, -1)[:, 0] == 0).cpu().numpy()
    return NONE


def mark_rows(
    options: Options, rows: Views, layout: CallLayout, done: np.ndarray, restart: np.ndarray
) -> np.ndarray:
    """Per row, an undecided collector batch-end mark (with ``set_truncated``).

    A done row on the call's last step whose only end signal may be the
    collector's truncation mark (truncated, not terminated).
    """
    if not options.set_truncated or not np.count_nonzero(done):
        return NONE
    set_truncated_needs_restarts(restart)
    mark = np.zeros(layout.n_rows, np.bool_)
    last = layout.last_rows
    truncated = _flag_or(rows, ("next", "truncated"), True)
    terminated = _flag_or(rows, ("next", "terminated"), False)
    mark[last] = (done & truncated & ~terminated)[last]
    return mark


def _flag_or(rows: Views, key: tuple, default: bool) -> np.ndarray | bool:
    return row_flags(key[-1], key, rows) if key in rows.tensors else default


def reward_rows(options: Options, rows: Views) -> np.ndarray:
    """Per row, nonzero where the reward is not exactly 0 (for the reset-row check)."""
    key = options.reward_key
    if not options.check_reset_rows or key is None or key not in rows.tensors:
        return NONE
    n = rows.n_rows
    a = rows[key]
    if a is not None and a.size == n and a.dtype.kind != "c":
        return a.reshape(n)
    reward = rows.tensors[key]
    return (reward != 0).reshape(n, -1).any(1).to(torch.uint8).cpu().numpy()


def joint_rows(
    options: Options, rows: Views, done: np.ndarray, mark: np.ndarray, layout: CallLayout
) -> np.ndarray:
    """Per row, done at a step where its whole reset group is done (``joint_reset``).

    Read from the done flags of each step, or, for flat rows, from
    ``joint_key``.

    A collector's undecided batch-end marks do not count (if they hid a
    real joint reset, the next row is a restart).
    """
    if not options.joint_reset:
        return NONE
    if options.joint_key is not None:  # flat rows: the flags come with them
        return done & row_flags("joint_key", options.joint_key, rows)
    n_streams = layout.n_streams
    group = options.reset_group_size or n_streams
    reset_groups(group, n_streams, layout.stream_shape)
    if len(mark):
        done = done & ~mark
    d = done.reshape(n_streams // group, group, layout.steps)
    return (d & d.all(axis=1, keepdims=True)).reshape(-1)
