"""The continuity check: each call must continue the streams of the calls before it."""

from __future__ import annotations

import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

from cleanbuf import AutoresetFilter, ContinuityError
from tests.batches import next_step_batch
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
