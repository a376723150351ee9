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
  one ``rb.extend(cleanbuf.step_rows(...))`` per step; and the Gymnasium
  loop extending once per 32 steps, their rows stacked as ``[E, 32]``.

Each rate is one run after one untimed batch. The rows go to
``bench/throughput.json`` and the plot to ``bench/throughput.png``
(``--replot`` redraws it from the JSON). Not part of the tests.
"""

from __future__ import annotations

import argparse
import functools
import json
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
from torchrl.envs import GymEnv, GymWrapper, Transform

import cleanbuf
from cleanbuf import AutoresetFilter

ENVS, BATCH = 8, 256
JSON, PNG = "bench/throughput.json", "bench/throughput.png"
STACK = 32  # steps per extend in the stacked raw loop
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


class FlatRows(Transform):
    """A buffer transform that stores each batch as flat rows, and does nothing else.

    The unfiltered Ray baseline: flattened in the buffer's actor, where
    the filter runs, not before Ray carries it (Ray carries a ``[256]``
    batch as 256 tensordicts, at a third of the rate of a ``[4, 64]`` one).
    """

    def __init__(self):
        super().__init__(in_keys=[], out_keys=[])

    def _inv_call(self, tensordict):
        return _flat(tensordict)


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
        transform=_filter(make(), filtered) if filtered else FlatRows(),
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


def _raw_filter(per_extend):
    if per_extend == 1:
        return AutoresetFilter("next_step", layout="step")
    # Steps stacked as [E, T]; a raw loop's done row holds its terminal observation,
    # which the filter reads from the data (no option needed).
    return AutoresetFilter("next_step", layout="time_last")


def raw_rate(name, frames, filtered, envpool=False, per_extend=1):
    """A raw next-step loop, one rb.extend of ``per_extend`` steps of step_rows."""
    rb = ReplayBuffer(
        storage=LazyTensorStorage(frames + 4 * ENVS * per_extend),
        transform=_raw_filter(per_extend) if filtered else None,
    )
    if envpool:
        import envpool

        env = envpool.make_gymnasium(name, num_envs=ENVS)
    else:
        env = gym.make_vec(name, num_envs=ENVS, vectorization_mode="sync")
    space = env.action_space
    obs, _ = env.reset(seed=0)
    pending, t = [], None
    for i in range(frames // ENVS + per_extend):
        if i == per_extend:  # after one untimed extend
            n0, t = len(rb), time.perf_counter()
        if envpool:  # one env's action space
            action = np.stack([space.sample() for _ in range(ENVS)]).astype(space.dtype)
        else:
            action = space.sample()
        next_obs, reward, terminated, truncated, _ = env.step(action)
        pending.append(cleanbuf.step_rows(obs, action, next_obs, reward, terminated, truncated))
        obs = next_obs
        if len(pending) == per_extend:
            batch = pending[0] if per_extend == 1 else torch.stack(pending, dim=-1)
            rb.extend(batch if filtered or per_extend == 1 else _flat(batch))
            pending = []
    return (len(rb) - n0) / (time.perf_counter() - t)


def raw_envpool_rate(name, frames, filtered):
    return raw_rate(name, frames, filtered, envpool=True)


def raw_stacked_rate(name, frames, filtered):
    return raw_rate(name, frames, filtered, per_extend=STACK)


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


def plot(rows, path):
    """Bars of clean frames/s by producer, one panel per task; the filter's
    share of each producer's time is written on its bar.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r[0] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.5), sharey=True)
    for ax, task in zip(np.atleast_1d(axes), tasks):
        mine = [r for r in rows if r[0] == task]
        y = np.arange(len(mine))
        colors = ["tab:gray" if r[4] is None else "tab:blue" for r in mine]
        ax.barh(y, [r[3] for r in mine], color=colors)
        for i, r in enumerate(mine):
            if r[4] is not None:
                ax.text(r[3], i, f" filter {100 * r[4]:.1f}%", va="center", fontsize=8)
        ax.set_yticks(y, [r[1] for r in mine], fontsize=8)
        ax.set_title(task)
        ax.set_xlabel("clean frames/s (gray: clean without cleanbuf)")
    axes_list = list(np.atleast_1d(axes))
    axes_list[0].invert_yaxis()  # the first producer on top (the panels share this axis)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=16384)
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument(
        "--replot", action="store_true", help="redraw the plot from bench/throughput.json"
    )
    args = parser.parse_args()
    if args.replot:
        with open(JSON) as f:
            plot(json.load(f)["rows"], PNG)
        return
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
        steps = _record_steps(name, n)
        stacked = [torch.stack(steps[i : i + STACK], dim=-1) for i in range(0, len(steps), STACK)]
        per_frame = {
            "batches": filter_seconds_per_frame(functools.partial(_filter, env), batches),
            "steps": filter_seconds_per_frame(functools.partial(_raw_filter, 1), steps),
            "stacked": filter_seconds_per_frame(functools.partial(_raw_filter, STACK), stacked),
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
            (
                f"raw Gymnasium sync loop, {STACK} steps of step_rows per extend + filter",
                raw_stacked_rate,
                None,
                "stacked",
            ),
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
    with open(JSON, "w") as f:
        json.dump({"frames": n, "rows": rows}, f, indent=1)
    plot(rows, PNG)


if __name__ == "__main__":
    main()
