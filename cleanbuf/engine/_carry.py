"""The cleaner's carry state: what one call leaves for the next.

Per stream: whether a reset row comes next (``pending``), whether a held row
waits for the next row as its next observation's source (``waiting``),
whether the next kept row starts an auto-reset episode (``need_init``), the
step-count shift of the current episode (``shift``), whether the held
row's end is an undecided collector mark (``marked``); the held rows
themselves; and, for stream-key data, the stream id of each slot. All of it
is small (a few values per stream and at most one row per stream).

The per-stream values live in one ``int64[5, S]`` array, the form the
planning kernel reads and returns (one array to pass instead of four).
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch

from cleanbuf.engine._continuity import LastRows, as_bytes
from cleanbuf.engine._errors import InputError
from cleanbuf.engine._kernels import (
    JOINT_MARK,
    MARK,
    MARKED,
    NEED_INIT,
    PENDING,
    SHIFT,
    WAITING,
)

STATE_VERSION = 2
# The per-stream values: their row in Carry.per_stream, and their dtype in a state dict.
_PER_STREAM = {
    "pending": (PENDING, np.bool_),
    "waiting": (WAITING, np.bool_),
    "need_init": (NEED_INIT, np.bool_),
    "shift": (SHIFT, np.int64),
    "marked": (MARKED, np.int8),
}


def _empty(dtype):
    return dataclasses.field(default_factory=lambda: np.zeros(0, dtype))


def no_streams() -> np.ndarray:
    """The per-stream state before any stream is seen."""
    return np.zeros((len(_PER_STREAM), 0), np.int64)


@dataclasses.dataclass
class Carry:
    """Per-stream state carried between calls.

    ``per_stream`` is ``int64[5, S]``: per stream, whether a reset row comes
    next (row ``PENDING``), whether its held row waits (``WAITING``), whether
    the next kept row starts an auto-reset episode (``NEED_INIT``), the
    step-count shift of its episode (``SHIFT``), and whether its pending
    done row is an undecided batch-end mark (``MARKED``). Callers replace the array
    and never write into it.

    Examples:
        >>> carry = Carry().grown(2)
        >>> carry.per_stream.shape, carry.n_streams
        ((5, 2), 2)
        >>> restored = Carry.from_state_dict(carry.state_dict())
        >>> restored.per_stream.tolist() == carry.per_stream.tolist()
        True
    """

    stream_shape: tuple | None = None
    layout_kind: str | None = None
    stream_ids: np.ndarray | None = None
    per_stream: np.ndarray = dataclasses.field(default_factory=no_streams)
    held: dict = dataclasses.field(default_factory=dict)  # key -> tensor [H, ...]
    held_stream: np.ndarray = _empty(np.int64)
    last: LastRows = dataclasses.field(default_factory=LastRows)  # for the continuity check
    traj_ids: np.ndarray = _empty(np.int64)  # producer_key: the last rows' trajectory ids

    @property
    def n_streams(self) -> int:
        """The streams the state covers."""
        return self.per_stream.shape[1]

    def snapshot(self) -> Carry:
        """A shallow copy, cheaper than ``copy.copy``.

        A call replaces the fields of its carry and never writes into their
        values, so the copy stays what the carry was.
        """
        out = object.__new__(Carry)
        out.__dict__.update(self.__dict__)
        return out

    def is_blank(self) -> bool:
        """Whether nothing carries over (a new carry is blank).

        Nothing carries over when no row is held, no flag is set and every
        stream's last row ended an episode.
        """
        return not (
            len(self.held_stream)
            or np.count_nonzero(self.per_stream[:MARKED])
            or np.count_nonzero(self.per_stream[MARKED] & (MARK | JOINT_MARK))
            or np.count_nonzero(self.last.open)
        )

    def grown(self, n_streams: int) -> Carry:
        """A shallow copy whose per-stream state covers ``n_streams`` streams.

        Callers replace the copy's arrays and never write into them, so the
        original stays valid until the copy is committed.
        """
        out = copy.copy(self)
        extra = n_streams - self.n_streams
        if extra > 0:
            new = np.zeros((len(_PER_STREAM), extra), np.int64)
            out.per_stream = np.concatenate([self.per_stream, new], axis=1)
        return out

    def state_dict(self) -> dict:
        """The state as tensors and plain Python values (picklable, copyable)."""
        state = {
            "version": STATE_VERSION,
            "stream_shape": None if self.stream_shape is None else list(self.stream_shape),
            "layout_kind": self.layout_kind,
            "stream_ids": None
            if self.stream_ids is None
            else torch.from_numpy(self.stream_ids.copy()),
            "held": {k: v.clone() for k, v in self.held.items()},
            "held_stream": torch.from_numpy(self.held_stream.copy()),
            "last_next": {k: torch.as_tensor(v).clone() for k, v in self.last.next_obs.items()},
            "last_open": torch.from_numpy(self.last.open.copy()),
            "traj_ids": torch.from_numpy(self.traj_ids.copy()),
        }
        for name, (row, dtype) in _PER_STREAM.items():
            state[name] = torch.from_numpy(self.per_stream[row].astype(dtype))
        return state

    @classmethod
    def from_state_dict(cls, state: dict) -> Carry:
        """Rebuilds the carry from :meth:`state_dict`'s output."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise InputError(
                f"not a cleanbuf state of version {STATE_VERSION} (got "
                f"{state.get('version') if isinstance(state, dict) else type(state).__name__}); "
                "pass what AutoresetFilter.state_dict() returned with this cleanbuf version."
            )
        ids = state["stream_ids"]
        shape = state["stream_shape"]
        per_stream = np.zeros((len(_PER_STREAM), len(state["pending"])), np.int64)
        for name, (row, _) in _PER_STREAM.items():
            if name in state:  # ("marked" came later: absent means none)
                per_stream[row] = state[name].numpy()
        return cls(
            stream_shape=None if shape is None else tuple(shape),
            layout_kind=state["layout_kind"],
            stream_ids=None if ids is None else ids.numpy().copy(),
            held={tuple(k): v.clone() for k, v in state["held"].items()},
            held_stream=state["held_stream"].numpy().copy(),
            last=LastRows(
                {tuple(k): as_bytes(v).copy() for k, v in state.get("last_next", {}).items()},
                state["last_open"].numpy().copy()
                if "last_open" in state
                else np.zeros(0, np.bool_),
            ),
            traj_ids=state["traj_ids"].numpy().copy()
            if "traj_ids" in state
            else np.zeros(0, np.int64),
            per_stream=per_stream,
        )
