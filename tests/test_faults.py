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
    pending), the stats counting the batch twice, and the slots the failed
    extend passed left holding nothing (TorchRL moves its writer first: the
    retry stored after them, a sampler drawing uninitialised rows).
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
    failed = False
    for batch in calls:
        if filt.stats["rows_held"] and not failed:  # this call releases held rows
            storage.fail_next = True
            with pytest.raises(OSError, match="injected"):
                rb.extend(batch)
            failed = True
        rb.extend(batch)
    filt.flush(rb)
    assert failed
    assert filt.stats == want_stats
    # TorchRL's writer moves past the slots before the storage writes: the
    # filter puts it back, so the retry fills them and none holds nothing.
    assert rb.write_count == len(rb) == len(want)
    assert_same_rows(rb[: len(rb)], want)


def test_a_failed_flush_write_flushed_again():
    """The storage raises on the flush's write; the user flushes again.
    Bugs caught: the held rows forgotten by the failed flush (nothing to
    flush the second time), and the slots the failed write's extend passed
    left holding nothing (its rows stored after them, the gap sampled: a
    lost terminal observation read as a random float instead of NaN).
    """
    calls = _calls(False)
    want_rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=AutoresetFilter("next_step"))
    for k, batch in enumerate(calls):  # up to a call that ends holding rows
        want_rb.extend(batch)
        if want_rb.transform[0].stats["rows_held"]:
            calls = calls[: k + 1]
            break
    want_rb.transform[0].flush(want_rb)
    want = want_rb[: len(want_rb)]

    storage = FlakyStorage(1000)
    filt = AutoresetFilter("next_step")
    rb = ReplayBuffer(storage=storage, transform=filt)
    for batch in calls:
        rb.extend(batch)
    held = filt.stats["rows_held"]
    assert held, "no held row: the flush writes nothing"
    storage.fail_next = True
    with pytest.raises(OSError, match="injected"):
        filt.flush(rb)
    assert filt.stats["rows_held"] == held, "the failed flush forgot the held rows"
    filt.flush(rb)
    assert rb.write_count == len(rb) == len(want)
    assert_same_rows(rb[: len(rb)], want)


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
