"""Envs that lose no terminal observation: TorchRL's Gym vector env, an mjlab env."""

from __future__ import annotations

from typing import Any

from cleanbuf.engine._errors import CleanbufError
from cleanbuf.engine._options import normalize_mode

_REPAIRED_MODES = ("disabled", "same_step")


def lossless_gym_env(
    env_name: str,
    num_envs: int,
    *,
    autoreset_mode: str = "disabled",
    vectorization_mode: str = "sync",
    device: Any = None,
    **kwargs: Any,
) -> Any:
    """``GymEnv(env_name, num_envs=N)``, built so that nothing is lost.

    TorchRL's ``GymEnv(name, num_envs=N)`` runs a Gymnasium vector env in
    next-step mode and resets all N envs together when they end on the same
    step, which drops their terminal observations: for fixed-horizon tasks
    (Pendulum, MuJoCo) that is every one. This builds TorchRL's
    ``GymWrapper`` over ``gymnasium.make_vec`` in an auto-reset mode that
    TorchRL repairs itself (``"disabled"``: explicit partial resets;
    ``"same_step"``: the terminal observation read from the step's info), so
    the data needs no cleaning. Still give the buffer
    ``transform=AutoresetFilter.for_env(env)``, a pass-through filter: it
    stores the collector's ``[E, T]`` batches as flat rows, as a filtered
    buffer does. Without it, TorchRL's ``LazyTensorStorage(N)`` stores each
    env's ``T`` steps as one item (a ``[N, T]`` storage, T times the
    memory, and ``sample(4)`` returns ``[4, T]``).

    Args:
        env_name: a Gymnasium env id, e.g. ``"Pendulum-v1"``.
        num_envs: the number of sub-envs.
        autoreset_mode: ``"disabled"`` (the default: the fastest) or
            ``"same_step"``, or the ``gymnasium.vector.AutoresetMode``.
        vectorization_mode: ``"sync"`` (the default: one process, fastest
            for cheap envs) or ``"async"`` (a process per sub-env, as
            ``GymEnv`` does; worth it when a step costs more than the
            inter-process round trip).
        device: the TorchRL env's device.
        **kwargs: passed to ``gymnasium.make_vec`` and on to each sub-env
            (``max_episode_steps=``, the env's own arguments).

    Returns:
        A TorchRL ``GymWrapper``.

    Raises:
        CleanbufError: an auto-reset mode TorchRL does not repair.

    Examples:
        >>> import cleanbuf
        >>> env = cleanbuf.lossless_gym_env("Pendulum-v1", 4, max_episode_steps=5)
        >>> td = env.rollout(12, break_when_any_done=False)
        >>> bool(td["next", "observation"].isnan().any())
        False
        >>> int(td["next", "done"].sum())  # every sub-env ended twice, at steps 5 and 10
        8
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> filt = cleanbuf.AutoresetFilter.for_env(env)  # pass-through: flat rows
        >>> filt.options.mode
        'disabled'
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
        >>> _ = rb.extend(td)
        >>> len(rb), rb.sample(4).batch_size
        (48, torch.Size([4]))
    """
    import gymnasium
    from torchrl.envs import GymWrapper

    mode = normalize_mode(autoreset_mode)
    if mode not in _REPAIRED_MODES:
        raise CleanbufError(
            f"autoreset_mode={autoreset_mode!r}: TorchRL repairs only {_REPAIRED_MODES} "
            "(next-step vector envs lose the terminal observations of a joint reset). "
            "Pass 'disabled' or 'same_step'."
        )
    vec = gymnasium.make_vec(
        env_name,
        num_envs=num_envs,
        vectorization_mode=vectorization_mode,
        vector_kwargs={"autoreset_mode": getattr(gymnasium.vector.AutoresetMode, mode.upper())},
        **kwargs,
    )
    return GymWrapper(vec, device=device)


class LosslessMjlabEnv:
    """An mjlab env built with ``cfg.auto_reset = False``, reset by this wrapper.

    mjlab's ``ManagerBasedRlEnv`` with ``auto_reset=False`` returns the true
    terminal observations and leaves the resets to the caller. This wrapper
    resets the done envs itself after each step (``env.reset(env_ids=...)``)
    and hands over their terminal observations as mjlab's own terminal
    extras, ``extras["terminal"] = {"env_ids": ..., "observations": {...}}``,
    which :func:`cleanbuf.step_rows` reads (``producer="mjlab"``): the loop
    sees what an auto-resetting env gives, and loses nothing. Everything
    else (``num_envs``, ``device``, spaces, ``close``) is the env's.

    Torch tensors stay on the env's device; the one host read per step is
    whether any env is done.

    Args:
        env: an mjlab ``ManagerBasedRlEnv`` (or any env with its ``step`` and
            ``reset(env_ids=...)``) whose ``cfg.auto_reset`` is False.

    Raises:
        CleanbufError: the env auto-resets (``cfg.auto_reset`` True): its
            step has already replaced the terminal observations.

    Examples:
        >>> import torch
        >>> class Counter:  # two envs; env 1 ends every 2 steps; auto_reset=False
        ...     num_envs, device = 2, "cpu"
        ...     def __init__(self): self.t = torch.zeros(2)
        ...     def reset(self, seed=None, env_ids=None, options=None):
        ...         self.t[slice(None) if env_ids is None else env_ids] = 0
        ...         return {"actor": self.t[:, None].clone()}, {}
        ...     def step(self, action):
        ...         self.t += 1
        ...         done = torch.tensor([False, bool(self.t[1] == 2)])
        ...         return {"actor": self.t[:, None].clone()}, torch.ones(2), done, done & False, {}
        >>> env = LosslessMjlabEnv(Counter())
        >>> _ = env.reset()
        >>> _ = env.step(None)
        >>> obs, reward, terminated, truncated, extras = env.step(None)
        >>> obs["actor"].reshape(-1).tolist(), extras["terminal"]["env_ids"].tolist()
        ([2.0, 0.0], [1])
        >>> extras["terminal"]["observations"]["actor"].reshape(-1).tolist()
        [2.0]
    """

    def __init__(self, env: Any):
        cfg = getattr(getattr(env, "unwrapped", env), "cfg", None)
        if cfg is not None and getattr(cfg, "auto_reset", False):
            raise CleanbufError(
                "this mjlab env auto-resets (cfg.auto_reset is True), so its step has already "
                "replaced the terminal observations. Build it with cfg.auto_reset = False "
                "before ManagerBasedRlEnv(cfg=cfg, ...), then wrap it: "
                "cleanbuf.LosslessMjlabEnv(env)."
            )
        self.env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["env"], name)

    def reset(self, *args: Any, **kwargs: Any):
        """The env's ``reset``."""
        return self.env.reset(*args, **kwargs)

    def step(self, action: Any):
        """The env's step, with the done envs reset and their terminal observations in extras.

        Returns:
            ``(obs, reward, terminated, truncated, extras)`` as mjlab's
            auto-resetting step gives them: ``obs`` after the resets, and
            ``extras["terminal"]`` on a step where an env was done.
        """
        import torch

        obs, reward, terminated, truncated, extras = self.env.step(action)
        done = terminated | truncated
        if not bool(done.any()):
            return obs, reward, terminated, truncated, extras
        ids = torch.nonzero(done.reshape(-1)).reshape(-1)

        def rows(tree: Any):
            if isinstance(tree, dict):
                return {k: rows(v) for k, v in tree.items()}
            return tree.index_select(0, ids.to(tree.device))  # a copy, before the reset

        terminal = {"env_ids": ids, "observations": rows(obs)}
        obs, _ = self.env.reset(env_ids=ids)
        extras = dict(extras or {})
        extras["terminal"] = terminal
        return obs, reward, terminated, truncated, extras
