"""The state a cleaner keeps between calls: the carry, its held rows, its checks.

What the step (read -> plan -> write) reads and replaces: a call builds a
new :class:`Carry` (or new fields of it), made current only when the call
succeeds, so a failed call leaves the state as it was. A cleaner's whole
state is one :class:`State`, which the cleaner's undo restores. Also the
checks of a saved state (:func:`check_state`, :func:`same_options`) and
:func:`kept_held`. Small: a few values and at most one held row per stream.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch

from cleanbuf.engine._continuity import LastRows, as_bytes
from cleanbuf.engine._errors import (
    InputError,
    StateError,
)
from cleanbuf.engine._kernels import (
    JOINT_MARK,
    MARK,
    MARKED,
    NEED_INIT,
    PENDING,
    SHIFT,
    STORED,
    WAITING,
)
from cleanbuf.engine._options import Options

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

    ``per_stream`` is the planning kernel's carry, ``int64[5, S]`` (rows
    ``PENDING``, ``WAITING``, ``NEED_INIT``, ``SHIFT``, ``MARKED``: see
    :func:`cleanbuf.engine._kernels.plan`). Callers replace the array and
    never write into it.

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
    stream_ids: np.ndarray | None = None  # stream-key data: the stream id of each slot
    per_stream: np.ndarray = dataclasses.field(default_factory=no_streams)
    held: dict = dataclasses.field(default_factory=dict)  # key -> tensor [H, ...]
    held_stream: np.ndarray = _empty(np.int64)
    last: LastRows = LastRows()  # for the continuity check (immutable)
    traj_ids: np.ndarray = _empty(np.int64)  # producer_key: the last rows' trajectory ids
    # Observation key -> (dtype, feature shape) of the calls so far (a change is refused).
    obs_schema: dict = dataclasses.field(default_factory=dict)
    # The read step's schema (cleanbuf.engine._read.Schema) the held rows were
    # checked against: a batch of that schema needs no comparison with them.
    held_schema: object = None

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
        """Whether nothing carries over: no held row, no flag, no open stream."""
        return not (
            len(self.held_stream)
            or np.count_nonzero(self.per_stream[:MARKED])
            or np.count_nonzero(self.per_stream[MARKED] & (MARK | JOINT_MARK))
            or np.count_nonzero(self.last.open)
        )

    def nothing_pending(self, has_is_init: bool, has_step_count: bool) -> bool:
        """Whether a call without an episode end has nothing to fix.

        Nothing to fix: no reset row to drop, no row waiting, and no
        bookkeeping fix that applies to the keys the call has (``is_init``,
        step counts).

        Examples:
            >>> carry = Carry().grown(2)
            >>> carry.nothing_pending(True, True)
            True
            >>> carry.expect_resets(1).nothing_pending(False, False)  # a reset row comes
            False
        """
        # (count_nonzero: cheaper than any() on these small arrays)
        nonzero, per_stream = np.count_nonzero, self.per_stream
        if nonzero(per_stream[PENDING]) or nonzero(per_stream[WAITING]):
            return False
        if has_is_init and nonzero(per_stream[NEED_INIT]):
            return False
        return not (has_step_count and nonzero(per_stream[SHIFT]))

    def forget_pending_init(self) -> None:
        """Forgets every pending ``is_init`` fix (rows without ``is_init`` make it moot).

        Replaces ``per_stream`` (never writes into it).
        """
        if np.count_nonzero(self.per_stream[NEED_INIT]):
            self.per_stream = self.per_stream.copy()
            self.per_stream[NEED_INIT] = 0

    def expect_resets(self, n_new: int) -> Carry:
        """A copy with ``n_new`` more streams, each starting with a reset row to drop.

        Examples:
            >>> carry = Carry().grown(1).expect_resets(2)
            >>> carry.n_streams, carry.per_stream[PENDING].tolist()
            (3, [0, 1, 1])
        """
        out = self.grown(self.n_streams + n_new)
        out.per_stream = out.per_stream.copy()
        out.per_stream[PENDING, self.n_streams :] = 1
        return out

    def held_marks(self) -> tuple[np.ndarray, np.ndarray]:
        """Per held row: an undecided mark, and its next observation stored.

        Two bool arrays: the held row's end is an undecided batch-end mark;
        the mark's next observation is stored (read when the row was held;
        only a mark is held with it stored).

        Examples:
            >>> carry = Carry().grown(1)
            >>> carry.held_stream = np.array([0])
            >>> [a.tolist() for a in carry.held_marks()]
            [[False], [False]]
        """
        flags = self.per_stream[MARKED][self.held_stream]
        return (flags & (MARK | JOINT_MARK)) != 0, (flags & STORED) != 0

    def flushed(self) -> None:
        """Forgets the held rows: no row is held, none waits."""
        per_stream = self.per_stream.copy()
        per_stream[WAITING] = 0
        self.held, self.held_stream, self.per_stream = {}, np.zeros(0, np.int64), per_stream

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
            "last_next": {
                k: torch.from_numpy(v.view(np.uint8).copy()) for k, v in self.last.next_obs.items()
            },
            "last_open": torch.from_numpy(self.last.open.copy()),
            "traj_ids": torch.from_numpy(self.traj_ids.copy()),
        }
        for name, (row, dtype) in _PER_STREAM.items():
            state[name] = torch.from_numpy(self.per_stream[row].astype(dtype))
        return state

    @classmethod
    def from_state_dict(cls, state: dict) -> Carry:
        """Rebuilds the carry from :meth:`state_dict`'s output.

        Raises:
            StateError: the state is not one :meth:`state_dict` returned, or
                its fields do not agree (checked before anything is built).
        """
        check_state(state)
        ids = state["stream_ids"]
        shape = state["stream_shape"]
        per_stream = np.zeros((len(_PER_STREAM), len(state["pending"])), np.int64)
        for name, (row, _) in _PER_STREAM.items():
            if name in state:  # (older states lack "marked": none)
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


@dataclasses.dataclass
class State:
    """A cleaner's whole state: what a call reads and replaces, and what undo restores.

    Attributes:
        carry: the carry of the producer whose call is in progress (or was last).
        producers: with several producers, one carry per producer (``carry``
            is one of them once its call succeeded); empty with one.
        stats: the counters, by name.

    Examples:
        >>> state = State(Carry(), [], {"rows_in": 0})
        >>> before = state.snapshot()
        >>> state.stats["rows_in"] += 5
        >>> before.stats["rows_in"], state.stats["rows_in"]
        (0, 5)
    """

    carry: Carry
    producers: list
    stats: dict

    def snapshot(self) -> State:
        """A copy to go back to: shallow copies of the carries, a copy of the counters.

        Shallow copies suffice, as for :meth:`Carry.snapshot`.
        """
        producers = [c.snapshot() for c in self.producers] if self.producers else []
        return State(self.carry.snapshot(), producers, dict(self.stats))


_LAYOUT_KINDS = (None, "time_last", "step", "stream_key")
_FIX = "Pass what state_dict() returned, unchanged, to a filter built with the same options."


def _state_error(field: str, expected: str, got: str) -> StateError:
    return StateError(f"state field {field!r}: expected {expected}, got {got}. {_FIX}")


def _tensor_1d(state: dict, field: str) -> torch.Tensor:
    value = state[field]
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.is_floating_point():
        got = (
            f"shape {list(value.shape)} and dtype {value.dtype}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise _state_error(field, "a 1-D integer or bool tensor", got)
    return value


def check_state(state: dict) -> None:
    """Raises unless ``state`` is a consistent carry state (:meth:`Carry.state_dict`).

    Every field is checked before anything is built from it: its presence,
    its type, and that the per-stream fields, the held rows and the stream
    shape agree.

    Raises:
        StateError: the first field that is wrong, with what it should be.

    Examples:
        >>> check_state(Carry().grown(2).state_dict())
        >>> check_state("garbage")
        Traceback (most recent call last):
        ...
        cleanbuf.engine._errors.StateError: state: expected a dict ...
    """
    if not isinstance(state, dict):
        raise StateError(
            f"state: expected a dict returned by state_dict(), got {type(state).__name__}. {_FIX}"
        )
    if state.get("version") != STATE_VERSION:
        raise _state_error("version", str(STATE_VERSION), repr(state.get("version")))
    required = ("stream_shape", "layout_kind", "stream_ids", "held", "held_stream")
    for field in (*required, *(n for n in _PER_STREAM if n != "marked")):
        if field not in state:
            raise _state_error(field, "the field", f"a state without it (keys {sorted(state)})")
    if state["layout_kind"] not in _LAYOUT_KINDS:
        raise _state_error("layout_kind", f"one of {_LAYOUT_KINDS}", repr(state["layout_kind"]))
    n_streams = _check_streams(state)
    _check_held(state, n_streams)
    _check_last(state)
    if "traj_ids" in state:
        _tensor_1d(state, "traj_ids")


def _check_streams(state: dict) -> int:
    """Checks the per-stream fields, the stream shape and ids; returns the streams."""
    n_streams = len(_tensor_1d(state, "pending"))
    for field in (n for n in _PER_STREAM if n in state):
        if len(_tensor_1d(state, field)) != n_streams:
            raise _state_error(
                field, f"{n_streams} values (one per stream, as 'pending')", str(len(state[field]))
            )
    shape = state["stream_shape"]
    if shape is not None:
        if not isinstance(shape, (list, tuple)) or not all(
            isinstance(d, int) and d >= 0 for d in shape
        ):
            raise _state_error("stream_shape", "None or a list of sizes", repr(shape))
        if state["layout_kind"] != "stream_key" and int(np.prod(shape)) != n_streams:
            raise _state_error(
                "stream_shape", f"sizes whose product is the {n_streams} streams", repr(shape)
            )
    ids = state["stream_ids"]
    if ids is not None and len(_tensor_1d(state, "stream_ids")) != n_streams:
        raise _state_error("stream_ids", f"{n_streams} ids (one per stream)", str(len(ids)))
    return n_streams


def _check_held(state: dict, n_streams: int) -> None:
    """Checks the held rows: one per stream at most, lined up with their streams."""
    held_stream = _tensor_1d(state, "held_stream")
    if len(held_stream) and (
        int(held_stream.min()) < 0
        or int(held_stream.max()) >= n_streams
        or len(torch.unique(held_stream)) != len(held_stream)
    ):
        raise _state_error(
            "held_stream",
            f"distinct stream indices in [0, {n_streams})",
            str(held_stream.tolist()),
        )
    held = state["held"]
    if not isinstance(held, dict):
        raise _state_error("held", "a dict of tensors", type(held).__name__)
    for key, value in held.items():
        if not isinstance(value, torch.Tensor) or not value.dim() or len(value) != len(held_stream):
            got = f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise _state_error(
                f"held[{key!r}]", f"a tensor of {len(held_stream)} rows (as 'held_stream')", got
            )
    if len(held_stream) and not held:
        raise _state_error("held", f"{len(held_stream)} held rows", "no keys")


def _check_last(state: dict) -> None:
    """Checks the continuity facts: one per stream, or none."""
    if "last_open" not in state:
        return
    n_open = len(_tensor_1d(state, "last_open"))
    n_streams = len(state["pending"])
    if n_open not in (0, n_streams):
        raise _state_error("last_open", f"0 or {n_streams} values", str(n_open))
    last_next = state.get("last_next", {})
    if not isinstance(last_next, dict):
        raise _state_error("last_next", "a dict of tensors", type(last_next).__name__)
    for key, value in last_next.items():
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or len(value) != n_open:
            is_tensor = isinstance(value, torch.Tensor)
            got = f"shape {list(value.shape)}" if is_tensor else "no tensor"
            raise _state_error(
                f"last_next[{key!r}]", f"a [{n_open}, bytes] tensor (as 'last_open')", got
            )


def same_options(saved: dict | None, options: Options) -> None:
    """Raises unless a state was saved by a cleaner with ``options``.

    ``saved`` is None for an older state that did not record them.
    """
    if saved is None:
        return
    diff = [
        f"{k}={saved.get(k)!r} (here: {v!r})"
        for k, v in options.as_dict().items()
        if saved.get(k) != v
    ]
    if diff:
        raise InputError(
            f"this state was saved with other options: {', '.join(diff)}. Build the "
            "filter or repair with the options it was saved with (or from the same "
            "for_env producer) before loading it. Nothing was changed."
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
