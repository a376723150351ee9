"""Cleaned transitions as a Minari dataset: whole episodes, final observations restored.

A Minari dataset (Farama's offline-RL format, which TorchRL reads as
``MinariExperienceReplay``) is a list of episodes, each with ``T + 1``
observations (the first and the final one) and ``T`` actions, rewards,
terminations and truncations. :func:`to_minari` reads what ``cleanbuf
clean`` reads, cleans it as ``cleanbuf clean`` would (the options the
audit found, or those given), cuts each env's cleaned rows into episodes
at their ends and writes them with Minari.

Core rule: an episode is exported as complete only when its final
observation is in the data. Where the producer lost it for good (a TorchRL
joint reset, a same-step producer that never stored it, a done row at the
end of the data whose reset row was never collected), the episode ends one
step earlier, as truncated, at the last observation the data holds
(``lost_final="shorten"``, the default), or is left out
(``lost_final="drop"``); the report counts both. An episode that did not
end in the data (the last one of each env, or one cut by a restart of its
env) is exported as truncated, or left out with ``unfinished="drop"``.

Observations that are not floating point (pixels, discrete states) are
cleaned as floats that hold their values exactly, so that a lost one can
be marked NaN, and exported in their own dtype. Only the entries an
episode holds go through the clean (``observation``, ``action``, the
reward, the flags and the bookkeeping); the cleaned rows are held in
memory until they are written.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import tempfile
import warnings
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from cleanbuf.engine._errors import InputError, TerminalObservationLostError
from cleanbuf.engine._keys import FINAL_KEYS
from cleanbuf.offline._audit import Report
from cleanbuf.offline._formats import Dataset, Shape, read

EXTRA = "pip install 'cleanbuf[minari]'"
LOST_FINAL = ("shorten", "drop", "raise")
UNFINISHED = ("truncate", "drop")
OBS, NEXT_OBS, ACTION = ("observation",), ("next", "observation"), ("action",)
TRAJ = ("collector", "traj_ids")
# Root entries an export keeps (their "next" twins too, and the reward and final entries).
ROOT_KEPT = ("observation", "action", "done", "terminated", "truncated", "is_init", "step_count",
             "collector")  # fmt: skip
# Minari warns at every call for each metadata entry left out; the report lists them once.
METADATA = ("author", "author_email", "algorithm_name", "code_permalink", "description")


def import_minari() -> Any:
    """The ``minari`` module, or an error naming the extra to install.

    Raises:
        InputError: minari (or h5py, its default storage) is not installed.
    """
    try:
        import h5py  # noqa: F401  (Minari's default storage; a clear error now, not mid-write)
        import minari
    except ImportError as err:
        raise InputError(
            f"exporting a Minari dataset needs minari and h5py ({err}); {EXTRA} installs them."
        ) from err
    return minari


@dataclasses.dataclass
class Export:
    """What :func:`to_minari` wrote, and what it left out.

    Attributes:
        dataset_id: the Minari dataset's id; path: where it is
            (``minari.load_dataset(dataset_id)`` loads it).
        source: the data exported; audit: its audit (what the producer
            did); stats: the cleaner's counters.
        rows: the cleaned rows; steps: the steps exported (so ``rows ==
            steps + steps_left_out``).
        episodes: the episodes exported, env after env, each env's in
            time order; episode_envs: each one's env.
        terminated, truncated: exported episodes that ended so in the data
            (the producer's flags, as they were set).
        unfinished: episodes that had not ended when the data ends (or
            whose env restarted), exported as truncated;
            unfinished_dropped: those left out (``unfinished="drop"``).
        lost_shortened: episodes whose final observation is lost, exported
            one step shorter, as truncated; lost_dropped: those left out
            (``lost_final="drop"``, or a one-step episode).
        restarts: of the unfinished episodes, those cut by a restart of
            their env (not at the end of the data).
        started_before: episodes whose first steps the data no longer
            holds (a buffer that wrapped overwrote them, or the first row
            of an env's data is not marked ``is_init``): left out, never
            exported as if they began there.
        env: the env id recorded (``recover_environment()`` builds it), or
            None; missing_metadata: the metadata entries left out.
    """

    dataset_id: str
    path: str
    source: str
    audit: Report
    stats: dict
    rows: int = 0
    steps: int = 0
    steps_left_out: int = 0
    episodes: int = 0
    episode_envs: list = dataclasses.field(default_factory=list, repr=False)
    terminated: int = 0
    truncated: int = 0
    unfinished: int = 0
    unfinished_dropped: int = 0
    lost_shortened: int = 0
    lost_dropped: int = 0
    restarts: int = 0
    started_before: int = 0
    env: str | None = None
    missing_metadata: list = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        """The counts as plain values (what ``cleanbuf export --json`` prints)."""
        out = dataclasses.asdict(self)
        out["audit"] = self.audit.to_dict()
        del out["episode_envs"]
        return out

    def __str__(self) -> str:
        a, s = self.audit, self.stats
        if a.clean:
            found = f"clean ({a.mode}): exported as stored"
        else:
            found = (
                f"{a.mode}{', joint resets' if a.joint_reset else ''}: cleaned, "
                f"{s['reset_rows_dropped']} reset rows dropped, "
                f"{s['next_obs_restitched']} terminal observations restored"
            )
        lost_how = "one step shorter, as truncated"
        lines = [
            f"cleanbuf export: {self.source} -> Minari dataset {self.dataset_id}",
            f"  source            {found}",
            f"  rows              {s['rows_in']} stored, {self.rows} once cleaned: "
            f"{self.steps} exported as steps, {self.steps_left_out} left out",
            f"  episodes          {self.episodes} exported",
            f"    ended           {self.terminated} terminated, {self.truncated} truncated "
            "(as the producer set them)",
            f"    unfinished      {self.unfinished} exported as truncated, "
            f"{self.unfinished_dropped} left out ({self.restarts} cut by an env restart)",
            f"    final obs lost  {self.lost_shortened} exported {lost_how}, "
            f"{self.lost_dropped} left out",
            f"    cut at start    {self.started_before} left out (begun before the oldest "
            "row the data holds)",
            f"  env               {self.env or 'none recorded (recover_environment() fails)'}",
            f"  path              {self.path}",
        ]
        if self.missing_metadata:
            lines.append(f"  metadata missing  {', '.join(self.missing_metadata)}")
        return "\n".join(lines)


@dataclasses.dataclass
class _Episode:
    """One episode's rows (positions in the cleaned rows) and how it ends."""

    env: int
    rows: np.ndarray
    final: tuple  # where its final observation is: ("next_obs" or "obs", row)
    terminated: bool
    truncated: bool


def to_minari(
    data: Any,
    dataset_id: str,
    *,
    env: Any = None,
    max_episode_steps: int | None = None,
    eval_env: Any = None,
    author: str | None = None,
    author_email: str | None = None,
    algorithm_name: str | None = None,
    code_permalink: str | None = None,
    description: str | None = None,
    requirements: list | None = None,
    observation_space: Any = None,
    action_space: Any = None,
    lost_final: str = "shorten",
    unfinished: str = "truncate",
    force: bool = False,
    jpeg_encoding: bool = False,
    mode: str | None = None,
    joint_reset: bool | str | None = None,
    layout: str | None = None,
    envs: int | None = None,
    keys: dict | None = None,
    check_reset_rows: bool = True,
) -> Export:
    """Exports auto-reset data as a Minari dataset of the explicit-reset run's episodes.

    The data is read and audited as ``cleanbuf clean`` reads it, cleaned
    with what the audit found (clean data passes as it is), and each env's
    rows are cut into episodes at their ends: one Minari episode per env
    per episode, ``T + 1`` observations (the final one restored), ``T``
    actions, rewards, terminations and truncations as the producer set
    them. Episodes are written env after env, each env's in time order.

    Args:
        data: whatever :func:`cleanbuf.clean` takes: a path (an
            ``rb.dumps`` directory, a TensorDict memmap directory, a
            ``.npz`` or HDF5 file), a TorchRL ``ReplayBuffer`` or storage, a
            dict of arrays or a TensorDict (``[N]``, ``[T, E]`` or ``[E,
            T]``), a Stable-Baselines3 ``ReplayBuffer``.
        dataset_id: the Minari id, ``(namespace/)(env_name/)name-vN``.
        env: the Gymnasium env id (or ``EnvSpec``, or env) the data came
            from: recorded so that ``dataset.recover_environment()``
            works, and its spaces are the dataset's (one-hot actions of a
            ``Discrete`` space become indices). None: no env recorded, the
            spaces read from the data (or given).
        max_episode_steps: the time limit of the recorded env, where the
            data was collected with another than the registered one.
        eval_env: Minari's evaluation env (id or spec), if another.
        author: the dataset's author (Minari metadata), as the others:
        author_email: contact.
        algorithm_name: the algorithm that collected the data.
        code_permalink: a link to the code that collected it.
        description: a description of the dataset.
        requirements: pip requirements to recover the env.
        observation_space: the observation space, instead of the env's
            or the one read from the data.
        action_space: the action space, likewise.
        lost_final: an episode whose final observation is lost for good:
            ``"shorten"`` (end it one step earlier, as truncated, at the
            last observation the data holds), ``"drop"`` (leave it out),
            or ``"raise"``.
        unfinished: an episode that has not ended when its env's rows end
            (or whose env restarted): ``"truncate"`` (exported as
            truncated) or ``"drop"``.
        force: replace a local dataset with the same id.
        jpeg_encoding: Minari's lossy JPEG encoding of image spaces (off:
            the observations are stored as they are).
        mode: the producer's mode; None: what the audit found.
        joint_reset: TorchRL ``GymEnv`` joint resets (True / "yes", False
            / "no"); None: what the audit found.
        layout: ``"time_first"``, ``"time_last"`` or ``"flat"``; None: read
            from the data.
        envs: with ``layout="flat"``, the number of envs.
        keys: ``{role: name}`` for arrays named otherwise.
        check_reset_rows: as for :class:`cleanbuf.AutoresetFilter`.

    Returns:
        An :class:`Export` (``print`` it for the report);
        ``minari.load_dataset(dataset_id)`` loads the dataset.

    Raises:
        InputError: minari is not installed (the message names the extra),
            a bad option, a dataset id that exists (without ``force``), or
            data whose arrays do not fit the env's spaces.
        TerminalObservationLostError: ``lost_final="raise"`` and an
            episode's final observation is lost.
        CleanbufError: data the clean refuses (named, with the fix).

    Examples:
        >>> import os, tempfile
        >>> import numpy as np
        >>> os.environ["MINARI_DATASETS_PATH"] = tempfile.mkdtemp()
        >>> column = lambda *v: np.array(v, np.float32)[:, None]
        >>> data = {  # one env: an episode of 3 steps, its reset row, a second one
        ...     "obs": column(0, 1, 2, 3, 10, 11), "next_obs": column(1, 2, 3, 10, 11, 12),
        ...     "actions": np.zeros((6, 1), np.float32),
        ...     "rewards": np.array([1.0, 1, 1, 0, 1, 1], np.float32),
        ...     "terminations": np.array([0, 0, 1, 0, 0, 0], bool),
        ...     "truncations": np.zeros(6, bool),
        ... }
        >>> done = to_minari(data, "demo/example-v0", layout="flat", envs=1, author="me")
        >>> done.episodes, done.terminated, done.unfinished
        (2, 1, 1)
        >>> import minari
        >>> first = minari.load_dataset("demo/example-v0")[0]
        >>> first.observations.ravel().tolist(), first.terminations.tolist()
        ([0.0, 1.0, 2.0, 3.0], [False, False, True])
        >>> del os.environ["MINARI_DATASETS_PATH"]
    """
    minari = import_minari()
    _check_choice("lost_final", lost_final, LOST_FINAL)
    _check_choice("unfinished", unfinished, UNFINISHED)
    _check_id(minari, dataset_id, force)
    spec, env_spaces = _env_spec(env, max_episode_steps)
    options = {k: v for k, v in (("mode", mode), ("joint_reset", joint_reset)) if v is not None}
    if not check_reset_rows:
        options["check_reset_rows"] = False
    shape = Shape(layout, envs, keys)
    with tempfile.TemporaryDirectory(prefix="cleanbuf-") as tmp:
        ds, name = _dataset(data, shape, os.path.join(tmp, "dump"))
        cleaned, dtypes = _clean(ds, options)
    rows, env_of = cleaned.rows, np.asarray(cleaned.env)
    arrays = _arrays(rows)
    arrays["obs"], arrays["obs_dtypes"] = _retype(arrays["obs"], dtypes), dtypes  # (never NaN)
    done = Export(dataset_id, "", name, cleaned.report, dict(cleaned.stats), rows=len(env_of))
    episodes = _episodes(arrays, env_of, lost_final, unfinished, done)
    obs_space = observation_space or env_spaces[0] or _infer(arrays["obs"], "observation")
    act_space = action_space or env_spaces[1] or _infer(arrays["action"], "action")
    buffers = [_buffer(arrays, ep, obs_space, act_space) for ep in episodes]
    done.episode_envs = [ep.env for ep in episodes]
    metadata = {
        "author": author,
        "author_email": author_email,
        "algorithm_name": algorithm_name,
        "code_permalink": code_permalink,
        "description": description,
    }
    done.missing_metadata = [k for k in METADATA if metadata[k] is None]
    if force:  # only now: every check on the data has passed
        shutil.rmtree(minari.storage.get_dataset_path(dataset_id), ignore_errors=True)
    _write(minari, dataset_id, buffers, spec, eval_env, obs_space, act_space, metadata,
           requirements, jpeg_encoding)  # fmt: skip
    done.path = os.fspath(minari.storage.get_dataset_path(dataset_id))
    done.env = None if spec is None else spec.id
    return done


def _check_choice(name: str, value: str, choices: tuple) -> None:
    if value not in choices:
        raise InputError(f"{name}={value!r}: pass one of {', '.join(map(repr, choices))}.")


def _check_id(minari: Any, dataset_id: str, force: bool) -> None:
    """Refuses a malformed id, or one that exists locally (without ``force``), before work."""
    if not isinstance(dataset_id, str) or not dataset_id:
        raise InputError(f"dataset_id={dataset_id!r}: pass a Minari id, e.g. 'cartpole/mine-v0'.")
    try:
        from minari.dataset.minari_dataset import parse_dataset_id

        parse_dataset_id(dataset_id)
    except (ValueError, TypeError) as err:  # (TypeError: Minari's parse of an id without -vN)
        raise InputError(
            f"dataset_id {dataset_id!r} is not a Minari id ({err}); the form is "
            "(namespace/)(env_name/)name-vN, e.g. 'cartpole/mine-v0'."
        ) from err
    root = os.environ.get("MINARI_DATASETS_PATH")
    if root is not None and not os.path.isabs(root):
        raise InputError(
            f"MINARI_DATASETS_PATH={root!r} is a relative path, which Minari 0.5 cannot write "
            "to (it joins the path twice); set it to an absolute path (os.path.abspath)."
        )
    if not force and os.path.exists(minari.storage.get_dataset_path(dataset_id)):
        raise InputError(
            f"a Minari dataset {dataset_id!r} exists already "
            f"({minari.storage.get_dataset_path(dataset_id)}); pick another id (or version), "
            "or pass force=True (--force) to replace it."
        )


def _env_spec(env: Any, max_episode_steps: int | None) -> tuple[Any, tuple]:
    """The env's spec (recorded) and its (observation, action) spaces; Nones without one."""
    if env is None:
        if max_episode_steps is not None:
            raise InputError("max_episode_steps is for the env recorded: pass env= (--env) too.")
        return None, (None, None)
    import gymnasium as gym
    from gymnasium.envs.registration import EnvSpec

    if isinstance(env, str):
        try:
            spec = gym.spec(env)
        except gym.error.Error as err:
            raise InputError(
                f"env {env!r} is not a registered Gymnasium env ({err}); pass the id the data "
                "was collected with (import the package that registers it first)."
            ) from err
    elif isinstance(env, EnvSpec):
        spec = env
    elif isinstance(env, gym.Env) and env.spec is not None:
        spec = env.spec
    else:
        raise InputError(
            f"env={type(env).__name__}: pass a Gymnasium env id (a str), an EnvSpec, or a "
            "gymnasium.Env made by gym.make (it has a spec)."
        )
    if max_episode_steps is not None:
        spec = dataclasses.replace(spec, max_episode_steps=max_episode_steps)
    probe = gym.make(spec)
    try:
        return spec, (probe.observation_space, probe.action_space)
    finally:
        probe.close()


def _dataset(data: Any, shape: Shape, tmp: str) -> tuple[Dataset, str]:
    """The data as a :class:`Dataset`, and its name for the report."""
    from cleanbuf.offline._sources import dataset

    if isinstance(data, Dataset):
        return data, data.path
    if isinstance(data, (str, os.PathLike)):
        return read(os.fspath(data), shape), os.fspath(data)
    ds, name, _ = dataset(data, shape, tmp)
    return ds, name


def _clean(ds: Dataset, options: dict) -> tuple[Any, dict]:
    """The cleaned rows, lost terminal observations marked NaN; the observations' dtypes.

    Observations that are not floating point are cleaned as floats (exact
    for the integers they hold) so that a lost one can be marked, and get
    their dtype back when exported (:func:`_retype`). The cleaner's other
    policies would not do here: ``drop`` removes the done row (its episode
    would run into the next one), ``keep`` stores a zero or a reset
    observation as the final one.

    Returns:
        ``(cleaned, dtypes)``: the :class:`~cleanbuf.offline.Cleaned`, and
        per observation leaf cast (its key inside ``observation``), its
        numpy dtype.
    """
    from cleanbuf.offline._clean_files import clean_dataset

    # Only what an episode holds goes through: other observation keys (pixels beside
    # the observation, user keys) would be cleaned, marked and held for nothing.
    data = ds.data.select(*(k for k in ds.data.keys(True, True) if _exported(k)))
    casts = {
        k: v.dtype for k, v in data.items(True, True) if _is_obs(k) and not v.is_floating_point()
    }
    for key in casts:
        data.set(key, _as_float(data.get(key), key))
    # No names and dtypes to give back: the rows stay under TorchRL's keys, flags as bool.
    ds = dataclasses.replace(ds, data=data, names={}, casts={})
    cleaned = clean_dataset(ds, None, on_lost_terminal_obs="nan", **options)
    dtypes = {
        _key(k)[len(OBS) :]: torch.empty(0, dtype=dt).numpy().dtype
        for k, dt in casts.items()
        if _key(k)[: len(OBS)] == OBS
    }
    return cleaned, dtypes


def _as_float(t: torch.Tensor, key: Any) -> torch.Tensor:
    """An integer (or boolean) observation as floats that hold each value exactly."""
    if t.dtype in (torch.bool, torch.uint8, torch.int8, torch.int16):
        return t.to(torch.float32)
    big = int(t.abs().max()) if t.numel() else 0
    if big >= 2**53:
        raise InputError(
            f"observation {'/'.join(_key(key))} ({t.dtype}) holds {big}, which float64 does "
            "not hold exactly; lost terminal observations cannot be marked. Export "
            "observations under 2**53."
        )
    return t.to(torch.float64)


def _exported(key: Any) -> bool:
    """A key the export reads or the clean needs: observation, action, reward, flags, bookkeeping.

    Examples:
        >>> [_exported(k) for k in ("action", ("next", "pixels"), ("next", "_final_obs"))]
        [True, False, True]
    """
    key = _key(key)
    finals = {p[1] for p in FINAL_KEYS} | {"_" + p[1] for p in FINAL_KEYS}
    if key[0] == "next":
        return len(key) > 1 and (key[1] in finals or key[1] in (*ROOT_KEPT, "reward"))
    return key[0] in ROOT_KEPT


def _key(key: Any) -> tuple:
    return key if isinstance(key, tuple) else (key,)


def _is_obs(key: Any) -> bool:
    """An observation leaf: under ``observation``, ``("next", "observation")`` or a final entry."""
    key = _key(key)
    return any(key[: len(p)] == p for p in (OBS, NEXT_OBS, *FINAL_KEYS))


def _retype(tree: Any, dtypes: dict, path: tuple = ()) -> Any:
    """Observations cleaned as floats back in their own dtypes."""
    if isinstance(tree, dict):
        return {k: _retype(v, dtypes, (*path, k)) for k, v in tree.items()}
    return tree if path not in dtypes else tree.astype(dtypes[path])


def _arrays(rows: TensorDictBase) -> dict:
    """Numpy arrays per role: obs, next_obs (arrays or dicts), action, reward, flags."""

    def leaf(key: tuple, what: str) -> Any:
        value = rows.get(key, None)
        if value is None:
            raise InputError(f"the cleaned rows have no {what} ({'/'.join(key)}).")
        if isinstance(value, TensorDictBase):
            return {k: leaf((*key, k), what) for k in value.keys()}
        return value.numpy()

    n = rows.batch_size[0]

    def flag(key: tuple) -> np.ndarray | None:
        value = rows.get(key, None)
        return None if value is None else value.reshape(n, -1).any(-1).numpy()

    done, term, trunc = (flag(("next", k)) for k in ("done", "terminated", "truncated"))
    if done is None and term is None and trunc is None:
        raise InputError("the cleaned rows have no done, terminated or truncated flag.")
    trunc = np.zeros(n, bool) if trunc is None else trunc
    if term is None:
        term = (done if done is not None else np.zeros(n, bool)) & ~trunc  # SB3: dones|timeouts
    end = term | trunc | (done if done is not None else False)
    return {
        "obs": leaf(OBS, "observation"),
        "next_obs": leaf(NEXT_OBS, "next observation"),
        "action": leaf(ACTION, "action"),
        "reward": leaf(("next", "reward"), "reward").reshape(n, -1),
        "terminated": term,
        "truncated": trunc,
        "end": end,
        "traj": None if (traj := rows.get(TRAJ, None)) is None else traj.reshape(n).numpy(),
        "start": flag(("is_init",)),  # a collector's mark of an episode's first step
    }


def _tree_rows(tree: Any, fn) -> Any:
    return {k: _tree_rows(v, fn) for k, v in tree.items()} if isinstance(tree, dict) else fn(tree)


def _leaves(tree: Any) -> list:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    return [tree]


def _row_has_nan(tree: Any, n: int) -> np.ndarray:
    out = np.zeros(n, bool)
    for a in _leaves(tree):
        if np.issubdtype(a.dtype, np.floating):
            out |= np.isnan(a.reshape(n, -1)).any(-1)
    return out


def _chains(a: Any, b: Any, n: int) -> np.ndarray:
    """Per row pair, ``a[i] == b[i]`` in every leaf (NaN never equal)."""
    out = np.ones(n, bool)
    for x, y in zip(_leaves(a), _leaves(b)):
        out &= (x.reshape(n, -1) == y.reshape(n, -1)).all(-1)
    return out


def _episodes(arrays: dict, env_of: np.ndarray, lost_final: str, unfinished: str, done: Export):
    """Each env's rows cut into episodes; counts what is exported and left out in ``done``."""
    out: list[_Episode] = []
    n = len(env_of)
    lost = _row_has_nan(arrays["next_obs"], n)
    for e in np.unique(env_of):
        pos = np.flatnonzero(env_of == e)
        obs = _tree_rows(arrays["obs"], lambda a, p=pos: a[p])
        nxt = _tree_rows(arrays["next_obs"], lambda a, p=pos: a[p])
        # Within an episode, a row's next observation is the next row's observation
        # (and a collector's trajectory id stays); else the env restarted there.
        linked = _chains(_tree_rows(nxt, lambda a: a[:-1]), _tree_rows(obs, lambda a: a[1:]),
                         len(pos) - 1)  # fmt: skip
        end = arrays["end"][pos]
        if arrays["traj"] is not None:  # a collector's trajectory id: one per episode
            traj = arrays["traj"][pos]
            linked &= traj[1:] == traj[:-1]
        cut = np.flatnonzero(end[:-1] | ~linked)
        parts = np.split(pos, cut + 1)
        if _begun_before(arrays["start"], parts[0][0], done.audit.wrapped):
            done.started_before += 1
            done.steps_left_out += len(parts[0])
            parts = parts[1:]
        for i, rows in enumerate(parts):
            trailing = i == len(parts) - 1
            out.extend(_episode(int(e), rows, trailing, arrays, lost, lost_final, unfinished, done))
    return out


def _begun_before(start: np.ndarray | None, first: int, wrapped: bool) -> bool:
    """Whether an env's first episode in the data began before its first row.

    A row marked ``is_init`` begins one; without the mark, a buffer that
    wrapped has overwritten the start of each env's first episode.
    """
    return bool(not start[first]) if start is not None else wrapped


def _episode(env, rows, trailing, arrays, lost, lost_final, unfinished, done) -> list:
    """The episode of ``rows`` as exported (none, when it is left out); counted in ``done``."""
    last = rows[-1]
    term, trunc = bool(arrays["terminated"][last]), bool(arrays["truncated"][last])
    ended = bool(arrays["end"][last])
    if lost[last]:
        if lost_final == "raise":
            raise TerminalObservationLostError(
                f"env {env}: the episode of {len(rows)} steps ending at cleaned row {last} has "
                "lost its final observation for good; pass lost_final='shorten' (end it one "
                "step earlier, truncated) or 'drop'."
            )
        if lost_final == "drop" or len(rows) == 1:
            done.lost_dropped += 1
            done.steps_left_out += len(rows)
            return []
        done.lost_shortened += 1
        done.steps_left_out += 1
        done.steps += len(rows) - 1
        done.episodes += 1
        # The lost step goes; its observation (the step before's next one) ends the episode.
        return [_Episode(env, rows[:-1], ("obs", last), False, True)]
    if not ended:
        done.restarts += not trailing
        if unfinished == "drop":
            done.unfinished_dropped += 1
            done.steps_left_out += len(rows)
            return []
        done.unfinished += 1
        trunc = True
    else:
        done.terminated += term
        done.truncated += trunc and not term
    done.steps += len(rows)
    done.episodes += 1
    return [_Episode(env, rows, ("next_obs", last), term, trunc)]


def _buffer(arrays: dict, ep: _Episode, obs_space: Any, act_space: Any) -> Any:
    """One Minari ``EpisodeBuffer``: ``T + 1`` observations, ``T`` of the rest."""
    from minari.data_collector.episode_buffer import EpisodeBuffer

    rows = ep.rows
    source, row = ep.final
    final = _tree_rows(arrays[source], lambda a: a[row : row + 1])
    obs = _tree_rows(arrays["obs"], lambda a: a[rows])
    obs = _retype(_join(obs, final), arrays["obs_dtypes"])
    n = len(rows)
    terminations = np.zeros(n, bool)
    truncations = np.zeros(n, bool)
    terminations[-1], truncations[-1] = ep.terminated, ep.truncated
    reward = arrays["reward"][rows]
    if reward.shape[1] != 1:
        raise InputError(
            f"the reward has shape {list(reward.shape[1:])} per step; Minari stores one "
            "number per step. Export a scalar reward."
        )
    return EpisodeBuffer(
        observations=_fit(obs, obs_space, "observation"),
        actions=_fit(_tree_rows(arrays["action"], lambda a: a[rows]), act_space, "action"),
        rewards=reward[:, 0],
        terminations=terminations,
        truncations=truncations,
    )


def _join(a: Any, b: Any) -> Any:
    if isinstance(a, dict):
        return {k: _join(a[k], b[k]) for k in a}
    return np.concatenate([a, b])


def _infer(tree: Any, what: str) -> Any:
    """A space for data without an env: a ``Box`` per array (``Dict`` for a dict)."""
    from gymnasium import spaces

    if isinstance(tree, dict):
        return spaces.Dict({k: _infer(v, f"{what}[{k!r}]") for k, v in tree.items()})
    shape, dtype = tree.shape[1:], tree.dtype
    if np.issubdtype(dtype, np.floating):
        return spaces.Box(-np.inf, np.inf, shape, dtype)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return spaces.Box(info.min, info.max, shape, dtype)
    if dtype == np.bool_:
        return spaces.MultiBinary(list(shape) or [1])
    raise InputError(
        f"the {what} has dtype {dtype}, for which no space is read from the data; pass "
        f"env= or {what.split('[')[0]}_space=."
    )


def _fit(x: Any, space: Any, what: str) -> Any:
    """``x`` (``[T, ...]`` arrays) as ``space`` holds it; an error where it cannot be.

    Fitted: a dict to a ``Dict`` space key by key; ``[T, 1]`` or one-hot
    ``[T, n]`` to ``Discrete(n)`` indices; ``[T, *s]`` to a ``Box`` of shape
    ``s`` (same size) and dtype (when no value changes).
    """
    from gymnasium import spaces

    if isinstance(space, spaces.Dict):
        if not isinstance(x, dict) or set(x) != set(space.spaces):
            got = sorted(x) if isinstance(x, dict) else f"an array {list(x.shape[1:])}"
            raise InputError(
                f"the {what} space is a Dict of {sorted(space.spaces)}; the data holds {got}. "
                "Pass the env (or the space) the data was collected with."
            )
        return {k: _fit(x[k], space[k], f"{what}[{k!r}]") for k in space.spaces}
    if isinstance(x, dict):
        raise InputError(
            f"the {what} is a dict of {sorted(x)}, the space {space}; pass a Dict space "
            "(or the env the data was collected with)."
        )
    if isinstance(space, spaces.Discrete):
        return _discrete(x, space, what)
    if isinstance(space, spaces.Box):
        return _box(x, space, what)
    return x


def _discrete(x: np.ndarray, space: Any, what: str) -> np.ndarray:
    n = int(space.n)
    if x.ndim == 2 and x.shape[1] == n and n > 1:
        one_hot = ((x == 0) | (x == 1)).all() and (x.sum(1) == 1).all()
        if not one_hot:
            raise InputError(
                f"the {what} has shape {list(x.shape[1:])} for a Discrete({n}) space but is "
                "not one-hot; pass the env (or the space) the data was collected with."
            )
        return x.argmax(1).astype(np.int64) + int(space.start)
    if x.ndim == 2 and x.shape[1] == 1:
        x = x[:, 0]
    y = x.astype(np.int64)
    if x.ndim != 1 or not np.array_equal(y, x):
        raise InputError(
            f"the {what} has shape {list(x.shape[1:])} and dtype {x.dtype}, which a "
            f"Discrete({n}) space does not hold (one integer, or a one-hot [{n}], per step)."
        )
    return y


def _box(x: np.ndarray, space: Any, what: str) -> np.ndarray:
    shape = tuple(space.shape)
    if tuple(x.shape[1:]) != shape:
        if math.prod(x.shape[1:]) != math.prod(shape):
            raise InputError(
                f"the {what} has shape {list(x.shape[1:])} per step; the space {space} holds "
                f"{list(shape)}. Pass the env (or the space) the data was collected with."
            )
        x = x.reshape(len(x), *shape)
    if x.dtype != space.dtype:
        y = x.astype(space.dtype)
        if not np.array_equal(y.astype(x.dtype), x, equal_nan=np.issubdtype(x.dtype, np.floating)):
            raise InputError(
                f"the {what} has dtype {x.dtype}; the space {space} holds {space.dtype}, and "
                "casting would change values. Pass the space the data was collected with."
            )
        x = y
    return x


def _write(minari, dataset_id, buffers, spec, eval_env, obs_space, act_space, metadata,
           requirements, jpeg_encoding) -> None:  # fmt: skip
    """Writes the dataset with Minari; nothing is left at its path when that fails."""
    if not buffers:
        raise InputError(
            "no episode to export: every episode was left out (see lost_final= and "
            "unfinished=), or the data holds no rows."
        )
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`\w+` is set to None")
            warnings.filterwarnings("ignore", message="env_spec is None")
            minari.create_dataset_from_buffers(
                dataset_id,
                buffers,
                env=spec,
                eval_env=eval_env,
                observation_space=obs_space,
                action_space=act_space,
                requirements=requirements,
                jpeg_encoding=jpeg_encoding,
                **metadata,
            )
    except BaseException:
        shutil.rmtree(minari.storage.get_dataset_path(dataset_id), ignore_errors=True)
        raise
