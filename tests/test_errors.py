"""Bad input: each error names the key, what was expected and what came, and
the fix; the failed call changes no state and writes nothing to the buffer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

import cleanbuf
from cleanbuf import (
    AutoresetFilter,
    CleanbufError,
    InputError,
    LayoutError,
    ResetRowError,
    TerminalObservationLostError,
    clean,
    step_rows,
)
from tests.batches import next_step_batch, same_step_batch


def _state_equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _primed(**options):
    """A buffer with a filter that already holds rows (non-trivial state).

    Also returns the continuation of the primed streams, for checking that
    the filter still works after a rejected call.
    """
    for seed in range(100):
        filt = AutoresetFilter("next_step", **options)
        rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
        both = next_step_batch(2, 24, seed)
        rb.extend(both[:, :12])
        if filt.stats["rows_held"]:
            return filt, rb, both[:, 12:]
    raise AssertionError("no seed leaves a held row")


def assert_rejected(filt, rb, bad, error, *fragments, then=None):
    """Extends with a bad batch; checks the error, its message, and that
    neither the filter's state nor the buffer changed. With ``then`` (the
    continuation of the streams already written), also checks that the
    filter still works afterwards.
    """
    state, n = filt.state_dict(), len(rb)
    with pytest.raises(error) as info:
        rb.extend(bad)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    assert _state_equal(filt.state_dict(), state), "a failed call changed the state"
    assert len(rb) == n, "a failed call wrote to the buffer"
    if then is not None:
        rb.extend(then)  # the held rows are released
        assert filt.stats["rows_in"] == 48
    return message


def test_missing_done_key():
    """Bug caught: data without any done key cleaned as if nothing ever ended."""
    filt, rb, rest = _primed()
    bad = next_step_batch(2, 12, 1).exclude(("next", "done"))
    assert_rejected(
        filt, rb, bad, InputError, "no done key", "('next', 'done')", "done_key=", then=rest
    )


def test_missing_observation_key():
    """Bug caught: observation-only data passed through with no next
    observation and no error.
    """
    filt, rb, rest = _primed()
    bad = next_step_batch(2, 12, 1).exclude(("next", "observation"))
    assert_rejected(filt, rb, bad, InputError, "no observation key", "observation_keys=", then=rest)


def test_declared_observation_key_missing():
    """Bug caught: a typo in observation_keys silently ignored."""
    filt = AutoresetFilter("next_step", observation_keys=["pixels"])
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    with pytest.raises(InputError, match="'pixels' missing.*observation_keys="):
        rb.extend(next_step_batch(2, 12, 1))
    assert len(rb) == 0 and filt.stats["rows_in"] == 0


def test_done_not_boolean():
    """Bug caught: a float done (0.0 / 1.0) used as a mask or truthiness."""
    filt, rb, rest = _primed()
    bad = next_step_batch(2, 12, 1)
    bad.set(("next", "done"), bad["next", "done"].float())
    assert_rejected(
        filt,
        rb,
        bad,
        InputError,
        "('next', 'done')",
        "torch.bool",
        "torch.float32",
        ".bool()",
        then=rest,
    )


def test_done_with_several_flags_per_row():
    """Bug caught: a per-agent done [.., 2] flattened into twice the rows."""
    filt, rb, rest = _primed()
    bad = next_step_batch(2, 12, 1)
    bad.set(("next", "done"), bad["next", "done"].expand(2, 12, 2).clone())
    assert_rejected(filt, rb, bad, InputError, "one flag per row", "[2]", "done_key=", then=rest)


def test_non_tensor_entry():
    """Bug caught: a non-tensor entry (a string in the batch, which
    TensorDict's leaf iterator skips by default) silently left out of the
    stored rows.
    """
    filt, rb, rest = _primed()
    bad = rest.clone()
    bad.set_non_tensor(("info", "name"), "CartPole")
    assert_rejected(
        filt, rb, bad, InputError, "('info', 'name')", "not a tensor", "data.exclude", then=rest
    )


def test_observation_and_next_observation_shapes_differ():
    """Bug caught: re-stitching an observation into a next observation of
    another shape (broadcast or truncated silently).
    """
    filt, rb, rest = _primed(observation_keys=["observation"])
    bad = next_step_batch(2, 12, 1)
    bad.set(("next", "observation"), torch.zeros(2, 12, 3))
    assert_rejected(
        filt, rb, bad, InputError, "'observation'", "[2, 12, 1]", "[2, 12, 3]", then=rest
    )


def test_stream_count_changes_between_calls():
    """Bug caught: a held row of env 1 released into another env's stream
    after the env count changed.
    """
    filt, rb, rest = _primed()
    assert_rejected(
        filt, rb, next_step_batch(3, 12, 1), LayoutError, "[2]", "[3]", "flush()", then=rest
    )


def test_flattened_collector_batch_is_ambiguous():
    """Bug caught: data.reshape(-1) of [E, T] cleaned as one stream, which
    stitches env 1's observation into env 0's done row.
    """
    filt, rb, rest = _primed()
    bad = next_step_batch(2, 12, 1).reshape(-1)
    assert_rejected(
        filt, rb, bad, LayoutError, "reshape(-1)", "layout='step'", "stream_key=", then=rest
    )


def test_step_layout_rejects_time_batches():
    """Bug caught: an [E, T] batch read as T*E independent steps."""
    filt = AutoresetFilter("next_step", layout="step")
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    assert_rejected(filt, rb, next_step_batch(2, 12, 1), LayoutError, "layout='step' expects")


def test_integer_observation_lost_without_policy():
    """Bug caught: a lost terminal frame of an integer (Atari-like)
    observation filled with a silent garbage value (NaN cast to int).
    """
    filt = AutoresetFilter("next_step", joint_reset=True)
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    bad = next_step_batch(2, 30, 3, group=2)
    for key in ("observation", ("next", "observation")):
        bad.set(key, bad[key].to(torch.uint8))
    assert_rejected(
        filt, rb, bad, TerminalObservationLostError, "'observation'", "'drop'", "'keep'"
    )
    kept = AutoresetFilter("next_step", joint_reset=True, on_lost_terminal_obs="keep")
    rb2 = ReplayBuffer(storage=LazyTensorStorage(1000), transform=kept)
    rb2.extend(bad)
    assert kept.stats["terminal_obs_missing"] > 0 and len(rb2) == kept.stats["rows_out"]


def test_integer_observations_lost_are_offered_only_the_policies_that_apply():
    """Bug caught: the error for lost terminal observations of integer keys offered
    on_lost_terminal_obs='nan', which the next call then refused (a printed fix that
    fails); each policy it names is run as printed.
    """
    bad = next_step_batch(2, 30, 3, group=2)
    for key in ("observation", ("next", "observation")):
        bad.set(key, bad[key].to(torch.int64))
    with pytest.raises(TerminalObservationLostError) as info:
        AutoresetFilter("next_step", joint_reset=True).inv(bad)
    message = str(info.value)
    assert "'nan'" not in message and "for_env(env, on_lost_terminal_obs='drop')" in message
    assert "cleanbuf.lossless_gym_env(name, num_envs)" in message  # (the way to lose none)
    for policy in ("drop", "keep"):
        assert f"'{policy}' (" in message
        filt = AutoresetFilter("next_step", joint_reset=True, on_lost_terminal_obs=policy)
        assert len(filt.inv(bad)) == filt.stats["rows_out"] > 0


def test_same_step_integer_observations_without_final_are_offered_what_applies():
    """Bug caught: same-step done rows of integer observations without a final
    observation were offered on_lost_terminal_obs='nan' (then refused); floating ones
    are offered it, and it runs.
    """
    bad = same_step_batch(2, 30, 3, final=False)
    ints = bad.clone()
    for key in ("observation", ("next", "observation")):
        ints.set(key, ints[key].to(torch.int64))
    for batch, nan in ((ints, False), (bad, True)):
        with pytest.raises(TerminalObservationLostError) as info:
            AutoresetFilter("same_step").inv(batch)
        message = str(info.value)
        assert ("'nan' (mark them NaN)" in message) == nan, message
        for policy in ("drop", "keep", "nan") if nan else ("drop", "keep"):
            assert f"'{policy}' (" in message
            filt = AutoresetFilter("same_step", on_lost_terminal_obs=policy)
            assert len(filt.inv(batch)) == filt.stats["rows_out"] > 0


def test_a_missing_reward_key_error_gives_a_fix_that_runs():
    """Bug caught: the missing-reward error's example named ('reward',) where the
    batch had no such key; its fix is now the reward-like key found (run as printed),
    or a placeholder where none is found.
    """
    batch = next_step_batch(2, 30, 3)
    moved = batch.clone()
    moved.set("reward", moved.pop(("next", "reward")))
    with pytest.raises(InputError) as info:
        AutoresetFilter("next_step").inv(moved)
    assert "reward_key=('reward',)" in str(info.value)
    fixed = AutoresetFilter("next_step", reward_key=("reward",))
    assert len(fixed.inv(moved)) == len(AutoresetFilter("next_step").inv(batch))
    renamed = batch.clone()
    renamed.set(("next", "rew"), renamed.pop(("next", "reward")))
    with pytest.raises(InputError) as info:
        AutoresetFilter("next_step").inv(renamed)
    assert "reward_key=KEY" in str(info.value) and "('next', 'rew')" in str(info.value)


def test_a_reset_row_error_names_the_reward_key_and_a_loops_own_reset():
    """Bug caught: a raw loop that calls envs.reset() itself met a ResetRowError
    naming every cause but that one (a user then turned the checks off and lost
    real rows), and not the key read.
    """
    filt, rb, rest = _primed()
    bad = next_step_batch(2, 30, 3, group=2)
    assert_rejected(
        filt, rb, bad, ResetRowError, "nonzero reward (('next', 'reward'))",
        "step_rows(..., reset=mask)", then=rest,
    )  # fmt: skip


def test_nan_policy_on_integer_observation():
    """Bug caught: on_lost_terminal_obs='nan' honoured on uint8 (NaN -> 0)."""
    filt = AutoresetFilter("next_step", joint_reset=True, on_lost_terminal_obs="nan")
    bad = next_step_batch(2, 30, 3, group=2)
    bad.set(("next", "observation"), bad["next", "observation"].to(torch.int64))
    bad.set("observation", bad["observation"].to(torch.int64))
    with pytest.raises(InputError, match="cannot mark"):
        filt.inv(bad)


def test_joint_reset_data_with_a_plain_filter():
    """Bug caught: the real transition after a joint reset dropped as if it
    were a reset row (reward 1, so the signature check must fire).
    """
    filt, rb, rest = _primed()
    bad = next_step_batch(2, 30, 3, group=2)
    assert_rejected(
        filt,
        rb,
        bad,
        ResetRowError,
        "nonzero reward",
        "joint_reset=True",
        "check_reset_rows=False",
        "for_env",
        then=rest,
    )


def test_unknown_producer():
    """Bug caught: guessing a mode for an env we do not know."""
    with pytest.raises(CleanbufError, match="explicit mode"):
        AutoresetFilter.for_env(object())


def test_same_step_done_row_without_final_observation():
    """Bug caught: a same-step done row stored with the reset observation as
    its next observation (every truncation bootstrap silently wrong).
    """
    filt = AutoresetFilter("same_step")
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    batch = next_step_batch(2, 12, 1)  # no final-observation entry at all
    with pytest.raises(TerminalObservationLostError) as info:
        rb.extend(batch)
    msg = str(info.value)
    for fragment in ("final_obs", "final_obs_key=", "'drop'", "'nan'", "'keep'", "step_rows"):
        assert fragment in msg
    assert len(rb) == 0 and filt.stats["rows_in"] == 0


def test_bad_options():
    """Bug caught: a misspelt option or mode silently ignored."""
    with pytest.raises(CleanbufError, match="unknown option"):
        AutoresetFilter("next_step", joint_rest=True)
    with pytest.raises(CleanbufError, match="not a known auto-reset mode"):
        AutoresetFilter("nextstep")
    with pytest.raises(CleanbufError, match="layout="):
        AutoresetFilter("next_step", layout="rows")


def test_trajectory_ids_as_stream_key_are_refused():
    """TorchRL gives a next-step reset row the next episode's trajectory id,
    so grouping rows by it puts each reset row at the start of the next
    episode, where it looks like a first row. Bug caught: every reset row
    kept, silently (175 of 175 in a CartPole run), with
    stream_key=("collector", "traj_ids").
    """
    with pytest.raises(CleanbufError, match="name episodes, not envs"):
        AutoresetFilter("next_step", stream_key=("collector", "traj_ids"))
    with pytest.raises(CleanbufError, match="env index"):
        cleanbuf.clean(next_step_batch(2, 8, 0).reshape(-1), stream_key=("collector", "traj_ids"))


def test_clean_dict_with_mismatched_batch_shapes():
    """Bug caught: arrays of different lengths zipped into rows."""
    data = {
        "observation": np.zeros((5, 1), np.float32),
        "next": {
            "observation": np.zeros((4, 1), np.float32),
            "reward": np.zeros((5, 1), np.float32),
            "done": np.zeros((5, 1), bool),
        },
    }
    with pytest.raises(InputError, match=r"\('next', 'observation'\)"):
        clean(data, layout="time_last")


def _same_step_primed(**options):
    filt = AutoresetFilter("same_step", **options)
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    rb.extend(same_step_batch(2, 12, 0))
    return filt, rb


def test_final_entry_single_tensor_with_several_observation_keys():
    """Bug caught: one final-observation tensor written into two observation
    keys (or into the wrong one).
    """
    filt, rb = _same_step_primed()
    bad = same_step_batch(2, 12, 1)
    bad.set("pixels", torch.zeros(2, 12, 3))
    bad.set(("next", "pixels"), torch.zeros(2, 12, 3))
    assert_rejected(
        filt,
        rb,
        bad,
        InputError,
        "('next', 'final_obs')",
        "one tensor",
        "'observation'",
        "'pixels'",
    )


def test_final_entry_missing_an_observation_key():
    """Bug caught: a nested final-observation entry that lacks one of the
    observation keys, silently leaving that key's reset observation.
    """
    filt, rb = _same_step_primed()
    bad = same_step_batch(2, 12, 1)
    final = bad["next", "final_obs"]
    bad = bad.exclude(("next", "final_obs"))
    bad.set(("next", "final_obs", "observation"), final)
    for key in ("pixels", ("next", "pixels")):
        bad.set(key, torch.zeros(2, 12, 3))
    assert_rejected(
        filt, rb, bad, InputError, "lacks", "('next', 'final_obs', 'pixels')", "final_obs_key="
    )


def test_final_mask_not_boolean():
    """Bug caught: a 0/1 float mask used as truthiness, or as a row index."""
    filt, rb = _same_step_primed()
    bad = same_step_batch(2, 12, 1)
    bad.set(("next", "_final_obs"), bad["next", "_final_obs"].float())
    assert_rejected(
        filt, rb, bad, InputError, "('next', '_final_obs')", "torch.bool", "torch.float32"
    )


def test_final_entry_of_another_shape():
    """Bug caught: a final observation broadcast into a next observation of
    another shape.
    """
    filt, rb = _same_step_primed()
    bad = same_step_batch(2, 12, 1)
    bad.set(("next", "final_obs"), torch.zeros(2, 12, 5))
    assert_rejected(filt, rb, bad, InputError, "('next', 'final_obs')", "[2, 12, 5]", "[2, 12, 1]")


def test_observation_keys_partly_observation_only():
    """Bug caught: one observation key re-stitched from successors while
    another keeps its stored next observation (mixed layouts).
    """
    filt = AutoresetFilter("next_step", observation_keys=["observation", "pixels"])
    bad = next_step_batch(2, 12, 1)
    bad.set("pixels", torch.zeros(2, 12, 3))
    with pytest.raises(InputError, match=r"'observation' have a \('next', ...\) twin but 'pixels'"):
        filt.inv(bad)
    assert filt.stats["rows_in"] == 0


def test_joint_reset_with_same_step():
    """Bug caught: a next-step-only option silently ignored in same-step mode."""
    with pytest.raises(CleanbufError, match=r"joint_reset=True \(or joint_key=\) describes"):
        AutoresetFilter("same_step", joint_reset=True)


def test_joint_key_misuse():
    """Bugs caught: joint_reset=True on flat rows refused without naming the
    way that works (joint_key), a joint_key silently ignored on time-aligned
    batches, a batch without the joint key read as having no joint reset.
    """
    with pytest.raises(CleanbufError, match="joint_key=KEY"):
        AutoresetFilter("next_step", stream_key="env", joint_reset=True)
    with pytest.raises(CleanbufError, match="joint_key=.*goes with layout='stream_key'"):
        AutoresetFilter("next_step", joint_key="joint")
    filt = AutoresetFilter("next_step", stream_key="env", joint_key="joint")
    rb = ReplayBuffer(storage=LazyTensorStorage(100), transform=filt)
    rows = next_step_batch(2, 12).reshape(-1)
    rows.set("env", torch.arange(2).repeat_interleave(12))
    with pytest.raises(InputError, match="joint key 'joint' is missing from the batch"):
        rb.extend(rows)
    assert len(rb) == 0 and filt.stats["rows_in"] == 0


def test_step_rows_bad_input():
    """Bugs caught: per-env arrays of the wrong length zipped into rows; a
    Gymnasium step without truncations mistaken for an SB3 step.
    """
    obs = np.zeros((3, 4), np.float32)
    with pytest.raises(
        InputError, match=r"next_obs must have the envs first, shape \[3, ...\]; got shape \[2, 4\]"
    ):
        step_rows(obs, np.zeros(3), obs[:2], np.zeros(3), np.zeros(3, bool), np.zeros(3, bool))
    with pytest.raises(InputError, match="truncated=None is for Stable-Baselines3"):
        step_rows(obs, np.zeros(3), obs, np.zeros(3), np.zeros(3, bool), None, {})


def test_set_truncated_is_no_longer_needed():
    """set_truncated was an option until batch-end marks were read from the
    rows. Bugs caught: code that still passes it broken (an unknown-option
    error), or passing it silently changing what is stored (it must be
    ignored, with a DeprecationWarning that says so).
    """
    with pytest.warns(DeprecationWarning, match="set_truncated is no longer an option"):
        filt = AutoresetFilter("next_step", set_truncated=True)
    assert not hasattr(filt.options, "set_truncated")
    assert filt.options == AutoresetFilter("next_step").options


def test_options_of_the_multi_process_work():
    """Bugs caught: producer_key accepted with a layout whose rows are not
    [E, T] batches, a batch without the producer key routed by guess.
    """
    with pytest.raises(CleanbufError, match="producer_key"):
        AutoresetFilter("next_step", layout="step", producer_key=("collector", "traj_ids"))
    filt = AutoresetFilter("next_step", producer_key=("collector", "traj_ids"))
    rb = ReplayBuffer(storage=LazyTensorStorage(100), transform=filt)
    assert_rejected(filt, rb, next_step_batch(2, 12, 1), InputError, "producer_key",
                    "trajectory ids")  # fmt: skip
