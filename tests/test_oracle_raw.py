"""Oracle tests for raw vector-env loops that extend the buffer one [E] step at a time.

A Gymnasium NEXT_STEP loop, cleaned with layout="step", must equal the same
loop in AutoresetMode.DISABLED with explicit partial resets. EnvPool (next
step, no disabled mode) is checked for its invariants instead.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

from cleanbuf import AutoresetFilter
from tests.loops import ENVS, run_loop, step_rows
from tests.oracle import compare_streams, streams_from_rows


@pytest.mark.parametrize("env_key", list(ENVS))
def test_gymnasium_next_step_loop_matches_explicit_resets(env_key):
    """Bugs caught: a reset row stored (rows shift against the oracle), the
    done row's next observation not the terminal one, a done row held forever
    or stored twice, a truncation at the same step in every env mistaken for
    a joint reset (raw loops always emit reset rows).
    """
    name, kwargs, policy = ENVS[env_key]
    n_envs, steps = 4, 60
    _, oracle_rows = run_loop(
        name, kwargs, policy, n_envs, steps, gym.vector.AutoresetMode.DISABLED
    )
    oracle = torch.stack(oracle_rows, dim=1)
    venv = gym.make_vec(name, num_envs=n_envs, vectorization_mode="sync", **kwargs)
    filt = AutoresetFilter.for_env(venv)
    assert filt.options.layout == "step"
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=filt)
    run_loop(name, kwargs, policy, n_envs, steps, gym.vector.AutoresetMode.NEXT_STEP, rb)
    filt.flush(rb)
    stats = filt.stats
    assert stats["reset_rows_dropped"] > 0
    assert stats["terminal_obs_missing"] == 0
    assert len(rb) == stats["rows_out"] == stats["rows_in"] - stats["reset_rows_dropped"]
    lost = compare_streams(
        streams_from_rows(rb[: len(rb)]), {e: oracle[e] for e in range(n_envs)}, min_rows=40
    )
    assert lost == 0


def test_envpool_next_step_loop():
    """EnvPool CartPole in its default (next-step) mode. Bugs caught: a reset
    row left in the buffer (EnvPool marks it with elapsed_step == 0 after the
    first reset), a raw row lost or duplicated, a done row not paired with
    the terminal observation EnvPool returned at that step, a non-done row
    whose next observation is not the following row's observation.
    """
    envpool = pytest.importorskip("envpool")
    n_envs, steps = 4, 80
    env = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=n_envs, seed=0)
    filt = AutoresetFilter.for_env(env)
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=filt)
    obs, _ = env.reset()
    n_reset_rows, terminal = 0, {}
    for _ in range(steps):
        action = np.zeros(n_envs, np.int64)
        next_obs, reward, terminated, truncated, info = env.step(action)
        is_reset = info["elapsed_step"] == 0
        n_reset_rows += int(is_reset.sum())
        for e in np.flatnonzero(terminated | truncated):
            terminal[(e, float(obs[e, 0]))] = next_obs[e].copy()
        rb.extend(step_rows(obs, action, next_obs, reward, terminated, truncated))
        obs = next_obs
    filt.flush(rb)
    stats = filt.stats
    assert n_reset_rows > 0
    assert stats["reset_rows_dropped"] == n_reset_rows
    assert stats["rows_in"] == n_envs * steps
    assert len(rb) == stats["rows_out"] == n_envs * steps - n_reset_rows
    assert stats["terminal_obs_missing"] == 0
    rows = streams_from_rows(rb[: len(rb)])
    n_done = 0
    for e, s in rows.items():
        obs_s, nobs_s = s["observation"], s["next", "observation"]
        done = s["next", "done"].reshape(-1)
        assert (s["next", "reward"][~done] == 1).all()  # no reward-0 reset rows kept
        cont = ~done[:-1]
        assert torch.equal(nobs_s[:-1][cont], obs_s[1:][cont])
        for i in torch.nonzero(done).flatten().tolist():
            key = (e, float(obs_s[i, 0]))
            assert torch.equal(nobs_s[i], torch.as_tensor(terminal[key]))
            n_done += 1
    assert n_done == len(terminal) > 0


@pytest.mark.parametrize("env_key", list(ENVS))
def test_time_first_rollouts_match_explicit_resets(env_key):
    """A raw loop that stacks its steps ``[T, E]`` (CleanRL's rollout) and
    extends the buffer with each rollout, ``layout="time_first"``. Bugs
    caught: a time-first batch read with time last (envs taken for steps:
    reset rows kept, rows of one env mixed with another's), a done row at a
    rollout's end held forever or its terminal observation lost across the
    rollout boundary, an odd last rollout ``[T', E]`` refused.
    """
    name, kwargs, policy = ENVS[env_key]
    n_envs, steps = 3, 50
    _, oracle_rows = run_loop(
        name, kwargs, policy, n_envs, steps, gym.vector.AutoresetMode.DISABLED
    )
    oracle = torch.stack(oracle_rows, dim=1)
    _, rows = run_loop(name, kwargs, policy, n_envs, steps, gym.vector.AutoresetMode.NEXT_STEP)
    filt = AutoresetFilter("next_step", layout="time_first")
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=filt)
    for start in range(0, steps, 16):  # rollouts of 16 steps, the last one of 2
        rb.extend(torch.stack(rows[start : start + 16], dim=0))
    filt.flush(rb)
    stats = filt.stats
    assert stats["reset_rows_dropped"] > 0 and stats["terminal_obs_missing"] == 0
    assert len(rb) == stats["rows_out"] == n_envs * steps - stats["reset_rows_dropped"]
    lost = compare_streams(
        streams_from_rows(rb[: len(rb)]), {e: oracle[e] for e in range(n_envs)}, min_rows=30
    )
    assert lost == 0


class _DictDrift(gym.Env):
    """Dict observations (a float position, an integer tick); ends at random (3% a step)."""

    metadata: dict = {}  # noqa: RUF012 - gymnasium's class attribute

    def __init__(self):
        self.observation_space = gym.spaces.Dict(
            {
                "pos": gym.spaces.Box(-np.inf, np.inf, (3,), np.float32),
                "tick": gym.spaces.Box(0, 1 << 20, (1,), np.int64),
            }
        )
        self.action_space = gym.spaces.Discrete(2)

    def _obs(self):
        return {"pos": self._pos.copy(), "tick": np.array([self._tick], np.int64)}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._tick, self._pos = 1, self.np_random.normal(size=3).astype(np.float32)
        return self._obs(), {}

    def step(self, action):
        self._tick += 1
        self._pos = (self._pos + self.np_random.normal(size=3)).astype(np.float32)
        return self._obs(), 1.0, bool(self.np_random.random() < 0.03), False, {}


def _dict_loop(n_envs, steps, mode):
    """A sync vector env of ``_DictDrift`` (40-step time limit): each step's rows ``[E]``.

    In DISABLED mode the done envs are reset explicitly (the oracle).
    """
    venv = gym.vector.SyncVectorEnv(
        [lambda: gym.wrappers.TimeLimit(_DictDrift(), 40)] * n_envs, autoreset_mode=mode
    )
    obs, _ = venv.reset(seed=0)
    rows = []
    for _ in range(steps):
        action = np.zeros(n_envs, np.int64)
        next_obs, reward, terminated, truncated, _ = venv.step(action)
        rows.append(step_rows(obs, action, next_obs, reward, terminated, truncated))
        obs, done = next_obs, terminated | truncated
        if mode == gym.vector.AutoresetMode.DISABLED and done.any():
            reset_obs, _ = venv.reset(options={"reset_mask": done})
            obs = {k: np.where(done[:, None], reset_obs[k], next_obs[k]) for k in next_obs}
    venv.close()
    return rows


@pytest.mark.parametrize("layout", ["step", "time_last"])
def test_dict_observations_at_user_size_match_explicit_resets(layout):
    """32 envs x 300 steps of a two-key Dict observation (float and int), a
    Gymnasium next-step loop, written one step at a time (``layout="step"``)
    or as ``[E, T]`` chunks of uneven length (1 to 108 steps), cleaned:
    equal to the explicit-reset run, row for row within each env.

    Bugs caught: the stream ends of a batch of several observation keys read
    from the wrong rows or joined wrongly (a continuity error on good data,
    or a mark or reset decided from another key's bytes), the carry's last
    next observations split back per key wrongly between calls (the next
    chunk refused), a stored terminal observation of one key taken for a
    zero-fill because the other key was read (a row held and lost), and a
    reset row kept at a chunk boundary.
    """
    n_envs, steps = 32, 300
    oracle_rows = _dict_loop(n_envs, steps, gym.vector.AutoresetMode.DISABLED)
    oracle = torch.stack(oracle_rows, dim=1)
    rows = _dict_loop(n_envs, steps, gym.vector.AutoresetMode.NEXT_STEP)
    filt = AutoresetFilter("next_step", layout="step" if layout == "step" else None)
    rb = ReplayBuffer(storage=LazyTensorStorage(20_000), transform=filt)
    if layout == "step":
        for td in rows:
            rb.extend(td)
    else:
        bounds = [0, 37, 101, 102, 192, 300]
        for a, b in zip(bounds[:-1], bounds[1:]):
            rb.extend(torch.stack(rows[a:b], dim=1))
    filt.flush(rb)
    stats = filt.stats
    assert stats["reset_rows_dropped"] > 100, "too few episode ends to show anything"
    assert stats["terminal_obs_missing"] == stats["next_obs_missing"] == 0
    assert len(rb) == stats["rows_out"] == n_envs * steps - stats["reset_rows_dropped"]
    lost = compare_streams(
        streams_from_rows(rb[: len(rb)]), {e: oracle[e] for e in range(n_envs)}, min_rows=250
    )
    assert lost == 0
