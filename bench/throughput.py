"""Clean frames per second reaching a TorchRL replay buffer, by producer.

``python -m bench.throughput [--frames 16384]`` runs, for CartPole-v1 and
Pendulum-v1 with a random policy and 8 envs, each producer into a
``ReplayBuffer(LazyTensorStorage)``, and prints clean frames per second
(rows stored per second of wall time), the same producer's rate without
the filter (its rows dirty), and the filter's share of the producer's
time: clean frames/s times the seconds the filter takes per frame,
measured in this process on the task's recorded batches (a difference of
two rates would drown in the run-to-run noise of multi-process
producers). The producers:

* ``GymWrapper`` over a Gymnasium vector env in ``DISABLED`` / ``SAME_STEP``
  mode, sync and async, through a ``Collector``: clean without cleanbuf;
* TorchRL's ``GymEnv(name, num_envs=8)`` (async, next-step) through a
  ``Collector``, with the filter;
* a ``MultiSyncCollector`` of two such envs (4 envs each) given the
  filtered buffer;
* a ``RayCollector`` of two ``GymEnv(name, num_envs=4)`` workers extending
  a filtered ``RayReplayBuffer``
  (``ray.init(num_cpus=2)``; its start-up is not timed);
* a raw Gymnasium sync vector-env loop and a raw EnvPool loop, next-step,
  one ``rb.extend(cleanbuf.step_rows(...))`` per step.

Each rate is one run after one untimed batch. Not part of the tests.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import time
import warnings

import gymnasium as gym
import numpy as np
import torch
import torchrl
from torchrl.collectors import Collector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv, GymWrapper

import cleanbuf
from cleanbuf import AutoresetFilter

ENVS, BATCH = 8, 256
TASKS = {"cartpole": "CartPole-v1", "pendulum": "Pendulum-v1"}


def wrapped(name, mode, vectorization, envs=ENVS):
    return GymWrapper(
        gym.make_vec(
            name,
            num_envs=envs,
            vectorization_mode=vectorization,
            vector_kwargs={"autoreset_mode": mode},
        )
    )


def gym_env(name, envs=ENVS):
    return GymEnv(name, num_envs=envs)


def _filter(env, on=True):
    if not on:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the time-limit warning
        return AutoresetFilter.for_env(env, on_lost_terminal_obs="drop")


def collector_rate(make_env, frames, filtered):
    """Rows stored per second by a Collector extending a (filtered) buffer."""
    env = make_env()
    rb = ReplayBuffer(
        storage=LazyTensorStorage(frames + 4 * BATCH), transform=_filter(env, filtered)
    )
    collector = Collector(env, None, frames_per_batch=BATCH, total_frames=frames + BATCH)
    try:
        it = iter(collector)
        # Unfiltered, flat rows (a [E, T] batch would be stored as E rows).
        rb.extend(next(it) if filtered else _flat(next(it)))  # untimed
        n0, t0 = len(rb), time.perf_counter()
        for batch in it:
            rb.extend(batch if filtered else _flat(batch))
            t1 = time.perf_counter()  # not the env's close after the last batch
        return (len(rb) - n0) / (t1 - t0)
    finally:
        collector.shutdown()


def _flat(batch):
    """A collector's ``[E, T]`` batch as flat rows (a flat storage stores them as rows)."""
    return batch.reshape(-1)


def _filling_rate(collector, rb):
    """Rows per second a collector given ``rb`` stores, after one untimed batch.

    The clock stops at the last batch: a collector that reaches its
    ``total_frames`` shuts its envs down before the loop ends (an async
    vector env's 8 processes take seconds to join).
    """
    it = iter(collector)
    next(it)
    n0, t0 = len(rb), time.perf_counter()
    for _ in it:
        n1, t1 = len(rb), time.perf_counter()
    return (n1 - n0) / (t1 - t0)


def multi_rate(name, frames, filtered):
    """A MultiSyncCollector of two GymEnv(num_envs=4) given the buffer."""
    make = functools.partial(gym_env, name, ENVS // 2)
    rb = ReplayBuffer(
        storage=LazyTensorStorage(frames + 4 * BATCH), transform=_filter(make(), filtered)
    )
    collector = MultiSyncCollector(
        [make] * 2, None, frames_per_batch=BATCH, total_frames=frames + BATCH, replay_buffer=rb
    )
    try:
        return _filling_rate(collector, rb)
    finally:
        collector.shutdown()


def ray_rate(name, frames, filtered):
    """Two RayCollector workers, each a GymEnv(num_envs=4), extending a RayReplayBuffer."""
    from torchrl.collectors.distributed import RayCollector
    from torchrl.data import RayReplayBuffer

    make = functools.partial(gym_env, name, ENVS // 2)
    rb = RayReplayBuffer(
        storage=functools.partial(LazyTensorStorage, frames + 8 * BATCH),
        transform=_filter(make(), filtered),
        remote_config={"num_cpus": 0},
    )
    collector = RayCollector(
        [make] * 2,
        None,
        frames_per_batch=BATCH,
        total_frames=frames + 2 * BATCH,
        replay_buffer=rb,
        remote_configs={"num_cpus": 1},
        # Unfiltered, flat rows (as collector_rate stores them).
        collector_kwargs=None if filtered else {"postproc": _flat},
    )
    try:
        return _filling_rate(collector, rb)
    finally:
        collector.shutdown()
        rb.close()


def raw_rate(name, frames, filtered, envpool=False):
    """A raw next-step loop, one rb.extend(step_rows(...)) per step."""
    rb = ReplayBuffer(
        storage=LazyTensorStorage(frames + 4 * ENVS),
        transform=AutoresetFilter("next_step", layout="step") if filtered else None,
    )
    if envpool:
        import envpool

        env = envpool.make_gymnasium(name, num_envs=ENVS)
    else:
        env = gym.make_vec(name, num_envs=ENVS, vectorization_mode="sync")
    space = env.action_space
    obs, _ = env.reset(seed=0)
    steps, t = frames // ENVS, None
    for i in range(steps + 1):
        if i == 1:
            n0, t = len(rb), time.perf_counter()
        if envpool:  # one env's action space
            action = np.stack([space.sample() for _ in range(ENVS)]).astype(space.dtype)
        else:
            action = space.sample()
        next_obs, reward, terminated, truncated, _ = env.step(action)
        rb.extend(cleanbuf.step_rows(obs, action, next_obs, reward, terminated, truncated))
        obs = next_obs
    return (len(rb) - n0) / (time.perf_counter() - t)


def raw_envpool_rate(name, frames, filtered):
    return raw_rate(name, frames, filtered, envpool=True)


def _record_batches(name, frames):
    """A GymEnv(num_envs=8) collector's [8, 32] batches, cloned."""
    env = gym_env(name)
    collector = Collector(env, None, frames_per_batch=BATCH, total_frames=frames)
    try:
        return env, [b.clone() for b in collector]
    finally:
        collector.shutdown()


def _record_steps(name, frames):
    """A raw sync next-step loop's step rows, one [8] batch per step."""
    env = gym.make_vec(name, num_envs=ENVS, vectorization_mode="sync")
    obs, _ = env.reset(seed=0)
    steps = []
    for _ in range(frames // ENVS):
        action = env.action_space.sample()
        next_obs, reward, terminated, truncated, _ = env.step(action)
        steps.append(cleanbuf.step_rows(obs, action, next_obs, reward, terminated, truncated))
        obs = next_obs
    return steps


def filter_seconds_per_frame(make_filter, batches):
    """Seconds a fresh filter spends per frame cleaning ``batches`` (best of 3).

    The filter is called as a postproc, so no storage write is timed; one
    untimed pass first compiles the kernels.
    """
    frames = sum(b.numel() for b in batches)
    best = float("inf")
    for i in range(4):
        filt = make_filter()
        t = time.perf_counter()
        for b in batches:
            filt(b)
        if i:
            best = min(best, time.perf_counter() - t)
    return best / frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=16384)
    parser.add_argument("--no-ray", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    n = args.frames
    if not args.no_ray:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    modes = gym.vector.AutoresetMode
    rows = []  # (task, producer, frames/s without the filter, clean frames/s, share)

    def report(*row):
        rows.append(row)
        print(row, flush=True)  # progress (the table follows)

    for task, name in TASKS.items():
        env, batches = _record_batches(name, n)
        per_frame = {
            "batches": filter_seconds_per_frame(functools.partial(_filter, env), batches),
            "steps": filter_seconds_per_frame(
                functools.partial(AutoresetFilter, "next_step", layout="step"),
                _record_steps(name, n),
            ),
        }
        for mode in (modes.DISABLED, modes.SAME_STEP):
            for vec in ("sync", "async"):
                make = functools.partial(wrapped, name, mode, vec)
                rate = collector_rate(make, n, False)
                report(task, f"GymWrapper {mode.name} {vec}, no filter", None, rate, None)
        filtered = [
            ("GymEnv(num_envs=8) + filter", collector_rate, gym_env, "batches"),
            ("MultiSyncCollector, 2 x GymEnv(4) + filter", multi_rate, None, "batches"),
            ("RayCollector, 2 x GymEnv(4) + filter", ray_rate, None, "batches"),
            ("raw Gymnasium sync loop + step_rows + filter", raw_rate, None, "steps"),
            ("raw EnvPool loop + step_rows + filter", raw_envpool_rate, None, "steps"),
        ]
        for label, run, make, layout in filtered:
            if args.no_ray and run is ray_rate:
                continue
            arg = name if make is None else functools.partial(make, name)
            # Unfiltered, a multi-process collector's workers write [E, T]
            # chunks into the flat storage and die: no such rate.
            without = None if run is multi_rate else run(arg, n, False)
            rate = run(arg, n, True)
            report(task, label, without, rate, rate * per_frame[layout])
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; python "
        f"{platform.python_version()}, torch {torch.__version__}, torchrl "
        f"{torchrl.__version__}, gymnasium {gym.__version__}, numpy {np.__version__}, "
        f"cleanbuf {cleanbuf.__version__}; {n} frames a run, {ENVS} envs, random policy"
    )
    print("| task | producer | frames/s, no filter | clean frames/s | filter's share |")
    print("|---|---|---|---|---|")
    for task, label, without, rate, share in rows:
        w = "-" if without is None else f"{without:.0f}"
        s = "-" if share is None else f"{100 * share:.1f}%"
        print(f"| {task} | {label} | {w} | {rate:.0f} | {s} |")
    for task in TASKS:
        best = max((r for r in rows if r[0] == task), key=lambda r: r[3])
        print(f"fastest clean producer, {task}: {best[1]} ({best[3]:.0f} frames/s)")


if __name__ == "__main__":
    main()
