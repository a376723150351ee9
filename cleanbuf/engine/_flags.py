"""The per-row flags the planning kernel reads, besides the done flags.

Each returns a numpy array with one entry per row of the call, or an empty
array when the call has nothing of that kind (the kernel then skips it).
"""

from __future__ import annotations

import numpy as np
import torch

from cleanbuf.engine._errors import InputError, key_name
from cleanbuf.engine._keys import row_flags
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


def row_flags_or_none(rows: Views, key: tuple) -> np.ndarray:
    """The flags of ``key`` (see :func:`row_flags`), or empty where the rows lack it."""
    return row_flags(key[-1], key, rows) if key in rows.tensors else NONE


def reward_rows(options: Options, rows: Views) -> np.ndarray:
    """Per row, nonzero where the reward is not exactly 0 (for the reset-row check)."""
    key = options.reward_key
    if not options.check_reset_rows or key is None or options.mode != "next_step":
        return NONE
    if key not in rows.tensors:
        found = [k for k in rows.tensors if "reward" in str(k[-1])]
        raise InputError(
            f"reward key {key_name(key)} is missing from the batch (reward-like keys found: "
            f"{found or 'none'}); the reset-row check reads it: a row after a done row must "
            "have reward 0 to be dropped as a reset row, and without it data in the wrong "
            "mode (already clean, or same-step) would lose real rows. Fix: pass "
            "reward_key= naming the reward (for example reward_key=('reward',)), or "
            "check_reset_rows=False to drop every row after a done row unchecked. "
            "Nothing was written."
        )
    n = rows.n_rows
    a = rows[key]
    if a is not None and a.size == n and a.dtype.kind != "c":
        return a.reshape(n)
    reward = rows.tensors[key]
    return (reward != 0).reshape(n, -1).any(1).to(torch.uint8).cpu().numpy()


def joint_rows(options: Options, rows: Views, done: np.ndarray) -> np.ndarray:
    """Per flat row, done at a step where its whole reset group was done (``joint_key``).

    Time-aligned rows need no such flags: the planning kernel reads their
    joint resets from the done flags of each step (``group``).
    """
    if not options.joint_reset or options.joint_key is None:
        return NONE
    return done & row_flags("joint_key", options.joint_key, rows)
