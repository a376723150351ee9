"""The planning kernel on its own, against the row-by-row reference cleaner.

No TensorDict, no cleaner: the flags of simulated next-step streams go to
``plan_rows`` call by call (random boundaries, the carry state threaded
through by hand), and the rows it selects, with the next observation each
gets, must be the reference's. Observations encode their position
(``1000 * env + step``), so a row taken from the wrong place shows in the
number itself.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cleanbuf.engine._kernels import (
    RELEASED_AS_IS,
    RELEASED_LOST,
    RELEASED_STORED,
    Selection,
    plan_rows,
)
from tests.reference import reference_clean, simulate
from tests.test_properties import time_bounds

NONE = np.zeros(0, np.bool_)


def _kernel_rows(raw, bounds, joint_group):
    """Runs the kernel over calls ``bounds`` of the streams ``raw``; returns
    per stream the (observation, next observation) of each row it stores.
    """
    n = len(raw)
    field = {f: np.array([[r[f] for r in rows] for rows in raw]) for f in raw[0][0]}
    carry = np.zeros((5, n), np.int64)
    held: dict = {}  # stream -> (obs, stored next obs) of its held row
    out: list = [[] for _ in range(n)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        steps = b - a
        obs, nxt = field["obs"][:, a:b].reshape(-1), field["next_obs"][:, a:b].reshape(-1)
        done = field["done"][:, a:b].reshape(-1).astype(bool)
        reward = field["reward"][:, a:b].reshape(-1)
        restart = field["is_init"][:, a:b].reshape(-1).astype(bool)
        stored = done & (nxt != 0) & ~np.isnan(nxt)  # what the read step computes
        sel, released, carry, *_, bad = plan_rows(
            n=n * steps, steps=steps, stream=np.zeros(0, np.int64), done=done, stored=stored,
            joint=NONE,
            group=joint_group or 0, final_ok=NONE, final_default=False, reward=reward,
            restart=restart, terminated=NONE, truncated=NONE, marks=False,
            cont=np.zeros(0, np.uint8), carry=carry, reset_rows=True, successor=False,
            final=False, stitch=True, hold_done=True, drop_lost=False,
        )  # fmt: skip
        assert bad < 0
        sel = Selection(*sel)
        for s in sorted(held):  # released rows come first, in stream order
            src = released[s]
            if src == -1:
                continue
            row_obs, row_next = held.pop(s)
            if src >= 0:
                row_next = obs[src]
            elif src == RELEASED_LOST:
                row_next = math.nan
            else:
                assert src in (RELEASED_AS_IS, RELEASED_STORED)
            out[s].append((row_obs, row_next))
        stitched = dict(zip(sel.stitched.tolist(), sel.stitched_src.tolist()))
        lost = set(sel.lost.tolist())
        for pos, row in enumerate(sel.emit.tolist()):
            row_next = obs[stitched[pos]] if pos in stitched else nxt[row]
            out[row // steps].append((obs[row], math.nan if pos in lost else row_next))
        for row in sel.hold.tolist():
            held[row // steps] = (obs[row], nxt[row])
    for s, (row_obs, row_next) in held.items():  # the flush: lost unless stored
        assert row_next == 0 or math.isnan(row_next), "a stored done row was held"
        out[s].append((row_obs, math.nan))
    return out


def _pairs(rows):
    return [(r["obs"], r["next_obs"]) for r in rows]


def _same(got, want):
    return len(got) == len(want) and all(
        g[0] == w[0] and (g[1] == w[1] or (math.isnan(g[1]) and math.isnan(w[1])))
        for g, w in zip(got, want)
    )


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 4),
    steps=st.integers(1, 40),
    joint=st.booleans(),
    restarts=st.booleans(),
    zero_fill=st.sampled_from([True, False, 0.5]),
    data=st.data(),
)
def test_plan_rows_selects_what_the_reference_keeps(
    seed, n, steps, joint, restarts, zero_fill, data
):
    """Done rows zero-filled (TorchRL), holding their terminal observation
    (raw loops), or either, row by row (the ``stored`` flag).

    Bugs caught: a reset row kept or a real row dropped, a next
    observation taken from another row or stream, a held row released at
    the wrong call or never, a joint reset's or a restart's lost terminal
    observation not marked, rows of a stream out of order, a stored
    terminal observation held, replaced by NaN or counted lost at a joint
    reset, a restart or the end.
    """
    bounds = time_bounds(data, steps)
    inner = bounds[1:-1]  # collector resets happen between calls
    restart_at = data.draw(st.sets(st.sampled_from(inner))) if restarts and inner else set()
    raw, _ = simulate(np.random.default_rng(seed), n, steps, group=n if joint else None,
                      restart_at=restart_at, zero_fill=zero_fill)  # fmt: skip
    got = _kernel_rows(raw, bounds, n if joint else 0)
    for e in range(n):
        want = _pairs(reference_clean(raw[e]))
        assert _same(got[e], want), f"stream {e}: kernel {got[e]} != reference {want}"
