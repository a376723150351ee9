"""Stable-Baselines3 ``ReplayBuffer``s filled the SB3 way and the CleanRL way.

A real Gymnasium next-step loop (CartPole, 4 envs: two balance and reach the
time limit, two push left and terminate) fills an SB3 ``ReplayBuffer``
step by step, as each stack calls ``rb.add``:

* SB3's own algorithms: ``dones = terminated | truncated``, the
  truncations again in ``timeouts`` (SB3 reads them from each env's
  ``info["TimeLimit.truncated"]``);
* CleanRL's DQN / SAC / TD3: ``rb.add(obs, real_next_obs, actions,
  rewards, terminations, infos)``: ``dones`` holds the terminations only,
  ``timeouts`` the truncations.

Each buffer is cleaned with ``cleanbuf.clean(rb)`` and compared, env by
env, with the same loop run with explicit resets (the oracle), not full,
exactly full, and wrapped with its oldest slot (``pos``) a reset row whose
done row was overwritten.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

import cleanbuf
from tests.rollout_helpers import raw_loop

E, LIMIT, STEPS = 4, 12, 160
MODES = gym.vector.AutoresetMode


@pytest.fixture(scope="module")
def runs():
    """The next-step loop and its explicit-reset twin, ``[T, E]``, run once."""
    return raw_loop(MODES.NEXT_STEP, E, STEPS, LIMIT, False), raw_loop(
        MODES.DISABLED, E, STEPS, LIMIT, False
    )


def _fill(steps, way: str, slots: int, n: int):
    """An SB3 ReplayBuffer of ``slots`` steps given the loop's first ``n`` steps."""
    from stable_baselines3.common.buffers import ReplayBuffer as SB3Buffer

    obs_space = spaces.Box(-np.inf, np.inf, (4,), np.float32)
    rb = SB3Buffer(slots * E, obs_space, spaces.Discrete(2), "cpu", n_envs=E)
    for t in range(n):
        s = steps[t]
        term = s["next", "terminated"].reshape(E).numpy()
        trunc = s["next", "truncated"].reshape(E).numpy()
        infos = [{"TimeLimit.truncated": bool(x)} for x in trunc]
        dones = term | trunc if way == "sb3" else term  # CleanRL: rb.add(..., terminations, infos)
        rb.add(
            s["observation"].numpy(),
            s["next", "observation"].numpy(),  # next-step: the terminal obs is there
            s["action"].reshape(E, 1).numpy(),
            s["next", "reward"].reshape(E).numpy(),
            dones,
            infos,
        )
    return rb


def _reset_steps(steps) -> np.ndarray:
    """Per step, whether env 0's row is a reset row (the row after its done row)."""
    done = (steps["next", "done"].reshape(len(steps), E)[:, 0]).numpy()
    return np.r_[False, done[:-1]]


def _per_env(out: dict, e: int) -> dict:
    rows = out["_cleanbuf/env"] == e
    return {k: v[rows] for k, v in out.items()}


def _compare(out: dict, oracle, wrapped: bool) -> int:
    """Asserts each env's cleaned rows are a run of the explicit-reset rows; returns rows."""
    total = 0
    for e in range(E):
        got = _per_env(out, e)
        obs = got["observations"]
        want = oracle[:, e]
        start = 0
        if wrapped:  # the rows are a window of the run: find its first row
            hits = np.flatnonzero((want["observation"].numpy() == obs[0]).all(1))
            assert len(hits), f"env {e}: the first cleaned row is no row of the explicit run"
            start = int(hits[0])
        n = min(len(obs), len(want) - start)
        assert n >= 20, f"env {e}: {n} rows compared"
        w = want[start : start + n]
        assert np.array_equal(obs[:n], w["observation"].numpy()), f"env {e}: observations"
        assert np.array_equal(got["next_observations"][:n], w["next", "observation"].numpy()), e
        assert np.array_equal(got["rewards"][:n], w["next", "reward"].reshape(n).numpy()), e
        ends = (got["dones"][:n] != 0) | (got["timeouts"][:n] != 0)
        assert np.array_equal(ends, w["next", "done"].reshape(n).numpy()), f"env {e}: ends"
        total += len(obs)
    return total


CASES = [(way, fill) for way in ("sb3", "cleanrl") for fill in ("part", "full", "wrapped")]


@pytest.mark.parametrize("way, fill", CASES, ids=["-".join(c) for c in CASES])
def test_sb3_buffer_cleans_to_the_explicit_reset_run(runs, way, fill):
    """Bugs caught: a CleanRL-filled buffer (``dones`` = terminations only)
    read with done from ``timeouts`` alone, so the reset rows after
    terminations stayed in the cleaned rows while its re-audit said clean;
    a wrapped buffer whose oldest slot (``pos``) holds a reset row whose
    done row was overwritten: that orphan kept, ``orphan_reset_rows`` 0,
    and no word that the buffer wrapped.
    """
    steps, oracle = runs
    slots = 100
    if fill == "part":
        n = 80
    elif fill == "full":
        n = slots
    else:  # the oldest slot, step n - slots, a reset row of env 0
        resets = np.flatnonzero(_reset_steps(steps))
        n = slots + int(resets[(resets > 5) & (resets < STEPS - slots)][0])
    rb = _fill(steps, way, slots, n)
    assert rb.full == (fill != "part") and rb.pos == n % slots
    report = cleanbuf.audit(rb)
    assert report.status == 1 and report.mode == "next_step", str(report)
    convention = {"sb3": "SB3 convention", "cleanrl": "CleanRL convention"}[way]
    assert convention in str(report), str(report)
    assert ("wrapped" in str(report)) == (fill != "part"), str(report)
    out, stats = cleanbuf.clean(rb, return_stats=True)
    assert isinstance(out, dict) and isinstance(out["observations"], np.ndarray)
    assert (
        "``clean(sb3_buffer)``                   a dict of numpy arrays" in cleanbuf.clean.__doc__
    )
    if fill == "wrapped":
        assert rb.rewards[rb.pos, 0] == 0 and not rb.dones[rb.pos - 1, 0], "precondition"
        assert stats["orphan_reset_rows"] >= 1, stats
    else:
        assert stats["orphan_reset_rows"] == 0, stats
    rows = _compare(out, oracle, wrapped=fill == "wrapped")
    assert not (out["rewards"] == 0).any(), "a reset row left in the cleaned rows"
    assert rows == len(out["observations"])
    again = cleanbuf.audit(out)
    assert again.clean, str(again)


def test_the_minimal_cleanrl_case_of_the_issue():
    """``[T=8, E=2]`` arrays with SB3 names: ``dones`` marks row 1 (a
    termination), ``timeouts`` row 4 (a truncation), rows 2 and 5 the reset
    rows (reward 0). Bug caught: ``clean()`` returned 14 rows with 2 reward-0
    rows (done read from ``timeouts`` alone); the truth is 12 rows.
    """
    obs = np.arange(8.0)[:, None] + 100 * np.arange(2.0)  # [T, E]: env e counts from 100 e
    nxt = obs + 1
    for r in (2, 5):  # a reset row: from the terminal state to a new episode's start
        obs[r] = nxt[r - 1]
        nxt[r] = obs[r] + 50
        obs[r + 1] = nxt[r]
    for r in (0, 2, 3, 5, 6):  # elsewhere a row's next observation is the next row's
        nxt[r] = obs[r + 1]
    rewards = np.ones((8, 2), np.float32)
    rewards[[2, 5]] = 0
    dones, timeouts = np.zeros((8, 2), np.float32), np.zeros((8, 2), np.float32)
    dones[1], timeouts[4] = 1, 1
    data = {
        "observations": obs[..., None].astype(np.float32),
        "next_observations": nxt[..., None].astype(np.float32),
        "actions": np.zeros((8, 2, 1), np.float32),
        "rewards": rewards,
        "dones": dones,
        "timeouts": timeouts,
    }
    out = cleanbuf.clean(data)
    assert len(out["rewards"]) == 12 and not (out["rewards"] == 0).any(), out["rewards"]
    assert out["dones"].sum() == 2 and out["timeouts"].sum() == 2  # the source's convention kept
    assert "CleanRL convention" in str(cleanbuf.audit(data))


def test_a_pickled_buffer_file_names_the_way_to_read_it(runs, tmp_path):
    """Bug caught: an SB3 buffer saved with ``save_to_pkl`` (what
    ``model.save_replay_buffer`` writes) refused as "no format" with no hint,
    while the same buffer, loaded in Python, audits and cleans.
    """
    from stable_baselines3.common.save_util import save_to_pkl

    rb = _fill(runs[0], "cleanrl", STEPS, STEPS)
    path = str(tmp_path / "replay_buffer.pkl")
    save_to_pkl(path, rb)
    with pytest.raises(cleanbuf.InputError, match=r"load_from_pkl\(path\), then cleanbuf.audit"):
        cleanbuf.audit(path)
    from stable_baselines3.common.save_util import load_from_pkl

    assert not cleanbuf.audit(load_from_pkl(path)).clean  # the advice, followed, runs
