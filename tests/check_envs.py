"""Envs and cleanings that ``tests/test_check.py`` hands to ``cleanbuf check`` by name.

``cleanbuf check`` takes ``package.module:function``; these are importable
as ``tests.check_envs:...`` from the repository root.
"""

from __future__ import annotations

import os

import gymnasium as gym
import numpy as np
import torch

from cleanbuf import AutoresetFilter


class RandomWalk(gym.Env):
    """A 1-D walk: +-1 a step plus noise; it ends past +-3 (terminated).

    ``seeded=False``: its reset draws from NumPy's global generator and
    ignores the seed it is given (the bug ``cleanbuf check`` exits 3 on).
    """

    def __init__(self, seeded: bool = True):
        self.observation_space = gym.spaces.Box(-100.0, 100.0, (2,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.seeded = seeded
        self.pos = 0.0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        rng = self.np_random if self.seeded else np.random
        self.pos = float(rng.uniform(-1.0, 1.0))
        return self._obs(), {}

    def _obs(self):
        return np.array([self.pos, self.pos**2], np.float32)

    def step(self, action):
        self.pos += (1.0 if action else -1.0) * 0.7 + float(self.np_random.normal(0.0, 0.3))
        terminated = abs(self.pos) > 3.0
        return self._obs(), 1.0 + self.pos / 10.0, terminated, False, {}


def make_walk():
    """A seeded RandomWalk with a 25-step time limit (terminations and truncations)."""
    return gym.wrappers.TimeLimit(RandomWalk(), 25)


class Drift(RandomWalk):
    """The walk without its edges: it never terminates."""

    def step(self, action):
        obs, reward, _, truncated, info = super().step(action)
        return obs, reward, False, truncated, info


def make_endless_drift():
    """A Drift without a time limit: no episode ever ends."""
    return Drift()


def make_long_drift():
    """A Drift with a 400-step time limit: every episode a truncation (as MuJoCo's at 1000)."""
    return gym.wrappers.TimeLimit(Drift(), 400)


def make_noisy_walk():
    """:func:`make_walk`, saying a line on stderr from below Python each time it is built.

    As MuJoCo's C code does (``settotalmass is deprecated``): written to
    the file descriptor, not through Python's warnings, and so once per
    env built.
    """
    os.write(2, b"WARNING: a third-party library says this once per env built\n")
    return make_walk()


def make_unseeded_walk():
    """A RandomWalk whose reset ignores its seed."""
    return gym.wrappers.TimeLimit(RandomWalk(seeded=False), 25)


def make_dict_walk():
    """A RandomWalk whose observation is a Dict (not compared: exit 2, naming the fix)."""
    return gym.wrappers.TransformObservation(
        make_walk(), lambda o: {"x": o}, gym.spaces.Dict({"x": make_walk().observation_space})
    )


def make_not_an_env():
    """A factory that returns no env (an error: exit 2)."""
    return "CartPole-v1"


def keeps_one_reset_row(batches, env):
    """A broken cleaning: cleanbuf's, with the first reset row put back after its done row.

    For next-step producers stepped one ``[E]`` step per batch (Gymnasium's
    next-step vector env).
    """
    filt = AutoresetFilter.for_env(env)
    parts = [filt(b) for b in batches] + [filt.flush()]
    rows = torch.cat([p for p in parts if p is not None and p.batch_size[0]])
    for t in range(1, len(batches)):
        done = batches[t - 1]["next", "done"].reshape(-1)
        if done.any():
            e = int(done.nonzero()[0])
            reset_row = batches[t][e].select(*rows.keys(True, True))
            ids = rows["env_id"].reshape(-1)
            ends = rows["next", "done"].reshape(-1) & (ids == e)
            i = int(ends.nonzero()[0])
            return torch.cat([rows[: i + 1], reset_row.unsqueeze(0), rows[i + 1 :]])
    raise AssertionError("no reset row in the batches")


class GridWalk(RandomWalk):
    """The walk on integer cells: observations ``int64`` (a Box of integers)."""

    def __init__(self):
        super().__init__()
        self.observation_space = gym.spaces.Box(-100, 100, (2,), np.int64)

    def _obs(self):
        cell = round(self.pos)
        return np.array([cell, cell * cell], np.int64)


def make_grid_walk():
    """A GridWalk with a 25-step time limit."""
    return gym.wrappers.TimeLimit(GridWalk(), 25)
