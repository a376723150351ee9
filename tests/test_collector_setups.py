"""TorchRL collector settings around the core: restarts and batch-end marks.

``reset_at_each_iter=True`` and ``collector.reset()`` restart the streams
between batches; ``set_truncated=True`` marks every batch end as truncated.
Marks leave the envs alone, so that run is compared with the explicit-reset
run; a restart spends the envs' random numbers differently in the two runs,
so those are checked against the invariants of clean data.
"""

from __future__ import annotations

import pytest
import torch
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer

from cleanbuf import AutoresetFilter
from tests.batches import assert_same_rows
from tests.invariants import check_invariants
from tests.oracle import (
    compare_streams,
    make_env,
    push_left_policy,
    streams_from_batches,
    streams_from_rows,
)

E, T, BATCHES = 2, 16, 12


def _run(collector_kwargs, reset_every=None, via_rb=False, build="for_env(collector)", **env):
    env_name = env.pop("env_name", "CartPole-v1")
    source = make_env(env_name, E, **env)
    rb = ReplayBuffer(storage=LazyTensorStorage(100_000))
    collector = Collector(
        source,
        push_left_policy,
        frames_per_batch=E * T,
        total_frames=E * T * BATCHES,
        replay_buffer=rb if via_rb else None,
        **collector_kwargs,
    )
    if build == "for_env(collector)":
        filt = AutoresetFilter.for_env(collector)
    elif build == "for_env(env)":
        filt = AutoresetFilter.for_env(source)
    else:  # by hand, as a user who knows GymEnv's joint reset writes it
        filt = AutoresetFilter("next_step", joint_reset=True)
    rb.append_transform(filt)
    for i, batch in enumerate(collector):
        if not via_rb:
            rb.extend(batch)
        if reset_every and i % reset_every == reset_every - 1 and i < BATCHES - 1:
            collector.reset()
    collector.shutdown()
    filt.flush(rb)
    source.close()
    return filt, rb


def _oracle(env_name="CartPole-v1", **env):
    oracle_env = make_env(env_name, E, disabled=True, **env)
    collector = Collector(
        oracle_env,
        push_left_policy,
        frames_per_batch=E * T,
        total_frames=E * T * BATCHES,
        set_truncated=True,
    )
    batches = [b.clone() for b in collector]
    collector.shutdown()
    return streams_from_batches(batches)


BUILDS = ["for_env(collector)", "for_env(env)", "by hand"]


@pytest.mark.parametrize("trackers", [True, False], ids=["InitTracker", "no trackers"])
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("via_rb", [False, True], ids=["rb.extend", "Collector(replay_buffer=rb)"])
def test_set_truncated_marks_match_explicit_resets(via_rb, build, trackers):
    """Collector(set_truncated=True) marks the last step of every batch done
    and truncated; no option tells the filter. Bugs caught: marks read as
    episode ends (the next batch's first row dropped as a reset row, or
    ResetRowError), as joint resets (real next observations replaced by NaN:
    22 of them in 8 batches of [4, 40] before marks were read from the
    rows), or a real episode end at a batch end taken for a mark (a reset row
    kept); without InitTracker, a mark decided by guess instead of by the
    next row's observation.
    """
    oracle = _oracle(trackers=trackers)
    filt, rb = _run({"set_truncated": True}, via_rb=via_rb, build=build, trackers=trackers)
    stats = filt.stats
    assert stats["reset_rows_dropped"] > 0
    rows = rb[: len(rb)]
    # The marks fall on other transitions in the two runs (a batch of the
    # auto-reset run holds fewer real steps), and a mark is kept as stored, so
    # done and truncated are left out; CartPole's real ends are terminations
    # here (episodes end long before the time limit), and those are compared.
    # The last row of each stream is the last batch's mark, which no row came
    # to decide: flushed as stored (its next observation is real, not
    # zero-filled), so it is compared too.
    marks = (("next", "done"), ("next", "truncated"))
    cleaned = streams_from_rows(rows)
    assert stats["next_obs_missing"] == 0
    for s in cleaned.values():
        assert s[-1]["next", "done"].all() and not s[-1]["next", "observation"].isnan().any()
    n_lost = compare_streams(
        {e: s.exclude(*marks) for e, s in cleaned.items()},
        {e: s.exclude(*marks) for e, s in oracle.items()},
        min_rows=T * BATCHES * 3 // 4,
    )
    assert n_lost == stats["terminal_obs_missing"]  # real joint terminations only
    if trackers:  # (the invariants read is_init; the oracle above checked the rest)
        check_invariants(rows, stats, len(rb))


@pytest.mark.parametrize("trackers", [True, False], ids=["InitTracker", "no trackers"])
@pytest.mark.parametrize("build", BUILDS)
def test_real_joint_end_on_a_batch_end_with_marks(build, trackers):
    """Pendulum with a T-step time limit and T-step batches: every real
    episode end is a joint reset (all envs truncate together) on a batch's
    last step, where Collector(set_truncated=True) also marks. Bugs caught:
    the real joint end taken for a mark (the zero-filled next observation
    stored as a real one, the new episode's first row treated as the
    continuation: no is_init, step counts running on), the new episode's
    first row dropped as a reset row (ResetRowError on a nonzero reward,
    or a real transition lost), a lost terminal observation not counted.
    """
    env = {"env_name": "Pendulum-v1", "max_episode_steps": T, "trackers": trackers}
    oracle = _oracle(**env)
    filt, rb = _run({"set_truncated": True}, build=build, **env)
    stats = filt.stats
    rows = rb[: len(rb)]
    cleaned = streams_from_rows(rows)
    assert stats["reset_rows_dropped"] == 0 and stats["rows_held"] == 0
    # Every episode's last row lost its terminal observation (joint reset),
    # the last batch's too (undecided at the flush): NaN, counted.
    assert stats["terminal_obs_missing"] + stats["next_obs_missing"] == E * BATCHES
    for s in cleaned.values():
        lost = s["next", "observation"].isnan().any(-1)
        assert lost.sum() == BATCHES and lost[T - 1 :: T].all()
    n_lost = compare_streams(
        {e: s[:-1] for e, s in cleaned.items()},
        {e: s[:-1] for e, s in oracle.items()},
        min_rows=T * BATCHES - 1,
    )
    assert n_lost == E * (BATCHES - 1)
    assert stats["rows_in"] == stats["rows_out"] == len(rb) == E * T * BATCHES


@pytest.mark.parametrize("how", ["reset_at_each_iter", "collector.reset()"])
def test_restarts_between_batches(how):
    """A collector reset between batches restarts every stream (is_init,
    step count 0). Bugs caught: the step-count shift of the interrupted
    episode carried into the new one (step_count -1, counts off by one), an
    is_init fix leaking into it, a done row waiting for its reset row when
    the reset discarded it (its restart row dropped as a reset row, or
    ResetRowError), a held row lost or stored twice.
    """
    if how == "reset_at_each_iter":
        filt, rb = _run({"reset_at_each_iter": True})
    else:
        filt, rb = _run({}, reset_every=3)
    stats = filt.stats
    assert stats["reset_rows_dropped"] > 0 and stats["rows_held"] == 0
    check_invariants(rb[: len(rb)], stats, len(rb))


def test_slice_sampler_over_trajectory_ids_stays_in_one_episode():
    """The README's sampler for sequences from cleaned rows:
    SliceSampler(traj_key=("collector", "traj_ids")). Flat rows interleave
    the streams in the buffer (each call stores stream after stream), so a
    sampler that only looks for done flags (end_key) crosses streams. Bug
    caught: a cleaned buffer whose trajectory ids no longer split it into
    episodes (a reset row's id kept, ids mixed across streams), so that a
    slice runs across two episodes or two envs.
    """
    from torchrl.data import SliceSampler

    filt, rb = _run({})
    rows = rb[: len(rb)]
    sampler_rb = ReplayBuffer(
        storage=LazyTensorStorage(len(rows)),
        sampler=SliceSampler(slice_len=4, traj_key=("collector", "traj_ids"), strict_length=True),
        batch_size=400,
    )
    sampler_rb.extend(rows)
    sample = sampler_rb.sample().reshape(-1, 4)
    assert (sample["env_id"] == sample["env_id"][:, :1]).all(), "a slice crosses streams"
    count = sample["step_count"].squeeze(-1)
    assert (count[:, 1:] == count[:, :-1] + 1).all(), "a slice crosses an episode or a gap"
    assert torch.equal(sample["next", "observation"][:, :-1], sample["observation"][:, 1:])


def test_filter_as_a_collector_postproc():
    """``Collector(..., postproc=filt)`` yields the rows the filter stores as
    the buffer's transform, and sampling that buffer leaves its filter alone.
    Bugs caught: ``forward`` as the identity (a postproc filter passing
    reset rows and zeroed terminal observations through), ``forward``
    cleaning sampled rows (``rb.sample()`` changing the filter's state, or
    refusing the sample as a broken stream).
    """
    want_filt, want_rb = _run({})
    env = make_env("CartPole-v1", E)
    filt = AutoresetFilter.for_env(env)
    collector = Collector(
        env, push_left_policy, frames_per_batch=E * T, total_frames=E * T * BATCHES, postproc=filt
    )
    batches = [b for b in collector]
    collector.shutdown()
    env.close()
    held = filt.flush()
    rows = torch.cat([*batches, held]) if held.batch_size[0] else torch.cat(batches)
    assert_same_rows(rows, want_rb[: len(want_rb)])
    assert filt.stats == want_filt.stats

    before = want_filt.stats
    sample = want_rb.sample(64)
    assert sample.batch_size == (64,) and want_filt.stats == before
