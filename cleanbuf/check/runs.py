"""The runs behind ``cleanbuf check``: one env, every producer, and the truth.

Every run builds its sub-envs from one factory (:class:`EnvSource`), and
sub-env ``e`` starts from ``reset(seed=seed + e)`` whatever the producer
does with seeds (:func:`seeded`). Each env ``e`` has its own seeded
random action sequence; the ``k``-th real step of env ``e`` takes action
``k`` of that sequence in every run, and a reset step (the step after an
episode end in next-step mode, whose action the env ignores) takes none.
The truth steps every env ``steps`` times with explicit partial resets
(Gymnasium ``AutoresetMode.DISABLED``); a producer's ``steps`` steps hold
fewer real steps when some of them are reset steps.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from cleanbuf.engine._errors import CleanbufError
from cleanbuf.online._rows import step_rows

STREAM = "env_id"
BATCH_STEPS = 64  # steps per [E, T] batch of the TorchRL producers (a collector's batch)

# name -> (what it is, the package it needs)
PRODUCERS = {
    "gym-next-step": ("Gymnasium vector env, next-step (its default)", "gymnasium"),
    "gym-same-step": ("the same, same-step", "gymnasium"),
    "torchrl-gymenv": ("TorchRL GymEnv(name, num_envs=N), its sub-envs in this process", "torchrl"),
    "torchrl-serial": ("TorchRL SerialEnv of single GymEnvs", "torchrl"),
    "torchrl-parallel": ("TorchRL ParallelEnv of single GymEnvs", "torchrl"),
    "torchrl-autoreset": (
        "TorchRL SerialEnv of single GymEnvs that reset inside their step (auto_reset=True: "
        "AutoResetTransform)",
        "torchrl",
    ),
    "sb3-dummy": ("Stable-Baselines3 DummyVecEnv", "stable_baselines3"),
    "envpool": ("EnvPool (against EnvPool's own env with explicit resets)", "envpool"),
}
# What runs when no producer is named: the ones that start no process.
DEFAULT_PRODUCERS = (
    "gym-next-step",
    "gym-same-step",
    "torchrl-gymenv",
    "torchrl-serial",
    "torchrl-autoreset",
    "sb3-dummy",
    "envpool",
)
ENVPOOL_WHY = (
    "EnvPool runs its own C++ version of an env, built from a registered id, not from a "
    "Gymnasium factory"
)
_PIP = {
    "gymnasium": "gymnasium (pip install 'cleanbuf[gym]')",
    "stable_baselines3": "stable-baselines3 (pip install stable-baselines3)",
    "envpool": "envpool (pip install envpool)",
    "torchrl": "torchrl",
}


def installed(package: str) -> bool:
    """Whether ``package`` can be imported."""
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


def require(producer: str) -> None:
    """Raises, naming the package to install, when ``producer`` cannot run here."""
    package = PRODUCERS[producer][1]
    if not installed(package):
        raise CleanbufError(
            f"producer {producer!r} ({PRODUCERS[producer][0]}) needs {_PIP[package]}, which is "
            "not installed. Install it, or leave the producer out (--producer)."
        )


def gym() -> Any:
    """The ``gymnasium`` module, or an error naming the extra."""
    try:
        import gymnasium
    except ImportError as err:
        raise CleanbufError(
            "cleanbuf check runs Gymnasium envs: install gymnasium (pip install 'cleanbuf[gym]')."
        ) from err
    return gymnasium


@dataclasses.dataclass(frozen=True)
class EnvSource:
    """The env under test: a Gymnasium id or a ``package.module:function`` factory.

    Attributes:
        name: as the user gave it.
        max_episode_steps: a time limit put on every sub-env (None: the env's own).
    """

    name: str
    max_episode_steps: int | None = None

    def factory(self) -> Callable[[], Any] | None:
        """The ``module:function`` the name points to, or None for a Gymnasium id."""
        module, sep, attr = self.name.partition(":")
        if not sep or not attr.isidentifier():
            return None
        try:
            fn = getattr(importlib.import_module(module), attr, None)
        except ImportError:
            return None  # maybe "module:EnvId", which gymnasium.make reads itself
        return fn if callable(fn) else None

    def limit(self) -> dict:
        """``{"max_episode_steps": N}`` when a time limit is set, else ``{}``."""
        steps = self.max_episode_steps
        return {} if steps is None else {"max_episode_steps": steps}

    def make(self) -> Any:
        """One sub-env, with the time limit."""
        g = gym()
        fn = self.factory()
        if fn is None:
            return g.make(self.name, **self.limit())
        env = fn()
        if not isinstance(env, g.Env):
            raise CleanbufError(
                f"{self.name} returned {type(env).__name__}, not a Gymnasium env. The factory "
                "must return one single env (gymnasium.Env), as gymnasium.make does."
            )
        if self.max_episode_steps is not None:
            env = g.wrappers.TimeLimit(env, self.max_episode_steps)
        return env

    def _factory_problem(self) -> str | None:
        """What is wrong with a ``module:function`` name that built no env, or None.

        Gymnasium reads ``module:EnvId`` itself (it imports the module, which
        registers the id), so its error for a missing function or module
        speaks of env registration; this says what the user wrote instead.
        """
        module, sep, attr = self.name.partition(":")
        if not sep:
            return None
        try:
            found = importlib.import_module(module)
        except ImportError as err:
            return (
                f"cannot build env {self.name!r}: module {module!r} cannot be imported ({err}). "
                "Run from the directory that holds it, or add that directory to PYTHONPATH."
            )
        if hasattr(found, attr):
            return None
        return (
            f"cannot build env {self.name!r}: module {module!r} has no {attr!r}. Pass "
            "module:function naming a function that returns one Gymnasium env (or "
            "module:EnvId for an env id the module registers)."
        )

    def probe(self) -> tuple[Any, Any]:
        """``(observation space, action space)`` of one sub-env; raises if it cannot be built."""
        try:
            env = self.make()
        except CleanbufError:
            raise
        except Exception as err:
            raise CleanbufError(
                self._factory_problem()
                or f"cannot build env {self.name!r}: {type(err).__name__}: "
                f"{str(err).rstrip('.')}. Pass a Gymnasium id (gymnasium.pprint_registry() "
                "lists them) or package.module:function returning one Gymnasium env."
            ) from err
        try:
            spaces = env.observation_space, env.action_space
        finally:
            env.close()
        if not isinstance(spaces[0], gym().spaces.Box):
            raise CleanbufError(
                f"{self.name}: cleanbuf check compares array observations (a Box space); this "
                f"env's observation space is {spaces[0]}. Wrap it to give a Box (for a Dict "
                "space: gymnasium.wrappers.FlattenObservation) and pass that factory."
            )
        return spaces


def time_limit(source: EnvSource) -> int | None:
    """The sub-envs' time limit (a ``TimeLimit`` wrapper's or the spec's), or None."""
    if source.max_episode_steps is not None:
        return source.max_episode_steps
    env = source.make()
    try:
        layer = env
        while layer is not None:
            if isinstance(layer, gym().wrappers.TimeLimit):
                return int(layer._max_episode_steps)
            layer = getattr(layer, "env", None)
        steps = getattr(getattr(env, "spec", None), "max_episode_steps", None)
        return None if steps is None else int(steps)
    finally:
        env.close()


def seeded(source: EnvSource, seed: int) -> Any:
    """A sub-env of ``source`` that starts from ``reset(seed=seed)``."""
    return _seeded_start_class()(source.make(), seed)


@functools.cache
def _seeded_start_class() -> type:
    """The wrapper class (built once gymnasium is imported: it is an optional dependency)."""
    g = gym()

    class SeededStartWrapper(g.Wrapper):
        """Every reset before the first step uses ``seed``; later ones go on unseeded.

        Producers seed differently (a vector env seeds sub-env i with
        seed + i, TorchRL's batched envs chain seeds, a collector resets
        again after ``set_seed``); with this wrapper, sub-env ``e`` of every
        run starts from the same state, and its later episodes follow its
        own random numbers, as with explicit resets.
        """

        def __init__(self, env: Any, seed: int):
            super().__init__(env)
            self._start_seed = seed
            self._stepped = False

        def reset(self, *, seed: int | None = None, options: dict | None = None):
            return self.env.reset(seed=None if self._stepped else self._start_seed, options=options)

        def step(self, action: Any):
            self._stepped = True
            return self.env.step(action)

        def restart(self) -> None:
            """Starts again from ``reset(seed=seed)`` (after a framework's probing steps)."""
            self._stepped = False

    return SeededStartWrapper


def action_sequences(action_space: Any, num_envs: int, steps: int, seed: int) -> np.ndarray:
    """Each env's seeded random actions ``[E, steps, ...]`` (env e's space seeded ``seed + e``)."""
    import copy

    out = []
    for e in range(num_envs):
        space = copy.deepcopy(action_space)
        space.seed(seed + e)
        out.append(np.stack([np.asarray(space.sample()) for _ in range(steps)]))
    if out[0].dtype == object:
        raise CleanbufError(
            f"cleanbuf check draws array actions; the action space {action_space} gives "
            f"{type(action_space.sample()).__name__}. Use an env with a Box, Discrete, "
            "MultiDiscrete or MultiBinary action space."
        )
    return np.stack(out)


@dataclasses.dataclass
class Run:
    """One producer's rows as its pipeline would store them.

    Attributes:
        producer: its name (a key of :data:`PRODUCERS`).
        batches: the batches in the order a pipeline extends a buffer with
            them: ``[E]`` steps (raw loops) or ``[E, T]`` (TorchRL), each
            row with its env index (``"env_id"``).
        rows: every row, ``[E, T]`` (time last).
        real: bool ``[E, T]``: the row is a real step (False: a reset step).
        joint: bool ``[T]``: a joint reset followed that step (every env
            done at once, reset together by TorchRL).
        filled: the producer fills every done step's next observation
            (TorchRL's ``AutoResetTransform``): no terminal observation is kept.
        stored_terminated: bool ``[E, T]``: the producer's own termination
            flag (Stable-Baselines3: its ``dones``, truncations included).
        env: the producer (open until :meth:`close`).
        seconds: the collection's wall time.
    """

    producer: str
    batches: list
    rows: TensorDict
    real: np.ndarray
    joint: np.ndarray
    stored_terminated: np.ndarray
    env: Any
    seconds: float
    filled: bool = False

    def close(self) -> None:
        """Closes the producer's env."""
        try:
            self.env.close()
        except Exception:  # a producer already closed: nothing to do
            pass


def _where(mask: np.ndarray, a: Any, b: Any) -> Any:
    """``np.where`` per env on arrays or dicts of arrays."""
    if isinstance(a, dict):
        return {k: _where(mask, a[k], b[k]) for k in a}
    m = mask.reshape(-1, *([1] * (np.ndim(a) - 1)))
    return np.where(m, a, b)


def run_truth(source: EnvSource, num_envs: int, steps: int, seed: int, actions: np.ndarray):
    """The explicit-reset run: ``[E, steps]`` rows with ``is_init`` and ``step_count``."""
    g = gym()
    venv = g.vector.SyncVectorEnv(
        [functools.partial(seeded, source, seed + e) for e in range(num_envs)],
        autoreset_mode=g.vector.AutoresetMode.DISABLED,
    )
    try:
        obs, _ = venv.reset(seed=seed)
        first = np.ones(num_envs, bool)
        count = np.zeros(num_envs, np.int64)
        rows = []
        for t in range(steps):
            action = actions[:, t]
            next_obs, reward, terminated, truncated, _ = venv.step(action)
            row = step_rows(
                obs, action, next_obs, reward, terminated, truncated, env_ids=True, reset=first
            )
            row["step_count"] = torch.from_numpy(count.copy()).reshape(-1, 1)
            rows.append(row)
            done = np.asarray(terminated) | np.asarray(truncated)
            count = np.where(done, 0, count + 1)
            obs = next_obs
            if done.any():
                reset_obs, _ = venv.reset(options={"reset_mask": done})
                obs = _where(done, reset_obs, next_obs)
            first = done
    finally:
        venv.close()
    return torch.stack(rows, dim=1)


class _Actions:
    """Hands out each env's next action; a reset step takes none."""

    def __init__(self, actions: np.ndarray):
        self.actions = actions
        self.next = np.zeros(actions.shape[0], np.int64)

    def take(self, real: np.ndarray) -> np.ndarray:
        idx = np.minimum(self.next, self.actions.shape[1] - 1)
        out = self.actions[np.arange(len(idx)), idx]
        self.next += real
        return out


def _gym_loop(source, num_envs, steps, seed, actions, same_step: bool, tick) -> Run:
    g = gym()
    mode = g.vector.AutoresetMode.SAME_STEP if same_step else g.vector.AutoresetMode.NEXT_STEP
    venv = g.vector.SyncVectorEnv(
        [functools.partial(seeded, source, seed + e) for e in range(num_envs)],
        autoreset_mode=mode,
    )
    name = "gym-same-step" if same_step else "gym-next-step"
    reset = functools.partial(venv.reset, seed=seed)
    return _vector_loop(name, venv, reset, num_envs, steps, actions, tick, not same_step, True)


def _vector_loop(name, vec, reset, num_envs, steps, actions, tick, next_step, info) -> Run:
    """A raw loop over a vector env (Gymnasium's or EnvPool's), stored with ``step_rows``.

    In next-step mode the step after an episode end is a reset step, which
    takes no action of the env's sequence (``real``); ``info`` passes each
    step's info to ``step_rows`` (Gymnasium's final observations).
    """
    start = time.perf_counter()
    take = _Actions(actions)
    obs, _ = reset()
    pending = np.zeros(num_envs, bool)
    batches, real = [], []
    for _ in range(steps):
        is_real = ~pending
        action = take.take(is_real)
        next_obs, reward, terminated, truncated, step_info = vec.step(action)
        kept = step_info if info else None
        batches.append(
            step_rows(obs, action, next_obs, reward, terminated, truncated, kept, env_ids=True)
        )
        real.append(is_real)
        done = np.asarray(terminated) | np.asarray(truncated)
        pending = done if next_step else np.zeros_like(done)
        obs = next_obs
        tick()
    rows = torch.stack(batches, dim=1)
    term = rows["next", "terminated"].reshape(num_envs, steps).numpy()
    return Run(name, batches, rows, np.stack(real, 1), np.zeros(steps, bool), term, vec,
               time.perf_counter() - start)  # fmt: skip


def _torchrl_action(td: TensorDict, env: Any, action: np.ndarray) -> None:
    spec = env.action_spec
    td["action"] = torch.as_tensor(action).to(spec.dtype).reshape(spec.shape)


def _torchrl_single(source: EnvSource, seed: int) -> Any:
    """A worker of the batched TorchRL producers: one GymWrapper over one sub-env."""
    from torchrl.envs import GymWrapper

    return GymWrapper(seeded(source, seed), categorical_action_encoding=True)


@functools.cache
def _auto_resetting_class() -> type:
    """A ``GymWrapper`` resetting inside its step, as TorchRL's ``AutoResetTransform`` docs say.

    Built once torchrl is imported (an optional dependency). Its step
    resets a done env at once and puts the reset observation in the step's
    output; built with ``auto_reset=True``, TorchRL wraps it in
    ``AutoResetEnv(env, AutoResetTransform())``, which moves that
    observation to the next step's root and fills the done step's
    ``("next", obs)`` (NaN for floats, -1 for signed integers).
    """
    from torchrl.envs import GymWrapper

    class AutoResettingGymWrapper(GymWrapper):
        def _step(self, tensordict):
            tensordict = super()._step(tensordict)
            if tensordict["done"].any():
                tensordict.update(super().reset().exclude(*self.done_keys))
            return tensordict

        def _reset(self, tensordict=None, **kwargs):
            if tensordict is not None and "_reset" in tensordict:
                return tensordict.copy()  # reset already, in the step
            return super()._reset(tensordict, **kwargs)

    return AutoResettingGymWrapper


def _torchrl_auto_resetting(source: EnvSource, seed: int) -> Any:
    """A worker of ``torchrl-autoreset``: one auto-resetting env over one sub-env."""
    cls = _auto_resetting_class()
    return cls(seeded(source, seed), categorical_action_encoding=True, auto_reset=True)


def _gym_env_in_process(source: EnvSource, num_envs: int, seed: int) -> Any:
    """TorchRL's ``GymEnv(name, num_envs=N)`` over this check's seeded sub-envs.

    ``GymEnv`` builds a next-step ``AsyncVectorEnv`` (a process per
    sub-env) and, in TorchRL's ``GymWrapper``, resets every sub-env
    together when all are done at the same step. This is that class with
    the vector env built in this process from the same factories (the
    rows are the same; no process starts). A ``module:function`` factory
    is registered under a Gymnasium id for it.
    """
    from torchrl.envs import GymEnv

    g = gym()
    made = []

    def make(e: int) -> Any:
        made.append(seeded(source, seed + e))
        return made[-1]

    fns = [functools.partial(make, e) for e in range(num_envs)]

    class InProcessGymEnv(GymEnv):
        def _async_env(self, *args: Any, **kwargs: Any) -> Any:
            return g.vector.SyncVectorEnv(fns, autoreset_mode=g.vector.AutoresetMode.NEXT_STEP)

    name = source.name
    if source.factory() is not None:
        name = "cleanbuf_check/" + source.name.replace(":", ".").replace("/", ".") + "-v0"
        if name not in g.registry:
            g.register(name, entry_point=source.factory())
    limit = source.limit()
    env = InProcessGymEnv(name, num_envs=num_envs, categorical_action_encoding=True, **limit)
    for sub in made:  # GymEnv stepped them to read the info specs: start again
        sub.restart()
    return env


def _torchrl_loop(producer, source, num_envs, steps, seed, actions, tick) -> Run:
    import logging
    import warnings

    from torchrl.envs import (
        Compose,
        InitTracker,
        ParallelEnv,
        SerialEnv,
        StepCounter,
        TransformedEnv,
    )

    logger = logging.getLogger("torchrl")
    level = logger.level
    logger.setLevel(logging.WARNING)  # its INFO lines on building an env: not the user's
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Nested TransformedEnvs")
        if producer == "torchrl-gymenv":
            base = _gym_env_in_process(source, num_envs, seed)
        else:
            make = _torchrl_auto_resetting if producer == "torchrl-autoreset" else _torchrl_single
            fns = [functools.partial(make, source, seed + e) for e in range(num_envs)]
            batched = ParallelEnv if producer == "torchrl-parallel" else SerialEnv
            base = batched(num_envs, fns)
        env = TransformedEnv(base, Compose(StepCounter(), InitTracker()))
    logger.setLevel(level)
    start = time.perf_counter()
    take = _Actions(actions)
    td = env.reset()
    pending = np.zeros(num_envs, bool)
    rows, real, joint = [], [], []
    for _ in range(steps):
        is_real = ~pending
        _torchrl_action(td, env, take.take(is_real))
        out, td = env.step_and_maybe_reset(td)
        out = out.clone()
        out[STREAM] = torch.arange(num_envs)
        rows.append(out)
        real.append(is_real)
        done = out["next", "done"].reshape(num_envs).numpy()
        together = bool(done.all()) and producer == "torchrl-gymenv"
        joint.append(together)
        # GymEnv: a done env's next step is a reset step, unless all reset together;
        # the batched envs of single envs reset explicitly, or (torchrl-autoreset)
        # inside the done step, the reset observation in the next step's root.
        pending = done & (producer == "torchrl-gymenv") & (not together)
        tick()
    data = torch.stack(rows, dim=1)
    batches = [data[:, t : t + BATCH_STEPS] for t in range(0, steps, BATCH_STEPS)]
    term = data["next", "terminated"].reshape(num_envs, steps).numpy()
    return Run(
        producer,
        batches,
        data,
        np.stack(real, 1),
        np.array(joint),
        term,
        env,
        time.perf_counter() - start,
        filled=producer == "torchrl-autoreset",
    )


def _sb3_loop(source, num_envs, steps, seed, actions, tick) -> Run:
    from stable_baselines3.common.vec_env import DummyVecEnv

    venv = DummyVecEnv([functools.partial(seeded, source, seed + e) for e in range(num_envs)])
    start = time.perf_counter()
    take = _Actions(actions)
    venv.seed(seed)
    obs = venv.reset()
    batches, dones = [], []
    every = np.ones(num_envs, bool)
    for _ in range(steps):
        action = take.take(every)
        next_obs, reward, done, infos = venv.step(action)
        batches.append(step_rows(obs, action, next_obs, reward, done, None, infos, env_ids=True))
        dones.append(np.asarray(done, bool))
        obs = next_obs
        tick()
    rows = torch.stack(batches, dim=1)
    return Run(
        "sb3-dummy",
        batches,
        rows,
        np.ones((num_envs, steps), bool),
        np.zeros(steps, bool),
        np.stack(dones, 1),
        venv,
        time.perf_counter() - start,
    )


def autoreset_why_not(observation_space: Any) -> str | None:
    """Why ``torchrl-autoreset`` cannot be compared on this env, or None.

    ``AutoResetTransform`` fills integer observations with -1 (unsigned
    ones with 0), which NaN cannot mark: ``AutoresetFilter.for_env`` then
    chooses no policy for them, and the first done row raises, naming the
    choices (``on_lost_terminal_obs="drop"`` or ``"keep"``).
    """
    dtype = np.dtype(observation_space.dtype)
    if dtype.kind == "f":
        return None
    return (
        f"its observations ({dtype}) are not floating point: AutoResetTransform fills them "
        "(-1, or 0 unsigned) where NaN cannot mark them, so AutoresetFilter.for_env(env) "
        'needs on_lost_terminal_obs="drop" (or "keep") chosen, and the check runs '
        "for_env's defaults"
    )


def envpool_id(source: EnvSource) -> str | None:
    """The EnvPool id of ``source``, or None (a factory, or an id EnvPool lacks)."""
    import envpool

    if source.factory() is not None:
        return None
    return source.name if source.name in envpool.list_all_envs() else None


def envpool_why_not(source: EnvSource) -> str:
    """Why ``source`` cannot be run on EnvPool (a factory, or an id EnvPool lacks)."""
    if source.factory() is not None:
        return f"{ENVPOOL_WHY}, and {source.name} is a factory"
    return (
        f"{ENVPOOL_WHY}, and {source.name!r} is not one of its ids (envpool.list_all_envs() "
        "lists them)"
    )


def _envpool(source: EnvSource, num_envs: int, seed: int) -> Any:
    import envpool

    limit = source.limit()
    return envpool.make(source.name, env_type="gymnasium", num_envs=num_envs, seed=seed, **limit)


def run_envpool_truth(source: EnvSource, num_envs: int, steps: int, seed: int, actions):
    """EnvPool's explicit-reset run: env ``e`` is a pool of one seeded ``seed + e``.

    A batched pool seeds its env ``e`` with ``seed + e``; each pool of one
    is reset explicitly after an episode end, before its next step.
    """
    columns = []
    for e in range(num_envs):
        pool = _envpool(source, 1, seed + e)
        try:
            obs, _ = pool.reset()
            first, count, rows = True, 0, []
            for t in range(steps):
                action = actions[e : e + 1, t]
                next_obs, reward, terminated, truncated, _ = pool.step(action)
                row = step_rows(obs, action, next_obs, reward, terminated, truncated,
                                reset=np.array([first]))  # fmt: skip
                row["step_count"] = torch.tensor([[count]])
                row[STREAM] = torch.tensor([e])
                rows.append(row)
                first = bool(terminated[0] or truncated[0])
                count = 0 if first else count + 1
                obs = pool.reset()[0] if first else next_obs
        finally:
            pool.close()
        columns.append(torch.cat(rows))
    return torch.stack(columns)


def _envpool_loop(source, num_envs, steps, seed, actions, tick) -> Run:
    pool = _envpool(source, num_envs, seed)
    return _vector_loop("envpool", pool, pool.reset, num_envs, steps, actions, tick, True, False)


def run_producer(
    producer: str,
    source: EnvSource,
    num_envs: int,
    steps: int,
    seed: int,
    actions: np.ndarray,
    tick: Callable[[], Any] = lambda: None,
) -> Run:
    """Runs ``producer`` on ``source`` with each env's ``actions``; returns its rows.

    Args:
        producer: a key of :data:`PRODUCERS` (``"envpool"``: an EnvPool id only).
        source: the env.
        num_envs: sub-envs.
        steps: steps of the producer (reset steps included).
        seed: sub-env e starts from ``reset(seed=seed + e)``.
        actions: ``[E, steps, ...]``, each env's actions in order.
        tick: called once per step (the progress bar).

    Returns:
        The :class:`Run`, its env still open (:meth:`Run.close`).
    """
    require(producer)
    if producer in ("gym-next-step", "gym-same-step"):
        return _gym_loop(source, num_envs, steps, seed, actions, producer == "gym-same-step", tick)
    if producer.startswith("torchrl-"):
        return _torchrl_loop(producer, source, num_envs, steps, seed, actions, tick)
    if producer == "sb3-dummy":
        return _sb3_loop(source, num_envs, steps, seed, actions, tick)
    return _envpool_loop(source, num_envs, steps, seed, actions, tick)


def filter_cleaning(batches: list, env: Any) -> TensorDict:
    """The cleaning ``cleanbuf check`` tests by default: ``AutoresetFilter.for_env(env)``.

    Each batch goes through the filter as ``rb.extend(batch)`` would send
    it, then :meth:`~cleanbuf.AutoresetFilter.flush` releases the held
    rows. The lost-observation warning is silenced: the check counts them.

    Args:
        batches: the producer's batches, in order.
        env: the producer.

    Returns:
        The cleaned flat rows.
    """
    import warnings

    from cleanbuf.engine._errors import CleanbufWarning, TerminalObservationLostError
    from cleanbuf.online._transform import AutoresetFilter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CleanbufWarning)
        filt = AutoresetFilter.for_env(env)
        try:
            out = [filt(b) for b in batches]
            out.append(filt.flush())
        except TerminalObservationLostError:
            filt.flush(on_lost_terminal_obs="drop")  # let go of the held rows: no warning at exit
            raise
    return torch.cat([o for o in out if o is not None and o.batch_size[0] > 0])


def repair_cleaning(batches: list, env: Any) -> TensorDict | None:
    """The on-policy cleaning: ``RolloutRepair.for_env(env)`` on ``[E, T]`` batches.

    The repaired batches keep their time axis and mask the reset rows
    (``("collector", "mask")``); their valid rows, env by env, are what is
    compared with the truth.

    Args:
        batches: the producer's ``[E, T]`` batches, in order.
        env: the producer.

    Returns:
        The valid rows, flat (each keeps its ``"env_id"``), or None where
        the batches are single steps ``[E]`` (raw loops: no rollout).
    """
    import warnings

    from cleanbuf.engine._errors import CleanbufWarning
    from cleanbuf.online._repair import RolloutRepair

    if batches[0].batch_dims != 2:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CleanbufWarning)
        repair = RolloutRepair.for_env(env)
        out = [repair(b) for b in batches]
        out.append(repair.flush())
    data = torch.cat([o for o in out if o is not None and o.batch_size[-1] > 0], dim=1)
    mask = data["collector", "mask"].reshape(data.batch_size)
    return torch.cat([data[e][mask[e]] for e in range(data.batch_size[0])])
