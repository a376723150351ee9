"""Rows from a raw vector-env loop: one step's outputs as the TensorDict the filter expects."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from cleanbuf.engine._errors import InputError


def _tree(value: Any, n: int, what: str):
    """Numpy / torch / dict-of-those -> tensor or dict of tensors, batch [n]."""
    if isinstance(value, Mapping):
        return {k: _tree(v, n, f"{what}[{k!r}]") for k, v in value.items()}
    t = torch.as_tensor(np.asarray(value) if not isinstance(value, torch.Tensor) else value)
    if t.dim() == 0 or t.shape[0] != n:
        raise InputError(
            f"{what} must have the envs first, shape [{n}, ...]; got shape {list(t.shape)}."
        )
    return t


def _flag(value: Any, n: int, what: str) -> torch.Tensor:
    t = _tree(value, n, what)
    return t.reshape(n, 1).to(torch.bool)


def _final_from_info(info: Any, next_obs: Any, n: int):
    """Reads the terminal observations out of a step's info.

    Gymnasium (``SAME_STEP``): a dict with ``"final_obs"`` (an object array
    with one entry per env, None where not done) and the mask
    ``"_final_obs"``. Stable-Baselines3: a list of per-env dicts with
    ``"terminal_observation"`` on the envs that were done.

    Returns:
        ``(final, present)``: the terminal observations shaped like
        ``next_obs`` (zeros where absent), and the bool mask ``[n]``.
    """
    entries: list = [None] * n
    if isinstance(info, Mapping):
        key = next((k for k in ("final_obs", "final_observation") if k in info), None)
        if key is not None:
            mask = np.asarray(info.get("_" + key, [x is not None for x in info[key]]), bool)
            for i in np.flatnonzero(mask):
                entries[i] = info[key][i]
    elif isinstance(info, Sequence) and not isinstance(info, str):
        if len(info) != n:
            raise InputError(f"info is a list of {len(info)} dicts; expected one per env ({n}).")
        for i, d in enumerate(info):
            if d.get("terminal_observation") is not None:
                entries[i] = d["terminal_observation"]
    else:
        raise InputError(
            f"info must be Gymnasium's info dict or Stable-Baselines3's list of info dicts; "
            f"got {type(info).__name__}."
        )
    present = np.array([e is not None for e in entries], bool)

    def fill(template: Any, pick):
        if isinstance(template, Mapping):
            return {k: fill(v, lambda e, k=k: pick(e)[k]) for k, v in template.items()}
        out = np.zeros_like(np.asarray(template))
        for i in np.flatnonzero(present):
            out[i] = pick(entries[i])
        return out

    return fill(next_obs, lambda e: e), present


def _done_flags(terminated: Any, truncated: Any, info: Any, n: int):
    """``(terminated, truncated)`` as ``[n, 1]`` booleans.

    ``truncated=None`` is a Stable-Baselines3 step: the truncations are
    read from the infos' ``"TimeLimit.truncated"`` and removed from its
    ``dones``.
    """
    terminated = _flag(terminated, n, "terminated")
    if truncated is not None:
        return terminated, _flag(truncated, n, "truncated")
    if not (isinstance(info, Sequence) and not isinstance(info, (str, Mapping))):
        raise InputError(
            "truncated=None is for Stable-Baselines3 steps, where the truncations are in "
            "the list of info dicts; pass truncated= for Gymnasium steps."
        )
    flags = [bool(d.get("TimeLimit.truncated", False)) for d in info]
    truncated = torch.tensor(flags).reshape(n, 1)
    return terminated & ~truncated, truncated


def step_rows(
    obs: Any,
    action: Any,
    next_obs: Any,
    reward: Any,
    terminated: Any,
    truncated: Any = None,
    info: Any = None,
    *,
    env_ids: bool = False,
) -> TensorDict:
    """Turns one vector-env step into rows ``[E]`` for the filter (``layout="step"``).

    Args:
        obs: the observations the actions were taken from (array ``[E, ...]``
            or a dict of them, for Dict spaces).
        action: the actions ``[E, ...]``.
        next_obs: what ``step`` returned as observations.
        reward: rewards ``[E]``.
        terminated: terminations ``[E]`` (Stable-Baselines3: its ``dones``).
        truncated: truncations ``[E]``; None for Stable-Baselines3, where they
            are read from the infos' ``"TimeLimit.truncated"`` (and removed
            from ``terminated``).
        info: the step's info; always pass it. The terminal observations
            it holds (same-step producers: Gymnasium ``info["final_obs"]`` on
            a step where an env ended, Stable-Baselines3
            ``infos[i]["terminal_observation"]``) become
            ``("next", "final_obs")`` with the mask ``("next", "_final_obs")``
            (False where it holds none), on every step, so that steps stack
            into ``[E, T]``. The filter reads them and stores neither column
            (a same-step filter unless ``keep_final_obs=True``; a next-step
            one whenever the mask is all False, as a next-step producer's
            info leaves it). Required (for the truncations) when
            ``truncated`` is None.
        env_ids: also store each row's env index as ``"env_id"``.

    Returns:
        A TensorDict ``[E]`` with ``observation``, ``action`` and ``next``:
        ``observation``, ``reward`` ``[E, 1]``, ``terminated``, ``truncated``,
        ``done`` (``[E, 1]`` booleans), and with ``info`` the
        final-observation entry and its mask.

    Examples:
        >>> import gymnasium as gym
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> from cleanbuf import AutoresetFilter, step_rows
        >>> envs = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync",
        ...     vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
        >>> filt = AutoresetFilter.for_env(envs)
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(100), transform=filt)
        >>> obs, _ = envs.reset(seed=0)
        >>> for _ in range(20):
        ...     action = envs.action_space.sample()
        ...     next_obs, reward, terminated, truncated, info = envs.step(action)
        ...     _ = rb.extend(step_rows(obs, action, next_obs, reward, terminated, truncated, info))
        ...     obs = next_obs
        >>> len(rb)
        40
    """
    n = int(np.asarray(reward).shape[0])
    terminated, truncated = _done_flags(terminated, truncated, info, n)
    action_t = _tree(action, n, "action")
    if isinstance(action_t, torch.Tensor) and action_t.dim() == 1:
        action_t = action_t.reshape(n, 1)
    reward_t = _tree(reward, n, "reward").reshape(n, 1)
    if reward_t.is_floating_point():
        reward_t = reward_t.to(torch.float32)
    nxt = {
        "observation": _tree(next_obs, n, "next_obs"),
        "reward": reward_t,
        "terminated": terminated,
        "truncated": truncated,
        "done": terminated | truncated,
    }
    found = None if info is None else _final_from_info(info, next_obs, n)
    if found is not None:
        final, present = found
        nxt["final_obs"] = _tree(final, n, "final_obs")
        nxt["_final_obs"] = torch.from_numpy(present).reshape(n, 1)
    data = {"observation": _tree(obs, n, "obs"), "action": action_t, "next": nxt}
    if env_ids:
        data["env_id"] = torch.arange(n)
    return TensorDict(data, batch_size=[n])
