"""The private names cleanbuf leans on, and their public fallbacks (each side's ``_compat``).

The first test fails when a release of torch, tensordict or torchrl drops
one of them: the compat function then runs its fallback, which the other
tests check against the private path.
"""

from __future__ import annotations

import contextlib
import os
import sys
from unittest import mock

import gymnasium as gym
import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv, GymWrapper

from cleanbuf import AutoresetFilter, CleanbufError
from cleanbuf.engine import _compat as engine_compat
from cleanbuf.engine import _keys
from cleanbuf.offline import _compat as offline_compat
from cleanbuf.online import _compat as online_compat
from tests.oracle import push_left_policy


def test_the_private_names_are_there():
    """Bug caught: a dependency release that renamed or dropped a private
    name cleanbuf uses (the fallback would run silently, slower or with
    less information).
    """
    assert isinstance(TensorDict({"a": torch.zeros(1)}, [1])._tensordict, dict)
    assert callable(TensorDict._new_unsafe)
    assert callable(torch._C._storage_Use_Count)
    env = GymEnv("CartPole-v1", num_envs=2)
    assert env._is_batched and isinstance(env._env, gym.vector.VectorEnv)
    env.close()
    collector = Collector(
        GymEnv("CartPole-v1", num_envs=2),
        push_left_policy,
        frames_per_batch=4,
        total_frames=4,
        compact_obs=True,
    )
    assert ("next", "observation") in collector._compact_next_keys
    collector.shutdown()
    assert callable(sys._getframe)
    assert callable(getattr(LazyMemmapStorage, offline_compat.INIT))  # offline_compat.lay_out
    storage = LazyTensorStorage(8)
    storage.set(slice(0, 2), TensorDict({"a": torch.ones(2, 3)}, [2]))
    assert offline_compat.storage_tensors(storage).shape == (8,)  # every slot, not the filled
    rb = ReplayBuffer(storage=storage)
    assert online_compat.reports_writes(rb)  # RoundRobinWriter._mark_update_entities
    assert rb in online_compat.attached_entities(storage)  # storage._attached_entities
    assert isinstance(storage._len, int)  # online_compat.storage_length
    assert online_compat.storage_length(storage) == len(storage) == 2
    assert online_compat.stored_chunk_shape(storage) is None  # rows, not chunks


def test_fallbacks_match_the_private_paths():
    """Each fallback, with its private name hidden, gives what the private
    path gives. Bugs caught: a fallback that builds another TensorDict,
    misreads a batched GymWrapper as a single env, or reuses a buffer it
    cannot prove free.
    """
    td = TensorDict({"a": torch.zeros(2), "b": {"c": torch.ones(2)}}, [2])
    fast = engine_compat.new_tensordict(
        {"a": torch.zeros(2), "b": {"c": torch.ones(2)}}, torch.Size([2]), None
    )
    with mock.patch.object(TensorDict, "_new_unsafe", None):
        slow = engine_compat._tensordict_maker()(
            {"a": torch.zeros(2), "b": {"c": torch.ones(2)}}, torch.Size([2]), None
        )
    assert (fast == td).all() and (slow == td).all()
    with mock.patch.object(engine_compat, "TensorDict", lambda *args: object()):
        gone = engine_compat._children_getter()  # (a TensorDict without _tensordict)
    assert gone(td) is None and engine_compat.children_of(td) is td._tensordict
    with mock.patch.object(_keys, "children_of", gone):  # the walk then takes items()
        assert _keys.batch_views(td, 1, 2) is None
        assert list(_keys.batch_leaves(td)) == [("a",), ("b", "c")]
    with mock.patch.object(torch._C, "_storage_Use_Count", None, create=True):
        assert engine_compat.storage_use_count(torch.zeros(3)) is None
    venv = gym.make_vec(
        "CartPole-v1",
        num_envs=2,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    wrapper = GymWrapper(venv)
    with mock.patch.object(type(wrapper), "_is_batched", None, create=True):
        assert online_compat.gym_wrapper_vector_env(wrapper) is venv
    assert online_compat.collector_compact_next_keys(object()) == []


def test_for_env_without_the_wrapped_env_asks_for_a_mode():
    """Bug caught: for_env guessing a mode when torchrl no longer shows the
    env a GymWrapper wraps (the private ``_env`` gone).
    """
    env = GymEnv("CartPole-v1", num_envs=2)
    wrapper = type(env.base_env)

    def gone(self):
        raise AttributeError("_env")

    with mock.patch.object(wrapper, "_env", property(gone), create=True):
        with pytest.raises(CleanbufError, match="mode="):
            AutoresetFilter.for_env(env)
    env.close()


@pytest.mark.parametrize("private", [True, False], ids=["storage._init", "fallback"])
def test_lay_out_makes_the_files_and_counts_no_row(private, tmp_path):
    """``offline_compat.lay_out``, with TorchRL's private ``_init`` and
    without it. Bugs caught: a storage left uninitialised (its first
    ``set`` would write through sparse files again), a laid-out row counted
    as written, the rows written after it not read back.
    """
    rows = TensorDict({"a": torch.arange(6.0).reshape(3, 2)}, [3])
    storage = LazyMemmapStorage(3, scratch_dir=tmp_path)
    with contextlib.nullcontext() if private else mock.patch.object(offline_compat, "INIT", "_x"):
        offline_compat.lay_out(storage, rows)
    assert storage.initialized and len(storage) == 0
    assert sorted(os.listdir(tmp_path)) == ["a.memmap", "meta.json"]
    storage.set(slice(0, 3), rows)
    assert len(storage) == 3 and torch.equal(storage.get(slice(0, 3))["a"], rows["a"])
