"""The oracle: the same env run with explicit resets, and a per-stream comparison.

Cleaned data must equal, row for row within each stream, what the same
environment produces under Gymnasium ``AutoresetMode.DISABLED`` with explicit
resets, same seeds, same deterministic policy.
"""

from __future__ import annotations

import functools

import gymnasium as gym
import torch
from torchrl.collectors import Collector
from torchrl.envs import Compose, GymEnv, GymWrapper, InitTracker, StepCounter, TransformedEnv

STREAM = "env_id"
TRAJ = ("collector", "traj_ids")


def push_left_policy(td):
    """Deterministic policy: always push left (CartPole ends in ~10 steps).

    It also writes each row's env index, so stored rows can be grouped by
    stream after the buffer has flattened them.
    """
    batch = td.batch_size
    action = torch.zeros(*batch, 2)
    action[..., 0] = 1.0
    td.set("action", action)
    td.set(STREAM, torch.arange(batch[-1]).expand(batch).clone())
    return td


def make_env(env_name, num_envs, max_episode_steps=None, disabled=False, trackers=True):
    """A TorchRL env with StepCounter and InitTracker (``trackers=False``: without).

    ``disabled=False``: ``GymEnv(name, num_envs=N)`` (next-step, joint reset).
    ``disabled=True``: ``GymWrapper`` over a Gymnasium sync vector env in
    ``AutoresetMode.DISABLED`` (explicit partial resets: the oracle).
    """
    kwargs = {} if max_episode_steps is None else {"max_episode_steps": max_episode_steps}
    if disabled:
        venv = gym.vector.SyncVectorEnv(
            [functools.partial(gym.make, env_name, **kwargs)] * num_envs,
            autoreset_mode=gym.vector.AutoresetMode.DISABLED,
        )
        base = GymWrapper(venv)
    else:
        base = GymEnv(env_name, num_envs=num_envs, **kwargs)
    env = TransformedEnv(base, Compose(StepCounter(), InitTracker())) if trackers else base
    env.set_seed(0)
    return env


def collect(env, frames_per_batch, total_frames, replay_buffer=None, policy=push_left_policy):
    """Runs a Collector; returns its batches (none when it writes to a buffer)."""
    collector = Collector(
        env,
        policy,
        frames_per_batch=frames_per_batch,
        total_frames=total_frames,
        replay_buffer=replay_buffer,
    )
    try:
        return [b.clone() for b in collector if b is not None]
    finally:
        collector.shutdown()


def streams_from_batches(batches):
    """Per-stream rows of collector batches [E, T]: {env: TensorDict [L]}."""
    data = torch.cat(batches, dim=1)
    return {e: data[e] for e in range(data.shape[0])}


def streams_from_rows(rows):
    """Per-stream rows of flat stored rows, storage order kept."""
    ids = rows[STREAM].reshape(-1)
    return {int(e): rows[ids == e] for e in ids.unique()}


def same_partition(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when two label sequences split the rows into the same groups in order."""
    a, b = a.reshape(-1), b.reshape(-1)
    return bool(((a[1:] != a[:-1]) == (b[1:] != b[:-1])).all())


class OracleMismatch(AssertionError):
    """Cleaned data differs from the explicit-reset run."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise OracleMismatch(message)


def compare_streams(cleaned: dict, oracle: dict, min_rows: int, subset: bool = False):
    """Asserts cleaned == oracle row for row within each stream.

    Lost terminal observations must be NaN in the cleaned data (and only on
    done rows); they are returned, counted, for the caller to check against
    the stats. Trajectory ids are compared as a partition (their numbering
    depends on the order in which episodes end across envs).

    Returns:
        The number of NaN-marked terminal observations in the compared rows.

    Args:
        cleaned: per stream, the cleaned rows.
        oracle: per stream, the explicit-reset rows.
        min_rows: the least number of rows each stream must have to compare.
        subset: compare the cleaned keys only (the cleaned data may lack
            keys, such as the ("next", ...) bookkeeping that
            ``Collector(compact_obs=True)`` drops); by default the key sets
            must be equal.

    Raises:
        OracleMismatch: the first difference found.
    """
    _check(set(cleaned) == set(oracle), f"streams {sorted(cleaned)} != {sorted(oracle)}")
    n_lost = 0
    for e in oracle:
        c, o = cleaned[e], oracle[e]
        n = min(len(c), len(o))
        _check(n >= min_rows, f"stream {e}: only {n} rows to compare")
        c, o = c[:n], o[:n]
        keys_c = set(c.keys(True, True))
        keys_o = set(o.keys(True, True))
        same_keys = keys_c <= keys_o if subset else keys_c == keys_o
        _check(same_keys, f"stream {e}: keys differ: {keys_c ^ keys_o}")
        for key in keys_c:
            if key == TRAJ:
                _check(same_partition(c[key], o[key]), f"stream {e}: trajectory ids")
                continue
            x, y = c[key], o[key]
            if key == ("next", "observation"):
                lost = torch.isnan(x).any(-1)
                ends = c.get(("next", "done"), c.get(("next", "terminated"), None))
                _check(bool(ends.reshape(-1)[lost].all()), f"stream {e}: NaN on a non-done row")
                n_lost += int(lost.sum())
                x, y = x[~lost], y[~lost]
            _check(
                torch.equal(x, y),
                f"stream {e}: key {key} differs at rows "
                + str((x != y).reshape(len(x), -1).any(-1).nonzero().flatten()[:10].tolist()),
            )
    return n_lost
