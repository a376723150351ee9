"""RolloutRepair: on-policy batches repaired in place, against the explicit-reset run.

The repaired batch keeps its time axis; on its valid rows (``("collector",
"mask")``), every TorchRL value estimator must give what it gives on the same
env run with explicit resets (Gymnasium ``AutoresetMode.DISABLED``), same
seeds, same deterministic policy.
"""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import Collector
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

from cleanbuf import CleanbufWarning, InputError, LayoutError, RolloutRepair
from tests.batches import grid_td
from tests.oracle import collect, make_env
from tests.reference import simulate
from tests.rollout_helpers import (
    ESTIMATORS,
    actor,
    add_behaviour_log_prob,
    compare_valid_rows,
    estimate,
    mixed_policy,
    raw_loop,
    value_net,
)

E, T, BATCHES, LIMIT = 4, 10, 12, 20
TOL = 1e-5  # float32 sums in another order: what float precision allows
MASK = ("collector", "mask")
ODD_CHUNKS = (7, 10, 1, 13, 4, 9, 2, 11)  # batch boundaries anywhere


def _identity(stats):
    return stats["rows_in"] == (
        stats["rows_out"] + stats["reset_rows_masked"] + stats["lost_rows_masked"]
        + stats["rows_held"]
    )  # fmt: skip


@pytest.fixture(scope="module")
def cartpole():
    """TorchRL ``GymEnv(num_envs=4)`` batches, repaired as the collector's postproc.

    Returns the raw batches, the repaired ones (the flush last), the repair
    and the explicit-reset run's batches.
    """
    env = make_env("CartPole-v1", E, LIMIT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CleanbufWarning)  # the time-limit prediction
        repair = RolloutRepair.for_env(env)
    raw = []

    def postproc(batch):
        raw.append(batch.clone())
        return repair(batch)

    collector = Collector(
        env, mixed_policy, frames_per_batch=E * T, total_frames=E * T * BATCHES, postproc=postproc
    )
    try:
        repaired = [b.clone() for b in collector]
    finally:
        collector.shutdown()
        env.close()
    repaired.append(repair.flush())
    oracle_env = make_env("CartPole-v1", E, LIMIT, disabled=True)
    oracle = collect(oracle_env, E * T, E * T * BATCHES, policy=mixed_policy)
    return raw, repaired, repair, torch.cat(oracle, 1)


def _rechunked(raw, sizes=ODD_CHUNKS):
    """The raw batches cut at other boundaries, repaired; returns their concatenation."""
    data = torch.cat(raw, 1)
    repair = RolloutRepair(joint_reset=True)
    outs, t, i = [], 0, 0
    while t < data.shape[1]:
        size = sizes[i % len(sizes)]
        outs.append(repair(data[:, t : t + size]))
        t, i = t + size, i + 1
    outs.append(repair.flush())
    return torch.cat(outs, 1), repair, data


def test_collector_postproc_keeps_the_time_axis(cartpole):
    """Bugs caught: flat rows from the postproc (GAE would take the one dimension
    for time and chain each env's last row into the next env's rows), a frame
    returned twice or lost across the held column, and bookkeeping (is_init,
    step_count) that differs from the explicit-reset run on valid rows.
    """
    raw, repaired, repair, oracle = cartpole
    shapes = [tuple(b.batch_size) for b in repaired]
    assert shapes == [(E, T - 1)] + [(E, T)] * (BATCHES - 1) + [(E, 1)]
    done = torch.cat(raw, 1)["next", "done"].squeeze(-1)
    # the data must hold what the test is about: truncations, terminations,
    # and a done row on a batch's last step (its reset row first in the next)
    assert done[:, T - 1 :: T].any()
    whole = torch.cat(repaired, 1)
    assert whole.shape == (E, T * BATCHES)
    for e in range(E):
        r = whole[e][whole[e][MASK]]
        o = oracle[e][: len(r)]
        for key in ("is_init", "step_count", ("next", "step_count"), ("next", "observation")):
            assert torch.equal(r[key], o[key]), (e, key)
    assert whole["next", "truncated"][whole[MASK]].any()
    assert whole["next", "terminated"][whole[MASK]].any()
    assert _identity(repair.stats) and repair.stats["rows_held"] == 0


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_estimators_equal_explicit_reset_run(cartpole, name):
    """Bugs caught: a reset row that chains into the next episode (advantages
    off by the next episode's return), a truncated done row bootstrapped from
    TorchRL's zero-filled next observation, a done row on a batch's last step
    left without its terminal observation, and a batch boundary that changes
    the result (the raw batches are cut at odd places: 7, 1, 13 steps...).
    """
    raw, repaired, _, oracle = cartpole
    want = estimate(name, oracle)
    for whole in (torch.cat(repaired, 1), _rechunked(raw)[0]):
        got = estimate(name, whole)
        worst, n_rows = compare_valid_rows(got, want)
        assert n_rows > 0.8 * oracle.numel() and worst < TOL, (worst, n_rows)
        if name != "VTrace":  # inert reset rows: no bootstrap, no chaining (target 0)
            assert got["value_target"][~got[MASK]].eq(0).all()
    # As TorchRL stores it, the same estimator is wrong: the test can fail.
    dirty = estimate(name, torch.cat(raw, 1))
    dirty.set(MASK, torch.ones(dirty.shape, dtype=torch.bool))
    with pytest.raises(AssertionError):
        compare_valid_rows(dirty, want)


def test_ppo_loss_with_mask_equals_loss_on_valid_rows(cartpole):
    """Bugs caught: reset rows left unmasked (ClipPPOLoss trains the
    log-probability of an action the env ignored), a mask key TorchRL's
    losses do not read, and normalize_advantage over masked rows (it reads
    only "shifted_valid", which must be set after the estimator).
    """
    _, repaired, _, _ = cartpole
    batch = add_behaviour_log_prob(torch.cat(repaired, 1), "action_log_prob")
    critic = value_net()
    with torch.no_grad():
        GAE(gamma=0.99, lmbda=0.95, value_network=critic)(batch)
    assert not batch[MASK].all()
    for normalize in (False, True):
        loss = ClipPPOLoss(actor(), critic, normalize_advantage=normalize)
        loss.set_keys(sample_log_prob="action_log_prob")
        b = batch.clone()
        if normalize:  # after the estimator, never before
            b.set("shifted_valid", b[MASK].clone())
        on_valid, masked = loss(b[b[MASK]]), loss(b)
        for key in ("loss_objective", "loss_critic"):
            torch.testing.assert_close(masked[key], on_valid[key], rtol=1e-5, atol=1e-6)
        wrong = [b.exclude(MASK, "shifted_valid")]  # the reset rows in the loss
        if normalize:
            wrong.append(b.exclude("shifted_valid"))  # normalised over the masked rows
        for w in wrong:
            assert not torch.allclose(loss(w)["loss_objective"], on_valid["loss_objective"])


def test_held_column_and_batch_ends(cartpole):
    """Bugs caught: a done row on a batch's last step returned before its reset
    row came (zeros as its terminal observation), the reset row that opens the
    next batch left unmasked or chaining, and a flush that loses or repeats
    the held column. Position-coded rows: observation = 1000 * env + step.
    """
    obs = torch.tensor([[0.0, 1, 2, 3], [1000, 1001, 1002, 1003]])[..., None]
    nxt = obs + 1
    nxt[0, 3] = 0  # stream 0 ends on the batch's last step (zero-filled)
    done = torch.zeros(2, 4, 1, dtype=torch.bool)
    done[0, 3] = True
    first = TensorDict({
        "observation": obs, ("next", "observation"): nxt, ("next", "done"): done,
        ("next", "terminated"): done.clone(), ("next", "truncated"): torch.zeros_like(done),
        ("next", "reward"): torch.ones(2, 4, 1),
    }, batch_size=[2, 4])  # fmt: skip
    second = first.clone()
    second["observation"] = torch.tensor([[4.0, 50, 51, 52], [1004, 1005, 1006, 1007]])[..., None]
    second["next", "observation"] = second["observation"] + 1
    second["next", "observation"][0, 0] = 50.0  # the reset row: terminal obs 4 -> reset obs 50
    second["next", "reward"][0, 0] = 0.0
    for key in ("done", "terminated"):
        second["next", key].zero_()
    repair = RolloutRepair()
    out1, out2 = repair(first), repair(second)
    assert out1.batch_size == (2, 3) and out2.batch_size == (2, 4)
    # the held done row comes first in the next output, with its terminal obs
    assert out2["observation"][0, :2].flatten().tolist() == [3.0, 4.0]
    assert out2["next", "observation"][0, 0].item() == 4.0
    assert out2[MASK][0].tolist() == [True, False, True, True]
    assert out2["next", "done"][0, :2].flatten().tolist() == [True, True]  # inert reset row
    assert out2["next", "reward"][0, 1].item() == 0.0
    assert out2[MASK][1].all() and not out2["next", "done"][1].any()
    tail = repair.flush()
    assert tail["observation"].flatten().tolist() == [52.0, 1007.0]
    assert repair.flush() is None
    s = repair.stats
    assert s["rows_in"] == 16 and s["reset_rows_masked"] == 1 and s["rows_held"] == 0
    assert _identity(s)


def test_stats_add_up_at_every_call(cartpole):
    """Bugs caught: a row counted twice or not at all (the identity
    rows_in == rows_out + reset_rows_masked + lost_rows_masked + rows_held
    breaks), and returned rows that disagree with the counters.
    """
    raw, _, _, _ = cartpole
    repair = RolloutRepair(joint_reset=True)
    returned = valid = 0
    for batch in raw:
        out = repair(batch)
        returned += out.numel()
        valid += int(out[MASK].sum())
        s = repair.stats
        assert _identity(s) and s["rows_held"] == E
        assert s["rows_out"] == valid and returned + s["rows_held"] == s["rows_in"]
    tail = repair.flush()
    s = repair.stats
    assert _identity(s) and s["rows_held"] == 0 and tail.numel() == E
    data = torch.cat(raw, 1)["next", "done"].squeeze(-1)
    ends = int(data[:, :-1].sum())  # each is followed by a reset row in the data
    assert s["reset_rows_masked"] == ends and s["episodes_completed"] == int(data.sum())


def test_bad_input_changes_no_state(cartpole):
    """Bugs caught: a batch without a time axis or with other streams repaired
    anyway (streams mixed up), and a failed call that leaves state behind (the
    next good batch then comes out differently).
    """
    raw, _, _, _ = cartpole
    good, twin = RolloutRepair(joint_reset=True), RolloutRepair(joint_reset=True)
    good(raw[0])
    twin(raw[0])
    before = good.stats
    with pytest.raises(LayoutError, match="no stream dimension"):
        good(raw[1][:, 0])  # one step of E envs: no time axis
    with pytest.raises(LayoutError, match="streams changed"):
        good(raw[1][:2])
    bad = raw[1].clone()
    bad.set(("next", "done"), bad["next", "done"].int())
    with pytest.raises(InputError, match="torch.bool"):
        good(bad)
    assert good.stats == before
    a, b = good(raw[1]), twin(raw[1])
    assert (a == b).all() and good.stats == twin.stats


def test_joint_reset_never_bootstraps_from_zeros():
    """Bugs caught: TorchRL's zero-filled terminal observations after a joint
    reset (Pendulum: all envs truncate together) used as real states (value
    targets from V(0), as on the data TorchRL stores); the loss left silent
    (no warning, not counted); and the masked alternative left valid or
    bootstrapping from zeros.
    """
    env = make_env("Pendulum-v1", 2, 8)
    batches = collect(env, 2 * 5, 2 * 5 * 4)
    env.close()
    value = value_net(n_obs=3)
    gae = GAE(gamma=0.99, lmbda=0.95, value_network=value)
    raw = torch.cat(batches, 1)
    raw_done = raw["next", "done"].squeeze(-1)
    assert raw["next", "observation"][raw_done].eq(0).all()  # what TorchRL stores
    for policy in (None, "drop"):
        repair = RolloutRepair(joint_reset=True, on_lost_terminal_obs=policy)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            whole = torch.cat([repair(b) for b in batches] + [repair.flush()], 1)
        done = whole["next", "done"].squeeze(-1)
        with torch.no_grad():
            gae(whole)
            v_obs = value(whole.select("observation").clone())["state_value"][done]
            v_zero = value(TensorDict({"observation": torch.zeros(1, 3)}, [1]))["state_value"]
        # each episode end bootstraps from V(s_{T-1}) (TorchRL's reading of a
        # lost next observation), never from V(0)
        reward = whole["next", "reward"][done]
        torch.testing.assert_close(whole["value_target"][done], reward + 0.99 * v_obs)
        assert not torch.isclose(whole["value_target"][done], reward + 0.99 * v_zero).any()
        s = repair.stats
        assert done.sum() >= 4 and s["terminal_obs_missing"] == int(done.sum()) and _identity(s)
        warned = [w for w in caught if issubclass(w.category, CleanbufWarning)]
        if policy is None:
            assert whole["next", "observation"][done].isnan().all() and len(warned) == 1
            assert whole[MASK][done].all()
        else:
            assert not warned and s["lost_rows_masked"] == int(done.sum())
            assert not whole[MASK][done].any() and whole["advantage"].isfinite().all()
            assert torch.equal(whole["next", "observation"][done], whole["observation"][done])


@pytest.mark.parametrize("numpy_arrays", [False, True], ids=["TensorDict", "numpy"])
def test_raw_next_step_loop_time_first(numpy_arrays):
    """Bugs caught: a time-first [T, E] rollout read with time last (streams
    mixed up), reset rows of a raw next-step loop (CleanRL, SB3 storage)
    left to chain into the next episode, and arrays returned as another kind.
    """
    modes = gym.vector.AutoresetMode
    data = raw_loop(modes.NEXT_STEP, E, 90, LIMIT, with_info=False)
    oracle = raw_loop(modes.DISABLED, E, 90, LIMIT, with_info=False)
    repair = RolloutRepair(layout="time_first")
    outs = []
    for t in range(0, 90, 30):
        chunk = data[t : t + 30]
        if numpy_arrays:
            chunk = {k: v.numpy() for k, v in chunk.items(True, True)}
            out = repair(chunk)
            assert isinstance(out["next"]["observation"], np.ndarray)
            out = TensorDict(out, batch_size=[30, E])
        else:
            out = repair(chunk)
        assert out.batch_size == (30, E)  # the done rows hold their terminal obs: no wait
        outs.append(out)
    assert repair.flush() is None
    whole = torch.cat(outs, 0)
    assert not whole[MASK].all()
    kw = {"time_dim": 0}
    worst, n_rows = compare_valid_rows(estimate("GAE", whole, **kw), estimate("GAE", oracle, **kw),
                                       time_dim=0)  # fmt: skip
    assert worst < TOL and n_rows > 200


def test_same_step_loop():
    """Bugs caught: a same-step producer's done rows left with the reset
    observation as next observation (bootstrapping from the next episode's
    first state) instead of the final observation from the info.
    """
    modes = gym.vector.AutoresetMode
    data = raw_loop(modes.SAME_STEP, E, 60, LIMIT, with_info=True)
    oracle = raw_loop(modes.DISABLED, E, 60, LIMIT, with_info=False)
    repair = RolloutRepair("same_step", layout="time_first")
    whole = torch.cat([repair(data[:25]), repair(data[25:])], 0)
    assert whole[MASK].all() and ("next", "final_obs") not in whole.keys(True)
    kw = {"time_dim": 0}
    worst, n_rows = compare_valid_rows(estimate("GAE", whole, **kw), estimate("GAE", oracle, **kw),
                                       time_dim=0)  # fmt: skip
    assert worst < TOL and n_rows > 150
    assert repair.stats["next_obs_restitched"] == int(data["next", "done"].sum())


def test_state_dict_restores_the_held_column(cartpole, tmp_path):
    """Bugs caught: a checkpoint that forgets the held column (a frame lost,
    its done row never completed) or the cleaner's carry (the next batch's
    reset row left unmasked), or that is not picklable.
    """
    raw, _, _, _ = cartpole
    repair = RolloutRepair(joint_reset=True)
    for batch in raw[:3]:
        repair(batch)
    torch.save(repair.state_dict(), tmp_path / "repair.pt")
    restored = RolloutRepair(joint_reset=True)
    restored.load_state_dict(torch.load(tmp_path / "repair.pt", weights_only=False))
    assert restored.stats == repair.stats
    for batch in raw[3:]:
        assert (restored(batch) == repair(batch)).all()
    assert (restored.flush() == repair.flush()).all() and restored.stats == repair.stats


def test_for_env_reads_a_raw_vector_env_as_time_first():
    """Bugs caught: for_env taking a raw Gymnasium loop's [T, E] rollouts as
    TorchRL's [E, T] batches (streams and time swapped), or holding the last
    step of a producer whose done rows keep their terminal observation.
    """
    envs = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    repair = RolloutRepair.for_env(envs)
    envs.close()
    assert "layout='time_first'" in repr(repair)
    assert repair.options.mode == "next_step" and repair.options.terminal_obs_in_done_row


def test_batch_end_marks_are_undone(cartpole):
    """Bugs caught: a collector's batch-end truncation marks
    (Collector(set_truncated=True)) left as episode ends once their column
    is no batch end any more (GAE then bootstraps there instead of chaining:
    advantages off), or a real end on a batch's last step taken for a mark.
    """
    raw, _, _, _ = cartpole
    marked = []
    for batch in raw:
        b = batch.clone()
        for key in ("truncated", "done"):
            b["next", key][:, -1] = True  # what set_truncated=True writes
        marked.append(b)
    plain = RolloutRepair(joint_reset=True)
    repair = RolloutRepair(joint_reset=True)  # marks need no option
    for b, m in zip(raw, marked, strict=True):
        want, got = plain(b), repair(m)
        # a terminated row keeps the mark's truncated flag (the env may set
        # both), which no estimator reads: terminated cuts and does not bootstrap
        terminated = want["next", "terminated"]
        assert torch.equal(got["next", "truncated"] & ~terminated, want["next", "truncated"])
        assert (got.exclude(("next", "truncated")) == want.exclude(("next", "truncated"))).all()
    assert repair.stats["episodes_completed"] == plain.stats["episodes_completed"]


def test_observation_only_rows_get_their_next_observations():
    """Bugs caught: observation-only batches (Collector(compact_obs=True):
    no ("next", "observation")) returned without next observations, or with
    a stream's last row never completed across the batch boundary.
    """
    raw, _ = simulate(np.random.default_rng(1), 3, 24, max_len=5)
    full, obs_only = grid_td(raw, (3,)), grid_td(raw, (3,), obs_only=True)
    a, b = RolloutRepair(), RolloutRepair(observation_keys=["observation"])
    for t in range(0, 24, 8):
        want, got = a(full[:, t : t + 8]), b(obs_only[:, t : t + 8])
        mask = want[MASK]
        assert torch.equal(got[MASK], mask) and not mask.all()
        assert torch.equal(got["next", "observation"][mask], want["next", "observation"][mask])
    assert _identity(b.stats) and b.stats["reset_rows_masked"] == a.stats["reset_rows_masked"]


def test_a_dict_whose_done_flags_have_another_name():
    """A rollout as a dict of numpy arrays whose done flags are stored
    under another name, given with ``done_key=``. Bug caught: the repair
    read the batch dimensions from the standard done keys only, so it
    refused the dict with "name the key ... with done_key=", the option
    the user had passed; also checks that the repaired arrays equal the
    TensorDict path's.
    """
    from tests.batches import next_step_batch

    batch = next_step_batch(3, 12, 7)
    want = RolloutRepair("next_step")(batch)
    arrays = {
        k if isinstance(k, str) else "/".join(k): v.numpy() for k, v in batch.items(True, True)
    }
    arrays["next/dones"] = arrays.pop("next/done")
    got = RolloutRepair("next_step", done_key=("next", "dones"))(arrays)
    np.testing.assert_array_equal(got["next"]["observation"], want["next", "observation"].numpy())
    np.testing.assert_array_equal(got["collector"]["mask"], want["collector", "mask"].numpy())
