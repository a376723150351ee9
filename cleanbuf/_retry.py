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
checked only when the call fails (a repeated batch does not follow the
streams: the continuity check or the reset-row check refuses it, unless
every stream ended or restarted right at its start, which a raw loop's
repeat is left to).
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from cleanbuf._continuity import _same_rows, _take
from cleanbuf._move import Views

TRAJ_IDS = ("collector", "traj_ids")


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
    def of_call(cls, views: Views, obs_keys: list, steps: int) -> "Fingerprint":
        """Reads the first row of each stream (``steps`` rows a stream)."""
        first = np.arange(0, views.n_rows, steps)
        if TRAJ_IDS in views.tensors:
            return cls(True, {TRAJ_IDS: _take(views, TRAJ_IDS, first)})
        return cls(False, {k: _take(views, k, first) for k in obs_keys})

    def same(self, other: "Fingerprint | None") -> bool:
        """Whether ``other`` has the same first rows."""
        if other is None or other.exact != self.exact or other.rows.keys() != self.rows.keys():
            return False
        for k, a in self.rows.items():
            b = other.rows[k]
            if a.shape != b.shape or not _same_rows(a, b).all():
                return False
        return True


@dataclasses.dataclass
class Undo:
    """What a cleaner was before a call, and that call's fingerprint."""

    carry: object
    groups: list
    stats: dict
    fingerprint: Fingerprint | None = None

    @classmethod
    def of(cls, cleaner) -> "Undo":
        """Snapshots ``cleaner`` (its carries are replaced or have their
        fields replaced by a call, never written into: shallow copies do)."""
        return cls(copy.copy(cleaner._carry), [copy.copy(g) for g in cleaner._groups],
                   dict(cleaner._stats))

    def same_batch(self, fingerprint: Fingerprint | None) -> bool:
        """Whether a call with ``fingerprint`` brings this call's batch again."""
        return fingerprint is not None and fingerprint.same(self.fingerprint)

    def restore(self, cleaner) -> None:
        cleaner._carry, cleaner._groups, cleaner._stats = self.carry, self.groups, self.stats
