"""Demo: 8 auto-resetting CartPole envs into two buffers, with and without cleanbuf.

Run with ``python -m cleanbuf.demo`` (needs the ``gym`` extra). It collects
with a TorchRL ``Collector`` from TorchRL's ``GymWrapper`` over a next-step
Gymnasium vector env (what ``GymEnv("CartPole-v1", num_envs=8)`` builds, in
one process here instead of eight, which makes the demo start in seconds),
writes every batch into a plain buffer and into one with
:class:`cleanbuf.AutoresetFilter`, runs the same envs with explicit resets
(the oracle), and prints what the filter found and whether the cleaned
buffer matches the oracle, env by env. (The test suite holds the full
oracle, ``tests/oracle.py``; this is a small copy of what the demo needs.)
"""

from __future__ import annotations

import functools
import logging
import time
import warnings

import torch
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import Compose, GymEnv, GymWrapper, InitTracker, StepCounter, TransformedEnv

from cleanbuf import AutoresetFilter, CleanbufWarning

NUM_ENVS, STEPS_PER_BATCH, BATCHES = 8, 64, 8
STREAM = "env_id"


def _policy(td):
    """Always push left (episodes of about 10 steps); tags each row with its env."""
    batch = td.batch_size
    action = torch.zeros(*batch, 2)
    action[..., 0] = 1.0
    td.set("action", action)
    td.set(STREAM, torch.arange(batch[-1]).expand(batch).clone())
    return td


class _InProcessGymEnv(GymEnv):
    """``GymEnv(name, num_envs=N)`` with its N sub-envs in this process.

    TorchRL's ``GymEnv`` builds a next-step ``AsyncVectorEnv`` (a process per
    sub-env, started with spawn: most of a minute for 8 here); this builds
    the same vector env synchronously and leaves the rest of ``GymEnv``,
    its auto-reset handling included, as it is.
    """

    def _async_env(self, *args, **kwargs):
        import gymnasium as gym

        return gym.vector.SyncVectorEnv(*args, **kwargs)


def _env(explicit_resets: bool):
    """CartPole x 8: TorchRL's ``GymEnv`` (next-step), or explicit resets (the oracle)."""
    if explicit_resets:
        import gymnasium as gym

        venv = gym.vector.SyncVectorEnv(
            [functools.partial(gym.make, "CartPole-v1")] * NUM_ENVS,
            autoreset_mode=gym.vector.AutoresetMode.DISABLED,
        )
        base = GymWrapper(venv)
    else:
        base = _InProcessGymEnv("CartPole-v1", num_envs=NUM_ENVS)
    env = TransformedEnv(base, Compose(StepCounter(), InitTracker()))
    env.set_seed(0)
    return env


def _collect(env):
    frames = NUM_ENVS * STEPS_PER_BATCH
    collector = Collector(env, _policy, frames_per_batch=frames, total_frames=frames * BATCHES)
    batches = [b.clone() for b in collector]
    collector.shutdown()
    env.close()
    return batches


def _matches(rows, oracle) -> bool:
    """Whether each env's cleaned rows equal the oracle's.

    NaN where the terminal observation was lost; trajectory ids are numbered
    differently in the two runs and are left out.
    """
    for e in range(NUM_ENVS):
        got = rows[rows[STREAM].reshape(-1) == e]
        want = oracle[e][: len(got)]
        for key in got.keys(True, True):
            if key == ("collector", "traj_ids"):
                continue
            x, y = got[key], want[key]
            if key == ("next", "observation"):
                lost = torch.isnan(x).any(-1)
                x, y = x[~lost], y[~lost]
            if not torch.equal(x, y):
                return False
    return True


def _report(filt, plain, cleaned, ok: bool, seconds: float) -> None:
    """Prints what the two buffers hold and whether the cleaned one matches (13 lines)."""
    raw = plain[: len(plain)]
    # CartPole pays 1 per real step: a stored reward of 0 is a reset row.
    bogus = int((raw["next", "reward"] == 0).sum())
    done = raw["next", "done"].reshape(-1)
    zeroed = int((raw["next", "observation"][done] == 0).all(-1).sum())
    s = filt.stats
    lost = s["terminal_obs_missing"]
    print(
        f"CartPole-v1 x {NUM_ENVS}, TorchRL GymEnv (next-step auto-reset), Collector: "
        f"{BATCHES} batches of [{NUM_ENVS}, {STEPS_PER_BATCH}]"
    )
    print(f"filter: {filt!r}")
    print(f"rows collected:                          {len(plain)}")
    print(f"bogus reset rows in the plain buffer:    {bogus} ({bogus / len(plain):.1%})")
    print(f"done rows with a zero-filled next obs:   {zeroed} of {int(done.sum())}")
    print(f"reset rows dropped by the filter:        {s['reset_rows_dropped']}")
    print(f"terminal observations restored:          {s['next_obs_restitched']}")
    why = f"  (all {NUM_ENVS} envs done at once: TorchRL reset them jointly)" if lost else ""
    print(f"terminal observations lost (NaN):        {lost}{why}")
    print(f"rows in the cleaned buffer:              {len(cleaned)}")
    verdict = "yes, row for row within each env" if ok else "NO"
    print(f"cleaned buffer matches explicit resets:  {verdict}")
    print(f"({seconds:.1f} s, torch {torch.__version__})")
    print("in your code: ReplayBuffer(..., transform=cleanbuf.AutoresetFilter.for_env(env))")
    print("next: README.md, 'With TorchRL'")


def main() -> int:
    """Runs the demo; returns the process exit code (0 when the buffer matches)."""
    start = time.perf_counter()
    warnings.filterwarnings("ignore", message="Nested TransformedEnvs")
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    env = _env(explicit_resets=False)
    with warnings.catch_warnings():
        # The 500-step time-limit warning: episodes here end within 20 steps.
        warnings.simplefilter("ignore", CleanbufWarning)
        filt = AutoresetFilter.for_env(env)
    plain = ReplayBuffer(storage=LazyTensorStorage(100_000))
    cleaned = ReplayBuffer(storage=LazyTensorStorage(100_000), transform=filt)
    for batch in _collect(env):
        plain.extend(batch.reshape(-1))
        cleaned.extend(batch)
    filt.flush(cleaned)
    oracle = torch.cat(_collect(_env(explicit_resets=True)), dim=1)
    ok = _matches(cleaned[: len(cleaned)], oracle)
    _report(filt, plain, cleaned, ok, time.perf_counter() - start)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
