"""A TorchRL Gym vector env that loses no terminal observation."""

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
