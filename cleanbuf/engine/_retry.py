"""A batch written again after its write failed: the cleaner forgets the failed call.

A replay buffer runs the filter, then writes what the filter returned. If
that write fails (a full disk, a storage that raises), the filter has
already moved on: the held rows it released in that call, and its flags,
belong to rows that never reached the buffer. A user who writes the same
batch again gets those rows again: the cleaner keeps what it was before its
last call, and when a call brings that call's batch again it goes back to
it first.

The batch is recognised by the first row of each stream: its observation,
and its trajectory id where the rows have TorchRL's
``("collector", "traj_ids")``. With trajectory ids it is checked on every
call. An id alone is not enough: a stream keeps its id for a whole episode,
so two batches in a row start with the same ids whenever no episode ended
between their starts (every batch of a 200-step Pendulum episode
collected 8 steps at a time). The observation tells them apart: the next
batch starts where the last one ended. Only an env whose observation did
not change over a whole batch, in every stream, looks the same. Without
trajectory ids the fingerprint is checked only when the call fails: a
repeated batch does not follow the streams, so the continuity check or the
reset-row check refuses it, unless every stream ended or restarted right at
its start; such a repeat is not recognised.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cleanbuf.engine._continuity import CallEnds, same_bytes, same_rows, take_rows
from cleanbuf.engine._keys import TRAJ_IDS
from cleanbuf.engine._move import Views


class SameBatchAgain(Exception):
    """Raised inside the cleaner when a call brings the last call's batch again."""


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """The first row of each stream of a time-aligned call.

    Attributes:
        exact: the rows include trajectory ids (checked on every call).
        rows: key -> rows ``[S, ...]`` (copies): the observations, and the
            trajectory ids when there are some.
    """

    exact: bool
    rows: dict

    @classmethod
    def of_call(cls, views: Views, first: np.ndarray, ends: CallEnds) -> Fingerprint:
        """The fingerprint of a call from its first row of each stream.

        The observations of the rows ``first`` (``ends``), with their
        trajectory ids when the rows have some.
        """
        if TRAJ_IDS not in views.tensors:
            return cls(False, ends.first_obs)
        return cls(True, {**ends.first_obs, TRAJ_IDS: take_rows(views, TRAJ_IDS, first)})

    def same(self, other: Fingerprint | None) -> bool:
        """Whether ``other`` has the same first rows, byte for byte."""
        if other is None or other.exact != self.exact or other.rows.keys() != self.rows.keys():
            return False
        return all(_same(a, other.rows[k]) for k, a in self.rows.items())


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return same_bytes(a, b)
    return a.shape == b.shape and bool(same_rows(a, b).all())


@dataclasses.dataclass
class Undo:
    """What a cleaner was before a call, and that call's fingerprint."""

    carry: object
    groups: list
    stats: dict
    fingerprint: Fingerprint | None = None

    @classmethod
    def of(cls, cleaner) -> Undo:
        """Snapshots ``cleaner``.

        A call replaces its carries or their fields and never writes into
        them, so shallow copies do.
        """
        return cls(
            cleaner._carry.snapshot(), [g.snapshot() for g in cleaner._groups], dict(cleaner._stats)
        )

    def same_batch(self, fingerprint: Fingerprint | None) -> bool:
        """Whether a call with ``fingerprint`` brings this call's batch again."""
        return fingerprint is not None and fingerprint.same(self.fingerprint)

    def restore(self, cleaner) -> None:
        """Puts ``cleaner`` back as it was when snapshotted."""
        cleaner._carry, cleaner._groups, cleaner._stats = self.carry, self.groups, self.stats
