"""The per-call checks folded into one kernel pass, on random streams and boundaries.

A call's first and last rows are read once (``stream_ends``): their bytes
decide the continuity check, a collector's batch-end marks and the retry
fingerprint. Here the rows carry no ``is_init`` and no step count, so the
marks are decided by the bytes alone, and the output must still be the
row-by-row reference's (which decides them from the simulated resets).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cleanbuf import AutoresetFilter, ContinuityError
from tests.batches import grid_td
from tests.reference import simulate
from tests.test_properties import run_and_check

NO_RESTART_FLAGS = ("is_init", "step_count", ("next", "step_count"))


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
def test_marks_decided_by_the_rows_bytes(seed, n, per_call, calls, joint, marks, max_len, data):
    """TorchRL collector batches of ``per_call`` steps, with or without
    batch-end marks (``set_truncated=True``) on every batch's last step, and
    no option saying so. Bugs caught: a mark read as an episode end (the
    next batch's first row dropped as a reset row, or ResetRowError), as a
    joint reset (a real next observation lost), a real end on a batch's
    last step read as a mark (a reset row kept, a zero-filled terminal
    observation stored as real), a real joint end followed by a reset-row
    drop of the new episode's first row, a collector reset after a mark
    taken for the mark's continuation (the old episode's step shift and
    is_init carried on, a fresh row stitched as a next observation), a mark
    undecided at the flush stored as if complete, a wrong stream's bytes
    compared.
    """
    rng = np.random.default_rng(seed)
    steps = per_call * calls
    # Collector resets between batches (every stream restarts, with a fresh
    # observation): without is_init only the bytes show them, after a mark.
    restart_at = set()
    if marks and calls > 1:
        restart_at = data.draw(st.sets(st.sampled_from(range(per_call, steps, per_call))))
    raw, truth = simulate(
        rng, n, steps, group=n if joint else None, max_len=max_len,
        mark_every=per_call if marks else 0, restart_at=restart_at,
    )  # fmt: skip
    # Without is_init a collector reset right after a real episode end (or
    # its reset row) looks like that reset row: nothing in the rows can tell.
    assume(all(raw[e][t - 1]["mark"] for e in range(n) for t in restart_at))
    td = grid_td(raw, (n,), marks=True).exclude(*NO_RESTART_FLAGS)
    batches = [td[:, a : a + per_call] for a in range(0, steps, per_call)]
    filt = AutoresetFilter("next_step", joint_reset=joint)
    run_and_check(
        filt, batches, raw, truth, restore_at=data.draw(st.integers(0, len(batches))),
        drop_fields=("is_init", "step_count", "next_step_count"),
    )  # fmt: skip


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 4),
    per_call=st.integers(1, 6),
    calls=st.integers(3, 6),
    joint=st.booleans(),
    flags=st.booleans(),
    data=st.data(),
)
def test_a_skipped_batch_is_refused(seed, n, per_call, calls, joint, flags, data):
    """One batch of a collector's sequence never reaches the filter.
    Bug caught: the continuity comparison dropped or reading another
    stream's or another call's rows, so that a skipped batch gets through
    and the next episode's rows are stitched onto the wrong ones. Whenever
    a stream was open (its last row not done) before the gap, and its first
    row after the gap is not a restart, the call must be refused, and
    nothing changes.
    """
    rng = np.random.default_rng(seed)
    steps = per_call * calls
    raw, _ = simulate(rng, n, steps, group=n if joint else None, max_len=4)
    td = grid_td(raw, (n,))
    if not flags:
        td = td.exclude(*NO_RESTART_FLAGS)
    batches = [td[:, a : a + per_call] for a in range(0, steps, per_call)]
    gap = data.draw(st.integers(1, len(batches) - 2))
    filt = AutoresetFilter("next_step", joint_reset=joint)
    for b in batches[:gap]:
        filt.inv(b)
    before, after = batches[gap - 1], batches[gap + 1]
    open_before = ~before["next", "done"][:, -1].reshape(-1)
    if flags:
        open_before &= ~after["is_init"][:, 0].reshape(-1)
    # observations encode the step, so a skipped step never looks continued
    if not open_before.any():
        return
    stats = filt.stats
    with pytest.raises(ContinuityError, match="does not continue"):
        filt.inv(after)
    assert filt.stats == stats
