"""Property tests: the filter against the row-by-row reference, on random streams.

Random envs, episode lengths from 1, joint or plain resets, and batch
boundaries anywhere (one step per call, a done row on the last step of a
call, state saved and restored mid-stream). Checked: equal to the reference
(and to the ground truth of an explicit-reset run), lossless, order kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pickle
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cleanbuf import AutoresetFilter
from cleanbuf.engine import _keys, _read, _write
from tests.batches import KEYS, assert_same_rows, grid_td
from tests.reference import FIELDS, reference_clean, simulate


def time_bounds(data, steps):
    """Random call boundaries in ``steps`` time steps: ``[0, ..., steps]``."""
    cuts = data.draw(st.sets(st.integers(1, max(steps - 1, 1)), max_size=steps))
    return [0, *sorted(cuts - {steps}), steps]


def cut_in_time(data, td, steps):
    """A ``[..., steps]`` batch cut into calls at random time boundaries."""
    bounds = time_bounds(data, steps)
    return [td[..., a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def rows_by_stream(out_tds):
    """Concatenates flat outputs and splits them by the 'stream' key, order kept."""
    out_tds = [o for o in out_tds if o is not None and o.batch_size[0]]
    if not out_tds:
        return {}
    rows = torch.cat(out_tds)
    ids = rows["stream"].reshape(-1)
    return {int(e): rows[ids == e] for e in ids.unique()}


def as_dicts(td):
    keys = {f: k for f, k in KEYS.items() if k in td.keys(True, True)}
    return [
        {f: (td.get(key)[i].item()) for f, key in keys.items()} for i in range(td.batch_size[0])
    ]


def assert_rows_equal(got, want, where):
    assert len(got) == len(want), f"{where}: {len(got)} rows, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert set(g) == set(w), f"{where}, row {i}: fields {sorted(g)} != {sorted(w)}"
        for f in FIELDS:
            if f not in w:
                continue
            a, b = g[f], w[f]
            same = (
                (math.isnan(a) and math.isnan(b))
                if isinstance(b, float) and math.isnan(b)
                else a == b
            )
            assert same, f"{where}, row {i}, field {f}: got {a}, expected {b}"


def run_filter(filt, calls, restore_at=None, after_call=None):
    outs = []
    for i, td in enumerate(calls):
        if i == restore_at:
            state = filt.state_dict()
            filt = pickle.loads(pickle.dumps(filt)) if i % 2 else _fresh_like(filt)
            filt.load_state_dict(state)
        outs.append(filt.inv(td))
        if after_call is not None:
            after_call(filt)
    outs.append(filt.flush())
    return filt, outs


def _fresh_like(filt):
    o = filt.options
    return AutoresetFilter(**{f.name: getattr(o, f.name) for f in dataclasses.fields(o)})


def check_against_reference(raw, truth, got, drop_fields=(), **reference):
    for e, rows in enumerate(raw):
        want = reference_clean(rows, **reference)
        assert_rows_equal(want, truth[e], f"reference vs truth, stream {e}")
        want = [{k: v for k, v in r.items() if k not in drop_fields} for r in want]
        stream_rows = as_dicts(got[e]) if e in got else []
        assert_rows_equal(stream_rows, want, f"filter vs reference, stream {e}")


def run_and_check(filt, calls, raw, truth, *, restore_at=None, after_call=None, **reference):
    """Runs the calls (and a flush), then checks the output per stream against
    the reference and the truth, and that no row was lost.
    """
    filt, outs = run_filter(filt, calls, restore_at, after_call)
    check_against_reference(raw, truth, rows_by_stream(outs), **reference)
    lossless(filt, raw)


def adjust_truth(raw, truth, *, mode, obs_only, compact):
    """The truth as the cleaner can know it: observation-only data has no next
    observation for a stream's last row unless a row came after it; compact
    output has no next observation at all.
    """
    for rows, true_rows in zip(raw, truth):
        if not true_rows:
            continue
        last = rows[-1]
        after_reset_row = (
            mode == "next_step" and len(rows) > 1 and rows[-2]["done"] and not rows[-2]["joint"]
        )
        if obs_only and not compact and not after_reset_row:
            if not (last["done"] and (mode == "same_step" or last["joint"])):
                true_rows[-1]["next_obs"] = float("nan")
        if compact:
            for r in true_rows:
                del r["next_obs"]
    return truth


def lossless(filt, raw):
    s = filt.stats
    n_in = sum(len(r) for r in raw)
    assert s["rows_in"] == n_in
    assert s["rows_out"] + s["reset_rows_dropped"] + s["lost_rows_dropped"] == n_in
    assert s["rows_held"] == 0


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    workers=st.integers(1, 3),
    per_worker=st.integers(1, 3),
    steps=st.integers(1, 40),
    joint=st.booleans(),
    zero_fill=st.sampled_from([True, False, 0.5]),
    max_len=st.integers(1, 6),
    data=st.data(),
)
def test_time_last_random_boundaries(
    seed, workers, per_worker, steps, joint, zero_fill, max_len, data
):
    """[W, n, T] collector-like batches cut at random time boundaries; done rows
    zero-filled (TorchRL: they wait for their reset row), holding their
    terminal observation (raw loops: emitted at once), or either, row by row
    (read from the data: no option says which).

    Bugs caught: a held done row lost or duplicated across calls, a reset row
    at the start of a call not recognised, the next observation taken from
    the wrong row or stream, step_count / is_init not carried across calls,
    a joint reset decided over the wrong group, state lost in a
    state_dict / pickle round trip, a done row emitted at once although its
    terminal observation is not in it (or held although it is), a stored
    terminal observation replaced by NaN at a joint reset or the flush.
    """
    rng = np.random.default_rng(seed)
    n = workers * per_worker
    raw, truth = simulate(
        rng,
        n,
        steps,
        group=per_worker if joint else None,
        max_len=max_len,
        zero_fill=zero_fill,
    )
    td = grid_td(raw, (workers, per_worker))
    calls = cut_in_time(data, td, steps)
    restore_at = data.draw(st.integers(0, len(calls)))
    filt = AutoresetFilter(
        "next_step",
        joint_reset=joint,
        reset_group_size=per_worker if joint else None,
    )

    def nothing_held(f):
        assert f.stats["rows_held"] == 0, "a done row that holds its terminal observation waits"

    run_and_check(
        filt,
        calls,
        raw,
        truth,
        restore_at=restore_at,
        after_call=nothing_held if zero_fill is False else None,
    )


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 4),
    per_call=st.integers(1, 8),
    calls=st.integers(1, 6),
    joint=st.booleans(),
    marks=st.booleans(),
    max_len=st.integers(1, 6),
    data=st.data(),
)
def test_restarts_and_marks(seed, n, per_call, calls, joint, marks, max_len, data):
    """TorchRL collector batches of ``per_call`` steps with collector resets
    between some of them (every stream restarts), and with or without
    ``set_truncated`` marks on every batch's last step.

    Bugs caught: a step-count shift or an is_init fix carried across a
    restart, a done row waiting for the reset row that a restart discarded
    (its restart row dropped, or ResetRowError), a restart after a mark
    taken as a reset row, a mark read as an episode end (a continuing row
    dropped), as a joint reset (a real next observation lost), or as a
    terminal observation to restitch, a mark on a reset row kept, a mark
    still undecided at the flush stored as if complete.
    """
    rng = np.random.default_rng(seed)
    steps = per_call * calls
    restart_at = data.draw(
        st.sets(st.sampled_from(range(per_call, steps, per_call))) if calls > 1 else st.just(set())
    )
    raw, truth = simulate(
        rng,
        n,
        steps,
        group=n if joint else None,
        max_len=max_len,
        restart_at=restart_at,
        mark_every=per_call if marks else 0,
    )
    td = grid_td(raw, (n,), marks=marks)
    batches = [td[:, a : a + per_call] for a in range(0, steps, per_call)]
    filt = AutoresetFilter("next_step", joint_reset=joint)  # marks need no option
    run_and_check(filt, batches, raw, truth, restore_at=data.draw(st.integers(0, len(batches))))


MODES = [
    # mode, observation-only, compact
    ("next_step", True, False),
    ("next_step", True, True),
    ("same_step", False, False),
    ("same_step", True, False),
    ("same_step", True, True),
]


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 4),
    steps=st.integers(1, 30),
    variant=st.sampled_from(MODES),
    joint=st.booleans(),
    data=st.data(),
)
def test_modes_random_boundaries(seed, n, steps, variant, joint, data):
    """Same-step and observation-only data (materialized and compact), [E, T]
    batches cut at random time boundaries, restored mid-stream. Bugs caught:
    a row's next observation taken from another stream or from a dropped
    row's successor, the last row of a call emitted before its successor
    arrives (then with a wrong or missing next observation), a same-step done
    row keeping the reset observation instead of its final one, a missing
    final observation not marked, compact output growing next observations,
    the final-observation entry stored in the output.
    """
    mode, obs_only, compact = variant
    joint = joint and mode == "next_step"
    rng = np.random.default_rng(seed)
    raw, truth = simulate(rng, n, steps, mode=mode, group=n if joint else None, final_missing=0.2)
    truth = adjust_truth(raw, truth, mode=mode, obs_only=obs_only, compact=compact)
    td = grid_td(raw, (n,), final=mode == "same_step", obs_only=obs_only)
    calls = cut_in_time(data, td, steps)
    filt = AutoresetFilter(
        mode,
        joint_reset=joint,
        on_lost_terminal_obs="nan",
        compact=compact,
        observation_keys=["observation"],
    )
    run_and_check(
        filt,
        calls,
        raw,
        truth,
        restore_at=data.draw(st.integers(0, len(calls))),
        mode=mode,
        obs_only=obs_only,
        compact=compact,
    )


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 6),
    steps=st.integers(1, 30),
    joint=st.booleans(),
    bookkeeping=st.sampled_from(["both", "none", "is_init", "step_count"]),
)
def test_step_layout_one_step_per_call(seed, n, steps, joint, bookkeeping):
    """Raw vector-env loops: one [E] step per call (raw loops keep the terminal
    observation in the done row), with or without InitTracker / StepCounter
    keys (raw loops usually have none: most calls then take the no-copy
    path). Bugs caught: a done row stored twice or with the wrong next obs, a
    reset row kept, a call taking the no-copy path while a reset row is
    pending or an is_init / step_count fix applies.
    """
    rng = np.random.default_rng(seed)
    raw, truth = simulate(rng, n, steps, group=n if joint else None, zero_fill=False)
    td = grid_td(raw, (n,))
    dropped = ()
    if bookkeeping in ("none", "step_count"):
        td = td.exclude("is_init")
        dropped += ("is_init",)
    if bookkeeping in ("none", "is_init"):
        td = td.exclude("step_count", ("next", "step_count"))
        dropped += ("step_count", "next_step_count")
    calls = [td[:, t] for t in range(steps)]
    filt = AutoresetFilter("next_step", layout="step", joint_reset=joint)
    run_and_check(filt, calls, raw, truth, drop_fields=dropped)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5), steps=st.integers(1, 30), data=st.data()
)
def test_stream_key_interleaved_rows(seed, n, steps, data):
    """Flat rows with a stream-id key, streams interleaved at random and cut
    anywhere, stream ids sparse (10 * e + 3). Bugs caught: rows of different
    streams mixed up, a stream absent from a call losing its held row, new
    stream ids mapped onto old slots.
    """
    rng = np.random.default_rng(seed)
    raw, truth = simulate(rng, n, steps, zero_fill=False)
    td = grid_td(raw, (n,)).reshape(-1)
    td.set("sid", td["stream"] * 10 + 3)
    # A random interleaving that keeps time order within each stream: shuffle
    # which stream each slot belongs to, then fill each stream's slots in order.
    order = rng.permutation(n * steps)
    perm = np.empty(n * steps, np.int64)
    streams = np.repeat(np.arange(n), steps)
    for e in range(n):
        slots = np.flatnonzero(streams[order] == e)
        perm[slots] = np.flatnonzero(streams == e)
    flat = td[torch.from_numpy(perm)]
    cuts = sorted(
        data.draw(st.sets(st.integers(1, n * steps - 1), max_size=8)) if n * steps > 1 else []
    )
    bounds = [0, *cuts, n * steps]
    calls = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    run_and_check(AutoresetFilter("next_step", stream_key="sid"), calls, raw, truth)


@contextlib.contextmanager
def torch_ops_only():
    """Turns off the numpy shortcuts that CPU tensors take (small rows moved with
    numpy's ``take``, patches through numpy views, flags read as views), so that
    rows move and are patched with torch ops, as on CUDA or with dtypes numpy
    lacks (bfloat16).
    """

    def none(*args):
        return None

    with (
        mock.patch.object(_keys, "numpy_view", none),
        mock.patch.object(_write, "numpy_view", none),
        mock.patch.object(_read, "batch_views", none),  # (its walk views every leaf)
    ):
        yield


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 4),
    steps=st.integers(1, 30),
    variant=st.sampled_from([("next_step", False, False), *MODES]),
    joint=st.booleans(),
    wide=st.booleans(),
    data=st.data(),
)
def test_numpy_and_torch_paths_agree(seed, n, steps, variant, joint, wide, data):
    """The numpy shortcuts on CPU and the torch ops (CUDA, bfloat16) give the same
    output, call by call, on random streams cut at random boundaries: held
    rows, released rows, NaN-marked lost rows and bookkeeping fixes included.

    Bugs caught: a shortcut that writes other rows than its torch twin (an
    offset of the released held rows forgotten, the step shift applied to
    the wrong rows, a fancy-index assignment that writes into a copy), a
    small-row gather that returns another shape or dtype than index_select,
    the row-by-row copy of large observation rows (``wide``: 16 KiB a row,
    ``_write.ROW_LOOP_BYTES``) pairing a position with another row's source.
    """
    mode, obs_only, compact = variant
    joint = joint and mode == "next_step"
    rng = np.random.default_rng(seed)
    raw, _ = simulate(rng, n, steps, mode=mode, group=n if joint else None, final_missing=0.2)
    td = grid_td(raw, (n,), final=mode == "same_step", obs_only=obs_only)
    if wide:  # each observation value v becomes the row v, v + 1, ..., v + 4095
        width = _write.ROW_LOOP_BYTES // 4  # (a zero-filled row stays zero-filled)
        for k in list(td.keys(True, True)):
            if (k if isinstance(k, str) else k[-1]) in ("observation", "final_obs"):
                v = td.get(k)
                td.set(k, v + torch.arange(width, dtype=torch.float32) * (v != 0))
    calls = cut_in_time(data, td, steps)

    def run():
        filt = AutoresetFilter(
            mode,
            joint_reset=joint,
            on_lost_terminal_obs="nan",
            compact=compact,
            observation_keys=["observation"],
        )
        return [filt.inv(c) for c in calls] + [filt.flush()]

    fast = run()
    with torch_ops_only():
        slow = run()
    for i, (a, b) in enumerate(zip(fast, slow)):
        if a is None or b is None:
            assert a is None and b is None, f"call {i}: one path stored rows, the other none"
            continue
        assert_same_rows(a, b, f"call {i}:")


@pytest.mark.slow  # 49k rows compared one by one with the reference: seconds
def test_a_step_of_4096_envs_equals_the_reference():
    """One step of 4096 envs per call (``layout="step"``), as GPU simulators
    give it, for 12 steps, episodes of 1 to 6 steps. Bugs caught at that
    width only: a stream index kept in a narrow dtype, a per-call array
    sized by a small default, a held row given to the wrong env among
    thousands, a call read as "nothing to clean" while one env of 4096 has
    a reset row pending.
    """
    rng = np.random.default_rng(4096)
    raw, truth = simulate(rng, 4096, 12, max_len=6, zero_fill=False)
    td = grid_td(raw, (4096,))
    calls = [td[:, t] for t in range(12)]
    run_and_check(AutoresetFilter("next_step", layout="step"), calls, raw, truth)
