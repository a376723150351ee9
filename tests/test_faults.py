"""Faults around the filter: a write that fails, a worker that dies, a storage it cannot feed."""

from __future__ import annotations

import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

from cleanbuf import AutoresetFilter, LayoutError
from tests.batches import assert_same_rows, next_step_batch
from tests.faults import FlakyStorage

STEPS = 6


def _calls(traj_ids):
    both = next_step_batch(3, 8 * STEPS, 21)
    if traj_ids:  # one id per episode of each stream, never reused
        starts = both["is_init"].squeeze(-1).long().cumsum(1)
        both["collector", "traj_ids"] = starts + 1000 * torch.arange(3).unsqueeze(1)
    return [both[:, i : i + STEPS] for i in range(0, 8 * STEPS, STEPS)]


@pytest.mark.parametrize(
    "traj_ids, options",
    [(True, {}), (False, {}), (True, {"producer_key": ("collector", "traj_ids")})],
    ids=["trajectory ids", "observations", "producer_key"],
)
def test_a_failed_write_then_the_same_batch_again(traj_ids, options):
    """The storage raises on the write of a call that releases held rows;
    the user writes the same batch again. Bugs caught: the held rows the
    failed call released lost for good (the filter had moved on), the
    batch's reset rows kept on the second try (their done rows no longer
    pending), the stats counting the batch twice.
    """
    calls = _calls(traj_ids)
    filt = AutoresetFilter("next_step", **options)
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    for batch in calls:
        rb.extend(batch)
    filt.flush(rb)
    want, want_stats = rb[: len(rb)], filt.stats

    storage = FlakyStorage(1000)
    filt = AutoresetFilter("next_step", **options)
    rb = ReplayBuffer(storage=storage, transform=filt)
    gap = None
    for batch in calls:
        if filt.stats["rows_held"] and gap is None:  # this call releases held rows
            storage.fail_next = True
            start = rb.write_count
            with pytest.raises(OSError, match="injected"):
                rb.extend(batch)
            # TorchRL's writer moves its cursor (and write_count) before the
            # storage writes, so the failed write leaves a gap of unwritten
            # slots, and len(rb) no longer counts to the last row.
            gap = (start, rb.write_count)
        rb.extend(batch)
    filt.flush(rb)
    assert gap is not None and gap[1] > gap[0]
    assert filt.stats == want_stats
    rows = storage._storage[: rb.write_count]  # (get() stops at len(rb), short of the end)
    assert_same_rows(torch.cat([rows[: gap[0]], rows[gap[1] :]]), want)


def test_a_storage_of_two_dimensions_is_refused():
    """LazyTensorStorage(ndim=2) expects [E, T] batches; the filter stores flat
    rows. Bug caught: the filter committing (rows counted, held rows
    released) before TorchRL fails with an opaque transpose error.
    """
    filt = AutoresetFilter("next_step")
    rb = ReplayBuffer(storage=LazyTensorStorage(100, ndim=2), transform=filt)
    with pytest.raises(LayoutError, match="ndim=2") as info:
        rb.extend(next_step_batch(2, 12, 1))
    assert "ndim=1" in str(info.value) and "SliceSampler" in str(info.value)
    assert filt.stats["rows_in"] == 0 and len(rb) == 0
