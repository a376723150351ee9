"""Batches of several producers whose trajectory ids collide (Ray collectors).

Inside a Ray actor the cleaner keeps one carry per producer and sends each
batch to the producer whose streams it continues. Hand-made TorchRL-like
``[2, 3]`` batches (next-step, joint resets, ``is_init``, ``step_count``,
trajectory ids) set up the cases a real run meets now and then: the ids
another producer's open streams carry, met again on the new episodes of a
producer whose every stream ended at the batch boundary, or on the ended
streams of a producer that comes first.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from cleanbuf.engine._cleaner import Cleaner
from cleanbuf.engine._options import Options
from tests.batches import assert_same_rows


def _batch(obs, nxt, reward, is_init, count, ids):
    """A ``[2, 3]`` TorchRL-like batch from per-stream lists.

    A row is done where its next observation is 0 (TorchRL zero-fills a
    done row's terminal observation); ``("next", "step_count")`` is the
    row's count plus one.
    """

    def col(values, dtype):
        return torch.tensor(values, dtype=dtype).unsqueeze(-1)

    nxt_t = col(nxt, torch.float32)
    count_t = col(count, torch.int64)
    return TensorDict(
        {
            "observation": col(obs, torch.float32),
            "is_init": col(is_init, torch.bool),
            "step_count": count_t,
            ("collector", "traj_ids"): torch.tensor(ids),
            ("next", "observation"): nxt_t,
            ("next", "reward"): col(reward, torch.float32),
            ("next", "done"): nxt_t == 0,
            ("next", "is_init"): torch.zeros(2, 3, 1, dtype=torch.bool),
            ("next", "step_count"): count_t + 1,
        },
        batch_size=[2, 3],
    )


OPTIONS = Options.build("next_step", joint_reset=True)


def _b_owing_a_shift(ids):
    """Producer B's batch: stream 0 ends, its reset row (reward 0, ``is_init``,
    count 0) is dropped, and its new episode owes a step-count shift; stream
    1 stays open. ``ids``: the two streams' ids from the reset row on.
    """
    return _batch(
        obs=[[10, 11, 50], [20, 21, 22]],
        nxt=[[0, 50, 51], [21, 22, 23]],
        reward=[[1, 0, 1], [1, 1, 1]],
        is_init=[[False, True, False], [False, False, False]],
        count=[[7, 0, 1], [5, 6, 7]],
        ids=[[1, ids[0], ids[0]], [ids[1]] * 3],
    )


def _b_going_on(ids):
    """Producer B's next batch, continuing :func:`_b_owing_a_shift`."""
    return _batch(
        obs=[[51, 52, 53], [23, 24, 25]],
        nxt=[[52, 53, 54], [24, 25, 26]],
        reward=[[1, 1, 1], [1, 1, 1]],
        is_init=[[False, False, False], [False, False, False]],
        count=[[2, 3, 4], [8, 9, 10]],
        ids=[[ids[0]] * 3, [ids[1]] * 3],
    )


def _a_rows(obs0, count0, ids, *, start, ends):
    """Producer A's batch: two streams from observations ``obs0``, counts from
    ``count0``; ``start``: new episodes; ``ends``: both end on the last row
    (a joint reset).
    """
    obs = [[o + t for t in range(3)] for o in obs0]
    nxt = [[o + 1 for o in row] for row in obs]
    if ends:
        nxt = [row[:-1] + [0] for row in nxt]
    return _batch(
        obs=obs,
        nxt=nxt,
        reward=[[1, 1, 1], [1, 1, 1]],
        is_init=[[start, False, False], [start, False, False]],
        count=[[count0 + t for t in range(3)]] * 2,
        ids=[[ids[0]] * 3, [ids[1]] * 3],
    )


def _check_routing(calls):
    """One cleaner for both producers stores, call by call, what one cleaner
    per producer stores; the flushes and the stats agree too.
    """
    alone = {"a": Cleaner(OPTIONS), "b": Cleaner(OPTIONS)}
    shared = Cleaner(OPTIONS)
    shared.many_producers = True
    for producer, batch in calls:
        want = alone[producer](batch)
        assert_same_rows(shared(batch), want, f"producer {producer}")
    assert alone["b"].stats["reset_rows_dropped"] == 1
    held = [h for h in (c.flush() for c in alone.values()) if h.batch_size[0]]
    rest = shared.flush()
    if held:
        assert_same_rows(rest, torch.cat(held))
    else:
        assert rest.batch_size[0] == 0
    total = {k: alone["a"].stats[k] + alone["b"].stats[k] for k in shared.stats}
    assert shared.stats == total


def test_an_id_shared_by_chance_does_not_route_a_restart():
    """Producer B's streams are open with trajectory ids 3 and 4, and B's
    stream 0 owes a step-count shift (its reset row was dropped in this
    episode). Producer A's streams both ended at its batch boundary (a
    joint reset), and its next batch starts new episodes with ids 3 and 4
    (its own pool). Bug caught: A's batch routed to B, whose open streams
    it seems to continue (a restart continues anything, and the ids
    match): B's pending shift dropped, and B's next batch cleaned against
    A's streams, its step counts one too high ("step count jumped", as in
    a Ray run with two collectors).
    """
    _check_routing(
        (
            ("b", _b_owing_a_shift((3, 4))),
            ("a", _a_rows((100, 200), 0, (1, 2), start=True, ends=True)),
            ("a", _a_rows((300, 400), 0, (3, 4), start=True, ends=False)),  # B's open ids
            ("b", _b_going_on((3, 4))),
        )
    )


def test_an_id_of_an_ended_stream_does_not_take_another_producers_batch():
    """Producer A (the first producer) ends both its streams on a batch's
    last row, with ids 5 and 2; producer B's open streams carry ids 5 and 2,
    and B's stream 0 owes a step-count shift. Bug caught (seen in Ray runs
    of two collectors, "step count jumped"): B's next batch taken for A's,
    because A comes first and the continuity check cannot refuse a stream
    that ended, although an episode's end changes its id: B's shift lost.
    """
    _check_routing(
        (
            ("a", _a_rows((100, 200), 0, (5, 2), start=True, ends=False)),
            ("b", _b_owing_a_shift((5, 2))),
            ("a", _a_rows((103, 203), 3, (5, 2), start=False, ends=True)),
            ("b", _b_going_on((5, 2))),
        )
    )


def test_a_single_producers_calls_never_enter_the_routing(monkeypatch):
    """The same calls through a single-producer cleaner, with the routing
    replaced by a function that fails. Bug caught: the routing (its
    trajectory-id reads and candidate search) run on every call of a
    single producer, whose batches carry trajectory ids too; also checks
    that those calls clean as one producer's calls do, held rows included.
    """
    from cleanbuf.engine import _cleaner

    calls = [
        _a_rows((100, 200), 0, (5, 2), start=True, ends=False),
        _a_rows((103, 203), 3, (5, 2), start=False, ends=True),
    ]
    want = Cleaner(OPTIONS)
    want_rows = [want(b) for b in calls]

    def no_routing(*args):
        raise AssertionError("a single producer's call was routed")

    monkeypatch.setattr(_cleaner, "route", no_routing)
    monkeypatch.setattr(_cleaner, "producer_key", no_routing)
    alone = Cleaner(OPTIONS)
    for batch, rows in zip(calls, want_rows):
        assert_same_rows(alone(batch), rows)
    assert_same_rows(alone.flush(), want.flush())
    shared = Cleaner(OPTIONS)
    shared.many_producers = True  # routed calls do reach the stub: the check can fail
    with pytest.raises(AssertionError, match="routed"):
        shared(calls[0])
