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
