"""The continuity check: each call must continue the streams of the calls before it."""

from __future__ import annotations

import pytest
import torch
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv

from cleanbuf import AutoresetFilter, ContinuityError
from tests.batches import assert_same_rows, next_step_batch
from tests.test_errors import _primed, assert_rejected


def _open_at(batch, t):
    """Streams whose row t is not done and whose row t + 1 does not restart."""
    done = batch["next", "done"][:, t].reshape(-1)
    init = batch["is_init"][:, t + 1].reshape(-1)
    return (~done & ~init).nonzero().flatten().tolist()


def test_a_skipped_batch_is_refused():
    """Batches 0 and 2 of a stream, without batch 1. Bug caught: the filter
    gluing two pieces of a stream that do not meet (a held done row stored
    with a terminal observation from much later, step counts shifted
    across the gap). Without the check this call succeeds silently.
    """
    filt, rb, rest = _primed()
    assert_rejected(
        filt,
        rb,
        rest[:, 6:],
        ContinuityError,
        "does not continue",
        "skipped",
        "check_continuity=False",
        "Nothing was written",
        then=rest,
    )


def test_two_producers_interleaved_are_refused():
    """Two producers with the same stream shape extend one filter in turn
    (as a MultiAsyncCollector's workers do). Bug caught: worker B's rows
    taken as the continuation of worker A's streams (A's done row stored
    with B's observation as its terminal observation, B's rows with A's
    step-count shift).
    """
    a = next_step_batch(2, 24, 13)
    b = next_step_batch(2, 24, 113)
    b["observation"] += 0.5  # another env: other states (position encoding alone repeats)
    b["next", "observation"] += 0.5
    assert _open_at(torch.cat([a[:, :12], b[:, 12:]], 1), 11), "no stream to check"
    filt = AutoresetFilter("next_step")
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    rb.extend(a[:, :12])
    assert_rejected(
        filt,
        rb,
        b[:, 12:],
        ContinuityError,
        "another producer",
        "MultiAsyncCollector",
        "for_env(collector)",
        then=a[:, 12:],
    )


def test_opting_out_accepts_the_gap():
    """check_continuity=False is the documented way out (for producers whose
    observations do not chain, such as a env wrapper that rewrites
    observations between steps). Bug caught: the option ignored.
    """
    both = next_step_batch(2, 36, 4)
    assert _open_at(both, 11)
    filt = AutoresetFilter("next_step", check_continuity=False)
    filt.inv(both[:, :12])
    filt.inv(both[:, 24:])
    assert filt.stats["rows_in"] == 48


def test_nan_observations_continue():
    """Observations that hold NaN (an env that uses NaN for a missing
    sensor). Bug caught: NaN != NaN read as a break in the stream.
    """
    both = next_step_batch(2, 24, 4)
    both["observation"][:, 11:13] = float("nan")
    both["next", "observation"][:, 10:12] = float("nan")
    filt = AutoresetFilter("next_step")
    filt.inv(both[:, :12])
    filt.inv(both[:, 12:])
    assert filt.stats["rows_in"] == 48


def _long_episode_batches(producer_key):
    """Four [2, 8] collector batches of Pendulum (200-step episodes): no
    episode ends, so every batch starts with the same trajectory ids.
    """
    env = GymEnv("Pendulum-v1", num_envs=2)
    env.set_seed(0)
    collector = Collector(env, None, frames_per_batch=16, total_frames=64)
    try:
        batches = [b.clone() for b in collector]
    finally:
        collector.shutdown()
    ids = torch.stack([b["collector", "traj_ids"][:, 0] for b in batches])
    assert (ids == ids[0]).all() and not any(b["next", "done"].any() for b in batches)
    options = {"producer_key": ("collector", "traj_ids")} if producer_key else {}
    return AutoresetFilter("next_step", **options), batches


@pytest.mark.parametrize("producer_key", [False, True], ids=["one producer", "producer_key"])
def test_batches_with_the_same_trajectory_ids_are_new_batches(producer_key):
    """Bug caught (it shipped): a batch starting with the same trajectory
    ids as the last call's taken for that batch written again, so the
    filter rolled back to before the last call every time: each call
    counted over the first (rows_in stuck at one batch) and checked against
    the first call's state (a skipped batch went through).
    """
    filt, batches = _long_episode_batches(producer_key)
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    for b in batches[:3]:
        rb.extend(b)
    assert filt.stats["rows_in"] == filt.stats["rows_out"] == len(rb) == 48
    assert_same_rows(rb[:], torch.cat([b.reshape(-1) for b in batches[:3]]))
    filt, _ = _long_episode_batches(producer_key)
    filt.inv(batches[0])
    with pytest.raises(ContinuityError):
        filt.inv(batches[2])
