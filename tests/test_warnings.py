"""Never a silent NaN: the filter warns when it marks lost terminal observations."""

from __future__ import annotations

import warnings

import pytest
from torchrl.data import LazyTensorStorage, ReplayBuffer

from cleanbuf import AutoresetFilter, CleanbufWarning
from tests.batches import next_step_batch
from tests.faults import lost_warnings
from tests.oracle import collect, make_env


def _joint_batches():
    """Two next-step calls, each with a joint reset (two streams, one reset group)."""
    for seed in range(100):
        batch = next_step_batch(2, 40, seed, group=2)
        done = batch["next", "done"].squeeze(-1)
        joint = done.all(0)
        if joint[:19].any() and joint[20:39].any():  # a joint reset in each half
            return batch[:, :20], batch[:, 20:]
    raise AssertionError("no seed with a joint reset in each half")


def test_lost_terminal_observations_warn_once():
    """Bugs caught: NaN next observations written without a word (a user
    reads no stats before training diverges), a warning on every call
    (noise that gets filtered away), a warning without the count or
    without both ways out.
    """
    filt = AutoresetFilter("next_step", joint_reset=True)
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    first, second = _joint_batches()
    with pytest.warns(CleanbufWarning) as record:
        rb.extend(first)
        rb.extend(second)
    lost = lost_warnings(record)
    assert len(lost) == 1
    message = str(lost[0].message)
    assert filt.stats["terminal_obs_missing"] >= 2
    assert message.split()[0].isdigit() and int(message.split()[0]) >= 1
    for fragment in ("lossless_gym_env", "on_lost_terminal_obs='drop'", "NaN"):
        assert fragment in message


def test_the_lost_warning_producers_run_as_printed():
    """Bug caught: the warning's aside ``gymnasium.make_vec(...,
    vector_kwargs={'autoreset_mode': ...})`` failed for CartPole, whose
    default vectorization builds its own vector env that takes no
    ``autoreset_mode``. Both producers it names now run as printed (name
    and num_envs filled in) and build a same-step or disabled vector env, the
    aside the same mode as ``lossless_gym_env`` (it said same-step where that
    builds a disabled one).
    """
    import re

    import gymnasium
    from gymnasium.vector import AutoresetMode

    import cleanbuf

    filt = AutoresetFilter("next_step", joint_reset=True)
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    with pytest.warns(CleanbufWarning) as record:
        for batch in _joint_batches():
            rb.extend(batch)
    message = str(lost_warnings(record)[0].message)
    calls = re.findall(r"(cleanbuf\.lossless_gym_env\([^)]*\)|gymnasium\.make_vec\(.*?\}\))",
                       message)  # fmt: skip
    assert len(calls) == 2, message
    modes = []
    for call in calls:
        names = {"cleanbuf": cleanbuf, "gymnasium": gymnasium, "AutoresetMode": AutoresetMode}
        env = eval(call, {**names, "name": "CartPole-v1", "num_envs": 2})
        vec = getattr(env, "_env", env)
        modes.append(vec.metadata["autoreset_mode"])
        env.close()
    # The aside says what lossless_gym_env builds (it said SAME_STEP; it builds DISABLED).
    assert modes[0] == modes[1] and modes[0] in (AutoresetMode.SAME_STEP, AutoresetMode.DISABLED)


def test_no_warning_when_a_policy_is_chosen():
    """Bug caught: warning users who chose how lost observations are stored."""
    filt = AutoresetFilter("next_step", joint_reset=True, on_lost_terminal_obs="nan")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CleanbufWarning)
        for batch in _joint_batches():
            filt.inv(batch)
    assert filt.stats["terminal_obs_missing"] >= 2


@pytest.mark.parametrize("disabled", [False, True], ids=["GymEnv(num_envs=4)", "DISABLED"])
def test_no_warning_without_losses(disabled):
    """A CartPole GymEnv(num_envs=4) run short enough that the four envs never
    end on the same step, and the explicit-reset producer. Bug caught: a
    warning (or NaN) where no terminal observation was lost.
    """
    env = make_env("CartPole-v1", 4, disabled=disabled)
    filt = AutoresetFilter.for_env(env)
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=filt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CleanbufWarning)
        for batch in collect(env, 4 * 8, 4 * 8 * 4):
            rb.extend(batch)
    env.close()
    assert filt.stats["terminal_obs_missing"] == 0
    if not disabled:
        assert filt.stats["reset_rows_dropped"] > 0  # episodes did end


def test_a_flush_of_rows_without_their_next_row_says_so():
    """Observation-only rows (``Collector(compact_obs=True)``) take each row's
    next observation from the next row of its env; at the end of collection
    each env's last row waits for a row never collected. The flush stores
    it not done with a NaN next observation. Bug caught: those rows stored
    without a word (``next_obs_missing`` counted, no warning), so a TD
    target bootstraps from NaN with no done to mask it.
    """
    import torch
    from torchrl.collectors import Collector

    torch.manual_seed(0)
    env = make_env("CartPole-v1", 4)
    env.set_seed(0)
    collector = Collector(
        env, None, frames_per_batch=4 * 25, total_frames=4 * 100, compact_obs=True
    )
    filt = AutoresetFilter.for_env(collector)
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=filt)
    for batch in collector:
        rb.extend(batch)
    collector.shutdown()
    n_before, missing = len(rb), filt.stats["next_obs_missing"]
    with pytest.warns(CleanbufWarning) as record:
        filt.flush(rb)
    flushed = rb[n_before : len(rb)]
    unmasked = ~flushed["next", "done"].reshape(-1) & flushed["next", "observation"].isnan().any(-1)
    n_next = filt.stats["next_obs_missing"] - missing
    assert n_next == int(unmasked.sum()) > 0, "no unmasked NaN row: the test shows nothing"
    said = [str(w.message) for w in record]
    assert any(f"{n_next} row(s) stored by filt.flush(rb) are not done" in m for m in said), said
    assert any("on_lost_terminal_obs='drop'" in m for m in said)


def test_rows_after_a_flush_that_lost_rows_are_said():
    """Bug caught: a flush after a batch (as for a checkpoint) stored a held row with
    NaN while its reset row came in the next batch, and nothing said so (the flush's
    warning said the row "was never collected"). The next write now warns once, naming
    the checkpoint; a flush at the end of collection, with no write after it, does not.
    """
    seed = next(s for s in range(100) if next_step_batch(2, 40, s)["next", "done"][:, 19].any())
    filt = AutoresetFilter("next_step")
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    batch = next_step_batch(2, 40, seed)
    rb.extend(batch[:, :20])  # a done row on its last step: held for its reset row
    assert filt.stats["rows_held"], "precondition: a held row to flush"
    with pytest.warns(CleanbufWarning) as record:
        filt.flush(rb)
    said = " ".join(str(w.message) for w in record)
    assert "had not come" in said and "rows came after" not in said
    with pytest.warns(CleanbufWarning, match="rows came after filt.flush") as record:
        rb.extend(batch[:, 20:])
    assert "filt.state_dict()" in str(record[0].message)
    assert not filt.__dict__["_flushed_lost"], "said once per flush"
    ended = AutoresetFilter("next_step")
    rb2 = ReplayBuffer(storage=LazyTensorStorage(1000), transform=ended)
    rb2.extend(batch[:, :20])
    with pytest.warns(CleanbufWarning):
        ended.flush(rb2)  # the end: nothing comes after, nothing more is said
    assert ended.__dict__.get("_flushed_lost"), "the notice waits for a write that never comes"


def test_the_repr_shows_checks_turned_off():
    """Bug caught: a filter with its safety checks off, or reading another reward key,
    printed the repr of one with the defaults.
    """
    text = repr(
        AutoresetFilter("next_step", check_reset_rows=False, check_continuity=False,
                        reward_key=("reward",))
    )  # fmt: skip
    for part in ("check_reset_rows=False", "check_continuity=False", "reward_key=('reward',)"):
        assert part in text, text
