"""Ray: RayCollector workers extending one filtered RayReplayBuffer.

Two remote collectors, each a ``GymEnv("CartPole-v1", num_envs=2)``, write
into one ``RayReplayBuffer`` whose actor holds the filter. Each collector
draws trajectory ids from its own pool, so their ids collide. The same
RayCollector over explicit-reset envs, seeded the same, is the oracle;
streams are matched to it by their first observation. One local Ray
session (``ray.init(num_cpus=2)``) serves the module.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

ray = pytest.importorskip("ray")
from torchrl.collectors.distributed import RayCollector  # noqa: E402
from torchrl.data import LazyTensorStorage, RayReplayBuffer  # noqa: E402

from cleanbuf import AutoresetFilter  # noqa: E402
from tests.invariants import check_invariants  # noqa: E402
from tests.oracle import compare_streams, streams_from_rows  # noqa: E402
from tests.workers import (  # noqa: E402
    ENVS_PER_WORKER,
    STREAM,
    oracle_env,
    push_left,
    seeded,
    worker_env,
)

COLLECTORS, T, BATCHES = 2, 32, 8
OBS = ["observation"]  # env_id (see StreamId) is no observation to restitch
FRAMES = COLLECTORS * ENVS_PER_WORKER * T  # one batch of every collector


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _collect(make_env, sync, replay_buffer=None):
    """Runs a RayCollector to the end (collector i's envs seeded from 100 i).

    Returns its batches; none when it writes into ``replay_buffer``.
    """
    collector = RayCollector(
        [functools.partial(seeded, make_env, 100 * i) for i in range(COLLECTORS)],
        push_left,
        frames_per_batch=FRAMES if sync else FRAMES // COLLECTORS,
        total_frames=FRAMES * BATCHES,
        sync=sync,
        replay_buffer=replay_buffer,
        remote_configs={"num_cpus": 0.5},
    )
    try:
        return [b.clone() for b in collector if b is not None]
    finally:
        collector.shutdown()


def _by_first_obs(streams):
    return {
        tuple(s["observation"][0].tolist()): s.exclude(STREAM, ("next", STREAM))
        for s in streams.values()
    }


@pytest.fixture(scope="module")
def oracle():
    """The explicit-reset run: per stream, keyed by its first observation."""
    batches = _collect(oracle_env, sync=True)
    rows = torch.cat([b.reshape(-1, b.shape[-1]) for b in batches], dim=1)
    return _by_first_obs({i: rows[i] for i in range(rows.shape[0])})


def _filtered_buffer():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the time-limit warning: CartPole's 500 steps
        filt = AutoresetFilter.for_env(worker_env(), observation_keys=OBS)
    rb = RayReplayBuffer(
        storage=functools.partial(LazyTensorStorage, 100_000),
        transform=filt,
        remote_config={"num_cpus": 0},
    )
    return filt, rb


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_ray_collectors_share_one_filtered_buffer(sync, oracle):
    """Both collectors extend the buffer; the filter in its actor cleans them.
    Bugs caught: the collectors taken for the same streams (their
    trajectory ids collide: ContinuityError in the actor, the collector
    actor dead), a collector's batch cleaned against the other's streams
    (reset rows kept, wrong terminal observations), the driver's stats
    reading nothing (the actor's copy not seen), flush on the driver
    storing nothing while the actor holds rows, or storing them twice.
    """
    filt, rb = _filtered_buffer()
    try:
        _collect(worker_env, sync, replay_buffer=rb)
        before = filt.stats
        assert before["rows_in"] >= FRAMES * BATCHES, "the actor's counts are not seen"
        assert before["reset_rows_dropped"] > 0
        filt.flush(rb)
        stats = filt.stats
        assert stats["rows_held"] == 0
        assert stats["rows_out"] - before["rows_out"] == before["rows_held"]
        assert len(rb) == stats["rows_out"]
        rows = rb[: len(rb)]
        check_invariants(rows, stats, len(rb))
        cleaned = _by_first_obs(streams_from_rows(rows))
        assert len(cleaned) == COLLECTORS * ENVS_PER_WORKER
        n_lost = compare_streams(cleaned, oracle, min_rows=T * BATCHES // 4)
        assert n_lost <= stats["terminal_obs_missing"]
        filt.flush(rb)  # nothing left: stored once
        assert filt.stats == stats and len(rb) == stats["rows_out"]
    finally:
        rb.close()
