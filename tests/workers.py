"""Worker envs and a policy for the multi-process tests (importable by spawned workers)."""

from __future__ import annotations

import functools
import os

import gymnasium as gym
import torch
from torchrl.data import Unbounded
from torchrl.envs import Compose, GymEnv, GymWrapper, InitTracker, StepCounter, TransformedEnv
from torchrl.envs.transforms import Transform

ENVS_PER_WORKER = 2
STREAM = "env_id"


def worker_env(disabled=False):
    """One worker's env: ``GymEnv("CartPole-v1", num_envs=2)`` (next-step,
    joint reset), or the same envs with explicit resets (the oracle).
    """
    if disabled:
        venv = gym.vector.SyncVectorEnv(
            [functools.partial(gym.make, "CartPole-v1")] * ENVS_PER_WORKER,
            autoreset_mode=gym.vector.AutoresetMode.DISABLED,
        )
        base = GymWrapper(venv)
    else:
        base = GymEnv("CartPole-v1", num_envs=ENVS_PER_WORKER)
    return TransformedEnv(base, Compose(StepCounter(), InitTracker(), StreamId()))


class StreamId(Transform):
    """Writes each row's stream as ``1000 * pid + env index`` (key ``env_id``).

    An env transform rather than a policy output, so that it is in the env's
    specs and thus in a storage that TorchRL initialises from them (a
    multi-process collector given ``policy=`` and the buffer does), and the
    rows of each worker's envs can be told apart once the buffer has
    flattened them. It is observation-like (at the root and under "next"),
    so the filter carries it like an observation.
    """

    def __init__(self):
        super().__init__(in_keys=[], out_keys=[STREAM])

    def _ids(self, td):
        batch = td.batch_size
        return (1000 * os.getpid() + torch.arange(batch[-1])).expand(batch).clone()

    def _call(self, next_td):
        next_td.set(STREAM, self._ids(next_td))
        return next_td

    def _reset(self, td, td_reset):
        td_reset.set(STREAM, self._ids(td_reset))
        return td_reset

    def transform_observation_spec(self, spec):
        spec[STREAM] = Unbounded(shape=spec.shape, dtype=torch.int64, device=spec.device)
        return spec


oracle_env = functools.partial(worker_env, disabled=True)


def push_left(td):
    """Deterministic: always push left."""
    action = torch.zeros(*td.batch_size, 2, dtype=torch.long)  # the action spec's dtype
    action[..., 0] = 1
    td.set("action", action)
    return td


def seeded(make_env, seed):
    """``make_env()`` seeded before anything resets it (a Ray collector resets
    its env when it is built, before ``set_seed`` reaches it).
    """
    env = make_env()
    env.set_seed(seed)
    return env


def pendulum_env():
    """``GymEnv("Pendulum-v1", num_envs=2)``: a fixed horizon, so its two envs
    always end together and TorchRL's joint reset loses both terminal observations.
    """
    return GymEnv("Pendulum-v1", num_envs=ENVS_PER_WORKER)


def no_torque(td):
    """Deterministic Pendulum policy: no torque."""
    td.set("action", torch.zeros(*td.batch_size, 1))
    return td
