"""The compact storage against a plain filtered buffer: bytes held, time, exactness.

Two parts, ``python -m bench.compact`` (``--quick``: smaller sizes):

1. **bytes and time.** Synthetic next-step streams (raw-loop style: the
   done row holds its terminal observation, a reset row follows), ``[E,
   T]`` batches, written through ``AutoresetFilter("next_step")`` into a
   ``LazyTensorStorage`` and into a ``CompactStorage`` of the same size, in
   alternated rounds. Rows: Atari-like (``[4, 84, 84]`` uint8 observation,
   int64 action, episodes of 50-400 steps) and MuJoCo-like (17 float32
   observation, 6 float32 action, episodes of 100-1000 steps), each with
   reward, done, terminated, truncated and ``("collector", "traj_ids")``.
   Measured: bytes the storage holds once full (every tensor, links and
   side table included), the time of all ``rb.extend`` calls (the filter
   included, for both), and ``rb.sample(256)`` under ``RandomSampler``;
   each as the compact buffer's over the plain one's, same run: medians of
   alternated rounds after a warm-up round.
2. **exactness, side by side.** The same real loops as the explicit-reset
   run (same seeds, deterministic policy): a Gymnasium next-step
   ``CartPole-v1`` and ``Pendulum-v1`` (``max_episode_steps=50``) loop, 4
   envs, and a TorchRL ``GymEnv("CartPole-v1", num_envs=4)`` collector.
   Each sampled row (``RandomSampler``, 16 x 256) is looked up in the
   explicit-reset run by its env and observation bytes; it counts as wrong
   where its ``("next", obs)`` differs there, or where no such transition
   exists (a reset row stored as a transition). NaN next observations (a
   terminal observation lost before anything saw it: the collector's joint
   resets) are counted apart. Stores: Stable-Baselines3
   ``ReplayBuffer(optimize_memory_usage=True)`` (rows added per step, as
   its users do), TorchRL rows without ``("next", obs)``
   (``Collector(compact_obs=True)`` for the collector; the loop's rows
   without it, each row's env as the trajectory key) rebuilt by
   ``NextStateReconstructor``, and ``cleanbuf.CompactStorage`` under
   ``AutoresetFilter.for_env``.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time

import gymnasium as gym
import numpy as np
import torch
import torchrl
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer

import cleanbuf
from cleanbuf import AutoresetFilter, CompactStorage

# ------------------------------------------------------------------ part 1


def _synthetic(kind: str, envs: int, steps: int, batches: int, seed: int = 0):
    """Next-step ``[E, T]`` batches, raw-loop style, of Atari- or MuJoCo-like rows."""
    g = torch.Generator().manual_seed(seed)
    if kind == "atari":
        shape, dtype, lengths = (4, 84, 84), torch.uint8, (50, 400)

        def frame(n):
            return torch.randint(0, 256, (n, *shape), dtype=dtype, generator=g)

        def act(n):
            return torch.randint(0, 6, (n,), generator=g)
    else:
        shape, dtype, lengths = (17,), torch.float32, (100, 1000)

        def frame(n):
            return torch.randn((n, *shape), generator=g)

        def act(n):
            return torch.randn((n, 6), generator=g)

    obs = frame(envs)
    left = torch.randint(*lengths, (envs,), generator=g)
    reset_due = torch.zeros(envs, dtype=torch.bool)
    traj = torch.arange(envs)
    next_traj = envs
    out = []
    for _ in range(batches):
        cols = {k: [] for k in ("obs", "next", "act", "rew", "done", "traj")}
        for _t in range(steps):
            nxt = frame(envs)
            done = (left == 1) & ~reset_due
            rew = torch.where(reset_due, 0.0, 1.0)
            cols["obs"].append(obs)
            cols["next"].append(nxt)
            cols["act"].append(act(envs))
            cols["rew"].append(rew)
            cols["done"].append(done)
            cols["traj"].append(traj.clone())
            new = reset_due.clone()
            traj = torch.where(new, torch.arange(next_traj, next_traj + envs), traj)
            next_traj += envs
            left = torch.where(reset_due, torch.randint(*lengths, (envs,), generator=g), left - 1)
            reset_due = done
            obs = nxt
        done = torch.stack(cols["done"], 1).unsqueeze(-1)
        out.append(
            TensorDict(
                {
                    "observation": torch.stack(cols["obs"], 1),
                    "action": torch.stack(cols["act"], 1),
                    ("next", "observation"): torch.stack(cols["next"], 1),
                    ("next", "reward"): torch.stack(cols["rew"], 1).unsqueeze(-1),
                    ("next", "done"): done,
                    ("next", "terminated"): done.clone(),
                    ("next", "truncated"): torch.zeros_like(done),
                    ("collector", "traj_ids"): torch.stack(cols["traj"], 1),
                },
                batch_size=[envs, steps],
            )
        )
    return out


def _bytes(storage) -> int:
    if isinstance(storage, CompactStorage):
        return storage.nbytes()
    return sum(t.numel() * t.element_size() for t in storage._storage.values(True, True))


def _fill(storage_cls, size, batches):
    rb = ReplayBuffer(storage=storage_cls(size), transform=AutoresetFilter("next_step"))
    start = time.perf_counter()
    for b in batches:
        rb.extend(b)
    return rb, time.perf_counter() - start


def bytes_and_time(kind, envs, steps, n_batches, size, rounds, samples):
    """One row of the table: (bytes, extend, sample) ratios and the plain figures."""
    batches = _synthetic(kind, envs, steps, n_batches)
    extend = {"plain": [], "compact": []}
    sample = {"plain": [], "compact": []}
    held = {}
    for r in range(rounds + 1):  # round 0 warms up (allocator, caches): not counted
        order = [("plain", LazyTensorStorage), ("compact", CompactStorage)]
        for name, cls in order if r % 2 == 0 else order[::-1]:
            rb, seconds = _fill(cls, size, batches)
            if r:
                extend[name].append(seconds)
            held[name] = _bytes(rb.storage)
            if name == "compact":
                held["side"] = rb.storage.side_rows
            rb.sample(256)  # warm
            start = time.perf_counter()
            for _ in range(samples):
                rb.sample(256)
            if r:
                sample[name].append((time.perf_counter() - start) / samples)
            held["rows"] = len(rb)
            del rb
    med = {k: {n: statistics.median(v[n]) for n in v} for k, v in (("e", extend), ("s", sample))}
    return {
        "kind": kind,
        "rows": held["rows"],
        "side": held["side"],
        "bytes_plain": held["plain"],
        "bytes_compact": held["compact"],
        "bytes": held["compact"] / held["plain"],
        "extend_plain_s": med["e"]["plain"],
        "extend": med["e"]["compact"] / med["e"]["plain"],
        "sample_plain_ms": 1e3 * med["s"]["plain"],
        "sample": med["s"]["compact"] / med["s"]["plain"],
    }


# ------------------------------------------------------------------ part 2

ENVS = 4
LOOPS = {
    "CartPole next-step loop": ("CartPole-v1", {}, lambda obs: np.zeros(len(obs), np.int64)),
    "Pendulum next-step loop": (
        "Pendulum-v1",
        {"max_episode_steps": 50},
        lambda obs: np.clip(-2.0 * obs[:, 2:3], -2.0, 2.0).astype(np.float32),
    ),
}


def _key(env: int, obs: np.ndarray) -> bytes:
    # By the observation's bytes alone (SB3's samples do not say their env; the
    # envs' continuous states do not collide).
    return np.ascontiguousarray(obs, dtype=np.float32).tobytes()


def _raw_loop(name, kwargs, policy, steps, mode):
    """Per step: obs, action, next obs, reward, terminated, truncated.

    DISABLED: the done envs are reset explicitly (the oracle).
    """
    venv = gym.make_vec(
        name,
        num_envs=ENVS,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": mode},
        **kwargs,
    )
    obs, _ = venv.reset(seed=0)
    out = []
    for _ in range(steps):
        action = policy(obs)
        nxt, rew, term, trunc, _ = venv.step(action)
        out.append((obs, action, nxt, rew, term, trunc))
        obs = nxt
        done = term | trunc
        if mode == gym.vector.AutoresetMode.DISABLED and done.any():
            reset_obs, _ = venv.reset(options={"reset_mask": done})
            obs = np.where(done[:, None], reset_obs, nxt)
    return venv, out


def _truth_of_steps(steps) -> dict:
    truth = {}
    for obs, _a, nxt, *_ in steps:
        for e in range(ENVS):
            truth[_key(e, obs[e])] = np.asarray(nxt[e], np.float32)
    return truth


def _count(truth, env, obs, nxt) -> tuple[int, int]:
    """(wrong, nan) over sampled rows: env [N], obs [N, ...], next obs [N, ...]."""
    wrong = nan = 0
    for e, o, n in zip(env.tolist(), obs, nxt):
        n = np.asarray(n, np.float32)
        if np.isnan(n).any():
            nan += 1
            continue
        want = truth.get(_key(int(e), o))
        if want is None or want.tobytes() != n.tobytes():
            wrong += 1
    return wrong, nan


def _sample_rows(rb, n=16):
    torch.manual_seed(0)
    return torch.cat([rb.sample(256) for _ in range(n)])


def _sb3_rows(steps, obs_space, act_space, n=16):
    """SB3's ReplayBuffer(optimize_memory_usage=True), rows added per step; its samples."""
    from stable_baselines3.common.buffers import ReplayBuffer as SB3Buffer

    buf = SB3Buffer(
        (len(steps) + 1) * ENVS,
        obs_space,
        act_space,
        n_envs=ENVS,
        optimize_memory_usage=True,
        handle_timeout_termination=False,
    )
    for obs, action, nxt, rew, term, trunc in steps:
        done = np.asarray(term) | np.asarray(trunc)
        buf.add(obs, nxt, np.asarray(action).reshape(ENVS, -1), rew, done, [{}] * ENVS)
    np.random.seed(0)
    obs, nxt = [], []
    for _ in range(n):
        sample = buf.sample(256)
        obs.append(sample.observations.numpy())
        nxt.append(sample.next_observations.numpy())
    obs = np.concatenate(obs)
    return np.zeros(len(obs), np.int64), obs, np.concatenate(nxt)


def _torchrl_compact_rows(rows_td, traj_key):
    """Rows without ("next", obs), rebuilt by NextStateReconstructor at sampling."""
    from torchrl.envs.transforms.rb_transforms import NextStateReconstructor

    rb = ReplayBuffer(
        storage=LazyTensorStorage(rows_td.shape[0]),
        transform=NextStateReconstructor(traj_key=traj_key),
    )
    rb.extend(rows_td)
    return _sample_rows(rb)


def exactness_loop(label, steps_n=400):
    name, kwargs, policy = LOOPS[label]
    _, oracle = _raw_loop(name, kwargs, policy, steps_n, gym.vector.AutoresetMode.DISABLED)
    truth = _truth_of_steps(oracle)
    venv, steps = _raw_loop(name, kwargs, policy, steps_n, gym.vector.AutoresetMode.NEXT_STEP)
    out = {}
    e, o, n = _sb3_rows(steps, venv.single_observation_space, venv.single_action_space)
    out["sb3"] = (*_count(truth, e, o, n), len(e))
    rows = [cleanbuf.step_rows(*s, env_ids=True) for s in steps]
    flat = torch.cat(rows)
    bare = flat.exclude(("next", "observation"))
    s = _torchrl_compact_rows(bare, "env_id")
    out["torchrl"] = (
        *_count(truth, s["env_id"], s["observation"].numpy(), s["next", "observation"].numpy()),
        len(s),
    )
    rb = ReplayBuffer(storage=CompactStorage(100_000), transform=AutoresetFilter.for_env(venv))
    for r in rows:
        rb.extend(r)
    rb.transform[0].flush(rb)
    s = _sample_rows(rb)
    out["cleanbuf"] = (
        *_count(truth, s["env_id"], s["observation"].numpy(), s["next", "observation"].numpy()),
        len(s),
    )
    return out


def _collector_env(disabled: bool):
    from torchrl.envs import GymEnv, GymWrapper

    if disabled:
        venv = gym.vector.SyncVectorEnv(
            [functools.partial(gym.make, "CartPole-v1")] * ENVS,
            autoreset_mode=gym.vector.AutoresetMode.DISABLED,
        )
        env = GymWrapper(venv)
    else:
        env = GymEnv("CartPole-v1", num_envs=ENVS)
    env.set_seed(0)
    return env


def _policy(td):
    batch = td.batch_size
    action = torch.zeros(*batch, 2)
    action[..., 0] = 1.0
    td.set("action", action)
    td.set("env_id", torch.arange(batch[-1]).expand(batch).clone())
    return td


def _collect(env, frames, compact_obs=False, replay_buffer=None):
    from torchrl.collectors import Collector

    collector = Collector(
        env,
        _policy,
        frames_per_batch=ENVS * 16,
        total_frames=frames,
        compact_obs=compact_obs,
        replay_buffer=replay_buffer,
    )
    try:
        return [b.clone() for b in collector if b is not None]
    finally:
        collector.shutdown()


def exactness_collector(frames=ENVS * 16 * 25):
    oracle = torch.cat(_collect(_collector_env(True), frames), dim=1)
    truth = {}
    for e in range(ENVS):
        for o, n in zip(oracle["observation"][e].numpy(), oracle["next", "observation"][e].numpy()):
            truth[_key(e, o)] = np.asarray(n, np.float32)
    out = {}
    raw = torch.cat(_collect(_collector_env(False), frames), dim=1)  # [E, T]
    steps = [
        (
            raw["observation"][:, t].numpy(),
            raw["action"][:, t].argmax(-1).numpy(),
            raw["next", "observation"][:, t].numpy(),
            raw["next", "reward"][:, t, 0].numpy(),
            raw["next", "terminated"][:, t, 0].numpy(),
            raw["next", "truncated"][:, t, 0].numpy(),
        )
        for t in range(raw.shape[1])
    ]
    venv = gym.make_vec("CartPole-v1", num_envs=ENVS)
    e, o, n = _sb3_rows(steps, venv.single_observation_space, venv.single_action_space)
    out["sb3"] = (*_count(truth, e, o, n), len(e))
    compact = torch.cat(_collect(_collector_env(False), frames, compact_obs=True), dim=1)
    s = _torchrl_compact_rows(compact.reshape(-1), ("collector", "traj_ids"))
    out["torchrl"] = (
        *_count(truth, s["env_id"], s["observation"].numpy(), s["next", "observation"].numpy()),
        len(s),
    )
    env = _collector_env(False)
    filt = AutoresetFilter.for_env(env)
    rb = ReplayBuffer(storage=CompactStorage(100_000), transform=filt)
    _collect(env, frames, replay_buffer=rb)
    filt.flush(rb)
    s = _sample_rows(rb)
    out["cleanbuf"] = (
        *_count(truth, s["env_id"], s["observation"].numpy(), s["next", "observation"].numpy()),
        len(s),
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    q = args.quick
    print(
        f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"torchrl {torchrl.__version__}, cleanbuf {cleanbuf.__version__}"
    )
    cases = [
        # kind, envs, steps per batch, batches, storage size
        ("atari", 8, 32, 4 if q else 20, 1_000 if q else 4_000),
        ("mujoco", 8, 128, 20 if q else 200, 20_000 if q else 200_000),
    ]
    print(
        "\n| rows | stored | side rows | bytes held (plain) | bytes | rb.extend (plain) "
        "| extend | rb.sample(256) (plain) | sample |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind, envs, steps, n, size in cases:
        r = bytes_and_time(
            kind, envs, steps, n, size, rounds=3 if q else 5, samples=50 if q else 200
        )
        name = "Atari-like [4, 84, 84] uint8" if kind == "atari" else "MuJoCo-like 17 float32"
        print(
            f"| {name} | {r['rows']} | {r['side']} | {r['bytes_plain'] / 2**20:.1f} MiB | "
            f"**{r['bytes']:.3f}x** | {r['extend_plain_s']:.3f} s | **{r['extend']:.2f}x** | "
            f"{r['sample_plain_ms']:.3f} ms | **{r['sample']:.2f}x** |"
        )
    print(
        "\n| loop | SB3 optimize_memory_usage | TorchRL compact_obs + NextStateReconstructor "
        "| cleanbuf CompactStorage |"
    )
    print("|---|---|---|---|")
    results = {label: exactness_loop(label) for label in LOOPS}
    results["TorchRL GymEnv(num_envs=4) collector"] = exactness_collector()
    for label, out in results.items():
        cells = [
            f"{w} wrong, {nan} NaN of {total}"
            for w, nan, total in (out["sb3"], out["torchrl"], out["cleanbuf"])
        ]
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
