"""Reading a producer's auto-reset behaviour, for ``AutoresetFilter.for_env``."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from cleanbuf.engine._errors import CleanbufError
from cleanbuf.engine._keys import TRAJ_IDS, may_be_observation
from cleanbuf.engine._options import normalize_mode
from cleanbuf.online._compat import collector_compact_next_keys, gym_wrapper_vector_env


def _gym_mode(vec_env: Any) -> str:
    mode = getattr(vec_env, "autoreset_mode", None)
    if mode is None:
        mode = getattr(vec_env, "metadata", {}).get("autoreset_mode")
    if mode is None:
        raise CleanbufError(
            f"{type(vec_env).__name__} does not say its auto-reset mode (no "
            "autoreset_mode attribute or metadata entry). Pass mode= explicitly."
        )
    return normalize_mode(mode)


def _is_envpool(env: Any) -> bool:
    return any(c.__module__.startswith("envpool") for c in type(env).__mro__)


def _is_gym_vector(env: Any) -> bool:
    try:
        import gymnasium
    except ImportError:
        return False
    return isinstance(env, gymnasium.vector.VectorEnv)


def _single_gym_env(env: Any) -> Reading | None:
    """The options for a single (non-vector) Gymnasium env, or None if ``env`` is none.

    A single env resets only when the loop calls ``reset()``: its data is
    clean as collected, unless a wrapper resets it on its own
    (``gymnasium.wrappers.Autoreset``: the step after an episode end
    resets, next-step style).
    """
    try:
        import gymnasium
    except ImportError:
        return None
    if not isinstance(env, gymnasium.Env):
        return None
    inner = env
    while inner is not None:
        if isinstance(inner, gymnasium.wrappers.Autoreset):
            why = f"single Gymnasium env {env} (auto-resets next-step, one row per step)"
            return Reading({"mode": "next_step", "layout": "step"}, why)
        inner = getattr(inner, "env", None) if isinstance(inner, gymnasium.Wrapper) else None
    why = (
        f"single Gymnasium env {env}: it resets only when the loop calls reset(), so its "
        "data needs no cleaning (passed through, checked)"
    )
    return Reading({"mode": "disabled", "layout": "step"}, why)


def _is_sb3_vec_env(env: Any) -> bool:
    return any(
        c.__module__.startswith("stable_baselines3") and c.__name__ == "VecEnv"
        for c in type(env).__mro__
    )


@dataclasses.dataclass
class Reading:
    """What ``for_env`` read from a producer.

    Attributes:
        options: the filter options that fit it.
        why: a short reason (shown in the filter's repr).
        streams: the streams in one batch of a ``RayCollector``'s remote
            collector (read there), else None.
    """

    options: dict
    why: str
    streams: int | None = None


def _time_limit(vec: Any) -> tuple[str, int] | None:
    """The env id and time limit of a Gymnasium vector env's sub-envs, if any.

    Shown in the filter's repr, not warned about: a time limit says when
    episodes end at the latest, not whether envs end together (that also
    depends on whether the task can end earlier, which a Gymnasium
    ``EnvSpec`` does not say, and on the policy). The filter warns when a
    call does lose a terminal observation.
    """
    try:
        spec = vec.get_attr("spec")[0]
    except Exception:  # an env without a spec, or a closed one: nothing to predict
        return None
    steps = getattr(spec, "max_episode_steps", None)
    return (spec.id, int(steps)) if steps else None


def _collector_options(collector: Any) -> Reading:
    """The options for a TorchRL collector.

    Its env's options; a multi-process collector's workers, each its own
    reset group; observation-only data with ``compact_obs=True``. (Batch-end
    marks, ``set_truncated=True``, need no option: the rows tell them.)
    """
    from torchrl.collectors import MultiCollector

    if type(collector).__name__ == "RayCollector":
        return _ray_collector_options(collector)
    if isinstance(collector, MultiCollector):
        reading, obs_keys = _multi_collector_options(collector)
    else:
        env = getattr(collector, "env", None)
        if env is None:
            raise CleanbufError(
                f"cannot find the env of {type(collector).__name__}; call "
                "AutoresetFilter.for_env(env) with the env it collects from."
            )
        reading = _torchrl_options(env)
        obs_keys = []
        for k in collector_compact_next_keys(collector):
            root = k[1:] if len(k) > 2 else k[1]
            name = root[-1] if isinstance(root, tuple) else root
            if may_be_observation((name,)) and root not in obs_keys:
                obs_keys.append(root)
    opts = reading.options
    if getattr(collector, "compact_obs", False):
        opts["observation_keys"] = obs_keys
        reading.why += ", compact_obs=True: observation-only rows"
    return reading


def _multi_collector_options(collector: Any) -> tuple[Reading, list]:
    """The options for a ``MultiSyncCollector`` / ``MultiAsyncCollector``.

    The options of the first worker's env (a probe is built once), with
    each worker its own reset group. The batches a ``MultiAsyncCollector``
    yields come from one worker at a time; the filter tells the workers
    apart by trajectory ids.

    Returns:
        ``(reading, observation keys of the worker env)``.
    """
    from torchrl.collectors import MultiAsyncCollector
    from torchrl.envs import EnvBase

    fn = collector.create_env_fn[0]
    kwargs = collector.create_env_kwargs[0] if collector.create_env_kwargs else {}
    probe = fn if isinstance(fn, EnvBase) else fn(**kwargs)
    try:
        reading = _torchrl_options(probe)
        opts, why = reading.options, reading.why
        worker_shape = tuple(probe.batch_size)
        obs_keys = [
            k if isinstance(k, tuple) else (k,) for k in probe.observation_spec.keys(True, True)
        ]
        obs_keys = [k for k in obs_keys if may_be_observation(k)]
    finally:
        if probe is not fn:
            probe.close()
    n_workers = collector.num_workers
    name = type(collector).__name__
    if opts.get("joint_reset") and opts.get("reset_group_size") is None:
        opts["reset_group_size"] = int(math.prod(worker_shape))  # a worker resets its own envs
    why = f"{name} of {n_workers} workers: {why}"
    if isinstance(collector, MultiAsyncCollector) and n_workers > 1 and opts["mode"] != "disabled":
        if getattr(collector, "replay_buffer", None) is None:
            if collector.reset_at_each_iter:
                raise CleanbufError(
                    f"{name}(reset_at_each_iter=True) restarts every worker's streams at every "
                    "batch, with new trajectory ids, so a batch extended from the parent "
                    "cannot be matched to its worker's earlier streams. Give the collector "
                    "the buffer instead (replay_buffer=rb, with the filter built by "
                    "AutoresetFilter.for_env(env)): each worker then cleans its own streams."
                )
            opts["producer_key"] = TRAJ_IDS
            why += ", one worker's batch at a time, told apart by trajectory ids"
    reading.why = why
    return reading, obs_keys


def _ray_collector_options(collector: Any) -> Reading:
    """The options for a TorchRL ``RayCollector``, read in its first remote collector.

    Every remote collector is taken to run the same kind of env. A filter
    in the buffer actor (``RayReplayBuffer(transform=filt)``) or in each
    collector (``collector_kwargs={"postproc": filt}``) runs in a Ray
    actor, where it tells the collectors apart by itself. On the driver, a
    sync collector's batches stack the collectors' envs (each collector
    its own reset group); an async one's come from one collector at a
    time, with trajectory ids that collide between collectors: refused.
    """
    import ray

    remotes = collector.remote_collectors
    reading = ray.get(remotes[0].__ray_call__.remote(_remote_options))
    n = len(remotes)
    opts = reading.options
    reading.why = f"RayCollector of {n} collectors: {reading.why}"
    if collector.replay_buffer is not None or n == 1:
        return reading
    if not collector._sync:
        raise CleanbufError(
            f"an async RayCollector of {n} collectors without a replay buffer yields one "
            "collector's batch at a time, and their trajectory ids collide, so a filter on "
            "the driver cannot tell whose streams a batch continues. Put the filter where "
            "it runs in a Ray actor: in the buffer (RayReplayBuffer(transform=filt), "
            "replay_buffer=rb) or in each collector (collector_kwargs={'postproc': filt}); "
            "or use sync=True, whose batches stack every collector's envs."
        )
    if opts.get("joint_reset") and opts.get("reset_group_size") is None:
        opts["reset_group_size"] = reading.streams  # a collector resets its own envs
    reading.why += ", batches stacking every collector's envs"
    return reading


def _remote_options(remote_collector: Any) -> Reading:
    """Runs in a remote collector's actor: its options, and its streams per batch."""
    reading = _collector_options(remote_collector)
    env = getattr(remote_collector, "env", None)
    reading.streams = int(math.prod(env.batch_size)) if env is not None else None
    return reading


def _resets_in_step(env: Any) -> bool:
    """Whether a TorchRL env resets inside its step (an ``AutoResetEnv`` layer).

    ``EnvType(..., auto_reset=True)`` wraps the env in ``AutoResetEnv`` with
    an ``AutoResetTransform`` (the only transform it takes).
    """
    from torchrl.envs import TransformedEnv

    try:
        from torchrl.envs import AutoResetEnv
    except ImportError:  # a torchrl without it: no env of that kind
        return False
    layer = env
    while isinstance(layer, TransformedEnv):
        if isinstance(layer, AutoResetEnv):
            return True
        layer = layer.base_env
    return False


def _workers_reset_in_step(batched: Any) -> bool:
    """Whether the single-env workers of a ``SerialEnv`` / ``ParallelEnv`` reset in their step.

    Read first in the description TorchRL keeps of a worker (built when
    the batched env was), then, where it names ``AutoResetTransform``,
    confirmed on a probe worker (built once).
    """
    meta = batched.__dict__.get("meta_data")  # (getattr would start a ParallelEnv's workers)
    meta = meta[0] if isinstance(meta, list) and meta else meta
    if "AutoResetTransform" not in str(getattr(meta, "env_str", "")):
        return False
    fn = batched.create_env_fn[0]
    kwargs = batched.create_env_kwargs[0] if batched.create_env_kwargs else {}
    probe = fn(**kwargs)
    try:
        return _resets_in_step(probe)
    finally:
        probe.close()


def _auto_reset_reading(env: Any, where: str) -> Reading:
    """The options for an env that resets inside its step under ``AutoResetTransform``.

    Same-step: the reset observation is the next step's root, no reset row.
    TorchRL fills the done step's ``("next", obs)`` (NaN for floats, -1 for
    signed integers, False for the rest) and keeps no terminal observation,
    so each done row is a lost one. With floating observations they stay
    NaN, counted (as next-step mode does by default); with others no
    policy is chosen, and the first done row raises, naming the choices.
    """
    obs = [
        spec.dtype
        for key, spec in env.observation_spec.items(True, True)
        if may_be_observation(key if isinstance(key, tuple) else (key,))
    ]
    options: dict = {"mode": "same_step"}
    why = (
        f"{where} resetting inside its step (AutoResetTransform, same-step): TorchRL fills "
        "every terminal observation, so they are lost"
    )
    if obs and all(d.is_floating_point for d in obs):
        options["on_lost_terminal_obs"] = "nan"
        why += " (kept NaN, counted)"
    return Reading(options, why)


def _torchrl_options(env: Any) -> Reading:
    from torchrl.envs import GymWrapper, TransformedEnv
    from torchrl.envs.batched_envs import BatchedEnvBase

    if _resets_in_step(env):
        return _auto_reset_reading(env, "TorchRL env")
    inner = env
    while isinstance(inner, TransformedEnv):
        inner = inner.base_env
    if isinstance(inner, BatchedEnvBase):
        worker_shape = tuple(inner.batch_size[1:])
        if not worker_shape:
            if _workers_reset_in_step(inner):
                return _auto_reset_reading(env, f"{type(inner).__name__} of single envs")
            why = f"{type(inner).__name__} of single envs (explicit resets)"
            return Reading({"mode": "disabled"}, why)
        fn = inner.create_env_fn[0]
        kwargs = inner.create_env_kwargs[0] if inner.create_env_kwargs else {}
        probe = fn(**kwargs)
        try:
            reading = _torchrl_options(probe)
        finally:
            probe.close()
        if reading.options.get("joint_reset"):
            reading.options["reset_group_size"] = int(math.prod(worker_shape))
        reading.why = f"{type(inner).__name__} workers: {reading.why}"
        return reading
    if isinstance(inner, GymWrapper):
        try:
            vec = gym_wrapper_vector_env(inner)
        except AttributeError as err:
            raise CleanbufError(
                "this torchrl version does not show the env a GymWrapper wraps, so its "
                "auto-reset mode cannot be read; pass mode= explicitly (and "
                "joint_reset=True for GymEnv(name, num_envs=N))."
            ) from err
        if vec is None:
            return Reading({"mode": "disabled"}, "single GymWrapper env (explicit resets)")
        mode = _gym_mode(vec) if _is_gym_vector(vec) else "same_step"
        if mode != "next_step":
            return Reading(
                {"mode": "disabled"}, f"GymWrapper over a {mode} vector env (TorchRL repairs it)"
            )
        why = "TorchRL GymWrapper over a next-step vector env (joint reset)"
        limit = _time_limit(vec)
        if limit is not None and vec.num_envs > 1:
            why += (
                f"; envs ending together (e.g. at the {limit[1]}-step time limit) lose terminal obs"
            )
        return Reading({"mode": "next_step", "joint_reset": True}, why)
    raise CleanbufError(
        f"cannot read the auto-reset behaviour of TorchRL env {type(inner).__name__}; "
        "pass mode= (and joint_reset=) explicitly."
    )


def options_for_env(env: Any) -> Reading:
    """Returns the filter options that fit ``env``, with a short reason.

    Args:
        env: a TorchRL env or collector, a Gymnasium ``VectorEnv`` or
            single env, a Stable-Baselines3 ``VecEnv`` or an EnvPool env.

    Returns:
        The options, the reason, and what to warn the user of.

    Raises:
        CleanbufError: unknown producer, or an env id (a str) instead of an env.

    Examples:
        >>> import gymnasium as gym
        >>> venv = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
        >>> options_for_env(venv).options
        {'mode': 'next_step', 'layout': 'step', 'terminal_obs_in_done_row': True}
    """
    module = type(env).__module__
    if module.startswith("torchrl.collectors"):
        return _collector_options(env)
    if module.startswith("torchrl"):
        return _torchrl_options(env)
    if _is_sb3_vec_env(env):
        return Reading(
            {"mode": "same_step", "layout": "step"},
            f"Stable-Baselines3 {type(env).__name__} (same-step, terminal_observation in infos)",
        )
    # A Gymnasium or EnvPool next-step loop hands every done row its terminal
    # observation (step_rows stores it): all zeros is a real observation there,
    # never a producer's fill, so it is not read as one.
    stored = {"terminal_obs_in_done_row": True}
    if _is_envpool(env):
        return Reading({"mode": "next_step", "layout": "step", **stored}, "EnvPool env (next-step)")
    if _is_gym_vector(env):
        mode = _gym_mode(env)
        options = {"mode": mode, "layout": "step", **(stored if mode == "next_step" else {})}
        return Reading(options, f"Gymnasium {type(env).__name__} ({mode})")
    single = _single_gym_env(env)
    if single is not None:
        return single
    if isinstance(env, str):
        raise CleanbufError(
            f"for_env takes the env the data comes from, not its id ({env!r}): how it "
            "auto-resets depends on how it is built. Pass the env itself: "
            f"gymnasium.make_vec({env!r}, num_envs=N), TorchRL GymEnv({env!r}, num_envs=N), "
            "a collector... A single env (gymnasium.make, GymEnv without num_envs) resets "
            "only when you call reset() and needs no cleaning."
        )
    raise CleanbufError(
        f"cannot tell how {type(env).__name__} (module {module}) auto-resets. Build the "
        "filter with an explicit mode: AutoresetFilter('next_step' | 'same_step' | "
        "'disabled', ...)."
    )
