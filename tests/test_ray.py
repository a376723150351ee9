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
import threading
import time
import warnings

import pytest
import torch

ray = pytest.importorskip("ray")
from torchrl.collectors.distributed import RayCollector  # noqa: E402
from torchrl.collectors.distributed.ray import DEFAULT_REMOTE_CLASS_CONFIG  # noqa: E402
from torchrl.data import LazyTensorStorage, RayReplayBuffer, ReplayBuffer  # noqa: E402

from cleanbuf import AutoresetFilter, CleanbufError  # noqa: E402
from tests.batches import assert_same_rows  # noqa: E402
from tests.invariants import check_invariants  # noqa: E402
from tests.oracle import compare_streams, streams_from_rows  # noqa: E402
from tests.test_checkpoints import CUT, _calls  # noqa: E402  (short calls, one held row at CUT)
from tests.test_multiprocess import _check_loss_warning  # noqa: E402
from tests.workers import (  # noqa: E402
    ENVS_PER_WORKER,
    STREAM,
    no_torque,
    oracle_env,
    pendulum_env,
    push_left,
    seeded,
    worker_env,
)

pytestmark = pytest.mark.slow  # a Ray session and its actors: minutes on 2 cores

COLLECTORS, T, BATCHES = 2, 32, 8
OBS = ["observation"]  # env_id (see StreamId) is no observation to restitch
FRAMES = COLLECTORS * ENVS_PER_WORKER * T  # one batch of every collector


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _collector(make_env, sync, replay_buffer=None, policy=push_left, **collector_kwargs):
    """A RayCollector of ``COLLECTORS`` collectors (collector i's envs seeded from 100 i)."""
    return RayCollector(
        [functools.partial(seeded, make_env, 100 * i) for i in range(COLLECTORS)],
        policy,
        frames_per_batch=FRAMES if sync else FRAMES // COLLECTORS,
        total_frames=FRAMES * BATCHES,
        sync=sync,
        replay_buffer=replay_buffer,
        remote_configs={"num_cpus": 0.5},
        collector_kwargs=collector_kwargs or None,
    )


def _collect(make_env, sync, replay_buffer=None, **collector_kwargs):
    """Runs a :func:`_collector` to the end.

    Returns its batches; none when it writes into ``replay_buffer``.
    """
    collector = _collector(make_env, sync, replay_buffer, **collector_kwargs)
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


def _filter():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the time-limit warning: CartPole's 500 steps
        return AutoresetFilter.for_env(worker_env(), observation_keys=OBS)


def _ray_buffer(transform=None):
    return RayReplayBuffer(
        storage=functools.partial(LazyTensorStorage, 100_000),
        transform=transform,
        remote_config={"num_cpus": 0},
    )


def _check_flushed_buffer(filt, rb, oracle, min_rows=T * BATCHES // 4):
    """Flushes ``filt`` into ``rb`` from the driver and checks what ``rb`` holds.

    The held rows are stored once, the invariants hold, and every stream
    equals the oracle's, row for row, over at least ``min_rows`` rows.
    """
    before = filt.stats
    assert before["rows_in"] > 0, "the copies' counts are not seen"
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
    want = {k: oracle[k] for k in cleaned}
    n_lost = compare_streams(cleaned, want, min_rows=min_rows)
    assert n_lost <= stats["terminal_obs_missing"]
    filt.flush(rb)  # nothing left: stored once
    assert filt.stats == stats and len(rb) == stats["rows_out"]


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
    filt = _filter()
    rb = _ray_buffer(filt)
    try:
        _collect(worker_env, sync, replay_buffer=rb)
        assert filt.stats["rows_in"] >= FRAMES * BATCHES
        _check_flushed_buffer(filt, rb, oracle)
    finally:
        rb.close()


def test_one_filter_in_each_collector(oracle):
    """The filter as each remote collector's ``postproc``; the buffer has none.
    Bugs caught: the filter passing a collector's batches through as a
    postproc (``forward`` the identity: reset rows stored), its copies'
    stats and held rows gone with the collector actors (the driver's stats
    reading zero, flush storing nothing), held rows stored twice.
    """
    filt = _filter()
    rb = _ray_buffer()
    try:
        _collect(worker_env, True, replay_buffer=rb, postproc=filt)
        _check_flushed_buffer(filt, rb, oracle)
    finally:
        rb.close()


def test_for_env_reads_a_sync_ray_collector(oracle):
    """``for_env(RayCollector)`` reads the env in a remote collector; the
    driver's filter cleans the batches the sync collector stacks.
    Bugs caught: "cannot find the env" (RayCollector keeps no env on the
    driver), both collectors' envs taken for one reset group (a joint reset
    of one collector's envs applied to the other's: terminal observations
    marked lost, or a reset row taken for a real step).
    """
    collector = _collector(worker_env, sync=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the time-limit warning
            filt = AutoresetFilter.for_env(collector, observation_keys=OBS)
        assert filt.options.joint_reset
        assert filt.options.reset_group_size == ENVS_PER_WORKER
        rb = ReplayBuffer(storage=LazyTensorStorage(100_000), transform=filt)
        for batch in collector:
            assert batch.batch_size[:2] == (COLLECTORS, ENVS_PER_WORKER)
            rb.extend(batch)
    finally:
        collector.shutdown()
    _check_flushed_buffer(filt, rb, oracle)


def test_for_env_refuses_an_async_ray_collector_without_buffer():
    """Bug caught: a driver-side filter built for an async RayCollector
    whose batches it cannot tell apart (their trajectory ids collide), which
    fails with a ContinuityError mid-run or cleans one collector's batch
    against the other's streams.
    """
    collector = _collector(worker_env, sync=False)
    try:
        with pytest.raises(CleanbufError, match="async RayCollector") as err:
            AutoresetFilter.for_env(collector)
        assert "postproc" in str(err.value) and "RayReplayBuffer(transform=filt)" in str(err.value)
    finally:
        collector.shutdown()


def test_killed_collector_actor(oracle):
    """One remote collector actor is killed mid-run; the other goes on.
    The filter reaches the buffer actor with ``rb.append_transform`` after
    ``for_env(collector)``.
    Bugs caught: the survivor's batches refused or cleaned against the dead
    collector's streams (a ContinuityError, or rows of the wrong stream),
    a partial or reset row stored, the dead collector's held rows lost
    (flush from the driver must store them; the stats identity breaks).
    """
    rb = _ray_buffer()
    collector = _collector(worker_env, sync=False, replay_buffer=rb)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the time-limit warning
            filt = AutoresetFilter.for_env(collector, observation_keys=OBS)
        rb.append_transform(filt)
        alive, doomed = collector.remote_collectors
        for _ in range(2):
            ray.get([alive.next.remote(), doomed.next.remote()])
        in_flight = doomed.next.remote()
        ray.kill(doomed)  # mid-batch, or just after it: either way no partial row
        try:
            ray.get(in_flight)  # almost always killed before its batch is written
        except ray.exceptions.RayActorError:
            pass
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(doomed.next.remote())
        for _ in range(BATCHES):
            ray.get(alive.next.remote())
        stats = filt.stats
        assert stats["rows_in"] >= FRAMES // COLLECTORS * (BATCHES + 2)
        _check_flushed_buffer(filt, rb, oracle, min_rows=T)
    finally:
        collector.shutdown()
        rb.close()


def test_checkpoint_through_the_actor(tmp_path):
    """``rb.dumps`` / ``rb.loads`` of a Ray buffer with the filter, run in its
    actor, mid-stream; the resumed run stores what the uninterrupted run stores.
    Bugs caught: the actor's filter state (held rows, pending reset rows,
    counters) not in the dump, or not loaded into the new actor's filter
    (a reset row stored, a held row lost, stats reset).
    """
    calls = _calls()

    def run(batches, rb):
        for batch in batches:
            rb.extend(batch)

    filt = AutoresetFilter("next_step")
    rb = _ray_buffer(filt)
    try:
        run(calls, rb)
        filt.flush(rb)
        want, want_stats = rb[: len(rb)], filt.stats
    finally:
        rb.close()

    filt = AutoresetFilter("next_step")
    rb = _ray_buffer(filt)
    try:
        run(calls[:CUT], rb)
        assert filt.stats["rows_held"] > 0, "the checkpoint should hold a row"
        rb.dumps(tmp_path / "rb")
    finally:
        rb.close()
    filt = AutoresetFilter("next_step")
    rb = _ray_buffer(filt)
    try:
        rb.loads(tmp_path / "rb")
        run(calls[CUT:], rb)
        filt.flush(rb)
        assert_same_rows(rb[: len(rb)], want)
        assert filt.stats == want_stats
    finally:
        rb.close()


def test_an_error_in_the_buffer_actor_reaches_the_driver():
    """A filter that refuses a collector's batch inside the buffer's actor
    (a same-step filter given next-step data). Ray 2.60 fails to pass the
    error on from the collector actor that called ``extend`` (a TypeError in
    its ``store_task_errors``), so the driver gets ``ActorDiedError``.
    Bugs caught: the filter's message missing from what the driver gets
    (only "the actor died"), rows of the refused batch stored.
    """
    rb = _ray_buffer(AutoresetFilter("same_step"))
    try:
        with pytest.raises(ray.exceptions.RayError) as err:
            _collect(worker_env, sync=True, replay_buffer=rb)
        assert "TerminalObservationLostError" in str(err.value)
        assert "Nothing was written" in str(err.value)
        assert len(rb) == 0
    finally:
        rb.close()


def test_distributed_transport_is_refused():
    """Bug caught: the filter in a ``transport="distributed"`` buffer, whose
    second extend fails deep in TorchRL (the reply size is fixed by the
    first extend's, and the filter's output size varies), with rows of the
    first call already stored.
    """
    rb = RayReplayBuffer(
        storage=functools.partial(LazyTensorStorage, 1000),
        transform=AutoresetFilter("next_step"),
        remote_config={"num_cpus": 0},
        transport="distributed",
    )
    try:
        with pytest.raises(Exception, match="transport='distributed'"):
            rb.extend(_calls()[0])
        assert len(rb) == 0
    finally:
        rb.close()


def test_actor_losses_warn_on_the_driver():
    """The filter in the buffer's actor; two collectors of
    ``GymEnv("Pendulum-v1", num_envs=2)``, each losing its envs' terminal
    observations at the 200-step limit (256 steps each). Bug caught: the
    warning raised only in the buffer's actor, so the driver holds NaN rows
    without a word; or a warning there without the summed count.
    """
    probe = pendulum_env()
    filt = AutoresetFilter.for_env(probe)
    probe.close()
    rb = _ray_buffer(filt)
    try:
        collector = _collector(pendulum_env, True, replay_buffer=rb, policy=no_torque)
        try:
            for _ in collector:
                pass
        finally:
            collector.shutdown()
        _check_loss_warning(filt, rb)
    finally:
        rb.close()


def test_two_collectors_and_the_buffer_fit_two_cpus(oracle):
    """The documented resources on ``ray.init(num_cpus=2)``: the buffer's
    actor asks no CPU (``remote_config={"num_cpus": 0}``), each of the two
    collectors one (``remote_configs={"num_cpus": 1}``); the run ends and
    the buffer holds every stream cleaned. Bug caught: TorchRL's defaults
    (one CPU per actor, the buffer's included: three on two CPUs) leave a
    collector actor unscheduled, and the program hangs without a word.
    """
    cpus = ray.cluster_resources()["CPU"]
    assert DEFAULT_REMOTE_CLASS_CONFIG["num_cpus"] * (COLLECTORS + 1) > cpus  # why they are set
    for _ in range(600):  # the actors of earlier tests release theirs (slowly on a loaded machine)
        if ray.available_resources().get("CPU") == cpus:
            break
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == cpus, "an earlier test holds a CPU"
    filt = _filter()
    rb = RayReplayBuffer(
        storage=functools.partial(LazyTensorStorage, 100_000),
        transform=filt,
        remote_config={"num_cpus": 0},
    )
    collector = RayCollector(
        [functools.partial(seeded, worker_env, 100 * i) for i in range(COLLECTORS)],
        push_left,
        frames_per_batch=FRAMES,
        total_frames=FRAMES * BATCHES,
        replay_buffer=rb,
        remote_configs={"num_cpus": 1},
    )
    try:
        run = threading.Thread(target=lambda: [None for _ in collector], daemon=True)
        run.start()
        run.join(timeout=600)  # a hang never ends; a loaded CI machine is only slow
        assert not run.is_alive(), "the collectors did not finish: an actor was not scheduled"
        _check_flushed_buffer(filt, rb, oracle)
    finally:
        collector.shutdown()
        rb.close()
