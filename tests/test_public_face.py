"""The public face: one set of options, counters and ``for_env`` for the filter and the repair.

:class:`cleanbuf.AutoresetFilter`, :class:`cleanbuf.RolloutRepair` and
:func:`cleanbuf.clean` take the options of :class:`cleanbuf.Options` as
typed keyword-only parameters. Where the two classes overlap they must
agree: the same names and defaults, the same counters with the same
values on the same data, the same reading of a producer, the same warning.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import gymnasium as gym
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv

import cleanbuf
from cleanbuf import AutoresetFilter, CleanbufError, CleanbufWarning, Options, RolloutRepair
from tests.batches import next_step_batch
from tests.faults import lost_warnings

FIELDS = [f.name for f in dataclasses.fields(Options)]
# The filter's options for flat rows and several producers, which the repair refuses.
FLAT_ROW_OPTIONS = {"stream_key", "joint_key", "producer_key", "compact"}


def _keyword_only(fn) -> dict:
    return {
        name: p.default
        for name, p in inspect.signature(fn).parameters.items()
        if p.kind is p.KEYWORD_ONLY
    }


def test_every_option_is_a_typed_keyword_with_the_options_default():
    """Bugs caught: an option hidden in ``**options`` (help() and editors
    show nothing), a new Options field the classes do not take, a signature
    default that differs from the Options default (the filter built with no
    argument would not be ``Options()``), an option without a type.
    """
    params = inspect.signature(AutoresetFilter).parameters
    filt = _keyword_only(AutoresetFilter)
    assert ["mode", *filt] == FIELDS
    assert all(params[n].annotation is not inspect.Parameter.empty for n in FIELDS)
    assert Options.build(**filt) == Options()
    assert AutoresetFilter().options == Options()

    repair = _keyword_only(RolloutRepair)
    assert set(repair) - {"mask_key"} == set(filt) - FLAT_ROW_OPTIONS
    assert {n: repair[n] for n in repair if n in filt and n != "layout"} == {
        n: filt[n] for n in repair if n in filt and n != "layout"
    }

    clean = _keyword_only(cleanbuf.clean)
    assert set(FIELDS) <= set(clean)
    assert {n: clean[n] for n in FIELDS if n not in ("mode", "joint_reset")} == {
        n: filt[n] for n in FIELDS if n not in ("mode", "joint_reset")
    }


@pytest.mark.parametrize("make", [AutoresetFilter, RolloutRepair, cleanbuf.clean])
def test_a_misspelt_option_names_the_options(make):
    """Bug caught: a misspelt option silently ignored, or a bare TypeError
    that does not list the options, in one of the three entry points.
    """
    args = (next_step_batch(1, 4, 0),) if make is cleanbuf.clean else ()
    with pytest.raises(CleanbufError, match=r"unknown option\(s\) \['joint_rest'\]") as info:
        make(*args, joint_rest=True)
    listed = str(info.value)
    assert "'joint_reset'" in listed
    # each entry lists its own options: the repair's mask_key and not the
    # filter's flat-row options, which it refuses; clean()'s dst
    assert ("'mask_key'" in listed) == (make is RolloutRepair)
    assert ("'stream_key'" in listed) == (make is not RolloutRepair)
    assert ("'dst'" in listed) == (make is cleanbuf.clean)


def test_options_built_directly_are_checked():
    """Bug caught: ``Options(layout="nonsense")`` accepted (only
    ``Options.build`` checked), so a cleaner built from it fails later, deep
    inside a call, or reads the batch under no known layout.
    """
    for field, value in (("mode", "next"), ("layout", "rows"), ("on_lost_terminal_obs", "zero")):
        with pytest.raises(CleanbufError, match=f"Options\\({field}="):
            Options(**{field: value})
    assert Options(layout="time_first").layout == "time_first"


@pytest.mark.parametrize("option", sorted(FLAT_ROW_OPTIONS))
def test_the_repair_refuses_flat_row_options_naming_the_filter(option):
    """Bug caught: a flat-row option given to the repair ignored (its
    batches would be read under another layout than the user meant).
    """
    with pytest.raises(CleanbufError, match="AutoresetFilter"):
        RolloutRepair(**{option: True if option == "compact" else "env"})


def test_same_counters_same_values_on_the_same_data():
    """Bugs caught: a counter of the same name that means something else in
    the two classes (restitched or completed episodes counted differently),
    a reset row counted by one and not the other, rows lost between the two
    identities.
    """
    chained = next_step_batch(3, 30, 0)
    filt = AutoresetFilter("next_step")
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    rb.extend(chained)
    filt.flush(rb)
    repair = RolloutRepair("next_step")
    repair(chained)
    repair.flush()
    f, r = filt.stats, repair.stats
    shared = set(f) & set(r)
    assert shared == {
        "rows_in",
        "rows_out",
        "rows_held",
        "next_obs_restitched",
        "terminal_obs_missing",
        "next_obs_missing",
        "episodes_completed",
    }
    assert f["reset_rows_dropped"] > 0
    assert {k: f[k] for k in shared} == {k: r[k] for k in shared}
    assert f["reset_rows_dropped"] == r["reset_rows_masked"]
    assert f["lost_rows_dropped"] == r["lost_rows_masked"] == 0


def test_for_env_reads_one_producer_the_same_way():
    """Bugs caught: the repair's for_env reading a producer differently from
    the filter's (mode, joint reset, group size), or a repr that does not
    say where the options came from.
    """
    env = GymEnv("CartPole-v1", num_envs=2)
    try:
        filt, repair = AutoresetFilter.for_env(env), RolloutRepair.for_env(env)
    finally:
        env.close()
    for name in ("mode", "joint_reset", "reset_group_size", "on_lost_terminal_obs"):
        assert getattr(filt.options, name) == getattr(repair.options, name), name
    assert filt.options.joint_reset
    for obj in (filt, repr(filt), repair, repr(repair)):
        assert "from=" in str(obj) and "joint_reset=True" in str(obj)

    venv = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    try:
        filt, repair = AutoresetFilter.for_env(venv), RolloutRepair.for_env(venv)
    finally:
        venv.close()
    assert (filt.options.mode, repair.options.mode) == ("next_step", "next_step")
    assert filt.options.layout == "step" and "layout='time_first'" in repr(repair)


def _joint_batch(first: bool) -> TensorDict:
    """``[E=2, T=2]``: both envs end on the last step, their terminal observations zero."""
    base = 0.0 if first else 10.0
    obs = torch.tensor([[[base + 1], [base + 2]], [[base + 5], [base + 6]]])
    nxt = torch.tensor([[[base + 2], [0.0]], [[base + 6], [0.0]]])
    done = torch.tensor([[[False], [True]], [[False], [True]]])
    return TensorDict(
        {
            "observation": obs,
            ("next", "observation"): nxt,
            ("next", "reward"): torch.ones(2, 2, 1),
            ("next", "done"): done,
            "is_init": torch.tensor([[[True], [False]], [[True], [False]]]),
        },
        batch_size=[2, 2],
    )


def test_both_warn_once_at_the_users_line_with_the_same_ways_out():
    """Bugs caught: the two classes telling different stories about lost
    terminal observations (one without the count or a way out), a warning
    on every call, a warning that names a TorchRL frame instead of the
    user's line (the user cannot tell which call lost them).
    """
    filt = AutoresetFilter("next_step", joint_reset=True)
    rb = ReplayBuffer(storage=LazyTensorStorage(100), transform=filt)
    repair = RolloutRepair("next_step", joint_reset=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for first in (True, False):
            rb.extend(_joint_batch(first))
            repair(_joint_batch(first))
    lost = lost_warnings(caught)
    assert len(lost) == 2, [str(w.message) for w in lost]
    for w, who in zip(lost, ("filter", "repair")):
        text = str(w.message)
        assert issubclass(w.category, CleanbufWarning)
        assert text.split()[0] == "2" and f"before the {who} saw them" in text
        for fragment in ("lossless_gym_env", "on_lost_terminal_obs='drop'", "NaN"):
            assert fragment in text
        assert w.filename == __file__, w.filename
    assert filt.stats["terminal_obs_missing"] == repair.stats["terminal_obs_missing"] == 4


def test_repair_state_has_the_filters_layout_and_refuses_a_foreign_one():
    """Bugs caught: the repair saving its state in another layout than the
    filter (one checkpoint helper cannot handle both), a foreign state
    loaded half-way or failing deep inside with a KeyError, a state saved
    before the layout changed no longer loading.
    """
    batch = next_step_batch(2, 12, 0)
    repair = RolloutRepair("next_step")
    repair(batch)
    state = repair.state_dict()
    filt_state = AutoresetFilter("next_step").state_dict()
    assert list(state) == list(filt_state) == ["_extra_state"]
    for given in ({"weights": 1}, [1, 2], {"_extra_state": {"held": None}}):
        fresh = RolloutRepair("next_step")
        with pytest.raises(cleanbuf.StateError, match="state_dict"):
            fresh.load_state_dict(given)
        assert fresh.stats == RolloutRepair("next_step").stats
    expected = repair.flush()
    for saved in (state, state["_extra_state"]):  # the plain dict of 0.4 too
        fresh = RolloutRepair("next_step")
        fresh.load_state_dict(saved)
        assert fresh.stats["rows_held"] == 2
        torch.testing.assert_close(fresh.flush(), expected, equal_nan=True)
        assert fresh.stats == repair.stats


def test_clean_and_a_direct_call_warn_at_the_users_line():
    """Bugs caught: ``cleanbuf.clean`` returning NaN next observations
    without a word (the README says lost observations are warned about),
    and the filter called directly (a collector's ``postproc``) warning at a
    line inside torch's ``Module.__call__``.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = cleanbuf.clean(_joint_batch(True), joint_reset=True)
        cleanbuf.clean(_joint_batch(True), joint_reset=True, on_lost_terminal_obs="nan")
        AutoresetFilter("next_step", joint_reset=True)(_joint_batch(True))
    lost = lost_warnings(caught)
    assert len(lost) == 2, [str(w.message) for w in lost]
    assert str(lost[0].message).startswith("2 terminal observation(s) were lost before clean()")
    assert "before the filter saw" in str(lost[1].message)
    assert all(w.filename == __file__ for w in lost), [w.filename for w in lost]
    assert int(out["next", "observation"].isnan().sum()) == 2


def test_a_filter_refuses_a_repairs_state_by_name():
    """Bug caught: a repair's state given to a filter failing on an unrelated
    field ("state field 'version'"), so the user cannot tell they mixed the
    two checkpoints; or loaded half-way.
    """
    repair = RolloutRepair("next_step")
    repair(next_step_batch(2, 12, 0))
    filt = AutoresetFilter("next_step")
    before = filt.state_dict()
    with pytest.raises(cleanbuf.StateError, match="RolloutRepair's state"):
        filt.load_state_dict(repair.state_dict())
    assert str(filt.state_dict()) == str(before)
