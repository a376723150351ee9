"""Oracle tests for same-step producers and observation-only data.

Each compares cleaned data with the explicit-reset run (Gymnasium
AutoresetMode.DISABLED, explicit partial resets, same seeds, deterministic
policy), row for row within each stream.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer

from cleanbuf import AutoresetFilter
from tests.loops import ENVS, run_loop, step_rows
from tests.oracle import (
    collect,
    compare_streams,
    make_env,
    push_left_policy,
    streams_from_batches,
    streams_from_rows,
)

N_ENVS, STEPS = 4, 60
DISABLED = gym.vector.AutoresetMode.DISABLED


def _oracle(env_key):
    name, kwargs, policy = ENVS[env_key]
    _, rows = run_loop(name, kwargs, policy, N_ENVS, STEPS, DISABLED)
    oracle = torch.stack(rows, dim=1)
    return {e: oracle[e] for e in range(N_ENVS)}


@pytest.mark.parametrize("env_key", list(ENVS))
def test_gymnasium_same_step_loop(env_key):
    """Gymnasium SAME_STEP, the terminal observation stored from
    info["final_obs"] by step_rows. Bugs caught: a done row keeping the reset
    observation as its next observation, a row dropped or added, the
    final-observation entry leaking into the buffer (key sets differ).
    """
    name, kwargs, policy = ENVS[env_key]
    venv = gym.make_vec(
        name,
        num_envs=N_ENVS,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        **kwargs,
    )
    filt = AutoresetFilter.for_env(venv)
    assert (filt.options.mode, filt.options.layout) == ("same_step", "step")
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=filt)
    run_loop(
        name, kwargs, policy, N_ENVS, STEPS, gym.vector.AutoresetMode.SAME_STEP, rb, with_info=True
    )
    stats = filt.stats
    assert stats["rows_out"] == len(rb) == N_ENVS * STEPS
    assert stats["next_obs_restitched"] == stats["episodes_completed"] > 0
    lost = compare_streams(streams_from_rows(rb[: len(rb)]), _oracle(env_key), min_rows=STEPS)
    assert lost == 0 == stats["terminal_obs_missing"]


def _make_cartpole():
    return gym.make("CartPole-v1")


@pytest.mark.slow  # SubprocVecEnv starts one process per env
def test_sb3_subproc_vec_env_loop():
    """Stable-Baselines3 SubprocVecEnv (spawn): the terminal observation is in
    infos[i]["terminal_observation"]. Bugs caught: the reset observation kept
    as the done row's next observation, the SB3 info list not read, a
    truncation flag lost.
    """
    from stable_baselines3.common.vec_env import SubprocVecEnv

    name, kwargs, policy = ENVS["CartPole-terminates"]
    venv = SubprocVecEnv([_make_cartpole] * N_ENVS, start_method="spawn")
    try:
        filt = AutoresetFilter.for_env(venv)
        assert (filt.options.mode, filt.options.layout) == ("same_step", "step")
        rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=filt)
        venv.seed(0)
        obs = venv.reset()
        for _ in range(STEPS):
            action = policy(obs)
            next_obs, reward, dones, infos = venv.step(action)
            rb.extend(step_rows(obs, action, next_obs, reward, dones, None, infos))
            obs = next_obs
    finally:
        venv.close()
    stats = filt.stats
    assert stats["next_obs_restitched"] == stats["episodes_completed"] > 0
    lost = compare_streams(
        streams_from_rows(rb[: len(rb)]), _oracle("CartPole-terminates"), min_rows=STEPS
    )
    assert lost == 0


@pytest.mark.parametrize("chunks", ["one step per call", "random [E, T] chunks"])
def test_observation_only_next_step_loop(chunks):
    """A Gymnasium NEXT_STEP loop that stores each observation once (no next
    observation). Bugs caught: a row emitted before its successor arrived
    (wrong next observation across a call boundary, in particular right
    after a done row), the reset row's observation (the terminal one) not
    used for the done row, a reset row kept, rows reordered across calls.
    """
    name, kwargs, policy = ENVS["CartPole-terminates"]
    _, rows = run_loop(name, kwargs, policy, N_ENVS, STEPS, gym.vector.AutoresetMode.NEXT_STEP)
    rows = [r.exclude(("next", "observation")) for r in rows]
    rng = np.random.default_rng(0)
    if chunks == "one step per call":
        filt = AutoresetFilter("next_step", layout="step", observation_keys=["observation"])
        calls = rows
    else:
        filt = AutoresetFilter("next_step", observation_keys=["observation"])
        cuts = np.cumsum(rng.integers(1, 8, STEPS))
        bounds = [0, *cuts[cuts < STEPS].tolist(), STEPS]
        calls = [torch.stack(rows[a:b], dim=1) for a, b in zip(bounds[:-1], bounds[1:])]
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=filt)
    for call in calls:
        rb.extend(call)
    stats = filt.stats
    assert stats["rows_held"] == N_ENVS  # the last row of each stream waits
    assert stats["reset_rows_dropped"] > 0
    cleaned = streams_from_rows(rb[: len(rb)])
    lost = compare_streams(cleaned, _oracle("CartPole-terminates"), min_rows=40)
    assert lost == 0
    filt.flush(rb)
    assert len(rb) == stats["rows_in"] - stats["reset_rows_dropped"]
    assert filt.stats["next_obs_missing"] + filt.stats["terminal_obs_missing"] == N_ENVS


def test_torchrl_compact_obs_collector():
    """TorchRL GymEnv(num_envs=E) with Collector(compact_obs=True), filter from
    for_env(collector). Bugs caught: observation-only data mistaken for full
    transitions (no next observation in the buffer), the reset row's
    observation not used as the done row's terminal observation, a joint
    reset's lost terminal observation not marked.
    """
    env = make_env("CartPole-v1", 2)
    collector = Collector(
        env, push_left_policy, frames_per_batch=2 * 16, total_frames=2 * 16 * 10, compact_obs=True
    )
    filt = AutoresetFilter.for_env(collector)
    assert filt.options.observation_keys == (("observation",),)
    assert "compact_obs" in repr(filt)
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=filt)
    for batch in collector:
        assert ("next", "observation") not in batch.keys(True, True)
        rb.extend(batch)
    collector.shutdown()
    stats = filt.stats
    assert stats["reset_rows_dropped"] > 0 and stats["terminal_obs_missing"] > 0
    oracle = streams_from_batches(collect(make_env("CartPole-v1", 2, disabled=True), 32, 320))
    rows = rb[: len(rb)]
    assert ("next", "observation") in rows.keys(True, True)
    lost = compare_streams(streams_from_rows(rows), oracle, min_rows=100, subset=True)
    assert lost == stats["terminal_obs_missing"]
