"""A done row's stored terminal observation, read from the data row by row.

Raw Gymnasium loops keep the terminal observation in the done row; TorchRL's
collectors zero-fill it (the reset row after it holds it). No option says
which: a next observation that is neither zero-filled nor NaN is stored, is
kept as it is, and is never counted lost, also where no reset row follows
(the end of the data, a restart, a collector's batch-end mark at the
flush). Each case is compared with the explicit-reset run.
"""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer

import cleanbuf
from cleanbuf import AutoresetFilter
from tests.loops import ENVS, run_loop, step_rows
from tests.oracle import (
    compare_streams,
    make_env,
    push_left_policy,
    streams_from_batches,
    streams_from_rows,
)

DISABLED, NEXT_STEP = gym.vector.AutoresetMode.DISABLED, gym.vector.AutoresetMode.NEXT_STEP
E = 4
# Per env: steps per write and steps in all, chosen so that done rows fall on
# a write's last step in the middle of the data and on the data's last step.
CHUNKS = {"CartPole-terminates": (8, 112), "Pendulum-truncates": (6, 48)}


def _chunks(rows, steps_per_write):
    """The loop's [E] steps stacked as [E, T] writes (the last one may be shorter)."""
    return [
        torch.stack(rows[i : i + steps_per_write], dim=1)
        for i in range(0, len(rows), steps_per_write)
    ]


def _oracle(env_key, steps):
    name, kwargs, policy = ENVS[env_key]
    _, rows = run_loop(name, kwargs, policy, E, steps, DISABLED)
    oracle = torch.stack(rows, dim=1)
    return {e: oracle[e] for e in range(E)}


def _raw_chunks(env_key):
    """The next-step loop's writes, with the preconditions of the tests checked."""
    name, kwargs, policy = ENVS[env_key]
    per_write, steps = CHUNKS[env_key]
    venv, rows = run_loop(name, kwargs, policy, E, steps, NEXT_STEP)
    chunks = _chunks(rows, per_write)
    last_step_done = [c["next", "done"][:, -1].reshape(-1) for c in chunks]
    assert last_step_done[-1].any(), "no done row on the data's last step"
    assert any(d.any() for d in last_step_done[:-1]), "no done row ending a write"
    return venv, chunks


def _no_nan(rows):
    return not rows["next", "observation"].isnan().any()


@pytest.mark.parametrize("env_key", list(CHUNKS))
def test_raw_loop_writes_through_the_filter_keep_stored_terminal_obs(env_key):
    """A raw Gymnasium next-step loop stacked as [E, T] per extend (the
    README's faster loop) through ``AutoresetFilter.for_env(envs,
    layout="time_last")``, no other option; done rows on a write's last
    step, mid-data and on the data's last step (Pendulum: every end is a
    time-limit truncation on a write's last step).

    Bugs caught: a done row on the data's last step held, then flushed with
    its stored terminal observation replaced by NaN and counted lost (as
    before the data decided); a raw loop's truncation on a write's last step
    taken for a collector's batch-end mark, so its reset row is stored as a
    transition (rows shift against the explicit-reset run).
    """
    venv, chunks = _raw_chunks(env_key)
    filt = AutoresetFilter.for_env(venv, layout="time_last")
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=filt)
    for chunk in chunks:
        rb.extend(chunk)
    filt.flush(rb)
    stats = filt.stats
    rows = rb[: len(rb)]
    assert stats["reset_rows_dropped"] > 0
    assert stats["terminal_obs_missing"] == stats["next_obs_missing"] == 0
    assert _no_nan(rows)
    assert compare_streams(streams_from_rows(rows), _oracle(env_key, CHUNKS[env_key][1]), 30) == 0
    assert stats["rows_in"] == len(rows) + stats["reset_rows_dropped"] == E * CHUNKS[env_key][1]


@pytest.mark.parametrize("env_key", list(CHUNKS))
def test_raw_loop_buffer_cleaned_offline_keeps_stored_terminal_obs(env_key):
    """The issue's "flat rows in collector-style writes": the same raw loop's
    [E, T] writes stored by a plain buffer (no filter), audited, then
    cleaned with ``cleanbuf.clean(rb)``, and its rows as one TensorDict
    ``[E, time]`` cleaned with ``cleanbuf.clean(td)``.

    Bugs caught: the clean replacing the stored terminal observation of the
    done row on the data's last step with NaN (the audit said "lost for
    good 0", the clean then counted 1), the audit's suggested options
    declaring the terminal observations absent from done rows.
    """
    _, chunks = _raw_chunks(env_key)
    oracle = _oracle(env_key, CHUNKS[env_key][1])
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000))
    for chunk in chunks:
        rb.extend(chunk)
    report = cleanbuf.audit(rb)
    assert report.lost == 0 and report.mode == "next_step"
    for data in (rb, torch.cat(chunks, dim=1)):
        rows, stats = cleanbuf.clean(data, return_stats=True)
        assert stats["terminal_obs_missing"] == stats["next_obs_missing"] == 0
        assert stats["reset_rows_dropped"] > 0 and stats["rows_held"] == 0
        assert _no_nan(rows)
        assert compare_streams(streams_from_rows(rows), oracle, 30) == 0


def _loop_with_restart(mode, steps, restart_at):
    """A raw CartPole loop with ``is_init`` rows, every env reset (reseeded)
    at step ``restart_at`` as a collector reset does; DISABLED also resets
    each done env explicitly (the oracle). Each row says its step (``"t"``).
    """
    name, kwargs, policy = ENVS["CartPole-terminates"]
    venv = gym.make_vec(
        name, num_envs=E, vectorization_mode="sync", vector_kwargs={"autoreset_mode": mode}
    )
    rows = []
    obs, _ = venv.reset(seed=0)
    is_init = np.ones(E, bool)
    for t in range(steps):
        if t == restart_at:
            obs, _ = venv.reset(seed=1)
            is_init[:] = True
        action = policy(obs)
        next_obs, reward, terminated, truncated, _ = venv.step(action)
        row = step_rows(obs, action, next_obs, reward, terminated, truncated)
        row.set("is_init", torch.from_numpy(is_init.copy()))
        row.set("t", torch.full((E,), t))
        rows.append(row)
        obs, is_init = next_obs, np.zeros(E, bool)
        done = terminated | truncated
        if mode == DISABLED and done.any():
            reset_obs, _ = venv.reset(options={"reset_mask": done})
            obs = np.where(done[:, None], reset_obs, next_obs)
            is_init = done.copy()
    venv.close()
    return rows


def test_restart_after_a_stored_done_row_keeps_it():
    """A done row on a write's last step whose next write restarts every env
    (``is_init``, a collector reset) instead of bringing its reset row.

    Bugs caught: the held done row released as lost at the restart (its
    stored terminal observation replaced by NaN, counted in
    ``terminal_obs_missing``), the restart row dropped as a reset row.
    """
    per_write, restart_at, steps = 8, 72, 96  # CartPole: envs end at step 71
    rows = _loop_with_restart(NEXT_STEP, steps, restart_at)
    assert rows[restart_at - 1]["next", "done"].any(), "no done row before the restart"
    filt = AutoresetFilter("next_step")
    outs = [filt(chunk) for chunk in _chunks(rows, per_write)] + [filt.flush()]
    got = torch.cat([o for o in outs if o.batch_size[0]])
    assert filt.stats["terminal_obs_missing"] == filt.stats["next_obs_missing"] == 0
    assert _no_nan(got)
    oracle = torch.stack(_loop_with_restart(DISABLED, steps, restart_at), dim=1)
    cleaned = streams_from_rows(got)
    # The two runs reach the restart after different numbers of transitions
    # (reset rows), so each side of it is compared on its own.
    for before in (True, False):
        part = {e: s[(s["t"] < restart_at) == before].exclude("t") for e, s in cleaned.items()}
        want = {
            e: oracle[e][(oracle[e]["t"] < restart_at) == before].exclude("t") for e in range(E)
        }
        assert compare_streams(part, want, 15) == 0


def test_collector_marks_at_flush_keep_their_next_obs():
    """TorchRL ``Collector(set_truncated=True)`` over ``GymEnv("CartPole-v1",
    num_envs=4)``: the last batch's batch-end marks are still undecided at
    ``flush()``. Bug caught: a mark whose next observation is real (not
    zero-filled) flushed with NaN and counted in ``next_obs_missing``
    (2 of 4 streams before).
    """
    steps, batches = 16, 10
    oracle_env = make_env("CartPole-v1", E, disabled=True)
    oracle_collector = Collector(
        oracle_env, push_left_policy, frames_per_batch=E * steps,
        total_frames=E * steps * batches, set_truncated=True,
    )  # fmt: skip
    oracle = streams_from_batches([b.clone() for b in oracle_collector])
    oracle_collector.shutdown()
    collector = Collector(
        make_env("CartPole-v1", E), push_left_policy, frames_per_batch=E * steps,
        total_frames=E * steps * batches, set_truncated=True,
    )  # fmt: skip
    filt = AutoresetFilter.for_env(collector)
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=filt)
    last = None
    for batch in collector:
        rb.extend(batch)
        last = batch
    collector.shutdown()
    marked_last = (last["next", "truncated"][:, -1] & ~last["next", "terminated"][:, -1]).reshape(
        -1
    )
    stored_last = last["next", "observation"][:, -1].ne(0).any(-1)
    assert (marked_last & stored_last).sum() >= 2, "too few undecided marks at the end"
    filt.flush(rb)
    stats = filt.stats
    assert stats["next_obs_missing"] == 0
    cleaned = streams_from_rows(rb[: len(rb)])
    for e, s in cleaned.items():
        assert not s[-1]["next", "observation"].isnan().any(), f"stream {e}: last mark NaN"
    marks = (("next", "done"), ("next", "truncated"))
    lost = compare_streams(
        {e: s.exclude(*marks) for e, s in cleaned.items()},
        {e: s.exclude(*marks) for e, s in oracle.items()},
        min_rows=steps * batches * 3 // 4,
    )
    assert lost == stats["terminal_obs_missing"]


def test_collector_marks_on_real_ends_at_flush_count_as_ends():
    """``Collector(set_truncated=True)`` over ``GymEnv("Pendulum-v1",
    num_envs=4)`` with a 32-step limit and 16-step batches: every second
    batch end is a real (joint) end as well as a mark, the last one too,
    still undecided at ``flush()``. Its next observation is zero-filled,
    which TorchRL does only at real ends. Bug caught: the flush took those
    last ends for marks because earlier marks of the stream had been only
    marks: their lost terminal observations counted in ``next_obs_missing``
    (rows not done) and their episodes not counted, without a warning.
    """
    torch.manual_seed(0)
    steps, batches = 16, 6
    collector = Collector(
        make_env("Pendulum-v1", E, max_episode_steps=32), None, frames_per_batch=E * steps,
        total_frames=E * steps * batches, set_truncated=True,
    )  # fmt: skip
    filt = AutoresetFilter.for_env(collector)
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=filt)
    for batch in collector:
        rb.extend(batch)
    collector.shutdown()
    assert filt.stats["rows_held"] == E, "the last batch's ends must wait for the flush"
    with pytest.warns(cleanbuf.CleanbufWarning, match="lost their terminal observation"):
        filt.flush(rb)
    stats = filt.stats
    n_ends = E * steps * batches // 32
    assert stats["next_obs_missing"] == 0
    assert stats["terminal_obs_missing"] == stats["episodes_completed"] == n_ends


class _Countdown(gym.Env):
    """Counts down from a random start to 0, which ends the episode: its
    terminal observation is exactly 0, a real state, not a fill.
    """

    observation_space = gym.spaces.Box(0.0, 10.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._n = int(self.np_random.integers(2, 6))
        return np.full(2, self._n, np.float32), {}

    def step(self, action):
        self._n -= 1
        return np.full(2, self._n, np.float32), 1.0, self._n == 0, False, {}


def _countdown_loop(mode, steps):
    venv = gym.vector.SyncVectorEnv([_Countdown] * E, autoreset_mode=mode)
    rows = []
    obs, _ = venv.reset(seed=0)
    for _ in range(steps):
        action = np.zeros(E, np.int64)
        next_obs, reward, terminated, truncated, _ = venv.step(action)
        rows.append(step_rows(obs, action, next_obs, reward, terminated, truncated))
        obs = next_obs
        if mode == DISABLED and terminated.any():
            reset_obs, _ = venv.reset(options={"reset_mask": terminated})
            obs = np.where(terminated[:, None], reset_obs, next_obs)
    return torch.stack(rows, dim=1)


@pytest.mark.parametrize("layout", ["step", "time_last"])
def test_a_truly_zero_terminal_obs(layout):
    """Terminal observations that are truly 0 in every element read as
    zero-filled, the rule's one ambiguity: where the reset row follows,
    its observation (the same zeros) completes the done row; where none
    follows (the data's last step), it counts as lost unless
    ``terminal_obs_in_done_row=True`` declares every done row complete.

    Bugs caught: a zero terminal observation with its reset row after it
    replaced by NaN or counted lost, or left waiting; the override not
    keeping a zero one at the end; a zero one at the end stored silently
    as 0 without the override (neither kept nor counted).
    """
    steps = 40
    raw = _countdown_loop(NEXT_STEP, steps)
    oracle = _countdown_loop(DISABLED, steps)
    assert raw["next", "done"][:, -1].any(), "no episode end on the last step"
    n_end = int(raw["next", "done"][:, -1].sum())

    def run(**options):
        filt = AutoresetFilter("next_step", layout=layout, **options)
        calls = (
            [raw[:, t] for t in range(steps)] if layout == "step" else [raw[:, :20], raw[:, 20:]]
        )
        outs = [filt(c) for c in calls] + [filt.flush()]
        return streams_from_rows(torch.cat([o for o in outs if o.batch_size[0]])), filt.stats

    kept, stats = run(terminal_obs_in_done_row=True)
    assert stats["terminal_obs_missing"] == 0 and stats["reset_rows_dropped"] > 0
    assert compare_streams(kept, {e: oracle[e] for e in range(E)}, 25) == 0
    read, stats = run(on_lost_terminal_obs="nan")
    assert stats["terminal_obs_missing"] == n_end  # the ends on the last step only
    assert compare_streams(read, {e: oracle[e] for e in range(E)}, 25) == n_end


def test_for_env_of_a_gymnasium_loop_keeps_a_truly_zero_terminal_obs():
    """A Gymnasium next-step vector env hands every done row its terminal
    observation, so a filter built by ``for_env(venv)`` reads no zeros as a
    fill. Bugs caught: a real all-zero terminal observation on the last
    step collected stored as NaN with a warning blaming TorchRL (or, for
    integer observations, a flush that raises and offers to drop a valid
    row), and a zero one mid-run "restitched" and counted where nothing
    was missing.
    """
    steps = 40
    raw = _countdown_loop(NEXT_STEP, steps)
    oracle = _countdown_loop(DISABLED, steps)
    assert raw["next", "done"][:, -1].any(), "no episode end on the last step"
    filt = AutoresetFilter.for_env(gym.vector.SyncVectorEnv([_Countdown] * E))
    with warnings.catch_warnings():
        warnings.simplefilter("error", cleanbuf.CleanbufWarning)
        outs = [filt(raw[:, t]) for t in range(steps)] + [filt.flush()]
    stats = filt.stats
    assert stats["reset_rows_dropped"] > 0
    assert stats["terminal_obs_missing"] == stats["next_obs_restitched"] == 0
    kept = streams_from_rows(torch.cat([o for o in outs if o.batch_size[0]]))
    assert compare_streams(kept, {e: oracle[e] for e in range(E)}, 25) == 0


def test_torchrl_joint_resets_still_count_their_losses():
    """TorchRL ``GymEnv("Pendulum-v1", num_envs=4)`` with a time limit: every
    end is a joint reset (all envs truncate together), whose zero-filled
    terminal observations are gone. Bugs caught: the zero fill read as a
    stored observation (zeros kept as a terminal state, no loss counted),
    the losses not matching the NaN rows, a real observation lost.
    """
    steps, batches, limit = 10, 4, 7
    oracle_env = make_env("Pendulum-v1", E, max_episode_steps=limit, disabled=True)
    oracle_collector = Collector(
        oracle_env, push_left_policy, frames_per_batch=E * steps, total_frames=E * steps * batches
    )
    oracle = streams_from_batches([b.clone() for b in oracle_collector])
    oracle_collector.shutdown()
    env = make_env("Pendulum-v1", E, max_episode_steps=limit)
    collector = Collector(
        env, push_left_policy, frames_per_batch=E * steps, total_frames=E * steps * batches
    )
    filt = AutoresetFilter.for_env(collector)
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=filt)
    for batch in collector:
        rb.extend(batch)
    collector.shutdown()
    filt.flush(rb)
    stats = filt.stats
    rows = rb[: len(rb)]
    n_nan = int(rows["next", "observation"].isnan().any(-1).sum())
    assert stats["terminal_obs_missing"] == n_nan == E * (steps * batches // limit)
    assert not (rows["next", "observation"] == 0).all(-1).any(), "a zero fill was kept"
    lost = compare_streams(streams_from_rows(rows), oracle, min_rows=steps * batches - 1)
    assert lost == n_nan


def test_terminal_obs_in_done_row_false_is_deprecated():
    """``terminal_obs_in_done_row=False`` could only turn stored terminal
    observations into NaN; the data decides now. Bug caught: the option
    still accepted silently (and obeyed), or refused outright (breaking
    code that passed it).
    """
    with pytest.warns(DeprecationWarning, match="read from the data"):
        filt = AutoresetFilter("next_step", terminal_obs_in_done_row=False)
    assert filt.options.terminal_obs_in_done_row is None
