"""Multi-process TorchRL collectors: every worker's streams cleaned, one view of the state.

Two workers, each a ``GymEnv("CartPole-v1", num_envs=2)``; the same
collector over explicit-reset envs is the oracle (TorchRL seeds the workers
and their envs the same way in both runs). Cleaned streams are matched to
the oracle's by their first observation, since the buffer holds the workers'
rows in whatever order they arrived.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch
from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer

from cleanbuf import AutoresetFilter, CleanbufError, CleanbufWarning, ContinuityError
from tests.batches import assert_same_rows
from tests.faults import lost_warnings
from tests.invariants import check_invariants
from tests.oracle import compare_streams, streams_from_rows
from tests.workers import (
    ENVS_PER_WORKER,
    STREAM,
    no_torque,
    oracle_env,
    pendulum_env,
    push_left,
    worker_env,
)

pytestmark = pytest.mark.slow  # spawned worker processes: minutes on 2 cores

WORKERS, T, BATCHES = 2, 16, 8
OBS = ["observation"]  # env_id (see StreamId) is no observation to restitch
FRAMES = WORKERS * ENVS_PER_WORKER * T


@contextlib.contextmanager
def _collector(cls, make_env, frames=FRAMES, **kwargs):
    """A seeded collector, shut down however the test ends (a worker left
    running keeps the test process alive).
    """
    collector = cls(
        [make_env] * WORKERS,
        push_left,
        frames_per_batch=frames,
        total_frames=FRAMES * BATCHES,
        **kwargs,
    )
    try:
        collector.set_seed(0)
        yield collector
    finally:
        collector.shutdown()


@pytest.fixture(scope="module")
def oracle():
    """The explicit-reset run: per stream, keyed by its first observation."""
    with _collector(MultiSyncCollector, oracle_env) as collector:
        batches = [b.clone() for b in collector]
    rows = torch.cat([b.reshape(-1, b.shape[-1]) for b in batches], dim=1)
    return _by_first_obs({i: rows[i] for i in range(rows.shape[0])})


def _by_first_obs(streams):
    return {
        tuple(s["observation"][0].tolist()): s.exclude(STREAM, ("next", STREAM))
        for s in streams.values()
    }


def _filled_by_workers(cls):
    """A filtered buffer given to a ``cls`` collector, which the workers fill."""
    filt = _worker_filter()
    rb = ReplayBuffer(storage=LazyTensorStorage(100_000), transform=filt)
    with _collector(cls, worker_env, replay_buffer=rb) as collector:
        for _ in collector:
            pass
    return filt, rb


def _worker_filter():
    return AutoresetFilter.for_env(worker_env(), observation_keys=OBS)


def _check(filt, rb, oracle):
    """The buffer against the oracle, stream by stream, and the summed stats."""
    stats = filt.stats
    rows = rb[: len(rb)]
    cleaned = _by_first_obs(streams_from_rows(rows))
    assert len(cleaned) == WORKERS * ENVS_PER_WORKER
    n_lost = compare_streams(cleaned, oracle, min_rows=T * BATCHES // 4)
    assert stats["reset_rows_dropped"] > 0
    assert n_lost <= stats["terminal_obs_missing"]
    assert stats["rows_held"] == 0
    check_invariants(rows, stats, len(rb))
    return stats


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_workers_extend_the_buffer(cls, oracle):
    """The collector is given the buffer: each worker cleans its own streams
    through its own copy of the filter. Bugs caught: the parent's stats
    reading 0 rows (the copies' counts never seen), flush storing nothing
    while the copies hold done rows at shutdown (rows lost without a count),
    TorchRL's all-zero storage-initialisation batch counted or kept as
    state, a copy's rows cleaned against another copy's streams.
    """
    filt, rb = _filled_by_workers(cls)
    before = filt.stats
    assert before["rows_in"] > 0, "the copies' counts are not seen from the parent"
    filt.flush(rb)
    stats = _check(filt, rb, oracle)
    assert stats["rows_out"] - before["rows_out"] == before["rows_held"]
    filt.flush(rb)  # nothing left: stored once
    assert filt.stats == stats and len(rb) == stats["rows_out"]


def test_multi_sync_from_the_parent(oracle):
    """For b in MultiSyncCollector(...): rb.extend(b), batches [W, E, T]. Bugs
    caught: for_env(collector) not finding the env, the joint reset judged
    over all W * E streams instead of each worker's E (ResetRowError at the
    second batch, or a joint reset missed).
    """
    with _collector(MultiSyncCollector, worker_env) as collector:
        filt = AutoresetFilter.for_env(collector, observation_keys=OBS)
        assert filt.options.reset_group_size == ENVS_PER_WORKER
        rb = ReplayBuffer(storage=LazyTensorStorage(100_000), transform=filt)
        for batch in collector:
            rb.extend(batch)
    filt.flush(rb)
    _check(filt, rb, oracle)


def test_multi_async_from_the_parent(oracle):
    """For b in MultiAsyncCollector(...): rb.extend(b): [E, T] batches from one
    worker at a time. Bugs caught: both workers taken for the same streams
    (another worker's step-count fix, another worker's observation stored as
    a terminal observation), a worker's first batch merged into another's
    streams.
    """
    with _collector(MultiAsyncCollector, worker_env, frames=FRAMES // WORKERS) as collector:
        filt = AutoresetFilter.for_env(collector, observation_keys=OBS)
        assert filt.options.producer_key == ("collector", "traj_ids")
        rb = ReplayBuffer(storage=LazyTensorStorage(100_000), transform=filt)
        for batch in collector:
            rb.extend(batch)
    filt.flush(rb)
    _check(filt, rb, oracle)


def test_multi_async_with_one_workers_filter_is_refused():
    """The configuration the old error message recommended: a filter built
    for one worker's env, fed the batches of all workers in turn. Bug
    caught: another worker's batch glued onto the streams (the continuity
    check must refuse it before anything is written).
    """
    filt = _worker_filter()
    rb = ReplayBuffer(storage=LazyTensorStorage(100_000), transform=filt)
    with _collector(MultiAsyncCollector, worker_env, frames=FRAMES // WORKERS) as collector:
        with pytest.raises(ContinuityError, match="another producer"):
            for batch in collector:
                n, stats = len(rb), filt.stats
                rb.extend(batch)
    assert len(rb) == n and filt.stats == stats


def test_a_worker_killed_mid_run():
    """One worker is killed after a few batches; TorchRL then stops the
    collector. Bugs caught: the dead worker's held rows lost without a
    count (its copy's state went with it), rows stored twice or wrong, the
    stats identity broken. At most one batch the dead worker's filter had
    handed over may miss the buffer (killed between the two).
    """
    filt = _worker_filter()
    rb = ReplayBuffer(storage=LazyTensorStorage(100_000), transform=filt)
    with pytest.raises(RuntimeError, match="process"):
        with _collector(MultiSyncCollector, worker_env, replay_buffer=rb) as collector:
            for i, _ in enumerate(collector):
                if i == 2:
                    collector.procs[0].kill()
    filt.flush(rb)
    stats = filt.stats
    assert stats["rows_in"] >= 3 * FRAMES and stats["rows_held"] == 0
    assert stats["rows_in"] == (
        stats["rows_out"] + stats["reset_rows_dropped"] + stats["lost_rows_dropped"]
    )
    check_invariants(rb[: len(rb)], stats, len(rb), unstored=FRAMES // WORKERS)


def _reload(rb, make_filter=_worker_filter):
    """rb.state_dict() through torch.save / torch.load with their defaults,
    into a new buffer with a new filter.
    """
    f = io.BytesIO()
    torch.save(rb.state_dict(), f)
    f.seek(0)
    filt = make_filter()
    fresh = ReplayBuffer(storage=LazyTensorStorage(100_000), transform=filt)
    fresh.load_state_dict(torch.load(f))
    return filt, fresh


def test_checkpoint_of_the_workers_copies():
    """The buffer shared with the workers is checkpointed once they are done,
    before the flush. Bugs caught: the checkpoint missing the copies' states
    (their held rows lost, the stats of the workers' rows gone), a copy's
    state restored twice (its held rows stored twice).
    """
    filt, rb = _filled_by_workers(MultiSyncCollector)
    stats = filt.stats
    filt2, rb2 = _reload(rb)
    assert filt2.stats == stats and stats["rows_held"] > 0
    filt.flush(rb)
    filt2.flush(rb2)
    filt2.flush(rb2)
    assert filt2.stats == filt.stats and len(rb2) == len(rb)
    assert_same_rows(rb2[: len(rb2)], rb[: len(rb)])


def test_multi_async_resumed_mid_run_equals_uninterrupted():
    """Parent-side MultiAsyncCollector batches; the buffer is checkpointed
    after a few batches (every worker's streams in the state) and the rest
    goes to the restored buffer. Bugs caught: the producers' carries or
    their trajectory ids missing from the checkpoint (the next batch of a
    worker taken for a new producer: reset rows kept, ContinuityError).
    """
    with _collector(MultiAsyncCollector, worker_env, frames=FRAMES // WORKERS) as collector:
        batches = [b.clone() for b in collector]

    def make_filter():
        return AutoresetFilter(
            "next_step",
            joint_reset=True,
            reset_group_size=ENVS_PER_WORKER,
            producer_key=("collector", "traj_ids"),
            observation_keys=OBS,
        )

    def run(cut):
        filt = make_filter()
        rb = ReplayBuffer(storage=LazyTensorStorage(100_000), transform=filt)
        for i, batch in enumerate(batches):
            if i == cut:
                filt, rb = _reload(rb, make_filter)
            rb.extend(batch)
        filt.flush(rb)
        return filt.stats, rb[: len(rb)]

    want_stats, want = run(None)
    got_stats, got = run(len(batches) // 2)
    assert want_stats["reset_rows_dropped"] > 0
    assert got_stats == want_stats
    assert_same_rows(got, want)


def test_multi_async_reset_at_each_iter_from_the_parent_is_refused():
    """Bug caught: for_env configuring a parent-side MultiAsyncCollector that
    restarts every worker at every batch, whose batches no trajectory id
    ties to their worker (the carries of restarted workers would pile up).
    """
    with _collector(MultiAsyncCollector, worker_env, frames=FRAMES // WORKERS,
                    reset_at_each_iter=True) as collector:  # fmt: skip
        with pytest.raises(CleanbufError, match="replay_buffer=rb"):
            AutoresetFilter.for_env(collector)


def _check_loss_warning(filt, rb):
    """The parent's first ``filt.stats`` warns once with the copies' summed
    losses and both remedies; ``stats`` and ``flush`` then stay silent.
    """
    with pytest.warns(CleanbufWarning) as record:
        stats = filt.stats
    lost = lost_warnings(record)
    assert len(lost) == 1
    message = str(lost[0].message)
    n_nan = int(rb[: len(rb)]["next", "observation"].isnan().any(-1).sum())
    assert n_nan > 0 and int(message.split()[0]) == stats["terminal_obs_missing"] == n_nan
    for fragment in ("lossless_gym_env", "on_lost_terminal_obs='drop'", "NaN"):
        assert fragment in message
    with warnings.catch_warnings():
        warnings.simplefilter("error", CleanbufWarning)
        filt.flush(rb)
        assert filt.stats["terminal_obs_missing"] >= n_nan


def test_worker_losses_warn_in_the_parent():
    """Two workers of ``GymEnv("Pendulum-v1", num_envs=2)`` extend the buffer;
    each worker's joint reset at the 200-step limit loses its envs' terminal
    observations, stored as NaN. Bug caught: the warning raised only in the
    worker processes, so the parent, where the user looks, holds NaN rows
    without a word; or a warning there without the summed count.
    """
    probe = pendulum_env()
    filt = AutoresetFilter.for_env(probe)
    probe.close()
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=filt)
    collector = MultiSyncCollector(
        [pendulum_env] * WORKERS,
        no_torque,
        frames_per_batch=WORKERS * ENVS_PER_WORKER * 50,
        total_frames=WORKERS * ENVS_PER_WORKER * 250,  # 250 steps: one 200-step episode
        replay_buffer=rb,
    )
    try:
        for _ in collector:
            pass
    finally:
        collector.shutdown()
    _check_loss_warning(filt, rb)
