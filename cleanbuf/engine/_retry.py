"""A batch written again after its write failed: the cleaner forgets the failed call.

A replay buffer runs the filter, then writes what the filter returned. If
that write fails (a full disk, a storage that raises), the filter has
already moved on: the held rows it released in that call, and its flags,
belong to rows that never reached the buffer. A user who writes the same
batch again gets those rows again: the cleaner keeps what it was before its
last call, and when a call brings that call's batch again it goes back to
it first (:func:`call_with_retry`).

The batch is recognised by the first row of each stream: its observation,
and its trajectory id where the rows have TorchRL's
``("collector", "traj_ids")`` (read with the stream ends,
:func:`cleanbuf.engine._continuity.read_ends`). With trajectory ids it is
checked on every call. Where the filter sees that the last call's rows
reached the buffer (:meth:`Cleaner.last_call_stored`), the same batch
again is a duplicate and raises :class:`~cleanbuf.ContinuityError`. An
id alone is not enough: a stream keeps its id for a whole episode, so two
batches in a row start with the same ids whenever
no episode ended between their starts (every batch of a 200-step Pendulum
episode collected 8 steps at a time). The observation tells them apart: the
next batch starts where the last one ended. Only an env whose observation
did not change over a whole batch, in every stream, looks the same. Without
trajectory ids the fingerprint is checked only when the call fails: a
repeated batch does not follow the streams, so the continuity check or the
reset-row check refuses it, unless every stream ended or restarted right at
its start; such a repeat is not recognised.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from cleanbuf.engine._errors import CleanbufError, ContinuityError


class SameBatchAgain(Exception):
    """Raised inside the cleaner when a call brings the last call's batch again."""


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """The first row of each stream of a time-aligned call.

    Attributes:
        exact: the rows include trajectory ids (checked on every call).
        rows: key -> the first rows' bytes ``[S, B]``: the observations, and
            the trajectory ids when there are some.
        again: the rows equal the fingerprint of the call before (compared
            when read).
    """

    exact: bool
    rows: dict
    again: bool


@dataclasses.dataclass
class Undo:
    """What a cleaner was before a call, and that call's fingerprint."""

    carry: object
    groups: list
    stats: dict
    fingerprint: Fingerprint | None = None
    stored: bool = False  # the call's rows reached the buffer: the batch again is a duplicate

    @classmethod
    def of(cls, cleaner) -> Undo:
        """Snapshots ``cleaner``.

        A call replaces its carries or their fields and never writes into
        them, so shallow copies do.
        """
        return cls(
            cleaner._carry.snapshot(), [g.snapshot() for g in cleaner._groups], dict(cleaner._stats)
        )

    def restore(self, cleaner) -> None:
        """Puts ``cleaner`` back as it was when snapshotted."""
        cleaner._carry, cleaner._groups, cleaner._stats = self.carry, self.groups, self.stats


def call_with_retry(cleaner, td: Any, call: Callable) -> Any:
    """``call(td)`` on ``cleaner``, going back first if ``td`` is the last call's batch.

    ``call`` raises :class:`SameBatchAgain` when the rows' fingerprint
    (with trajectory ids) says so; a call that fails otherwise is retried
    from before the last call when its fingerprint matches that call's. A
    call that fails leaves the cleaner as it was.
    """
    undo = Undo.of(cleaner)
    try:
        out = call(td)
    except (SameBatchAgain, CleanbufError) as err:
        fingerprint = cleaner._fingerprint
        again = cleaner._undo is not None and (
            isinstance(err, SameBatchAgain) or (fingerprint is not None and fingerprint.again)
        )
        if not again:
            raise
        if cleaner._undo.stored:
            _refuse_stored_again(cleaner, td, call, undo, err)
        last, cleaner._undo = cleaner._undo, None
        last.restore(cleaner)
        retry = Undo.of(cleaner)
        try:
            out = call(td)
        except CleanbufError:
            undo.restore(cleaner)  # as before this call, which changes nothing
            cleaner._undo = last
            if isinstance(err, SameBatchAgain):
                raise
            raise err from None
        undo = retry
    undo.fingerprint = cleaner._fingerprint
    cleaner._undo = undo
    return out


def _refuse_stored_again(cleaner, td: Any, call: Callable, undo: Undo, err: Exception) -> None:
    """Raises for a call that looks like the last one again, whose rows were stored.

    The first rows alone may match another batch (a fresh start of every
    stream looks the same each time): it is the same batch if it cleans
    from where the last call started. Either way the cleaner is left as
    it was.
    """
    last, cleaner._undo = cleaner._undo, None
    last.restore(cleaner)
    try:
        call(td)
    except (SameBatchAgain, CleanbufError):
        same = False
    else:
        same = True
    undo.restore(cleaner)
    cleaner._undo = last
    if same:
        raise written_twice() from None
    if isinstance(err, SameBatchAgain):
        raise written_twice() from None
    raise err


def written_twice() -> ContinuityError:
    """The error for a batch that comes again after its rows were stored."""
    return ContinuityError(
        "this batch is the one the last call cleaned (the same first row in every stream), "
        "and that call's rows were stored: it was written twice. Expected the next batch of "
        "each stream, got the last one again. Write each batch once (a batch whose write "
        "into the buffer failed may be written again; this one's write succeeded). Nothing "
        "was written."
    )
