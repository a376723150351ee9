"""Raw Gymnasium vector-env loops, for the oracle tests of raw-loop users."""

from __future__ import annotations

import gymnasium as gym
import numpy as np

import cleanbuf


def step_rows(obs, action, next_obs, reward, terminated, truncated, info=None):
    """One vector-env step as rows [E], with each row's env index."""
    return cleanbuf.step_rows(
        obs, action, next_obs, reward, terminated, truncated, info, env_ids=True
    )


ENVS = {
    # name, make kwargs, deterministic policy
    "CartPole-terminates": ("CartPole-v1", {}, lambda obs: np.zeros(len(obs), np.int64)),
    "Pendulum-truncates": (
        "Pendulum-v1",
        {"max_episode_steps": 6},
        lambda obs: np.clip(-2.0 * obs[:, 2:3], -2.0, 2.0).astype(np.float32),
    ),
}


def run_loop(name, kwargs, policy, n_envs, steps, mode, rb=None, with_info=False):
    """Runs a Gymnasium sync vector env loop; returns its [E] rows per step.

    In DISABLED mode it resets the done envs explicitly (the oracle). With
    ``rb``, each step's rows are extended into it as they come.
    """
    venv = gym.make_vec(
        name,
        num_envs=n_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": mode},
        **kwargs,
    )
    rows = []
    obs, _ = venv.reset(seed=0)
    for _ in range(steps):
        action = policy(obs)
        next_obs, reward, terminated, truncated, info = venv.step(action)
        td = step_rows(
            obs, action, next_obs, reward, terminated, truncated, info if with_info else None
        )
        if rb is not None:
            rb.extend(td)
        rows.append(td)
        obs = next_obs
        done = terminated | truncated
        if mode == gym.vector.AutoresetMode.DISABLED and done.any():
            reset_obs, _ = venv.reset(options={"reset_mask": done})
            obs = np.where(done[:, None], reset_obs, next_obs)
    return venv, rows
