"""The held rows of earlier calls that a call releases."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from cleanbuf.engine._carry import Carry
from cleanbuf.engine._kernels import NO_ROWS, RELEASED_LOST
from cleanbuf.engine._keys import done_flags
from cleanbuf.engine._move import Views

_NO_FLAGS = np.zeros(0, np.bool_)


@dataclasses.dataclass(frozen=True)
class Release:
    """The held rows a call releases, in output order (they come first).

    Attributes:
        streams: their streams.
        slots: their slots in the carry's held rows.
        src: per row, the call's row holding its next observation, or
            ``RELEASED_LOST`` (lost: a restart cut it off),
            ``RELEASED_AS_IS`` (complete as stored: its end was only a mark)
            or ``RELEASED_STORED`` (complete as stored: a real end whose
            terminal observation it holds).
        lost_done: per lost row (dropped ones included), whether it is a
            done row.
        n_dropped: lost rows left out (the "drop" policy).
    """

    streams: np.ndarray
    slots: np.ndarray
    src: np.ndarray
    lost_done: np.ndarray
    n_dropped: int = 0

    @classmethod
    def of(cls, carry: Carry, released_src: np.ndarray, done_key) -> Release:
        """Reads the kernel's per-stream ``released_src`` against the held rows."""
        if not len(carry.held_stream):
            return cls(NO_ROWS, NO_ROWS, NO_ROWS, _NO_FLAGS)
        slot_of = np.full(len(released_src), -1, np.int64)
        slot_of[carry.held_stream] = np.arange(len(carry.held_stream))
        streams = np.flatnonzero((released_src != -1) & (slot_of >= 0))
        slots, src = slot_of[streams], released_src[streams]
        lost_done = _NO_FLAGS
        if np.count_nonzero(src == RELEASED_LOST):
            held = Views(carry.held, 1, len(carry.held_stream))
            lost_done = done_flags(held, done_key)[slots[src == RELEASED_LOST]]
        return cls(streams, slots, src, lost_done)

    def __len__(self) -> int:
        return len(self.streams)

    @property
    def n_stitched(self) -> int:
        """Released rows whose next observation this call brings."""
        return int(np.count_nonzero(self.src >= 0))

    @property
    def n_lost(self) -> int:
        """Released rows whose next observation is lost."""
        return len(self.lost_done)

    @property
    def n_terminal_lost(self) -> int:
        """Of those, the done rows."""
        return int(np.count_nonzero(self.lost_done))

    def without_lost(self) -> Release:
        """The same release with the lost rows left out (the "drop" policy)."""
        keep = self.src != RELEASED_LOST
        return Release(
            self.streams[keep],
            self.slots[keep],
            self.src[keep],
            self.lost_done,
            n_dropped=len(self.src) - int(np.count_nonzero(keep)),
        )


def kept_held(held: dict, kept_old: np.ndarray, new_held: dict) -> dict:
    """The held rows after a call: the old ones not released, then the new ones."""
    if not kept_old.any():
        return new_held
    idx = torch.from_numpy(np.flatnonzero(kept_old))
    kept = {k: v.index_select(0, idx.to(v.device)) for k, v in held.items()}
    if not new_held:
        return kept
    return {k: torch.cat([kept[k], new_held[k].to(kept[k].device)]) for k in kept}
