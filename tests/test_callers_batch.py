"""The caller's batch: never written, and read whatever keys and shapes it has."""

from __future__ import annotations

import torch

from cleanbuf import AutoresetFilter
from tests.batches import next_step_batch


def _second_call_untouched(both, **options):
    """Extends a fresh filter (with ``options``) with ``both`` cut in two: up
    to the first reset row, then up to the next episode end (a call with no
    episode end, which moves nothing but fixes step counts). Checks that
    neither call wrote into the batch it was given; returns the second call's
    output.
    """
    done = both["next", "done"].reshape(-1).nonzero().flatten().tolist()
    reset = done[0] + 1
    assert done[1] > reset + 1
    first, second = both[:, : reset + 1], both[:, reset + 1 : done[1]]
    filt = AutoresetFilter("next_step", **options)
    for batch in (first, second):
        copy = batch.clone()
        out = filt.inv(batch)
        assert (batch == copy).all()
    return out


def test_filter_does_not_mutate_the_callers_batch():
    """Bug caught: is_init / step_count / next observation patched in place
    in the batch the collector handed over, in the copying path and in the
    zero-copy path (a call that drops nothing but still fixes the step
    counts of an episode that began with a reset row in an earlier call).
    """
    out = _second_call_untouched(next_step_batch(1, 40, 2))
    assert (out["step_count"].reshape(-1) == torch.arange(len(out))).all()  # stored one too high
    assert out["is_init"].reshape(-1)[0]


def test_next_step_count_alone_is_fixed_and_the_batch_untouched():
    """A batch with ("next", "step_count") but no root "step_count". Bugs
    caught: the next step counts of an episode that began with a dropped reset
    row left one too high, or shifted in place in the caller's batch (in the
    zero-copy path, a call that drops nothing).
    """
    out = _second_call_untouched(next_step_batch(1, 40, 2).exclude("step_count"))
    assert (out["next", "step_count"].reshape(-1) == torch.arange(1, len(out) + 1)).all()


def test_next_step_count_alone_without_is_init_is_fixed_in_a_quiet_call():
    """("next", "step_count") alone and no is_init: the second call has no
    episode end and no is_init fix pending, only the step shift. Bug caught:
    such a call judged clean because the root "step_count" was absent, and
    passed through with its next step counts one too high.
    """
    batch = next_step_batch(1, 40, 2).exclude("step_count", "is_init")
    out = _second_call_untouched(batch)
    assert (out["next", "step_count"].reshape(-1) == torch.arange(1, len(out) + 1)).all()


def test_step_count_key_none_leaves_the_counts_alone():
    """step_count_key=None, and the second call continues an episode that
    began with a dropped reset row. Bugs caught: a TypeError (the "next" twin
    of a None key built as ("next", *None)) as soon as a row needed a shift,
    and step counts shifted although the user opted out.
    """
    batch = next_step_batch(1, 40, 2)
    out = _second_call_untouched(batch, step_count_key=None)
    done = batch["next", "done"].reshape(-1).nonzero().flatten().tolist()
    second = batch[:, done[0] + 2 : done[1]].reshape(-1)
    assert len(out) == len(second)
    for key in ("step_count", ("next", "step_count")):
        assert (out[key] == second[key]).all()


def test_terminated_and_truncated_of_different_trailing_shapes():
    """Done flags read from ``terminated | truncated`` where one is ``[E, T, 1]``
    and the other ``[E, T]`` (both one flag per row). Bug caught: the two
    flag arrays broadcast against each other (``[N, 1] | [N]`` is ``[N, N]``)
    instead of being read row by row.
    """
    batch = next_step_batch(2, 12, 3)
    done = batch["next", "done"]
    flags = batch.exclude(("next", "done"))
    flags.set(("next", "terminated"), done.clone())
    mixed = flags.clone()
    mixed.set(("next", "truncated"), torch.zeros(done.shape[:-1], dtype=torch.bool))
    flags.set(("next", "truncated"), torch.zeros_like(done))
    want = AutoresetFilter("next_step").inv(flags)
    got = AutoresetFilter("next_step").inv(mixed)
    assert len(got) == len(want) < batch.numel()
    assert (got["next", "observation"] == want["next", "observation"]).all()
