"""Oracle tests: TorchRL GymEnv(num_envs=E) through a Collector, cleaned by the filter.

The cleaned buffer must equal, per stream, the same run on a Gymnasium vector
env in AutoresetMode.DISABLED wrapped by GymWrapper (explicit resets).
"""

from __future__ import annotations

import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

from cleanbuf import AutoresetFilter
from tests.oracle import (
    collect,
    compare_streams,
    make_env,
    streams_from_batches,
    streams_from_rows,
)

E, T, BATCHES = 2, 16, 10


def _oracle(max_episode_steps=None, batches=BATCHES):
    env = make_env("CartPole-v1", E, max_episode_steps, disabled=True)
    out = collect(env, E * T, E * T * batches)
    return streams_from_batches(out), out


def _cleaned(via_collector_rb, max_episode_steps=None, batches=BATCHES):
    env = make_env("CartPole-v1", E, max_episode_steps)
    filt = AutoresetFilter.for_env(env)
    rb = ReplayBuffer(storage=LazyTensorStorage(100_000), transform=filt)
    if via_collector_rb:
        raw = collect(env, E * T, E * T * batches, replay_buffer=rb)
    else:
        raw = collect(env, E * T, E * T * batches)
        for batch in raw:
            rb.extend(batch)
    filt.flush(rb)
    env.close()
    return filt, rb, raw


@pytest.mark.parametrize(
    "via_collector_rb", [False, True], ids=["rb.extend", "Collector(replay_buffer=rb)"]
)
def test_gymenv_matches_explicit_resets(via_collector_rb):
    """Bugs caught: a reset row left in the buffer (rows shift against the
    oracle), a terminal observation not restored (zeros instead of the
    oracle's value), is_init or step_count not restarted, a held row lost or
    stored twice (len(rb) != rows_out), a joint reset treated as a partial one
    (a real transition dropped, or ResetRowError), and lost terminal
    observations that are not NaN or not counted.
    """
    oracle, oracle_batches = _oracle()
    filt, rb, _ = _cleaned(via_collector_rb)
    stats = filt.stats
    # The run must contain both kinds of episode end, or the test proves little.
    done = torch.stack([b["next", "done"] for b in oracle_batches])
    assert stats["reset_rows_dropped"] > 0 and stats["terminal_obs_missing"] > 0
    assert len(rb) == stats["rows_out"] == stats["rows_in"] - stats["reset_rows_dropped"]
    assert stats["rows_held"] == 0
    rows = rb[: len(rb)]
    n_lost = compare_streams(streams_from_rows(rows), oracle, min_rows=T * BATCHES * 3 // 4)
    total_nan = int(torch.isnan(rows["next", "observation"]).any(-1).sum())
    assert total_nan == stats["terminal_obs_missing"]
    assert 0 < n_lost <= total_nan
    assert done.any()


def test_time_limit_all_envs_truncate_together():
    """Every episode ends by truncation at the same step in all envs, so
    TorchRL resets jointly and no reset row ever appears. Bugs caught: holding
    the done rows and then dropping the next real transition as a "reset row"
    (ResetRowError or missing rows), or restoring a wrong terminal
    observation instead of marking it lost.
    """
    oracle, _ = _oracle(max_episode_steps=5)
    filt, rb, _ = _cleaned(False, max_episode_steps=5)
    stats = filt.stats
    assert stats["reset_rows_dropped"] == 0
    assert stats["rows_out"] == stats["rows_in"] == len(rb)
    rows = rb[: len(rb)]
    n_lost = compare_streams(streams_from_rows(rows), oracle, min_rows=T * BATCHES)
    assert n_lost == stats["terminal_obs_missing"] == stats["episodes_completed"] > 0
