"""A batch written again after its write failed: the cleaner forgets the failed call.

A replay buffer runs the filter, then writes what the filter returned. If
that write fails (a full disk, a storage that raises), the filter has
already moved on: the held rows it released in that call, and its flags,
belong to rows that never reached the buffer. A user who writes the same
batch again gets those rows again: the cleaner keeps what it was before its
last call, and when a call brings that call's batch again it goes back to
it first.

The batch is recognised by the first row of each stream: its trajectory id
where the rows have TorchRL's ``("collector", "traj_ids")`` (an id is never
reused, so that is exact, and checked on every call); else its observation,
checked only when the call fails. A repeated batch does not follow the
streams, so the continuity check or the reset-row check refuses it, unless
every stream ended or restarted right at its start: such a repeat, without
trajectory ids, is not recognised.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from cleanbuf._continuity import CallEnds, same_bytes, same_rows, take_rows
from cleanbuf._keys import TRAJ_IDS
from cleanbuf._move import Views


class SameBatchAgain(Exception):
    """Raised inside the cleaner when a call brings the last call's batch again."""


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """The first row of each stream of a time-aligned call.

    Attributes:
        exact: the rows are trajectory ids (exact), not observations.
        rows: key -> rows ``[S, ...]`` (copies).
    """

    exact: bool
    rows: dict

    @classmethod
    def of_call(cls, views: Views, first: np.ndarray, ends: CallEnds) -> Fingerprint:
        """The fingerprint of a call from its first row of each stream.

        The trajectory ids of the rows ``first``, or their observations
        (``ends``) where the rows have no trajectory ids.
        """
        if TRAJ_IDS in views.tensors:
            return cls(True, {TRAJ_IDS: take_rows(views, TRAJ_IDS, first)})
        return cls(False, ends.first_obs)

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
