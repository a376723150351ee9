"""Clean frames per second reaching a TorchRL replay buffer, by producer.

``python -m bench.throughput [--frames 16384]`` runs, for CartPole-v1 and
Pendulum-v1 with a random policy and 8 envs, each producer into a
``ReplayBuffer(LazyTensorStorage)``, and prints clean frames per second
(rows stored per second of wall time) and the filter's share of the
producer's time: ``1 - rate with the filter / rate of the same producer
without it``. The producers:

* ``GymWrapper`` over a Gymnasium vector env in ``DISABLED`` / ``SAME_STEP``
  mode, sync and async, through a ``Collector``: clean without cleanbuf;
* TorchRL's ``GymEnv(name, num_envs=8)`` (async, next-step) through a
  ``Collector``, with the filter;
* a ``MultiSyncCollector`` of two such envs (4 envs each) given the
  filtered buffer;
* a ``RayCollector`` of two workers extending a filtered ``RayReplayBuffer``
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
        rb.extend(next(it) if filtered else next(it).reshape(-1))  # untimed
        n0, t = len(rb), time.perf_counter()
        for batch in it:
            rb.extend(batch if filtered else batch.reshape(-1))
        return (len(rb) - n0) / (time.perf_counter() - t)
    finally:
        collector.shutdown()


def _filling_rate(collector, rb):
    """Rows per second a collector given ``rb`` stores, after one untimed batch."""
    it = iter(collector)
    next(it)
    n0, t = len(rb), time.perf_counter()
    for _ in it:
        pass
    return (len(rb) - n0) / (time.perf_counter() - t)


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
    """Two RayCollector workers (GymWrapper over a next-step sync vector env)
    extending a RayReplayBuffer.
    """
    from torchrl.collectors.distributed import RayCollector
    from torchrl.data import RayReplayBuffer

    make = functools.partial(wrapped, name, gym.vector.AutoresetMode.NEXT_STEP, "sync", ENVS // 2)
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
    rows = []
    for task, name in TASKS.items():
        for mode in (modes.DISABLED, modes.SAME_STEP):
            for vec in ("sync", "async"):
                make = functools.partial(wrapped, name, mode, vec)
                rate = collector_rate(make, n, False)
                rows.append((task, f"GymWrapper {mode.name} {vec}, no filter", rate, None))
        filtered = [
            ("GymEnv(num_envs=8) + filter", collector_rate, functools.partial(gym_env, name)),
            ("MultiSyncCollector, 2 x GymEnv(4) + filter", multi_rate, name),
            ("RayCollector, 2 workers + filter", ray_rate, name),
            ("raw Gymnasium sync loop + step_rows + filter", raw_rate, name),
            ("raw EnvPool loop + step_rows + filter", raw_envpool_rate, name),
        ]
        for label, run, arg in filtered:
            if args.no_ray and run is ray_rate:
                continue
            with_f = run(arg, n, True)
            # Unfiltered, the workers write [E, T] chunks into the flat
            # storage and die: no baseline, no share.
            share = None if run is multi_rate else 1 - with_f / run(arg, n, False)
            rows.append((task, label, with_f, share))
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; python "
        f"{platform.python_version()}, torch {torch.__version__}, torchrl "
        f"{torchrl.__version__}, gymnasium {gym.__version__}, numpy {np.__version__}, "
        f"cleanbuf {cleanbuf.__version__}; {n} frames a run, {ENVS} envs, random policy"
    )
    print("| task | producer | clean frames/s | filter's share of the time |")
    print("|---|---|---|---|")
    for task, label, rate, share in rows:
        s = "-" if share is None else f"{100 * share:.1f}%"
        print(f"| {task} | {label} | {rate:.0f} | {s} |")
    for task in TASKS:
        best = max((r for r in rows if r[0] == task), key=lambda r: r[2])
        print(f"fastest clean producer, {task}: {best[1]} ({best[2]:.0f} frames/s)")


if __name__ == "__main__":
    main()
