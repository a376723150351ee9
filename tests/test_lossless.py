"""Fixed-horizon tasks: a producer that loses nothing, and losses without NaN.

TorchRL's ``GymEnv(name, num_envs=N)`` resets all N envs together when they
end on the same step; for a fixed-horizon task (Pendulum: every episode
ends at the time limit, all envs together) every terminal observation is
lost. ``cleanbuf.lossless_gym_env`` builds the env so that none is, and
``on_lost_terminal_obs="drop"`` keeps NaN out of the losses of the
``GymEnv`` data.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import Compose, GymEnv, InitTracker, StepCounter, TransformedEnv
from torchrl.modules import ValueOperator
from torchrl.objectives.value import TD0Estimator

import cleanbuf
from cleanbuf import AutoresetFilter, CleanbufError, CleanbufWarning
from tests.batches import assert_same_rows
from tests.faults import lost_warnings
from tests.oracle import STREAM, collect, compare_streams, make_env, streams_from_batches

E, T, HORIZON = 3, 8, 6
GAMMA = 0.9


def _pendulum_policy(td):
    """Deterministic: a torque against the angular velocity; tags each row's env."""
    batch = td.batch_size
    td.set("action", (-2.0 * td["observation"][..., 2:3]).clamp(-2.0, 2.0))
    td.set(STREAM, torch.arange(batch[-1]).expand(batch).clone())
    return td


def _collect(base, batches=5):
    env = TransformedEnv(base, Compose(StepCounter(), InitTracker()))
    env.set_seed(0)
    try:
        return collect(env, E * T, E * T * batches, policy=_pendulum_policy)
    finally:
        env.close()


def _pendulum_step(obs, action):
    """Gymnasium's Pendulum-v1 dynamics (g=10, m=l=1, dt=0.05) on observations."""
    th, thdot = torch.atan2(obs[:, 1], obs[:, 0]), obs[:, 2]
    u = action[:, 0].clamp(-2.0, 2.0)
    thdot = (thdot + (15.0 * torch.sin(th) + 3.0 * u) * 0.05).clamp(-8.0, 8.0)
    th = th + thdot * 0.05
    return torch.stack([torch.cos(th), torch.sin(th), thdot], -1)


def _oracle(batches=5):
    base = make_env("Pendulum-v1", E, HORIZON, disabled=True).base_env
    return streams_from_batches(_collect(base, batches))


def test_lossless_env_equals_the_explicit_reset_run():
    """Pendulum with a 6-step time limit: all three envs end together every
    six steps. Bugs caught: the helper building a next-step env (terminal
    observations lost: NaN or zeros where the oracle has states), a
    sub-env kwarg (max_episode_steps) not reaching the sub-envs (episodes
    of the wrong length), rows reordered or dropped.
    """
    got = _collect(cleanbuf.lossless_gym_env("Pendulum-v1", E, max_episode_steps=HORIZON))
    assert int(torch.cat(got, 1)["next", "done"].sum()) == E * (5 * T // HORIZON)
    assert compare_streams(streams_from_batches(got), _oracle(), min_rows=5 * T) == 0


def test_lossless_same_step_env_keeps_its_terminal_observations():
    """The same-step flavour draws its reset states in another order than
    explicit resets, so only its first episodes equal the oracle's row for
    row; after that every row's next observation must follow from its
    state and action, terminal rows included. Bug caught: a mode whose
    terminal rows hold the next episode's reset observation (the same-step
    artifact), or lost ones.
    """
    got = streams_from_batches(
        _collect(
            cleanbuf.lossless_gym_env(
                "Pendulum-v1", E, autoreset_mode="same_step", max_episode_steps=HORIZON
            )
        )
    )
    first = {e: rows[:HORIZON] for e, rows in got.items()}
    assert compare_streams(first, _oracle(1), min_rows=HORIZON) == 0
    for rows in got.values():
        nxt, obs = rows["next", "observation"], rows["observation"]
        start = rows["is_init"].squeeze(-1)[1:]
        assert int(start.sum()) == len(rows) // HORIZON - (len(rows) % HORIZON == 0)
        assert torch.equal(nxt[:-1][~start], obs[1:][~start])  # chains within episodes
        # Every next observation, terminal ones included, is Pendulum's physics
        # applied to the row's state and action; a reset state is not.
        torch.testing.assert_close(nxt, _pendulum_step(obs, rows["action"]), atol=1e-4, rtol=0)


def test_lossless_env_needs_no_filter():
    """Bug caught: for_env cleaning (or warning about) data TorchRL already
    repaired; the helper accepting a next-step mode (which loses data).
    """
    env = cleanbuf.lossless_gym_env("Pendulum-v1", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CleanbufWarning)
        assert AutoresetFilter.for_env(env).options.mode == "disabled"
    env.close()
    with pytest.raises(CleanbufError, match="'disabled' or 'same_step'"):
        cleanbuf.lossless_gym_env("Pendulum-v1", 2, autoreset_mode="next_step")


def test_for_env_warns_when_a_loss_happens_not_before():
    """``for_env`` on CartPole and Pendulum ``GymEnv(num_envs=2)`` stays
    silent; a Pendulum run warns at the call of its first joint reset, with
    the count and both ways out, and only once.
    Bugs caught: a construction warning for every ``GymEnv`` with a time
    limit (CartPole's 500 steps, which random-policy episodes never reach:
    nothing is lost, and a warning that always fires teaches users to
    ignore the one that matters); a Pendulum run storing NaN without a word;
    a warning for a user who chose ``on_lost_terminal_obs``; a warning whose
    count (the first lossy batch's) reads as the run's total.
    """
    for name in ("CartPole-v1", "Pendulum-v1"):
        env = GymEnv(name, num_envs=2)
        with warnings.catch_warnings():
            warnings.simplefilter("error", CleanbufWarning)
            filt = AutoresetFilter.for_env(env)
        env.close()
        assert "time limit" in repr(filt)  # the repr still tells where losses come from
    env = GymEnv("Pendulum-v1", num_envs=E, max_episode_steps=HORIZON)
    filt = AutoresetFilter.for_env(env)
    chosen = AutoresetFilter.for_env(env, on_lost_terminal_obs="drop")
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    batches = _collect(env, batches=3)  # [E, T=8] each: joint resets at steps 6 and 12
    with warnings.catch_warnings():
        warnings.simplefilter("error", CleanbufWarning)
        rb.extend(batches[0][:, : HORIZON - 1])  # no episode ended yet
    with pytest.warns(CleanbufWarning) as record:
        rb.extend(batches[0][:, HORIZON - 1 :])
        for batch in batches[1:]:
            rb.extend(batch)
    lost = lost_warnings(record)
    assert len(lost) == 1
    message = str(lost[0].message)
    assert message.startswith(f"{E} terminal observation(s) were lost")
    # (the count is the first lossy batch's: the text says so, and where the total is)
    for fragment in ("lossless_gym_env", "on_lost_terminal_obs='drop'", "first batch that lost"):
        assert fragment in message
    # the last episode ends on the last batch's last step: held one call (it
    # could be a collector's batch-end mark), and taken for a real end at the flush
    assert filt.stats["terminal_obs_missing"] == E * (3 * T // HORIZON - 1)
    filt.flush(rb)
    assert filt.stats["terminal_obs_missing"] == E * (3 * T // HORIZON)
    assert "on_lost_terminal_obs='drop'" in repr(chosen)
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=chosen)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CleanbufWarning)
        for batch in batches:
            rb.extend(batch)
        chosen.flush(rb)
    assert chosen.stats["lost_rows_dropped"] == filt.stats["terminal_obs_missing"]


def _td0_targets(on_lost_terminal_obs):
    """TorchRL's TD(0) target and r + gamma (1 - terminated) V(s') by hand,
    on every row a filtered buffer holds after a fixed-horizon GymEnv run.
    """
    env = GymEnv("Pendulum-v1", num_envs=E, max_episode_steps=HORIZON)
    env.set_seed(0)
    options = {} if on_lost_terminal_obs is None else {"on_lost_terminal_obs": on_lost_terminal_obs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CleanbufWarning)
        filt = AutoresetFilter.for_env(env, **options)
        rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt, batch_size=64)
        collector = Collector(env, None, frames_per_batch=E * T, total_frames=E * T * 5)
        try:
            for batch in collector:
                rb.extend(batch)
        finally:
            collector.shutdown()
    assert filt.stats["terminal_obs_missing"] == E * (5 * T // HORIZON)
    torch.manual_seed(0)
    value = ValueOperator(nn.Linear(3, 1), in_keys=["observation"])
    rows = rb[: len(rb)]
    with torch.no_grad():
        target = TD0Estimator(gamma=GAMMA, value_network=value).value_estimate(rows.clone())
        nxt = value(rows["next"].select("observation").clone())["state_value"]
    term = rows["next", "terminated"].float()
    by_hand = rows["next", "reward"] + GAMMA * (1 - term) * nxt
    return target, by_hand


def test_drop_keeps_nan_out_of_td_targets():
    """The documented NaN-free option, with TorchRL's own value estimator on
    the rows of a Pendulum run whose terminal observations are all lost.
    Bug caught: 'drop' storing the rows anyway (a NaN next observation: the
    hand-written target is NaN, and TorchRL's estimator, which swaps a NaN
    next observation for the current one, no longer equals it).
    """
    target, by_hand = _td0_targets("drop")
    assert torch.isfinite(target).all()
    torch.testing.assert_close(target, by_hand)
    # The default (NaN) is what the test tells apart from 'drop'.
    target, by_hand = _td0_targets(None)
    assert not torch.isfinite(by_hand).all()


def _row_bytes(td):
    """Bytes per row of a TensorDict whose first dimension is rows."""
    return sum(v[0].numel() * v.element_size() for v in td.values(True, True))


def test_lossless_recipe_stores_rows_like_the_filtered_buffer():
    """The fixed-horizon recipe: ``lossless_gym_env`` with the pass-through
    filter ``AutoresetFilter.for_env(env)``, written by
    ``Collector(replay_buffer=rb)`` and by ``rb.extend(batch)``.
    Bugs caught: the buffer storing ``[T]``-step chunks (a storage of
    ``[capacity, T]``, T times the memory the frames need, and ``sample(4)``
    of ``[4, T]``), a row lost or altered on the way, the two ways of
    writing storing different rows.
    """
    capacity, batches = 1000, 3
    stored = []
    for through_collector in (True, False):
        env = cleanbuf.lossless_gym_env("Pendulum-v1", E, max_episode_steps=HORIZON)
        env.set_seed(0)
        filt = AutoresetFilter.for_env(env)
        assert filt.options.mode == "disabled"
        rb = ReplayBuffer(storage=LazyTensorStorage(capacity), transform=filt)
        got = collect(env, E * T, E * T * batches, rb if through_collector else None, _policy)
        for batch in got:
            rb.extend(batch)
        env.close()
        storage = rb.storage._storage
        assert storage.batch_size == (capacity,) and len(rb) == E * T * batches
        assert rb.sample(4).batch_size == (4,)
        rows = rb[: len(rb)]
        assert _row_bytes(storage) == _row_bytes(rows)  # what the frames need, per row
        assert not rows["next", "observation"].isnan().any()
        assert int(rows["next", "done"].sum()) == E * (T * batches // HORIZON)
        stored.append(rows)
    assert_same_rows(stored[0], stored[1])
    # Without the filter TorchRL stores each env's [T] steps as one item.
    env = cleanbuf.lossless_gym_env("Pendulum-v1", E, max_episode_steps=HORIZON)
    rb = ReplayBuffer(storage=LazyTensorStorage(capacity))
    collect(env, E * T, E * T, rb, _policy)
    env.close()
    assert rb.storage._storage.batch_size == (capacity, T)


def _policy(td):
    """The deterministic Pendulum policy (torque against the angular velocity)."""
    td.set("action", (-2.0 * td["observation"][..., 2:3]).clamp(-2.0, 2.0))
    return td
