"""Invariants of cleaned CartPole rows, for runs the oracle cannot match.

Where the explicit-reset run cannot be reproduced (a collector reset spends
the envs' random numbers differently in the two runs), cleaned rows are
checked against what any clean CartPole data satisfies, stream by stream.
"""

from __future__ import annotations

import torch

from tests.oracle import streams_from_rows

# CartPole-v1 ends an episode past these (|x| > 2.4, |theta| > 12 degrees).
X_LIMIT, THETA_LIMIT = 2.4, 12 * 2 * 3.141592653589793 / 360


def check_invariants(rows, stats, stored, unstored=0):
    """Asserts that flat cleaned CartPole rows (with the ``env_id`` key of
    ``push_left_policy``, ``StepCounter`` and ``InitTracker``) are clean.

    Per stream, in storage order: no reset row (CartPole pays 1 on every real
    step); a row that does not start an episode continues the one before
    (same observation bytes, step count + 1); ``is_init`` exactly where the
    step count is 0; a done row followed by no reset is a truncation mark;
    a done row's next observation is a terminal state of
    CartPole or NaN; a restart's previous row keeps a real next observation;
    NaN only on done rows, as many as the stats count; the stats identity,
    and ``rows_out`` equal to what the buffer received.

    Args:
        rows: the stored rows, flat.
        stats: the filter's stats (summed over its copies).
        stored: the number of rows the buffer received.
        unstored: at most this many rows the filter handed over may be
            missing from the buffer (a worker killed between the two).
    """
    assert stats["rows_in"] == (
        stats["rows_out"]
        + stats["reset_rows_dropped"]
        + stats["lost_rows_dropped"]
        + stats["rows_held"]
    ), stats
    assert 0 <= stats["rows_out"] - stored <= unstored, (stats, stored)
    n_nan = 0
    for e, s in streams_from_rows(rows).items():
        obs, nxt = s["observation"], s["next", "observation"]
        done = s["next", "done"].reshape(-1)
        init = s["is_init"].reshape(-1)
        count = s["step_count"].reshape(-1)
        assert (s["next", "reward"] != 0).all(), f"stream {e}: a reset row was stored"
        assert torch.equal(init, count == 0), f"stream {e}: is_init where step_count != 0"
        assert (s["next", "step_count"].reshape(-1) == count + 1).all(), (
            f"stream {e}: next step count"
        )
        lost = torch.isnan(nxt).any(-1)
        assert done[lost].all(), f"stream {e}: NaN next observation on a non-done row"
        n_nan += int(lost.sum())
        cont = ~init[1:]
        truncated = s["next", "truncated"].reshape(-1)
        # A done row followed by no reset is only a collector's batch-end mark.
        assert truncated[:-1][cont & done[:-1]].all(), f"stream {e}: a done row continued"
        assert torch.equal(nxt[:-1][cont], obs[1:][cont]), f"stream {e}: chain broken"
        assert (count[1:][cont] == count[:-1][cont] + 1).all(), f"stream {e}: step count jumped"
        restart = ~cont & ~done[:-1]  # a collector reset: the row before it is complete
        assert torch.isfinite(nxt[:-1][restart]).all(), f"stream {e}: restart lost a next obs"
        ends = done & ~lost
        term = nxt[ends]
        past = (term[:, 0].abs() > X_LIMIT) | (term[:, 2].abs() > THETA_LIMIT)
        assert (past | truncated[ends]).all(), f"stream {e}: a done row without a terminal state"
    assert n_nan == stats["terminal_obs_missing"] + stats["next_obs_missing"], (n_nan, stats)
