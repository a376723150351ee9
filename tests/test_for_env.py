"""AutoresetFilter.for_env: the configuration read from each kind of producer."""

from __future__ import annotations

import gymnasium as gym
from torchrl.envs import GymEnv, GymWrapper, SerialEnv

from cleanbuf import AutoresetFilter
from tests.batches import next_step_batch


def test_disabled_mode_passes_through():
    """Bug caught: clean data altered (rows dropped) in disabled mode."""
    batch = next_step_batch(2, 12, 1)
    filt = AutoresetFilter("disabled")
    out = filt.inv(batch)
    assert (out == batch.reshape(-1)).all()
    assert filt.stats["rows_in"] == filt.stats["rows_out"] == 24


def test_for_env_producers():
    """for_env reads each producer's behaviour. Bugs caught: TorchRL's joint
    reset flavour not set for GymEnv(num_envs), the reset group of a batched
    env of vectorized workers taken as all envs, a TorchRL wrapper that
    already repairs its data (DISABLED / SAME_STEP underneath) cleaned again,
    a Gymnasium vector env's mode ignored.
    """
    env = GymEnv("CartPole-v1", num_envs=2)
    filt = AutoresetFilter.for_env(env)
    assert (filt.options.mode, filt.options.joint_reset, filt.options.reset_group_size) == (
        "next_step",
        True,
        None,
    )
    env.close()

    serial = SerialEnv(2, lambda: GymEnv("CartPole-v1", num_envs=3))
    filt = AutoresetFilter.for_env(serial)
    assert (filt.options.joint_reset, filt.options.reset_group_size) == (True, 3)
    assert "SerialEnv" in repr(filt)
    serial.close(raise_if_closed=False)

    single = SerialEnv(2, lambda: GymEnv("CartPole-v1"))
    assert AutoresetFilter.for_env(single).options.mode == "disabled"

    for mode, expected in [("DISABLED", "disabled"), ("SAME_STEP", "disabled")]:
        venv = gym.make_vec(
            "CartPole-v1",
            num_envs=2,
            vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": getattr(gym.vector.AutoresetMode, mode)},
        )
        filt = AutoresetFilter.for_env(GymWrapper(venv))
        assert filt.options.mode == expected
        assert "TorchRL repairs it" in repr(filt)

    same = gym.make_vec(
        "CartPole-v1",
        num_envs=2,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    assert AutoresetFilter.for_env(same).options.mode == "same_step"
    assert AutoresetFilter.for_env(same, layout=None).options.layout is None


def test_mode_accepts_gymnasium_enum():
    """Bug caught: AutoresetMode.NEXT_STEP rejected or mapped to another mode."""
    assert AutoresetFilter(gym.vector.AutoresetMode.NEXT_STEP).options.mode == "next_step"
    assert AutoresetFilter(gym.vector.AutoresetMode.DISABLED).options.mode == "disabled"


def test_for_env_sb3_dummy_vec_env():
    """Bug caught: an SB3 VecEnv (same-step, terminal observation in infos)
    configured as next-step, which would drop its real transitions.
    """
    from stable_baselines3.common.vec_env import DummyVecEnv

    venv = DummyVecEnv([lambda: gym.make("CartPole-v1")] * 2)
    filt = AutoresetFilter.for_env(venv)
    assert (filt.options.mode, filt.options.layout) == ("same_step", "step")
    assert "Stable-Baselines3" in repr(filt)


def _three_cartpoles():
    return GymEnv("CartPole-v1", num_envs=3)


def test_for_env_parallel_env_of_vectorized_workers():
    """ParallelEnv of GymEnv(num_envs=3) workers: batch [2, 3], each worker
    resets its 3 envs jointly. Bug caught: the reset group taken as all 6
    envs (then a joint reset of one worker is read as partial, and its next
    real transition dropped) or as single envs.
    """
    from torchrl.envs import ParallelEnv

    env = ParallelEnv(2, _three_cartpoles)
    try:
        filt = AutoresetFilter.for_env(env)
    finally:
        env.close(raise_if_closed=False)
    assert (filt.options.mode, filt.options.joint_reset, filt.options.reset_group_size) == (
        "next_step",
        True,
        3,
    )
    assert "ParallelEnv" in repr(filt)
