"""The public API around the cleaning rules: add(), clean(), state, Compose, for_env."""

from __future__ import annotations

import os
import pathlib
import pickle
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ListStorage, ReplayBuffer
from torchrl.envs import Compose, GymEnv, GymWrapper, SerialEnv

from cleanbuf import AutoresetFilter, clean
from tests.batches import next_step_batch


def test_add_one_row_at_a_time_equals_extend():
    """rb.add(row) of a single stream, one transition per call. Bugs caught:
    add() storing an [1]-batched element or a reset row, or losing the held
    done row between add() calls.
    """
    batch = next_step_batch(1, 30, 4)
    whole = AutoresetFilter("next_step")
    rb_whole = ReplayBuffer(storage=LazyTensorStorage(100), transform=whole)
    rb_whole.extend(batch)
    whole.flush(rb_whole)
    one = AutoresetFilter("next_step")
    rb_one = ReplayBuffer(storage=LazyTensorStorage(100), transform=one)
    for t in range(30):
        rb_one.add(batch[0, t])
    one.flush(rb_one)
    assert one.stats["reset_rows_dropped"] > 0
    assert len(rb_one) == len(rb_whole) == one.stats["rows_out"]
    a, b = rb_one[: len(rb_one)], rb_whole[: len(rb_whole)]
    assert (a == b).all()


def test_flush_writes_held_rows_once():
    """Bugs caught: held rows never reaching the buffer, or reaching it twice
    (flush going through the filter again, or a second flush repeating).
    """
    filt = AutoresetFilter("next_step")
    rb = ReplayBuffer(storage=LazyTensorStorage(100), transform=filt)
    for seed in range(50):
        batch = next_step_batch(2, 12, seed)
        if batch["next", "done"][:, -1].any():
            break
    rb.extend(batch)
    held = filt.stats["rows_held"]
    assert held > 0 and len(rb) == filt.stats["rows_out"]
    filt.flush(rb)
    filt.flush(rb)
    assert (
        len(rb)
        == filt.stats["rows_out"]
        == filt.stats["rows_in"] - filt.stats["reset_rows_dropped"]
    )
    tail = rb[len(rb) - held : len(rb)]
    assert tail["next", "done"].all()
    # Collector data zero-fills the terminal observation: lost, NaN, counted.
    assert torch.isnan(tail["next", "observation"]).all()
    assert filt.stats["terminal_obs_missing"] == held


def test_reused_buffers_never_overwrite_rows_someone_holds():
    """Output buffers of large leaves are reused across calls. ListStorage
    keeps references to what it is given. Bug caught: a later call writing
    its rows into the memory of rows stored earlier (the pool must see that
    they are still referenced).
    """
    filt = AutoresetFilter("next_step")
    rb = ReplayBuffer(storage=ListStorage(10_000), transform=filt)
    both = next_step_batch(2, 80, 3)
    pixels = torch.arange(2 * 80, dtype=torch.float32).reshape(2, 80, 1, 1).expand(2, 80, 128, 128)
    both.set("pixels", pixels.clone())
    both.set(("next", "pixels"), pixels + 0.5)
    rb.extend(both[:, :40])
    first = torch.stack([rb[i] for i in range(len(rb))]).clone()
    assert first["pixels"].numel() * 4 >= 1 << 20  # large enough to be pooled
    rb.extend(both[:, 40:])
    again = torch.stack([rb[i] for i in range(len(first))])
    assert (again == first).all()


def _second_call_untouched(both, **options):
    """Extends a fresh filter (with ``options``) with ``both`` cut in two: up
    to the first reset row, then up to the next episode end (a call with no
    episode end, which moves nothing but fixes step counts). Checks that
    neither call wrote into the batch it was given; returns the second call's
    output.
    """
    done = both["next", "done"].reshape(-1).nonzero().flatten().tolist()
    reset = done[0] + 1
    assert done[1] > reset + 1
    first, second = both[:, : reset + 1], both[:, reset + 1 : done[1]]
    filt = AutoresetFilter("next_step", **options)
    for batch in (first, second):
        copy = batch.clone()
        out = filt.inv(batch)
        assert (batch == copy).all()
    return out


def test_filter_does_not_mutate_the_callers_batch():
    """Bug caught: is_init / step_count / next observation patched in place
    in the batch the collector handed over, in the copying path and in the
    zero-copy path (a call that drops nothing but still fixes the step
    counts of an episode that began with a reset row in an earlier call).
    """
    out = _second_call_untouched(next_step_batch(1, 40, 2))
    assert (out["step_count"].reshape(-1) == torch.arange(len(out))).all()  # stored one too high
    assert out["is_init"].reshape(-1)[0]


def test_next_step_count_alone_is_fixed_and_the_batch_untouched():
    """A batch with ("next", "step_count") but no root "step_count". Bugs
    caught: the next step counts of an episode that began with a dropped reset
    row left one too high, or shifted in place in the caller's batch (in the
    zero-copy path, a call that drops nothing).
    """
    out = _second_call_untouched(next_step_batch(1, 40, 2).exclude("step_count"))
    assert (out["next", "step_count"].reshape(-1) == torch.arange(1, len(out) + 1)).all()


def test_next_step_count_alone_without_is_init_is_fixed_in_a_quiet_call():
    """("next", "step_count") alone and no is_init: the second call has no
    episode end and no is_init fix pending, only the step shift. Bug caught:
    such a call judged clean because the root "step_count" was absent, and
    passed through with its next step counts one too high.
    """
    batch = next_step_batch(1, 40, 2).exclude("step_count", "is_init")
    out = _second_call_untouched(batch)
    assert (out["next", "step_count"].reshape(-1) == torch.arange(1, len(out) + 1)).all()


def test_step_count_key_none_leaves_the_counts_alone():
    """step_count_key=None, and the second call continues an episode that
    began with a dropped reset row. Bugs caught: a TypeError (the "next" twin
    of a None key built as ("next", *None)) as soon as a row needed a shift,
    and step counts shifted although the user opted out.
    """
    batch = next_step_batch(1, 40, 2)
    out = _second_call_untouched(batch, step_count_key=None)
    done = batch["next", "done"].reshape(-1).nonzero().flatten().tolist()
    second = batch[:, done[0] + 2 : done[1]].reshape(-1)
    assert len(out) == len(second)
    for key in ("step_count", ("next", "step_count")):
        assert (out[key] == second[key]).all()


def test_output_declares_the_device_its_rows_are_on():
    """Collector batches come with ``device=None``; the filter's output says
    where its rows are, in the copying path, the zero-copy path and at a
    flush. Bug caught: an output without a device, which makes the storage
    run ``to()`` over every leaf before writing (a third of a MuJoCo-sized
    extend).
    """
    for seed in range(50):
        batch = next_step_batch(2, 12, seed)
        if batch["next", "done"][:, -1].any() and batch["next", "done"][:, :-2].any():
            break
    assert batch.device is None
    filt = AutoresetFilter("next_step")
    copied = filt.inv(batch)
    assert len(copied) < batch.numel() - filt.stats["rows_held"]  # rows were dropped
    quiet = batch[:, -1:].clone()
    quiet["next", "done"] = torch.zeros_like(quiet["next", "done"])
    quiet["next", "reward"] = torch.ones_like(quiet["next", "reward"])
    fresh = AutoresetFilter("next_step")
    passed = fresh.inv(quiet)
    assert passed["observation"].data_ptr() == quiet["observation"].data_ptr()  # zero-copy
    held = filt.flush()
    assert len(held) > 0
    for out in (copied, passed, held):
        assert out.device == torch.device("cpu")
        assert out["next"].device == torch.device("cpu")


def test_terminated_and_truncated_of_different_trailing_shapes():
    """Done flags read from ``terminated | truncated`` where one is ``[E, T, 1]``
    and the other ``[E, T]`` (both one flag per row). Bug caught: the two
    flag arrays broadcast against each other (``[N, 1] | [N]`` is ``[N, N]``)
    instead of being read row by row.
    """
    batch = next_step_batch(2, 12, 3)
    done = batch["next", "done"]
    flags = batch.exclude(("next", "done"))
    flags.set(("next", "terminated"), done.clone())
    mixed = flags.clone()
    mixed.set(("next", "truncated"), torch.zeros(done.shape[:-1], dtype=torch.bool))
    flags.set(("next", "truncated"), torch.zeros_like(done))
    want = AutoresetFilter("next_step").inv(flags)
    got = AutoresetFilter("next_step").inv(mixed)
    assert len(got) == len(want) < batch.numel()
    assert (got["next", "observation"] == want["next", "observation"]).all()


def test_state_dict_via_replay_buffer_and_pickle():
    """Bugs caught: the carry state missing from rb.state_dict() (a restored
    buffer forgets the held rows and keeps a reset row), or the filter not
    pickling.
    """
    both = next_step_batch(3, 40, 5)
    ref = AutoresetFilter("next_step")
    ref_rb = ReplayBuffer(storage=LazyTensorStorage(200), transform=ref)
    ref_rb.extend(both[:, :20])
    ref_rb.extend(both[:, 20:])

    filt = AutoresetFilter("next_step")
    rb = ReplayBuffer(storage=LazyTensorStorage(200), transform=filt)
    rb.extend(both[:, :20])
    assert filt.stats["rows_held"] or filt.stats["reset_rows_dropped"]
    saved = pickle.dumps(rb.state_dict())
    restored_filter = pickle.loads(pickle.dumps(AutoresetFilter("next_step")))
    rb2 = ReplayBuffer(storage=LazyTensorStorage(200), transform=restored_filter)
    rb2.load_state_dict(pickle.loads(saved))
    assert restored_filter.stats == filt.stats
    rb2.extend(both[:, 20:])
    assert len(rb2) == len(ref_rb)
    assert (rb2[: len(rb2)] == ref_rb[: len(ref_rb)]).all()


def test_inside_compose():
    """Bug caught: the filter only working as the sole transform."""
    filt = AutoresetFilter("next_step")
    rb = ReplayBuffer(storage=LazyTensorStorage(100), transform=Compose(filt))
    rb.extend(next_step_batch(2, 12, 1))
    assert len(rb) == filt.stats["rows_out"] > 0 and filt.stats["reset_rows_dropped"] > 0


def test_clean_returns_the_kind_it_got():
    """clean() on a TensorDict, a dict of numpy arrays and a dict of tensors.
    Bugs caught: held rows not flushed at the end, numpy input returned as
    tensors, results differing between the three kinds.
    """
    batch = next_step_batch(2, 24, 3)
    out_td = clean(batch)
    assert isinstance(out_td, TensorDict)
    assert out_td.batch_size[0] == batch.numel() - int((batch["next", "reward"] == 0).sum())
    as_np = {k: v.numpy() for k, v in batch.flatten_keys("|").items()}
    nested = {}
    for k, v in as_np.items():
        *head, last = k.split("|")
        node = nested
        for h in head:
            node = node.setdefault(h, {})
        node[last] = v
    out_np = clean(nested)
    assert isinstance(out_np["next"]["observation"], np.ndarray)
    np.testing.assert_array_equal(
        out_np["next"]["observation"], out_td["next", "observation"].numpy()
    )
    tuple_keys = {
        ("next", "done"): batch["next", "done"],
        ("next", "observation"): batch["next", "observation"],
        "observation": batch["observation"],
        ("next", "reward"): batch["next", "reward"],
    }
    out_t = clean(tuple_keys)
    assert isinstance(out_t["next"]["observation"], torch.Tensor)
    torch.testing.assert_close(
        out_t["next"]["observation"], out_td["next", "observation"], rtol=0, atol=0, equal_nan=True
    )


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


def _joint_batch():
    for seed in range(100):
        batch = next_step_batch(2, 30, seed, group=2)
        done = batch["next", "done"].squeeze(-1)
        if (done.all(0)[:-1]).any():  # a joint reset inside the batch
            return batch
    raise AssertionError("no joint reset")


def test_lost_terminal_observation_policies():
    """TorchRL's joint reset loses terminal observations. Bugs caught: 'drop'
    storing the rows anyway or not counting them, 'raise' writing part of the
    batch, 'keep' altering the producer's values, 'nan' marking rows other
    than the lost ones.
    """
    batch = _joint_batch()
    results = {}
    for policy in ("nan", "drop", "keep"):
        filt = AutoresetFilter("next_step", joint_reset=True, on_lost_terminal_obs=policy)
        rb = ReplayBuffer(storage=LazyTensorStorage(100), transform=filt)
        rb.extend(batch)
        filt.flush(rb)
        results[policy] = (filt.stats, rb[: len(rb)])
    nan_stats, nan_rows = results["nan"]
    n_lost = nan_stats["terminal_obs_missing"]
    assert n_lost > 0
    assert int(torch.isnan(nan_rows["next", "observation"]).sum()) == n_lost
    drop_stats, drop_rows = results["drop"]
    assert drop_stats["lost_rows_dropped"] == n_lost
    assert len(drop_rows) == len(nan_rows) - n_lost
    assert not torch.isnan(drop_rows["next", "observation"]).any()
    keep_stats, keep_rows = results["keep"]
    assert len(keep_rows) == len(nan_rows)
    lost = torch.isnan(nan_rows["next", "observation"]).reshape(-1)
    assert (keep_rows["next", "observation"].reshape(-1)[lost] == 0).all()  # as zero-filled
    filt = AutoresetFilter("next_step", joint_reset=True, on_lost_terminal_obs="raise")
    rb = ReplayBuffer(storage=LazyTensorStorage(100), transform=filt)
    with pytest.raises(Exception, match="on_lost_terminal_obs='raise'"):
        rb.extend(batch)
    assert len(rb) == 0 and filt.stats["rows_in"] == 0


def test_for_env_sb3_dummy_vec_env():
    """Bug caught: an SB3 VecEnv (same-step, terminal observation in infos)
    configured as next-step, which would drop its real transitions.
    """
    from stable_baselines3.common.vec_env import DummyVecEnv

    venv = DummyVecEnv([lambda: gym.make("CartPole-v1")] * 2)
    filt = AutoresetFilter.for_env(venv)
    assert (filt.options.mode, filt.options.layout) == ("same_step", "step")
    assert "Stable-Baselines3" in repr(filt)


def test_compact_keeps_observation_only_layout():
    """compact=True: the artifacts go, the layout stays observation-only.
    Bugs caught: next observations materialized anyway (memory doubled),
    rows held although nothing waits for a successor, reset rows kept.
    """
    batch = next_step_batch(2, 30, 6).exclude(("next", "observation"))
    filt = AutoresetFilter("next_step", observation_keys=["observation"], compact=True)
    out = filt.inv(batch)
    assert ("next", "observation") not in out.keys(True, True)
    assert filt.stats["rows_held"] == 0
    assert filt.stats["reset_rows_dropped"] > 0
    assert len(out) == filt.stats["rows_in"] - filt.stats["reset_rows_dropped"]
    assert (out["next", "reward"] != 0).all()


def test_final_observation_entry_stored_only_when_asked():
    """Bugs caught: the final-observation entry (a second copy of every
    observation) stored by default, or dropped when keep_final_obs=True.
    """
    from tests.batches import same_step_batch

    batch = same_step_batch(2, 12, 0)
    plain = AutoresetFilter("same_step").inv(batch)
    kept = AutoresetFilter("same_step", keep_final_obs=True).inv(batch)
    assert ("next", "final_obs") not in plain.keys(True, True)
    assert ("next", "_final_obs") not in plain.keys(True, True)
    assert ("next", "final_obs") in kept.keys(True, True)
    done = plain["next", "done"].reshape(-1)
    assert torch.equal(plain["next", "observation"][done], kept["next", "final_obs"][done])


def test_clean_same_step_and_observation_only():
    """clean() takes the same-step and observation-only options. Bugs caught:
    clean() ignoring mode='same_step' (done rows keep the reset observation)
    or not flushing the rows that wait for a successor.
    """
    from tests.batches import same_step_batch

    batch = same_step_batch(2, 12, 0)
    out = clean(batch, mode="same_step")
    done = out["next", "done"].reshape(-1)
    assert torch.equal(
        out["next", "observation"][done],
        batch["next", "final_obs"].reshape(-1, 1)[batch["next", "done"].reshape(-1)],
    )
    obs_only = clean(
        batch.exclude(("next", "observation")),
        mode="same_step",
        observation_keys=["observation"],
        on_lost_terminal_obs="nan",
    )
    assert len(obs_only) == batch.numel()
    # The last row of each stream has no successor, unless it is a done row
    # (its final observation is its next observation).
    waiting = int((~batch["next", "done"][:, -1]).sum())
    assert waiting > 0
    assert int(torch.isnan(obs_only["next", "observation"]).sum()) == waiting


def test_flush_same_step_observation_only_marks_unfinished_rows():
    """Same-step observation-only data: the last row of each stream waits for
    its successor; at a flush it never comes. Bug caught: the flush raising
    the same-step "no final observation" error for rows that are not done
    (or storing them with a next observation from nowhere).
    """
    from tests.batches import same_step_batch

    batch = same_step_batch(2, 12, 0).exclude(("next", "observation"))
    filt = AutoresetFilter("same_step", observation_keys=["observation"])
    filt.inv(batch)
    waiting = filt.stats["rows_held"]
    assert waiting > 0
    rows = filt.flush()
    assert len(rows) == waiting and not rows["next", "done"].any()
    assert torch.isnan(rows["next", "observation"]).all()
    assert filt.stats["next_obs_missing"] == waiting and filt.stats["terminal_obs_missing"] == 0


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


def test_step_rows_reads_gymnasium_and_sb3_infos_with_dict_observations():
    """step_rows with Dict observations. Bugs caught: the terminal observation
    of the wrong env stored, a nested final entry not built like the
    observation, the SB3 truncation flag not moved out of terminated.
    """
    from cleanbuf import step_rows

    obs = {"pos": np.zeros((3, 2), np.float32), "cam": np.zeros((3, 4), np.uint8)}
    next_obs = {"pos": np.full((3, 2), 5, np.float32), "cam": np.full((3, 4), 5, np.uint8)}
    final = np.array(
        [None, {"pos": np.full(2, 9, np.float32), "cam": np.full(4, 9, np.uint8)}, None],
        dtype=object,
    )
    info = {"final_obs": final, "_final_obs": np.array([False, True, False])}
    rows = step_rows(
        obs,
        np.zeros(3),
        next_obs,
        np.ones(3),
        np.array([False, True, False]),
        np.zeros(3, bool),
        info,
    )
    assert rows["next", "_final_obs"].reshape(-1).tolist() == [False, True, False]
    assert rows["next", "final_obs", "pos"][1].tolist() == [9.0, 9.0]
    assert rows["next", "final_obs", "cam"][1].tolist() == [9, 9, 9, 9]
    assert rows["next", "final_obs", "pos"][0].tolist() == [0.0, 0.0]
    out = AutoresetFilter("same_step", layout="step").inv(rows)
    pos = out["next", "observation", "pos"]
    assert pos[1].tolist() == [9.0, 9.0] and pos[0].tolist() == [5.0, 5.0]
    assert out["next", "observation", "cam"][1].tolist() == [9, 9, 9, 9]
    sb3_infos = [
        {},
        {
            "terminal_observation": {
                "pos": np.full(2, 7, np.float32),
                "cam": np.full(4, 7, np.uint8),
            },
            "TimeLimit.truncated": True,
        },
        {},
    ]
    rows = step_rows(
        obs, np.zeros(3), next_obs, np.ones(3), np.array([False, True, False]), None, sb3_infos
    )
    assert rows["next", "truncated"].reshape(-1).tolist() == [False, True, False]
    assert not rows["next", "terminated"].any() and rows["next", "done"].reshape(-1)[1]
    assert rows["next", "final_obs", "cam"][1].tolist() == [7, 7, 7, 7]


def test_add_path_raises_no_warning():
    """rb.add(row), one row per call, in a fresh process with warnings as
    errors (torch warns once per process, so an earlier test could hide
    it). Bug caught: torch's "NumPy array is not writable" warning from the
    shared read-only empty row index turned into a tensor.
    """
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "from torchrl.data import LazyTensorStorage, ReplayBuffer\n"
        "from cleanbuf import AutoresetFilter\n"
        "from tests.batches import next_step_batch\n"
        "batch = next_step_batch(1, 30, 4)\n"
        "filt = AutoresetFilter('next_step')\n"
        "rb = ReplayBuffer(storage=LazyTensorStorage(100), transform=filt)\n"
        "for t in range(30):\n"
        "    rb.add(batch[0, t])\n"
        "assert filt.stats['reset_rows_dropped'] > 0\n"
    )
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
