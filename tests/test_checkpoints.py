"""Checkpoints: the filter's state saved and loaded the ways TorchRL users do it.

Every path uses PyTorch's and TorchRL's defaults (``torch.load`` with
``weights_only=True``), and a run checkpointed mid-stream and resumed must
store exactly the rows of the uninterrupted run.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

from cleanbuf import AutoresetFilter, InputError
from tests.batches import assert_same_rows, next_step_batch

# Short calls, so that some calls have no episode end (the pass-through path)
# and some end on a done row (a held row in the checkpoint).
STEPS, CUT = 3, 4


def _calls(seed=7):
    both = next_step_batch(3, 8 * STEPS, seed)
    return [both[:, i : i + STEPS] for i in range(0, 8 * STEPS, STEPS)]


def _buffer(**options):
    filt = AutoresetFilter("next_step", **options)
    return filt, ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)


def _finish(filt, rb, calls):
    for batch in calls:
        rb.extend(batch)
    filt.flush(rb)
    return rb[: len(rb)]


def _via_dumps(rb, tmp_path):
    rb.dumps(tmp_path / "rb")
    filt, fresh = _buffer()
    fresh.loads(tmp_path / "rb")
    return filt, fresh


def _via_rb_state_dict(rb, tmp_path):
    f = io.BytesIO()
    torch.save(rb.state_dict(), f)
    f.seek(0)
    filt, fresh = _buffer()
    fresh.load_state_dict(torch.load(f))
    return filt, fresh


def _via_filter_state_dict(rb, tmp_path):
    old = rb._transform[0]
    f = io.BytesIO()
    torch.save({"filter": old.state_dict(), "rb": rb.state_dict()}, f)
    f.seek(0)
    saved = torch.load(f)
    filt, fresh = _buffer()
    fresh.load_state_dict(saved["rb"])
    filt.load_state_dict(saved["filter"])
    return filt, fresh


@pytest.mark.parametrize(
    "restore",
    [_via_dumps, _via_rb_state_dict, _via_filter_state_dict],
    ids=["rb.dumps/loads", "torch.save(rb.state_dict())", "torch.save(filt.state_dict())"],
)
def test_resume_with_default_loading_equals_uninterrupted(restore, tmp_path):
    """Saved after a few calls (with a held row), loaded with the defaults,
    resumed. Bugs caught: anything in the state that ``torch.load`` refuses
    with weights_only=True, the held row or a pending reset row missing
    from the checkpoint (the resumed buffer keeps a reset row or loses the
    held row), stats not restored.
    """
    calls = _calls()
    filt, rb = _buffer()
    want = _finish(filt, rb, calls)

    filt, rb = _buffer()
    for batch in calls[:CUT]:
        rb.extend(batch)
    assert filt.stats["rows_held"] > 0, "the checkpoint should hold a row"
    assert (
        filt.stats["rows_out"]
        == filt.stats["rows_in"] - filt.stats["rows_held"] - filt.stats["reset_rows_dropped"]
    )
    before = filt.stats
    filt2, rb2 = restore(rb, tmp_path)
    assert filt2.stats == before
    got = _finish(filt2, rb2, calls[CUT:])
    assert_same_rows(got, want)


def test_stats_are_plain_python_numbers():
    """Bug caught: numpy integers in the stats (from the pass-through path),
    which ``json.dumps`` and ``torch.load(weights_only=True)`` reject.
    """
    filt, rb = _buffer()
    quiet = next_step_batch(2, 12, 1)[:, :1].clone()
    quiet["next", "done"] = torch.zeros_like(quiet["next", "done"])
    quiet["next", "reward"] = torch.ones_like(quiet["next", "reward"])
    rb.extend(quiet)
    rb.extend(next_step_batch(2, 12, 1))
    stats = filt.stats
    assert all(type(v) is int for v in stats.values()), stats
    assert json.loads(json.dumps(stats)) == stats


def test_state_from_other_options_is_refused():
    """Bug caught: a state saved by a filter with other options (another
    mode, or another joint-reset flavour) loaded silently, so the held rows
    and pending flags are read under the wrong rules.
    """
    filt, rb = _buffer()
    rb.extend(_calls()[0])
    state = filt.state_dict()
    other = AutoresetFilter("next_step", joint_reset=True)
    with pytest.raises(InputError, match="joint_reset"):
        other.load_state_dict(state)
    with pytest.raises(InputError, match="mode"):
        AutoresetFilter("same_step").load_state_dict(state)
    same = AutoresetFilter("next_step")
    same.load_state_dict(state)
    assert same.stats == filt.stats
