"""One kernel call per call, the two ways it reads stream ends, and the schema cache.

Every call is read and planned in one kernel call (``_kernels.one_pass``,
through ``Reader._run_kernel``; a call with nothing to clean reads its stream
ends alone, ``_kernels.stream_ends``). Its stream ends come either as the rows
themselves (one observation key that numpy views whole) or as each stream's
first and last rows, every key's bytes side by side (several keys, rows on
another device or not contiguous: ``_continuity.EndRows``). These tests run
both readings on the same random streams and check that they agree call by
call, that each call runs the kernel once, and that a structure that comes
back after another is checked against what the cleaner holds, not against
the cache.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cleanbuf import AutoresetFilter, InputError, RolloutRepair
from cleanbuf.engine import _continuity, _read
from tests.batches import assert_same_rows, grid_td, next_step_batch
from tests.faults import state_bytes
from tests.reference import simulate
from tests.test_properties import cut_in_time

_WHOLE_WORDS = _continuity.whole_words


def _ends_only(rows, key, next_key):
    """``whole_words`` as for rows numpy cannot view whole: the end rows are read instead."""
    return None


def _run(calls, make, whole: bool):
    """Each call's output (or error) and the flush's, the stats, the state and the kernel calls.

    ``make()`` builds the filter or repair; ``whole`` False reads the stream
    ends as end rows (the general reading).
    """
    cleaner = make()
    outs = []
    plans = mock.patch.object(_read, "one_pass", wraps=_read.one_pass)
    ends_alone = mock.patch.object(
        _read, "stream_ends", wraps=_read.stream_ends
    )  # nothing to clean
    ends = mock.patch.object(_continuity, "whole_words", _WHOLE_WORDS if whole else _ends_only)
    with plans as kernel, ends_alone as ends_kernel, ends:
        for c in calls:
            try:
                outs.append(cleaner(c) if isinstance(cleaner, RolloutRepair) else cleaner.inv(c))
            except Exception as err:  # noqa: BLE001 - the same error both ways
                outs.append(f"{type(err).__name__}: {err}")
        if not isinstance(cleaner, RolloutRepair):
            outs.append(cleaner.flush())
    return outs, cleaner.stats, cleaner.state_dict(), kernel.call_count + ends_kernel.call_count


def _assert_same(fast, slow):
    fast_outs, fast_stats, fast_state, _ = fast
    slow_outs, slow_stats, slow_state, _ = slow
    assert len(fast_outs) == len(slow_outs)
    for i, (a, b) in enumerate(zip(fast_outs, slow_outs)):
        if isinstance(b, str) or isinstance(a, str):
            assert a == b, f"call {i}: {a} != {b}"
        elif b is None or a is None:
            assert a is None and b is None, f"call {i}: one path stored nothing"
        else:
            assert_same_rows(a, b, f"call {i}")
    assert fast_stats == slow_stats
    assert state_bytes(fast_state) == state_bytes(slow_state), "the states differ"


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 5),
    steps=st.integers(1, 40),
    joint=st.booleans(),
    marks=st.booleans(),
    zero_fill=st.sampled_from([True, False, 0.5]),
    policy=st.sampled_from(["nan", "drop", "keep"]),
    restarts=st.booleans(),
    data=st.data(),
)
def test_rows_read_whole_equal_end_rows(
    seed, n, steps, joint, marks, zero_fill, policy, restarts, data
):
    """Random collector-like streams (joint resets, batch-end marks with
    trajectory ids, collector restarts, zero-filled or stored terminal
    observations), cut at random time boundaries, cleaned with the stream
    ends read from the whole rows and read as end rows: the same rows,
    stats, state and errors, call by call, and one kernel call per call.

    Bugs caught: the end rows taken from the wrong row of a stream (a
    continuity check, a mark decision or a fingerprint comparing other
    rows), the trajectory ids or the carry's last next observations split
    or joined wrongly between calls (a retry or the next call's continuity
    check going wrong), and a call that runs the kernel twice or not at
    all.
    """
    rng = np.random.default_rng(seed)
    restart_at = set()
    if restarts and steps > 2:
        restart_at = data.draw(st.sets(st.integers(1, steps - 1), max_size=2))
    raw, _ = simulate(
        rng,
        n,
        steps,
        group=n if joint else None,
        max_len=data.draw(st.integers(1, 6)),
        zero_fill=zero_fill,
        restart_at=restart_at,
        mark_every=data.draw(st.integers(1, steps)) if marks else 0,
    )
    td = grid_td(raw, (n,), marks=marks)
    if data.draw(st.booleans()):  # some zero-filled next observations NaN-filled instead
        nxt = td.get(("next", "observation"))
        filled = td.get(("next", "done")) & (nxt == 0)
        nan = filled & torch.from_numpy(rng.random(filled.shape) < 0.5)
        td.set(("next", "observation"), torch.where(nan, torch.nan, nxt))
    calls = cut_in_time(data, td, steps)

    def make():
        return AutoresetFilter("next_step", joint_reset=joint, on_lost_terminal_obs=policy)

    whole = _run(calls, make, whole=True)
    _assert_same(whole, _run(calls, make, whole=False))
    assert whole[3] == len(calls), "a call ran the kernel other than once"


@pytest.mark.parametrize("policy", ["drop", "nan"])
def test_the_repair_runs_the_kernel_once_a_call_and_keeps_lost_rows(policy):
    """A repair runs one kernel call a batch too, and its batches come out the
    same both ways of reading the stream ends, lost rows kept and masked
    whatever ``on_lost_terminal_obs`` says.

    Bug caught: the repair's plan made with other rules than the call's
    (the filter's, which drop lost rows under
    ``on_lost_terminal_obs='drop'``), or a batch with nothing to clean not
    planned at all (the repair writes every row's mask). (That the repair
    keeps lost rows at all is ``tests/test_rollout.py``'s.)
    """
    raw, _ = simulate(np.random.default_rng(0), 2, 48, group=2, max_len=2)  # joint resets
    td = grid_td(raw, (2,))
    calls = [td[:, a : a + 12] for a in range(0, 48, 12)]

    def make():
        return RolloutRepair("next_step", joint_reset=True, on_lost_terminal_obs=policy)

    whole = _run(calls, make, whole=True)
    assert whole[3] == len(calls), "a call ran the kernel other than once"
    assert whole[1]["terminal_obs_missing"] > 0, "no lost row: the test shows nothing"
    _assert_same(whole, _run(calls, make, whole=False))


def _cast(td, key, dtype):
    td = td.clone()
    td.set(key, td.get(key).to(dtype))
    return td


def test_a_structure_that_comes_back_is_checked_against_the_held_rows():
    """Schema A, then schema B (another dtype of a non-observation leaf)
    while nothing is held, holding rows of B, then schema A again (its
    schema cached): refused, as the held rows are B's; after a flush, A is
    taken.

    Bug caught: the held rows compared with the batch only when its
    structure is new (the cache skipping the check): rows of two dtypes
    would be concatenated into one output key, or held rows silently cast.
    """
    first, second, third = (next_step_batch(2, 12, seed=s) for s in (1, 2, 3))
    filt = AutoresetFilter("next_step", check_continuity=False)
    filt.inv(first)  # schema A
    if filt.stats["rows_held"]:
        filt.flush()
    b = _cast(second, "action", torch.float64)
    filt.inv(b)  # schema B, cached; it may hold rows now
    assert filt.stats["rows_held"], "the batch must end with a held row for this test"
    state = state_bytes(filt.state_dict())
    with pytest.raises(InputError, match=r"'action' changed its dtype between calls while rows"):
        filt.inv(third)  # schema A again: cached, but the held rows are B's
    assert state_bytes(filt.state_dict()) == state, "a refused call changed the state"
    filt.flush()
    assert filt.inv(third) is not None  # nothing held: A is taken


def test_flags_of_another_kind_are_refused_as_before():
    """A float ``("next", "truncated")`` beside a custom done key (so the
    done flags' own checks never read it): refused, naming the key and the
    dtype, at the first call with an episode end.

    Bug caught: the truncated flags handed to the kernel unchecked, where
    a float flag reads as true wherever nonzero and a [*batch, 2] flag is
    read half.
    """
    td = next_step_batch(2, 12, seed=1)
    td.rename_key_(("next", "done"), ("next", "ended"))
    td.set(("next", "truncated"), torch.zeros(2, 12, 1))
    filt = AutoresetFilter("next_step", done_key=("next", "ended"))
    assert td["next", "ended"].any()
    with pytest.raises(
        InputError, match=r"truncated key \('next', 'truncated'\) must be torch.bool"
    ):
        filt.inv(td)
