"""cleanbuf.clean on data outside a buffer, and step_rows for raw loops."""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict

from cleanbuf import AutoresetFilter, clean
from tests.batches import assert_same_rows, next_step_batch


def test_clean_returns_the_kind_it_got():
    """clean() on a TensorDict, a dict of numpy arrays and a dict of tensors.
    Bugs caught: held rows not flushed at the end, numpy input returned as
    tensors, results differing between the three kinds. layout="time_last"
    reads the dicts as the TensorDict is read; without it a dict is read as
    stored arrays are, its rows step after step with each row's env.
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
    out_np = clean(nested, layout="time_last")
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
    out_t = clean(tuple_keys, layout="time_last")
    assert isinstance(out_t["next"]["observation"], torch.Tensor)
    torch.testing.assert_close(
        out_t["next"]["observation"], out_td["next", "observation"], rtol=0, atol=0, equal_nan=True
    )


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


def test_stacked_steps_clean_like_single_steps():
    """The README's faster raw loop: 32 steps of ``step_rows`` stacked as
    ``[E, 32]`` per extend (``layout="time_last"``, no other option) store,
    env by env, the rows that one extend per step stores. Bugs caught: a
    reset row kept or a real step dropped when a done row ends one stacked
    call and its reset row opens the next, the raw loop's terminal
    observation overwritten by the next row's, a stream's rows reordered.
    """
    import gymnasium as gym
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    import cleanbuf

    envs, steps, stack = 4, 320, 32
    venv = gym.make_vec("CartPole-v1", num_envs=envs, vectorization_mode="sync")
    venv.action_space.seed(0)
    obs, _ = venv.reset(seed=0)
    rows = []
    for _ in range(steps):
        action = venv.action_space.sample()
        next_obs, reward, terminated, truncated, _ = venv.step(action)
        step = cleanbuf.step_rows(obs, action, next_obs, reward, terminated, truncated)
        step.set("env", torch.arange(envs))
        rows.append(step)
        obs = next_obs
    venv.close()
    assert sum(bool(r["next", "done"].any()) for r in rows) > steps // 40, "too few episode ends"

    def store(filt, calls):
        rb = ReplayBuffer(storage=LazyTensorStorage(steps * envs), transform=filt)
        for call in calls:
            rb.extend(call)
        filt.flush(rb)
        out = rb[: len(rb)]
        return [out[out["env"] == e] for e in range(envs)]

    one = store(AutoresetFilter("next_step", layout="step"), rows)
    stacked_filt = AutoresetFilter("next_step", layout="time_last")
    calls = [torch.stack(rows[i : i + stack], dim=-1) for i in range(0, steps, stack)]
    stacked = store(stacked_filt, calls)
    for e in range(envs):
        assert_same_rows(stacked[e], one[e], f"env {e}")
    assert stacked_filt.stats["reset_rows_dropped"] > 0


def _final_keys(td):
    return {k for k in td.keys(True, True) if k[-1] in ("final_obs", "_final_obs")}


def test_step_rows_info_always_passed_stores_no_dead_column():
    """Real ``gymnasium.make_vec`` loops, the info always passed to
    ``step_rows``. Next-step: the filtered buffer stores what it stores
    without the info, and no final-observation column. Same-step: the steps
    stack into [E, T] (every step has the same keys) and the filter puts
    each terminal observation in its done row. Bugs caught: a next-step
    info adding an always-zero ``("next", "final_obs")`` and an
    always-False ``("next", "_final_obs")`` column to the buffer; same-step
    steps whose keys differ with whether an env ended (torch.stack fails);
    a same-step terminal observation not read from the info.
    """
    import gymnasium as gym
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    from tests.loops import ENVS, run_loop

    name, kwargs, policy = ENVS["Pendulum-truncates"]
    stored = {}
    for with_info in (True, False):
        filt = AutoresetFilter("next_step", layout="step")
        rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
        mode = gym.vector.AutoresetMode.NEXT_STEP
        venv, steps = run_loop(name, kwargs, policy, 3, 40, mode, rb, with_info=with_info)
        venv.close()
        assert all(_final_keys(s) for s in steps) == with_info
        stored[with_info] = rb[: len(rb)]
    assert filt.stats["reset_rows_dropped"] > 0
    assert not _final_keys(stored[True])
    assert_same_rows(stored[True], stored[False])

    filt = AutoresetFilter("same_step", layout="step")
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    mode = gym.vector.AutoresetMode.SAME_STEP
    venv, steps = run_loop(name, kwargs, policy, 3, 40, mode, rb, with_info=True)
    venv.close()
    stacked = torch.stack(steps, dim=1)  # [E, T]: a T-steps loop's extend
    ended = stacked["next", "done"].reshape(-1)
    assert ended.any() and torch.equal(stacked["next", "_final_obs"].reshape(-1), ended)
    rows = rb[: len(rb)]
    assert not _final_keys(rows) and len(rows) == 3 * 40
    done = rows["next", "done"].reshape(-1)
    finals = torch.cat([s["next", "final_obs"][s["next", "done"].reshape(-1)] for s in steps])
    torch.testing.assert_close(rows["next", "observation"][done], finals)


def test_a_loop_that_never_moves_on_is_told_to_set_obs():
    """Bug caught: a raw loop that forgets ``obs = next_obs`` got only "the
    same batch written twice", which sends the user looking for a duplicate
    write. The error now names the missing line, and nothing is written.
    """
    import gymnasium as gym
    import pytest
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    from cleanbuf import ContinuityError, step_rows

    envs = gym.make_vec("CartPole-v1", num_envs=4, vectorization_mode="sync")
    filt = AutoresetFilter.for_env(envs)
    rb = ReplayBuffer(storage=LazyTensorStorage(100), transform=filt)
    obs, _ = envs.reset(seed=0)
    envs.action_space.seed(0)
    step = envs.step(envs.action_space.sample())
    rb.extend(step_rows(obs, envs.action_space.sample(), *step))
    stored = len(rb)
    step = envs.step(envs.action_space.sample())
    with pytest.raises(ContinuityError, match="set obs = next_obs after each step"):
        rb.extend(step_rows(obs, envs.action_space.sample(), *step))  # obs not moved on
    assert len(rb) == stored
    envs.close()
