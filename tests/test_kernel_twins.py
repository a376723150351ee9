"""The planning kernel against a naive twin, one test per row of the mode table.

Each test simulates random streams (``tests/reference.py``), cuts them into
calls at random time boundaries, and runs the kernel alone on the flags of
each call through :func:`~cleanbuf.engine._kernels.one_pass` (with no
stream ends: the flags are given, as the read step computes them), with the carry
state and the held rows threaded through by hand (:func:`kernel_rows`). What
the kernel selects, with the next observation, ``is_init`` and step counts
its plan gives each row, must be what the readable row-by-row twin
(:func:`tests.reference.reference_clean`) keeps. Observations encode their
position, so a row taken from the wrong place shows in the number itself.

Disabled mode runs no kernel: its twin is the identity, checked on the
cleaner's output.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cleanbuf.engine._cleaner import Cleaner
from cleanbuf.engine._kernels import (
    NO_MARKS,
    NO_ROWS,
    RELEASED_AS_IS,
    RELEASED_LOST,
    RELEASED_STORED,
    KernelResult,
    Rules,
    Selection,
    one_pass,
)
from cleanbuf.engine._options import Options
from tests.batches import assert_same_rows, grid_td
from tests.reference import reference_clean, simulate
from tests.test_properties import time_bounds

NONE = np.zeros(0, np.bool_)
NO_WORDS = np.zeros((0, 0), np.uint8)
NO_SOURCE = -7.0  # the next observation of an emitted row the plan gave no source
COMPARED = ("obs", "next_obs", "is_init", "step_count", "next_step_count")


def rules_of(mode: str, obs_only: bool = False, compact: bool = False) -> Rules:
    """The kernel's flags for a mode row, as the cleaner derives them."""
    return Rules.of(Options.build(mode, compact=compact), obs_only, "time_last")


def kernel_rows(raw, bounds, rules: Rules, *, obs_only=False, group=0, joint_flags=False):
    """Runs the kernel over calls ``bounds`` of the streams ``raw``.

    Returns, per stream, the rows the kernel's plans store (dicts of
    ``COMPARED``), in output order. ``group``: time-last reset groups read
    from the done flags; ``joint_flags``: the per-row joint flags given
    instead (``joint_key``).
    """
    n = len(raw)
    fields = ("obs", "next_obs", "reward", "done", "is_init", "step_count", "next_step_count",
              "joint", "final", "final_ok")  # fmt: skip
    field = {f: np.array([[r[f] for r in rows] for rows in raw]) for f in fields}
    carry = np.zeros((5, n), np.int64)
    held: dict = {}  # stream -> its held row
    out: list = [[] for _ in range(n)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        steps = b - a
        f = {k: v[:, a:b].reshape(-1) for k, v in field.items()}
        nxt, done = f["next_obs"], f["done"].astype(bool)
        stored = np.zeros(0, np.bool_)  # (writeable: the kernel's type)
        if rules.reset_rows and not obs_only:  # what the read step computes
            stored = done & (nxt != 0) & ~np.isnan(nxt)
        r = rules
        _, planned = one_pass(
            n * steps, steps, NO_ROWS, done, NO_WORDS, False, False, stored,
            f["joint"].astype(bool) if joint_flags else NONE, group,
            f["final_ok"].astype(bool) if rules.final else NONE, False, f["reward"],
            f["is_init"].astype(bool), NONE, NONE, NO_MARKS, NO_WORDS, NO_WORDS, 1, NO_WORDS,
            NO_WORDS, NONE, NONE, NO_WORDS, NO_WORDS, carry, r.reset_rows, r.successor, r.final,
            r.stitch, r.hold_done, r.drop_lost,
        )  # fmt: skip
        k = KernelResult(Selection(*planned[0]), *planned[1:])
        assert k.bad_row < 0, "the kernel refused a reset row the simulation wrote"
        carry = k.carry
        _release(k.released_src, held, f, out, obs_only)
        _emit(k.sel, f, steps, out, held, obs_only)
    for s, row in held.items():  # the flush: no row after it came
        assert obs_only or row["next_obs"] == 0, "a row holding its next observation was held"
        row["next_obs"] = math.nan
        out[s].append(row)
    return out


def _row(f, i, obs_only, init, shift):
    """Row ``i`` of a call's fields ``f``, with the bookkeeping fixes of the plan."""
    return dict(
        obs=f["obs"][i],
        next_obs=NO_SOURCE if obs_only else f["next_obs"][i],
        is_init=bool(f["is_init"][i]) or init,
        step_count=f["step_count"][i] - shift,
        next_step_count=f["next_step_count"][i] - shift,
    )


def _release(released_src, held, f, out, obs_only):
    """The held rows the call releases, with the next observation the plan says."""
    for s in sorted(held):
        src = released_src[s]
        if src == -1:
            continue
        row = held.pop(s)
        if src >= 0:
            row["next_obs"] = f["obs"][src]
        elif src == RELEASED_LOST:
            row["next_obs"] = math.nan
        else:
            assert src in (RELEASED_AS_IS, RELEASED_STORED) and not obs_only
        out[s].append(row)


def _emit(sel, f, steps, out, held, obs_only):
    """The call's rows the selection emits (patched as it says), and those it holds."""
    stitched = dict(zip(sel.stitched.tolist(), sel.stitched_src.tolist()))
    lost, final = set(sel.lost.tolist()), set(sel.final.tolist())
    init = set(sel.emit_init.tolist())
    for pos, i in enumerate(sel.emit.tolist()):
        row = _row(f, i, obs_only, pos in init, sel.emit_shift[pos] if len(sel.emit_shift) else 0)
        if pos in stitched:
            row["next_obs"] = f["obs"][stitched[pos]]
        elif pos in final:
            row["next_obs"] = f["final"][i]
        elif pos in lost:
            row["next_obs"] = math.nan
        out[i // steps].append(row)
    init = set(sel.hold_init.tolist())
    for pos, i in enumerate(sel.hold.tolist()):
        shift = sel.hold_shift[pos] if len(sel.hold_shift) else 0
        held[i // steps] = _row(f, i, obs_only, pos in init, shift)


def assert_same(got, want, where):
    """Per stream, the same rows on ``COMPARED`` (NaN equal to NaN)."""
    assert len(got) == len(want), f"{where}: {len(got)} rows, expected {len(want)}: {got}"
    for i, (g, w) in enumerate(zip(got, want)):
        for k in COMPARED:
            if k not in w:
                continue
            a, b = g[k], w[k]
            same = (math.isnan(a) and math.isnan(b)) if math.isnan(b) else a == b
            assert same, f"{where}, row {i}, {k}: kernel {a}, twin {b}"


def check(raw, got, **twin):
    for e, rows in enumerate(raw):
        assert_same(got[e], reference_clean(rows, **twin), f"stream {e}")


SETTINGS = dict(max_examples=50, deadline=None)
STREAMS = dict(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 4),
    steps=st.integers(1, 30),
    data=st.data(),
)


def _restarts(data, bounds):
    inner = bounds[1:-1]  # collector resets happen between calls
    return data.draw(st.sets(st.sampled_from(inner))) if inner else set()


@settings(**SETTINGS)
@given(**STREAMS, zero_fill=st.sampled_from([True, False, 0.5]))
def test_next_step_reset_rows(seed, n, steps, data, zero_fill):
    """Next-step data, a reset row after each done row (row 1 of the table),
    done rows zero-filled or holding their terminal observation, collector
    restarts between calls.

    Bug caught: after a dropped reset row, the new episode's ``is_init`` not
    set or its step counts not shifted back by the reset row's step (also
    across a call boundary, on a held row), besides a reset row kept, a
    terminal observation taken from the wrong row, or a held row released
    at the wrong call.
    """
    bounds = time_bounds(data, steps)
    raw, _ = simulate(np.random.default_rng(seed), n, steps, zero_fill=zero_fill,
                      restart_at=_restarts(data, bounds))  # fmt: skip
    check(raw, kernel_rows(raw, bounds, rules_of("next_step")))


@settings(**SETTINGS)
@given(**STREAMS, zero_fill=st.sampled_from([True, False, 0.5]), joint_flags=st.booleans())
def test_next_step_joint_reset(seed, n, steps, data, zero_fill, joint_flags):
    """Next-step data with TorchRL's joint reset (no reset row after a step
    where a whole reset group is done), groups read from the done flags
    (time-last, ``reset_group_size``) or given per row (``joint_key``).

    Bug caught: a joint-reset done row whose terminal observation is
    stored (raw loops) marked lost, or a zero-filled one not marked lost;
    a group decided over the wrong streams; a reset row expected after a
    joint reset (the next real row dropped).
    """
    size = data.draw(st.sampled_from([g for g in range(1, n + 1) if n % g == 0]))
    bounds = time_bounds(data, steps)
    raw, _ = simulate(np.random.default_rng(seed), n, steps, group=size, zero_fill=zero_fill)
    got = kernel_rows(raw, bounds, rules_of("next_step"), group=0 if joint_flags else size,
                      joint_flags=joint_flags)  # fmt: skip
    check(raw, got)


@settings(**SETTINGS)
@given(**STREAMS, missing=st.sampled_from([0.0, 0.3, 1.0]))
def test_same_step_final_entries(seed, n, steps, data, missing):
    """Same-step data: a done row's next observation is its final entry, and
    some final entries are missing.

    Bug caught: a done row keeping the reset observation, or a missing final
    entry not marked lost (its row stored with the reset observation as its
    next observation, never silently), a row dropped or held in a mode
    without reset rows.
    """
    bounds = time_bounds(data, steps)
    raw, _ = simulate(np.random.default_rng(seed), n, steps, mode="same_step",
                      final_missing=missing)  # fmt: skip
    check(raw, kernel_rows(raw, bounds, rules_of("same_step")), mode="same_step")


@settings(**SETTINGS)
@given(**STREAMS, mode=st.sampled_from(["next_step", "same_step"]), restarts=st.booleans())
def test_observation_only_successor(seed, n, steps, data, mode, restarts):
    """Observation-only data (no ``("next", k)``): a row's next observation
    is its successor's observation, a next-step done row's the reset row's,
    a same-step done row's its final entry; collector restarts between
    calls (next-step).

    Bug caught: a row emitted before its successor arrived (no source for
    its next observation), the last row of a call not held until the next
    call or released with the wrong row, a next-step done row given the
    reset row's successor instead of the reset row, a row before a restart
    given the restart's observation instead of being marked lost.
    """
    bounds = time_bounds(data, steps)
    restart_at = _restarts(data, bounds) if restarts and mode == "next_step" else set()
    raw, _ = simulate(np.random.default_rng(seed), n, steps, mode=mode, final_missing=0.2,
                      restart_at=restart_at)  # fmt: skip
    got = kernel_rows(raw, bounds, rules_of(mode, obs_only=True), obs_only=True)
    check(raw, got, mode=mode, obs_only=True)


@settings(**SETTINGS)
@given(**STREAMS, joint=st.booleans())
def test_compact(seed, n, steps, data, joint):
    """Compact output (observation-only data kept observation-only, no next
    observation written), next-step, plain or joint reset.

    Bug caught: reset rows kept in compact output (nothing is stitched
    there, but reset rows are still artifacts), a row held (nothing waits
    in compact output), bookkeeping not fixed after a reset row.
    """
    bounds = time_bounds(data, steps)
    raw, _ = simulate(np.random.default_rng(seed), n, steps, group=n if joint else None)
    rules = rules_of("next_step", obs_only=True, compact=True)
    assert not rules.stitch and not rules.successor
    got = kernel_rows(raw, bounds, rules, obs_only=True, group=n if joint else 0)
    for e, rows in enumerate(raw):
        want = reference_clean(rows, obs_only=True, compact=True)
        assert_same([{k: v for k, v in r.items() if k != "next_obs"} for r in got[e]], want,
                    f"stream {e}")  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(**STREAMS, joint=st.booleans())
def test_disabled_passes_every_row_through(seed, n, steps, data, joint):
    """Disabled mode runs no kernel: the twin is the identity. Random
    next-step streams (reset rows, zero-filled done rows, joint resets),
    cut at random time boundaries, go through the cleaner.

    Bug caught: disabled mode cleaning anyway (a reset row dropped, a next
    observation restitched, bookkeeping fixed), a row held across calls,
    rows reordered, or the caller's batch written.
    """
    raw, _ = simulate(np.random.default_rng(seed), n, steps, group=n if joint else None)
    td = grid_td(raw, (n,))
    before = td.clone()
    bounds = time_bounds(data, steps)
    cleaner = Cleaner(Options.build("disabled"))
    for a, b in zip(bounds[:-1], bounds[1:]):
        call = td[..., a:b]
        assert_same_rows(cleaner(call), call.reshape(-1), f"call [{a}, {b})")
        assert cleaner.count("rows_held") == 0
    assert cleaner.flush().batch_size[0] == 0
    assert_same_rows(td.reshape(-1), before.reshape(-1), "the caller's batch")
