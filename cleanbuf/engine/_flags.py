"""The per-row flags the planning kernel reads, besides the done flags.

Each returns a numpy array with one entry per row of the call, or an empty
array when the call has nothing of that kind (the kernel then skips it).
"""

from __future__ import annotations

import numpy as np
import torch

from cleanbuf.engine._errors import InputError, key_name
from cleanbuf.engine._kernels import read_fills
from cleanbuf.engine._keys import row_flags
from cleanbuf.engine._move import SMALL_ROW_BYTES, Views
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


def stored_rows(rows: Views, obs_keys, done: np.ndarray) -> np.ndarray:
    """Per done row, whether its next observation is stored (read from the data).

    A done row's ``("next", k)`` holds its terminal observation unless the
    producer filled it in: zero-filled (every element of every observation
    key exactly 0, as TorchRL's collectors leave a next-step done row) or
    NaN-filled (any NaN in a floating-point key, TorchRL's mark of a missing
    next observation). Any other value is stored: it is never replaced and
    never counted as lost. The one ambiguity: a terminal observation that is
    truly 0 in every element reads as zero-filled. Where its reset row
    follows, that row's observation (the same zeros) is written back, so
    nothing changes; where none follows (a flush, a restart, a joint reset)
    it is counted lost. Only done rows are read (one small gather each).

    Returns:
        bool ``[n_rows]`` (False on rows that are not done), or an empty
        array when no row is done.

    Examples:
        >>> done = np.array([True, False, True, True])
        >>> nxt = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 3.0], [float("nan"), 1.0]])
        >>> rows = Views({("next", "observation"): nxt}, 1, 4)
        >>> stored_rows(rows, [("observation",)], done).tolist()
        [False, False, True, False]
    """
    done_rows = np.flatnonzero(done)
    if not len(done_rows):
        return NONE
    filled = np.ones(len(done_rows), np.bool_)  # zero-filled so far
    nan = np.zeros(len(done_rows), np.bool_)
    for k in obs_keys:
        nk = ("next", *k)
        a = rows[nk]
        if a is None:  # torch ops (CUDA, dtypes numpy lacks)
            x = rows.flat(nk)
            x = x.index_select(0, torch.from_numpy(done_rows).to(x.device))
            x = x.reshape(len(done_rows), -1)
            filled &= (x == 0).all(1).cpu().numpy()
            if x.is_floating_point():
                nan |= x.isnan().any(1).cpu().numpy()
            continue
        x = a.reshape(rows.n_rows, -1)
        floating = x.dtype.kind in "fc"
        if x.shape[1] * x.itemsize <= SMALL_ROW_BYTES and x.dtype != np.float16:  # (numba lacks it)
            read_fills(x.view(np.uint8) if x.dtype == np.bool_ else x, done_rows, floating,
                       filled, nan)  # fmt: skip
            continue
        x = x[done_rows]  # wide rows: numpy's vectorized scans
        filled &= ~x.any(1)  # (-0.0 is 0; NaN is not, and is read below)
        if floating:
            nan |= np.isnan(x).any(1)
    out = np.zeros(len(done), np.bool_)
    out[done_rows] = ~(filled | nan)
    return out
