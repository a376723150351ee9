"""Rows from a raw vector-env loop: one step's outputs as the TensorDict the filter expects."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from cleanbuf.engine._errors import InputError
from cleanbuf.online._simulators import check_infos, final_entry, producer_of

_FINAL_KEYS = ("final_obs", "final_observation")


def _shape(value: Any) -> list:
    return list(value.shape) if isinstance(value, torch.Tensor) else list(np.shape(value))


def _tensor(value: Any, what: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    a = np.asarray(value)
    if a.dtype == object:
        raise InputError(
            f"{what} must be an array of numbers, shape [E, ...]; got {type(value).__name__} "
            f"holding {sorted({type(x).__name__ for x in a.flat})} (an object array). Pass the "
            "array the vector env gave or took, one entry per env."
        )
    return torch.as_tensor(a)


def _tree(value: Any, n: int, what: str):
    """Numpy / torch / dict-of-those -> tensor or dict of tensors, batch [n]."""
    if isinstance(value, Mapping):
        return {k: _tree(v, n, f"{what}[{k!r}]") for k, v in value.items()}
    if value is None:
        raise InputError(
            f"{what} is None; expected an array with the envs first, shape [{n}, ...]. Pass "
            f"what the vector env gave or took at this step ({what} of every env)."
        )
    t = _tensor(value, what)
    if t.dim() == 0 or t.shape[0] != n:
        raise InputError(
            f"{what} must have the envs first, shape [{n}, ...]; got shape {list(t.shape)}. "
            f"Pass {what} of all {n} envs of this step (the {n} comes from terminated)."
        )
    return t


def _per_env(value: Any, n: int, what: str) -> torch.Tensor:
    """One number per env: ``[n]`` or ``[n, 1]``, returned as ``[n, 1]``."""
    shape = _shape(value)
    if shape not in ([n], [n, 1]):
        got = "a 0-dim value" if not shape else f"shape {shape}"
        raise InputError(
            f"{what} must hold one value per env, shape [{n}] (or [{n}, 1]); got {got}. "
            f"Pass the {what} array the vector env's step returned, unchanged."
        )
    return _tensor(value, what).reshape(n, 1)


def _flag(value: Any, n: int, what: str) -> torch.Tensor:
    t = _per_env(value, n, what)
    if t.dtype != torch.bool and not bool(((t == 0) | (t == 1)).all()):
        raise InputError(
            f"{what} must be booleans (or 0/1), one per env; got dtype {t.dtype} with values "
            f"other than 0 and 1. Pass the {what} flags the vector env's step returned."
        )
    return t.to(torch.bool)


def _n_envs(terminated: Any) -> int:
    """The number of envs, from ``terminated`` (``[E]`` or ``[E, 1]``)."""
    shape = _shape(terminated)
    if len(shape) == 1 or (len(shape) == 2 and shape[1] == 1):
        return int(shape[0])
    raise InputError(
        f"terminated must hold one flag per env, shape [E] (or [E, 1]); got shape {shape}. "
        "Pass the terminated array the vector env's step returned (step_rows takes one step "
        "of E envs)."
    )


def _one_env(obs, action, next_obs, reward, terminated, truncated, info):
    """A single (non-vector) env's step with the env axis added: E = 1."""

    def add(value: Any, what: str):
        if isinstance(value, Mapping):
            return {k: add(v, f"{what}[{k!r}]") for k, v in value.items()}
        if value is None:
            return _tree(value, 1, what)  # raises, naming it
        t = value if isinstance(value, torch.Tensor) else _tensor(value, what)
        return t.unsqueeze(0)

    final = {}
    if isinstance(info, Mapping):  # a same-step wrapper's terminal observation, if any
        key = next((k for k in _FINAL_KEYS if info.get(k) is not None), None)
        if key is not None:
            final = {"final_obs": np.array([None], object), "_final_obs": np.ones(1, bool)}
            final["final_obs"][0] = info[key]
    elif info is not None:
        raise InputError(
            f"info of a single env's step must be its info dict; got {type(info).__name__}."
        )
    truncated = False if truncated is None else truncated
    return (add(obs, "obs"), add(action, "action"), add(next_obs, "next_obs"), [reward],
            [terminated], [truncated], final)  # fmt: skip


def _done_flags(terminated: Any, truncated: Any, info: Any, n: int):
    """``(terminated, truncated)`` as ``[n, 1]`` booleans.

    ``truncated=None`` is a Stable-Baselines3 step (the truncations are
    read from the infos' ``"TimeLimit.truncated"``) or an Isaac Lab / RSL-RL
    one (from ``extras["time_outs"]``); they are removed from ``terminated``
    (its ``dones``). Torch flags stay on their device.
    """
    terminated = _flag(terminated, n, "terminated")
    if truncated is not None:
        return terminated, _flag(truncated, n, "truncated")
    if isinstance(info, Mapping) and info.get("time_outs") is not None:
        truncated = _flag(info["time_outs"], n, "info['time_outs']")
        return terminated & ~truncated, truncated
    if not (isinstance(info, Sequence) and not isinstance(info, (str, Mapping))):
        raise InputError(
            "truncated=None is for Stable-Baselines3 steps (the truncations in the list of "
            "info dicts) and for Isaac Lab / RSL-RL steps (the truncations in "
            "extras['time_outs']); this info holds neither: pass truncated= (the step's "
            "truncations)."
        )
    check_infos(info, n)
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
    reset: Any = None,
    producer: str | None = None,
) -> TensorDict:
    """Turns one vector-env step into rows ``[E]`` for the filter (``layout="step"``).

    A single (non-vector) env's step (``reward`` and ``terminated`` plain
    numbers) gives one row, ``E = 1``. A single env resets only when the
    loop calls ``reset()``, so its data needs no cleaning unless it is
    wrapped to auto-reset (``gymnasium.wrappers.Autoreset``); see
    :meth:`cleanbuf.AutoresetFilter.for_env`.

    Args:
        obs: the observations the actions were taken from (array ``[E, ...]``
            or a dict of them, for Dict spaces).
        action: the actions ``[E, ...]``; a flat ``[E]`` (a Discrete space's
            indices) is stored as ``[E, 1]``, like the reward and the flags.
        next_obs: what ``step`` returned as observations.
        reward: rewards ``[E]``.
        terminated: terminations ``[E]`` (Stable-Baselines3: its ``dones``);
            they give the number of envs ``E``.
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
        producer: whose end-of-episode format ``info`` follows: one of
            ``"gymnasium"``, ``"sb3"``, ``"isaaclab"`` (``extras["final_obs"]``
            for the whole batch, ``extras["time_outs"]``), ``"mjlab"``
            (``extras["terminal"] = {"env_ids", "observations"}``, the done
            envs only), ``"maniskill"`` (``infos["final_observation"]`` with
            the mask ``infos["_final_observation"]``); None (the default)
            reads it from the keys present. A declared producer whose keys
            the info contradicts is refused. Observation groups (a dict
            such as ``{"policy", "critic"}``) are restored together. Where
            a done env has no terminal observation (Isaac Lab without
            ``compute_final_obs=True``, mjlab without
            ``capture_terminal_observations``), its mask is False and the
            filter applies ``on_lost_terminal_obs``. Torch observations
            stay on their device: no observation is copied to the host.
        reset: bool ``[E]``: True for the envs the loop reset itself
            (``envs.reset()``, or ``options={"reset_mask": mask}``) since the
            previous step, so that ``obs`` is a fresh reset observation. Their
            rows are marked as episode starts (``is_init`` True) and the
            filter ends their carried episode there, instead of raising
            :class:`~cleanbuf.ContinuityError`. Given, it adds ``is_init``
            ``[E, 1]``; pass it on every step (all False where no env was
            reset) to keep the rows of every step alike.

    Returns:
        A TensorDict ``[E]`` with ``observation``, ``action`` and ``next``:
        ``observation``, ``reward`` ``[E, 1]``, ``terminated``, ``truncated``,
        ``done`` (``[E, 1]`` booleans), and with ``info`` the
        final-observation entry and its mask.

    Raises:
        InputError: an argument is missing (None) or not shaped one entry
            per env (named, with the shape expected and the one given).

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
    if not _shape(terminated) and not _shape(reward) and not _shape(truncated):
        obs, action, next_obs, reward, terminated, truncated, info = _one_env(
            obs, action, next_obs, reward, terminated, truncated, info
        )
        if reset is not None:
            reset = [reset]
    n = _n_envs(terminated)
    terminated, truncated = _done_flags(terminated, truncated, info, n)
    action_t = _tree(action, n, "action")
    if isinstance(action_t, torch.Tensor) and action_t.dim() == 1:
        action_t = action_t.reshape(n, 1)
    reward_t = _per_env(reward, n, "reward")
    if reward_t.is_floating_point():
        reward_t = reward_t.to(torch.float32)
    nxt = {
        "observation": _tree(next_obs, n, "next_obs"),
        "reward": reward_t,
        "terminated": terminated,
        "truncated": truncated,
        "done": terminated | truncated,
    }
    if info is not None:
        producer = producer_of(info, producer)
        final, present = final_entry(producer, info, nxt["observation"], nxt["done"].reshape(n), n)
        nxt["final_obs"] = _tree(final, n, "final_obs")
        nxt["_final_obs"] = present.reshape(n, 1)
    data = {"observation": _tree(obs, n, "obs"), "action": action_t, "next": nxt}
    if reset is not None:
        data["is_init"] = _flag(reset, n, "reset")
    if env_ids:
        data["env_id"] = torch.arange(n)
    return TensorDict(data, batch_size=[n])
