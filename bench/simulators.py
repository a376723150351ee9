"""One step of a GPU simulator through ``step_rows`` and the filter, against a plain extend.

A step of 4,096 envs in each simulator's format (``cleanbuf.step_rows``
reads it; ``AutoresetFilter("same_step", layout="step")`` cleans it into a
``ReplayBuffer``) against what a loop does without cleanbuf: the same
tensors put in a TensorDict by hand and extended into a buffer without a
transform. Observation groups as a locomotion task has them (``policy``
48 floats, ``critic`` 64), 1% of the envs done at each step (episodes of
about 100 steps), terminal observations kept by the simulator:

* ``isaaclab``: ``extras["final_obs"]`` (the whole batch) on a step where
  an env reset, ``extras["time_outs"]``;
* ``mjlab``: ``extras["terminal"] = {"env_ids", "observations"}`` for the
  done envs;
* ``maniskill``: one state tensor (112 floats), ``infos["final_observation"]``
  and its mask.

The simulator's step is not timed (it runs between the timed calls);
each call is the user's: build the rows, extend the buffer. The order of
the two calls rotates every round; the figure is the median of the
per-round ratios. ``python -m bench.simulators [--rounds N]``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numba
import tensordict
import torch
import torchrl
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer

from cleanbuf import AutoresetFilter, step_rows

N_ENVS = 4096
GROUPS = {"policy": 48, "critic": 64}
DONE_RATE = 0.01
CAPACITY = 8 * N_ENVS


class Steps:
    """An auto-resetting simulator's steps in one format (CPU tensors)."""

    def __init__(self, fmt: str, seed: int = 0):
        self.fmt = fmt
        self.gen = torch.Generator().manual_seed(seed)
        self.t = torch.zeros(N_ENVS, 1)
        self.obs = self._observe()

    def _observe(self):
        groups = {g: self.t + torch.arange(d, dtype=torch.float32) for g, d in GROUPS.items()}
        if self.fmt == "maniskill":
            return torch.cat(list(groups.values()), 1)
        return groups

    def next(self):
        """``(obs, action, next_obs, reward, terminated, truncated, info)``."""
        obs = self.obs
        action = torch.rand(N_ENVS, 12, generator=self.gen)
        self.t += 1
        done = torch.rand(N_ENVS, generator=self.gen) < DONE_RATE
        terminated = done & (torch.rand(N_ENVS, generator=self.gen) < 0.5)
        truncated = done & ~terminated
        final = self._observe()
        self.t[done] = 0
        next_obs = self._observe()
        info = {}
        if self.fmt == "isaaclab":
            info = {"time_outs": truncated, "final_obs": final}
        elif self.fmt == "mjlab":
            ids = done.nonzero().squeeze(-1)
            info = {
                "terminal": {"env_ids": ids, "observations": {g: v[ids] for g, v in final.items()}}
            }
        else:
            info = {"final_observation": final, "_final_observation": done}
        self.obs = next_obs
        reward = torch.rand(N_ENVS, generator=self.gen)
        return obs, action, next_obs, reward, terminated, truncated, info


def plain_rows(obs, action, next_obs, reward, terminated, truncated, info):
    """What a loop without cleanbuf stores: the step's tensors, as returned."""
    n = N_ENVS
    return TensorDict(
        {
            "observation": obs,
            "action": action,
            "next": {
                "observation": next_obs,
                "reward": reward.reshape(n, 1),
                "terminated": terminated.reshape(n, 1),
                "truncated": truncated.reshape(n, 1),
                "done": (terminated | truncated).reshape(n, 1),
            },
        },
        batch_size=[n],
    )


def measure(fmt: str, rounds: int) -> dict:
    rbs = {
        "plain": ReplayBuffer(storage=LazyTensorStorage(CAPACITY)),
        "cleanbuf": ReplayBuffer(
            storage=LazyTensorStorage(CAPACITY),
            transform=AutoresetFilter("same_step", layout="step"),
        ),
        "step_rows only": None,
    }
    feeds = {name: Steps(fmt) for name in rbs}
    calls = {
        "plain": lambda step: rbs["plain"].extend(plain_rows(*step)),
        "cleanbuf": lambda step: rbs["cleanbuf"].extend(step_rows(*step)),
        "step_rows only": lambda step: step_rows(*step),
    }
    for name in calls:  # warm up: storage allocation, numba, caches
        for _ in range(3):
            calls[name](feeds[name].next())
    times = {k: [] for k in calls}
    order = list(calls)
    for r in range(rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            step = feeds[name].next()  # the simulator's step: not timed
            start = time.perf_counter()
            calls[name](step)
            times[name].append(time.perf_counter() - start)
    plain = times["plain"]
    return {
        "plain_ms": statistics.median(plain) * 1e3,
        "cleanbuf_ratio": statistics.median(a / b for a, b in zip(times["cleanbuf"], plain)),
        "step_rows_ratio": statistics.median(a / b for a, b in zip(times["step_rows only"], plain)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    print(
        f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch "
        f"{torch.__version__}, torchrl {torchrl.__version__}, tensordict "
        f"{tensordict.__version__}, numba {numba.__version__}; {N_ENVS} envs a step, "
        f"{int(DONE_RATE * 100)}% done, {args.rounds} rounds"
    )
    print("| format | plain extend (ms) | step_rows + filter / plain | step_rows alone / plain |")
    print("|---|---|---|---|")
    for fmt in ("isaaclab", "mjlab", "maniskill"):
        m = measure(fmt, args.rounds)
        print(
            f"| {fmt} | {m['plain_ms']:.2f} | {m['cleanbuf_ratio']:.2f}x | "
            f"{m['step_rows_ratio']:.2f}x |"
        )


if __name__ == "__main__":
    main()
