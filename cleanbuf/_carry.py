"""The cleaner's carry state: what one call leaves for the next.

Per stream: whether a reset row comes next (``pending``), whether a held row
waits for the next row as its next observation's source (``waiting``),
whether the next kept row starts an auto-reset episode (``need_init``), the
step-count shift of the current episode (``shift``); the held rows
themselves; and, for stream-key data, the stream id of each slot. All of it
is small (a few values per stream and at most one row per stream).
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch

from cleanbuf._errors import InputError

STATE_VERSION = 2
_PER_STREAM = {"pending": np.bool_, "waiting": np.bool_, "need_init": np.bool_, "shift": np.int64}


def _empty(dtype):
    return dataclasses.field(default_factory=lambda: np.zeros(0, dtype))


@dataclasses.dataclass
class Carry:
    """Per-stream state carried between calls."""

    stream_shape: tuple | None = None
    layout_kind: str | None = None
    stream_ids: np.ndarray | None = None
    pending: np.ndarray = _empty(np.bool_)
    waiting: np.ndarray = _empty(np.bool_)
    need_init: np.ndarray = _empty(np.bool_)
    shift: np.ndarray = _empty(np.int64)
    held: dict = dataclasses.field(default_factory=dict)  # key -> tensor [H, ...]
    held_stream: np.ndarray = _empty(np.int64)

    def grown(self, n_streams: int) -> "Carry":
        """A shallow copy whose per-stream arrays cover ``n_streams`` streams.

        Callers replace the copy's arrays and never write into them, so the
        original stays valid until the copy is committed.
        """
        out = copy.copy(self)
        extra = n_streams - len(self.pending)
        if extra > 0:
            for name, dtype in _PER_STREAM.items():
                setattr(out, name, np.concatenate([getattr(self, name), np.zeros(extra, dtype)]))
        return out

    def state_dict(self) -> dict:
        """The state as tensors and plain Python values (picklable, copyable)."""
        state = {
            "version": STATE_VERSION,
            "stream_shape": None if self.stream_shape is None else list(self.stream_shape),
            "layout_kind": self.layout_kind,
            "stream_ids": None if self.stream_ids is None else torch.from_numpy(self.stream_ids.copy()),
            "held": {k: v.clone() for k, v in self.held.items()},
            "held_stream": torch.from_numpy(self.held_stream.copy()),
        }
        for name in _PER_STREAM:
            state[name] = torch.from_numpy(getattr(self, name).copy())
        return state

    @classmethod
    def from_state_dict(cls, state: dict) -> "Carry":
        """Rebuilds the carry from :meth:`state_dict`'s output."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise InputError(
                f"not a cleanbuf state of version {STATE_VERSION} (got "
                f"{state.get('version') if isinstance(state, dict) else type(state).__name__}); "
                "pass what AutoresetFilter.state_dict() returned with this cleanbuf version."
            )
        ids = state["stream_ids"]
        shape = state["stream_shape"]
        return cls(
            stream_shape=None if shape is None else tuple(shape),
            layout_kind=state["layout_kind"],
            stream_ids=None if ids is None else ids.numpy().copy(),
            held={tuple(k): v.clone() for k, v in state["held"].items()},
            held_stream=state["held_stream"].numpy().copy(),
            **{name: state[name].numpy().copy() for name in _PER_STREAM},
        )
