"""Layouts: how the rows of one call map to streams.

A layout turns a batch into flat rows (C order over the batch dimensions) and
gives each row a dense stream index. Three layouts exist:

* ``time_last``: batch ``[*E, T]``; each index of ``*E`` is a stream, stable
  across calls. A 1-D batch named ``["time"]``, or of length one (what
  ``ReplayBuffer.add`` passes), is a single stream.
* ``step``: batch ``[E]``; each call is one step of ``E`` streams.
* ``stream_key``: batch ``[N]``; a per-row key holds the stream id.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from cleanbuf.engine._errors import LayoutError
from cleanbuf.engine._kernels import NO_ROWS

_OPTIONS = (
    "layout=None for TorchRL collector batches [*E, T] (time last) or a single "
    "stream named ['time']; layout='step' when each call holds one step of E envs "
    "(batch [E]); stream_key=KEY for flat rows with a per-row stream id"
)


@dataclasses.dataclass(frozen=True)
class CallLayout:
    """How one call's rows map to streams.

    Attributes:
        kind: "time_last", "step" or "stream_key".
        stream_shape: the shape of the stream dimensions (``*E``; ``()`` for
            a single stream, ``(S,)`` for stream-key data).
        n_rows: rows in the call.
        stream: int64[n_rows] dense stream index of each flat row, for
            stream-key data (empty otherwise: row ``i`` belongs to stream
            ``i // steps``).
        steps: time steps per stream in this call (``T``; 1 for "step";
            0 for "stream_key", where it varies).
        new_stream_ids: stream ids seen for the first time (stream-key only).
    """

    kind: str
    stream_shape: tuple
    n_rows: int
    stream: np.ndarray
    steps: int
    new_stream_ids: np.ndarray | None = None
    n_streams: int = dataclasses.field(init=False)

    def __post_init__(self):
        # The number of streams (the product of ``stream_shape``).
        object.__setattr__(self, "n_streams", int(np.prod(self.stream_shape, dtype=np.int64)))

    @functools.cached_property
    def first_rows(self) -> np.ndarray:
        """The first row of each stream (time-aligned layouts)."""
        return np.arange(0, self.n_rows, self.steps)

    @functools.cached_property
    def last_rows(self) -> np.ndarray:
        """The last row of each stream (time-aligned layouts)."""
        return np.arange(self.steps - 1, self.n_rows, self.steps)

    def stream_of(self, rows: np.ndarray) -> np.ndarray:
        """The dense stream index of the given flat rows."""
        return rows // self.steps if self.steps else self.stream[rows]


def _time_last(batch_size: torch.Size) -> CallLayout:
    stream_shape = tuple(batch_size[:-1])
    steps = int(batch_size[-1])
    n_streams = int(np.prod(stream_shape, dtype=np.int64))
    return CallLayout("time_last", stream_shape, n_streams * steps, NO_ROWS, steps)


def _single_stream(steps: int) -> CallLayout:
    return CallLayout("time_last", (), steps, NO_ROWS, steps)


def resolve(
    batch_size: torch.Size,
    names: list | None,
    declared: str | None,
    stream_ids: torch.Tensor | None,
    known_ids: np.ndarray | None,
) -> CallLayout:
    """Works out the layout of one call and validates it.

    Args:
        batch_size: the batch size of the call.
        names: the batch dimension names, or None.
        declared: the layout the user declared (None to infer).
        stream_ids: the per-row stream ids (stream-key layout only).
        known_ids: stream ids seen in earlier calls, in slot order.

    Returns:
        The call's :class:`CallLayout`.

    Raises:
        LayoutError: the layout is ambiguous or does not match the batch.

    Examples:
        >>> lay = resolve(torch.Size([2, 3]), [None, None], None, None, None)
        >>> lay.stream_of(np.arange(6)).tolist()
        [0, 0, 0, 1, 1, 1]
    """
    if declared is None:
        return _inferred(batch_size, names)
    ndim = len(batch_size)
    if declared == "time_last":
        if ndim == 0:
            raise LayoutError(
                f"layout='time_last' expects a [*E, T] batch; got batch_size=[]. Pass {_OPTIONS}."
            )
        if ndim == 1:
            return _single_stream(int(batch_size[0]))
        return _time_last(batch_size)
    if declared == "step":
        if ndim != 1:
            raise LayoutError(
                f"layout='step' expects one step of E envs per call, batch [E]; got "
                f"batch_size={list(batch_size)}. If this is a collector batch [E, T], use "
                "layout=None; if you called rb.add() with E envs, call rb.extend() instead."
            )
        n = int(batch_size[0])
        return CallLayout("step", (n,), n, NO_ROWS, 1)
    return _stream_key(batch_size, stream_ids, known_ids)


def _inferred(batch_size: torch.Size, names: list | None) -> CallLayout:
    """The layout of a batch whose layout was not declared, or an error naming the options."""
    ndim = len(batch_size)
    if ndim == 0:
        raise LayoutError(
            "got a batch with batch_size=[] (a single row without a time or env "
            f"dimension). Use rb.add(row) for one row of one stream, or {_OPTIONS}."
        )
    if ndim >= 2:
        if names is not None and names[-1] not in (None, "time"):
            raise LayoutError(
                f"a [*E, T] batch must have time last; got names={list(names)}. "
                "Permute the batch so that 'time' is the last dimension, or pass "
                f"{_OPTIONS}."
            )
        return _time_last(batch_size)
    if (names is not None and names[0] == "time") or batch_size[0] == 1:
        return _single_stream(int(batch_size[0]))
    raise LayoutError(
        f"cannot tell the streams apart in a 1-D batch of batch_size={list(batch_size)} "
        f"and names={names}: it could be one step of {batch_size[0]} envs, one "
        "env's trajectory, or a flattened collector batch (data.reshape(-1) mixes "
        f"streams and cannot be cleaned). Pass {_OPTIONS}; a single stream can also "
        "be named: data.refine_names('time')."
    )


def _stream_key(
    batch_size: torch.Size, stream_ids: torch.Tensor, known_ids: np.ndarray | None
) -> CallLayout:
    """Flat rows with a stream id each: ids seen before keep their slot, new ones follow."""
    if len(batch_size) != 1:
        raise LayoutError(
            f"layout='stream_key' expects flat rows, batch [N]; got batch_size="
            f"{list(batch_size)}. Flatten with data.reshape(-1) only if the stream key "
            "identifies each row's env."
        )
    ids = stream_ids.reshape(batch_size[0], -1) if batch_size[0] else stream_ids.reshape(0, 1)
    if ids.shape[1] != 1 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise LayoutError(
            f"the stream key must hold one integer id per row, shape [{batch_size[0]}] or "
            f"[{batch_size[0]}, 1]; got shape {list(stream_ids.shape)} and dtype "
            f"{stream_ids.dtype}."
        )
    ids = ids[:, 0].cpu().numpy().astype(np.int64, copy=False)
    known = np.zeros(0, np.int64) if known_ids is None else known_ids
    uniq, inverse = np.unique(ids, return_inverse=True)
    order = np.argsort(known, kind="stable")
    pos = np.searchsorted(known[order], uniq)
    pos_clipped = np.minimum(pos, max(len(known) - 1, 0))
    found = (
        (pos < len(known)) & (known[order][pos_clipped] == uniq)
        if len(known)
        else (np.zeros(len(uniq), bool))
    )
    slot = np.empty(len(uniq), np.int64)
    slot[found] = order[pos_clipped[found]]
    new_ids = uniq[~found]
    slot[~found] = len(known) + np.arange(len(new_ids))
    n_streams = len(known) + len(new_ids)
    return CallLayout(
        "stream_key",
        (n_streams,),
        int(batch_size[0]),
        slot[inverse.reshape(-1)],
        0,
        new_ids,
    )
