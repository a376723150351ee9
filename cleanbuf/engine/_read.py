"""Reading one batch into a checked :class:`Call` (read -> plan -> write); reading changes nothing.

:meth:`Reader.read` works out the call's layout (:func:`resolve`), its leaves as rows, its flags,
observation keys and final entries, its stream ends and plan (one
:func:`~cleanbuf.engine._kernels.one_pass` kernel call) and its fingerprint, and runs every check a
call must pass. What depends only on the batch's layout and key set is built once and cached
(:class:`Schema`).

A layout maps the flat rows (C order over the batch dimensions) to dense stream indices:
``time_last`` (``[*E, T]``; a 1-D batch named ``["time"]`` or of length one is one stream),
``step`` (``[E]``, one step of E streams) or ``stream_key`` (``[N]``, a per-row stream id).

The flag readers return one numpy entry per row, or an empty array when the call has nothing of
that kind (the kernel then skips it).

The fingerprint (:class:`Fingerprint`), the first row of each stream, is compared with the last
call's in the same kernel pass: the cleaner's undo uses it to recognise a batch written again
(:class:`cleanbuf.engine._cleaner.Cleaner`); a failed call leaves it in ``Reader.fingerprint``.
With trajectory ids it is checked on every call (ids and observations must both match: a stream
keeps its id for a whole episode). Without them it is read only when a call fails (a repeat does
not continue its streams, so a check refuses it); a repeat whose every stream ended or restarted at
its first row passes those checks and is not recognised.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np
import torch
from tensordict import TensorDictBase

from cleanbuf.engine._continuity import NO_ENDS, CallEnds, EndRows, LastRows, check
from cleanbuf.engine._errors import (
    InputError,
    LayoutError,
    key_name,
)
from cleanbuf.engine._kernels import (
    ANY_MARKS,
    NO_MARKS,
    NO_ROWS,
    UNSTORED_MARKS,
    Rules,
    one_pass,
    read_fills,
    stream_ends,
)
from cleanbuf.engine._keys import (
    DONE_KEYS,
    FINAL_KEYS,
    TRAJ_IDS,
    Views,
    batch_leaves,
    batch_views,
    check_same_layout,
    done_source,
    final_entries,
    observation_keys,
    row_flags,
    without_empty_final_entry,
)
from cleanbuf.engine._options import Options
from cleanbuf.engine._orientation import batch_time_axis
from cleanbuf.engine._state import Carry
from cleanbuf.engine._write import SMALL_ROW_BYTES

_OPTIONS = (
    "layout=None for TorchRL collector batches [*E, T] (time last) or a single "
    "stream named ['time']; layout='time_first' for [T, *E] rollouts; layout='step' "
    "when each call holds one step of E envs (batch [E]); stream_key=KEY for flat "
    "rows with a per-row stream id"
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
        n_streams: the number of streams (the product of ``stream_shape``).
    """

    kind: str
    stream_shape: tuple
    n_rows: int
    stream: np.ndarray
    steps: int
    new_stream_ids: np.ndarray | None = None
    n_streams: int = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "n_streams", int(np.prod(self.stream_shape, dtype=np.int64)))

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
    if declared in ("time_last", "time_first"):  # (a time-first call is read transposed)
        if ndim == 0:
            raise LayoutError(
                f"layout={declared!r} expects a batch with a time axis; got batch_size=[]. "
                f"Pass {_OPTIONS}."
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


NONE = np.zeros(0, np.bool_)
NONE.flags.writeable = False


def restart_rows(options: Options, rows: Views) -> np.ndarray:
    """Per row, whether it follows a real reset of its env: ``is_init``, else ``step_count == 0``.

    Examples:
        >>> rows = Views({("is_init",): torch.tensor([True, False])}, 1, 2)
        >>> restart_rows(Options(), rows).tolist()
        [True, False]
    """
    restart, count = restart_keys(options, rows.tensors)
    if restart is not None:
        return row_flags("is_init", restart, rows)
    return NONE if count is None else count_restarts(rows, count)


def restart_keys(options: Options, leaves: dict) -> tuple:
    """``(is_init key, step-count key)`` that mark restarts: ``is_init`` first; None if absent."""
    if options.is_init_key is not None and options.is_init_key in leaves:
        return options.is_init_key, None
    if options.step_count_key is not None and options.step_count_key in leaves:
        return None, options.step_count_key
    return None, None


def count_restarts(rows: Views, key: tuple) -> np.ndarray:
    """Per row, its step count (``rows.tensors[key]``, the first element) is 0."""
    count = rows.tensors[key]
    return (count.reshape(rows.n_rows, -1)[:, 0] == 0).cpu().numpy()


def fill_marks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of ``x`` ``[R, ...]``: all zeros, and marked missing (the producer's fills).

    Marked missing: any NaN (floating point), or -1 in every element (signed integers), as
    TorchRL fills a next observation it does not have. :func:`stored_rows` and the audit use it.

    Examples:
        >>> zero, marked = fill_marks(np.array([[0, 0], [-1, -1], [-1, 0], [3, 1]]))
        >>> zero.tolist(), marked.tolist()
        ([True, False, False, False], [False, True, False, False])
        >>> fill_marks(np.array([[0.0, float("nan")]]))[1].tolist()
        [True]
        >>> fill_marks(np.zeros((0, 3), np.int64))[1].tolist()  # no done rows
        []
    """
    x = np.asarray(x)
    x = x.reshape(len(x), int(np.prod(x.shape[1:], dtype=np.int64)))  # -1 fails on 0 rows
    zero = ~x.any(1) if x.shape[1] else np.ones(len(x), np.bool_)  # (-0.0 is 0; NaN is not)
    if x.dtype.kind in "fc":
        marked = np.isnan(x).any(1)
    elif x.dtype.kind == "i" and x.shape[1]:
        marked = (x == -1).all(1)
    else:
        marked = np.zeros(len(x), np.bool_)
    return zero & ~marked, marked


def stored_rows(rows: Views, obs_keys, done: np.ndarray) -> np.ndarray:
    """Per done row, whether its next observation is stored (read from the data).

    Stored unless zero-filled (every element of every observation key exactly 0) or marked
    missing (:func:`fill_marks`); see docs/rules.md, 'Core rule (next-step mode)'. A terminal
    observation truly 0 in every element reads as zero-filled. Only done rows are read.

    Returns:
        bool ``[n_rows]`` (False on rows that are not done), or an empty
        array when no row is done.

    Examples:
        >>> done = np.array([True, False, True, True])
        >>> nxt = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 3.0], [float("nan"), 1.0]])
        >>> rows = Views({("next", "observation"): nxt}, 1, 4)
        >>> stored_rows(rows, [("observation",)], done).tolist()
        [False, False, True, False]
    """
    done_rows = np.flatnonzero(done)
    if not len(done_rows):
        return NONE
    filled = np.ones(len(done_rows), np.bool_)  # zero-filled so far
    nan = np.zeros(len(done_rows), np.bool_)
    for k in obs_keys:
        nk = ("next", *k)
        a = rows[nk]
        if a is None:  # torch ops (CUDA, dtypes numpy lacks)
            x = rows.flat(nk)
            x = x.index_select(0, torch.from_numpy(done_rows).to(x.device))
            x = x.reshape(len(done_rows), math.prod(x.shape[1:]))
            filled &= (x == 0).all(1).cpu().numpy()
            if x.is_floating_point():
                nan |= x.isnan().any(1).cpu().numpy()
            elif x.is_signed() and x.dtype != torch.bool and x.shape[1]:
                nan |= (x == -1).all(1).cpu().numpy()
            continue
        x = a.reshape(rows.n_rows, -1)
        floating = x.dtype.kind in "fc"
        if x.shape[1] * x.itemsize <= SMALL_ROW_BYTES and x.dtype != np.float16:  # (numba lacks it)
            read_fills(x.view(np.uint8) if x.dtype == np.bool_ else x, done_rows, floating,
                       x.dtype.kind == "i", filled, nan)  # fmt: skip
            continue
        zero, marked = fill_marks(x[done_rows])  # wide rows: numpy's vectorized scans
        filled &= zero
        nan |= marked
    out = np.zeros(len(done), np.bool_)
    out[done_rows] = ~(filled | nan)
    return out


def streams_changed(carry: Carry, layout: CallLayout) -> LayoutError:
    """The error for a call of fixed layout whose streams are not those of the calls before."""
    return LayoutError(
        f"the streams changed between calls: earlier calls had {carry.layout_kind} "
        f"streams of shape {list(carry.stream_shape)}, this call has {layout.kind} "
        f"streams of shape {list(layout.stream_shape)}. Each stream must stay "
        "the same env across calls. Call flush() and use a new filter for a new "
        "env set, or use stream_key= if envs come and go."
    )


def same_schema_as_held(held: dict, leaves: dict, batch_dims: int) -> None:
    """Raises unless a batch's leaves match the held rows (while rows are held)."""
    if set(held) != set(leaves):
        gone = ", ".join(key_name(k) for k in sorted(set(held) - set(leaves), key=str))
        new = ", ".join(key_name(k) for k in sorted(set(leaves) - set(held), key=str))
        raise InputError(
            f"the batch keys changed between calls while rows are held: expected the held "
            f"rows' keys, got a batch without [{gone}] and with new [{new}]. Keep the keys "
            "stable (every batch of a producer has the same keys), or call flush(rb) before "
            "changing them. Nothing was written."
        )
    for k, v in leaves.items():
        h = held[k]
        if h.dtype != v.dtype or h.shape[1:] != v.shape[batch_dims:]:
            what = "dtype" if h.dtype != v.dtype else "feature shape"
            cast = f"data.set({key_name(k)}, data.get({key_name(k)}).to({h.dtype}))"
            raise InputError(
                f"key {key_name(k)} changed its {what} between calls while rows are held: "
                f"expected shape {list(h.shape[1:])} and dtype {h.dtype} per row (as the held "
                f"rows), got {list(v.shape[batch_dims:])} and {v.dtype}. Keep it stable "
                f"(cast before the filter: {cast}), "
                "or call flush(rb) before changing it. Nothing was written."
            )


def same_observations(before: dict, now: dict) -> None:
    """Raises unless the observation keys kept their dtype and feature shape.

    Args:
        before: key -> (dtype, feature shape) of the calls before.
        now: the same for this call.

    Raises:
        InputError: a key present in both changed (a new or a dropped key is
            left to the continuity check).
    """
    for k, (dtype, shape) in before.items():
        if k not in now or now[k] == (dtype, shape):
            continue
        new_dtype, new_shape = now[k]
        what = "dtype" if dtype != new_dtype else "feature shape"
        cast = f"data.set({key_name(k)}, data.get({key_name(k)}).to({dtype}))"
        raise InputError(
            f"observation key {key_name(k)} changed its {what} between calls: expected dtype "
            f"{dtype} and feature shape {list(shape)} (as the calls before), got {new_dtype} "
            f"and {list(new_shape)}. This is no other producer: a stream's observations keep "
            f"their kind from step to step. Cast before the filter ({cast}, and its "
            "('next', ...) twin), or flush(rb) and use a new filter for data of another kind. "
            "Nothing was written."
        )


def reset_groups(group: int, n_streams: int, stream_shape: tuple) -> None:
    """Raises unless reset groups of ``group`` streams tile the streams."""
    if n_streams % group:
        raise LayoutError(
            f"reset_group_size={group} does not divide the {n_streams} streams of "
            f"shape {list(stream_shape)}; it must be the number of envs that "
            "reset together (the envs of one TorchRL GymEnv / worker)."
        )


def time_first_hint(td: Any, options: Options) -> str:
    """The filter's sentence for a batch of inferred layout that looks ``[T, E]``, or "".

    See :func:`~cleanbuf.engine._orientation.batch_time_axis`.
    """
    if options.layout is not None or batch_time_axis(td, options) != 0:
        return ""
    a, b = td.batch_size
    return (
        f"This batch looks time-first [T, E]: its rows continue along the first axis "
        f"(size {a}), not the last (size {b}), and the filter reads batches as [E, T] "
        "(time last, as TorchRL collectors give them; steps stacked with "
        "torch.stack(rows, dim=0) are [T, E]: stack with dim=1). Pass layout='time_first' "
        "(AutoresetFilter(mode, layout='time_first')), or transpose it first "
        "(batch.transpose(0, 1)). If the batch is [E, T] after all:"
    )


class SameBatchAgain(Exception):
    """Raised inside the cleaner when a call brings the last call's batch again."""


class Fingerprint(NamedTuple):
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


_CACHE_SIZE = 64
_NO_FILLS = np.zeros((0, 0), np.uint8)
_EMPTY_BOOL = np.zeros(0, np.bool_)  # (writeable: the kernel's type of a stored array it makes)


@dataclasses.dataclass(frozen=True, eq=False)
class Schema:
    """What a batch's structure decides, worked out and checked once per structure.

    A structure is the batch's layout and each leaf's key, dtype and shape; given the options,
    nothing else changes the schema. :meth:`Reader.read` builds it, with every check of the
    structure, the first time a structure comes; later calls read only the values.

    Attributes:
        done: where the done flags come from (:class:`~cleanbuf.engine._keys.DoneSource`).
        empty_entry: outside same-step mode, the leaves hold a final-observation mask (an entry
            dropped per call if empty: :func:`~cleanbuf.engine._keys.without_empty_final_entry`).
        obs_keys: the observation keys.
        obs_only: the rows have no ``("next", k)`` observations.
        obs_schema: observation key -> (dtype, feature shape).
        final_of: same-step mode: observation key -> its final-observation leaf.
        final_mask: the final-observation mask's key, or None.
        moved: the keys to store (None: every leaf, or per call where
            ``empty_entry``).
        rules: the planning kernel's mode flags.
        marks: which batch-end rows may be a collector's mark (``NO_MARKS``,
            ``ANY_MARKS``, ``UNSTORED_MARKS``).
        group: the reset group size the kernel reads from done flags (0: none).
        exact: the rows carry trajectory ids.
        has_is_init: the rows hold the ``is_init`` the cleaner fixes.
        has_step_count: the rows hold a step count the cleaner fixes.
        fills: the ``("next", k)`` key whose done rows the kernel reads for filled terminal
            observations (None: several keys, or a dtype numba lacks: :func:`stored_rows`).
        flag_keys: every key read as one bool a row (the done keys and those done must agree
            with, ``is_init``, the batch-end marks' ``terminated`` and ``truncated``, the joint
            key, the final-observation mask), each checked when the schema was built.
        restart: the ``is_init`` key (None: none, or restarts read from ``count``).
        count: the step-count key whose 0 marks a restart, where there is no ``is_init``.
        reward: the reward key the reset-row check reads (None: not checked).
        mark_keys: ``(terminated, truncated)`` keys read for batch-end marks (None: absent).
        joint: the per-row joint-reset key (``joint_key``), or None.
    """

    done: object
    empty_entry: bool = False
    obs_keys: list = dataclasses.field(default_factory=list)
    obs_only: bool = False
    obs_schema: dict = dataclasses.field(default_factory=dict)
    final_of: dict = dataclasses.field(default_factory=dict)
    final_mask: tuple | None = None
    moved: tuple | None = None
    rules: Rules | None = None
    marks: int = NO_MARKS
    group: int = 0
    exact: bool = False
    has_is_init: bool = False
    has_step_count: bool = False
    fills: tuple | None = None
    flag_keys: tuple = ()
    restart: tuple | None = None
    count: tuple | None = None
    reward: tuple | None = None
    mark_keys: tuple = (None, None)
    joint: tuple | None = None

    def flags(self, views: Views) -> tuple:
        """A call's per-row flags, each role read once, and done checked against its parts.

        Returns:
            ``(done, restart, reward, terminated, truncated, joint, final_present)``: numpy
            ``[n_rows]``, or empty where the batch has none (``final_present``: None). The
            reward as stored (the kernel reads nonzero), or uint8 nonzero flags.

        Raises:
            InputError: ``("next", "done")`` disagrees with ``terminated | truncated``.
        """
        n = views.n_rows
        f = {}
        for key in self.flag_keys:  # (checked at build: one bool a row)
            a = views[key]
            f[key] = a.reshape(n) if a is not None else views.tensors[key].reshape(n).cpu().numpy()
        done = self.done.of_flags(f)
        restart = NONE
        if self.restart is not None:
            restart = f[self.restart]
        elif self.count is not None:
            restart = count_restarts(views, self.count)
        reward = NONE
        if self.reward is not None and self.reward in views.tensors:  # (else read() raises)
            a = views[self.reward]
            if a is not None and a.size == n and a.dtype.kind != "c":
                reward = a.reshape(n)
            else:
                r = views.tensors[self.reward]
                r = (r != 0).reshape(n, r.numel() // n if n else 0)  # (-1 fails on 0 rows)
                reward = r.any(1).to(torch.uint8).cpu().numpy()
        term = f.get(self.mark_keys[0], NONE) if self.marks else NONE  # (f.get(None): NONE)
        trunc = f.get(self.mark_keys[1], NONE) if self.marks else NONE
        joint = NONE if self.joint is None else done & f[self.joint]
        present = None if self.final_mask is None else f[self.final_mask]
        return done, restart, reward, term, trunc, joint, present


def structure(layout: CallLayout, leaves: dict, batch_dims: int) -> tuple:
    """The key of a batch's :class:`Schema`: its layout, each leaf's key, dtype and shape.

    Fixed layouts key on whole shapes; stream-key batches, whose row count varies, on row shapes.
    """
    cut = batch_dims if layout.kind == "stream_key" else 0
    leaf_keys = tuple([(k, v.dtype, v.shape[cut:]) for k, v in leaves.items()])
    return layout.kind, batch_dims, leaf_keys


def build_schema(options: Options, layout: CallLayout, views: Views, batch_dims: int) -> Schema:
    """Works out and checks what a batch's structure decides (see :class:`Schema`).

    Raises:
        InputError: no done key, a done key of the wrong kind, no
            observation key, an observation twin or a final-observation
            entry that does not match its observation key.
    """
    opts, leaves = options, views.tensors
    done = done_source(views, opts.done_key)
    empty_entry = opts.mode != "same_step" and any(
        (*p[:-1], "_" + p[-1]) in leaves
        for p in ([opts.final_obs_key] if opts.final_obs_key is not None else FINAL_KEYS)
    )
    flag_keys = [*done.keys, *done.agree]
    if opts.mode == "disabled":
        return Schema(done, empty_entry, flag_keys=tuple(flag_keys))
    bookkeeping = {k for k in (opts.is_init_key, opts.step_count_key) if k}
    obs_keys, obs_only = observation_keys(leaves, opts.observation_keys, bookkeeping)
    if not obs_only:
        for k in obs_keys:
            check_same_layout(leaves, k, ("next", *k))
    obs_schema = {k: (leaves[k].dtype, leaves[k].shape[batch_dims:]) for k in obs_keys}
    final_of, final_mask, moved = {}, None, None
    if opts.mode == "same_step":
        declared = opts.final_obs_key
        final_of, final_mask, entry = final_entries(leaves, declared, obs_keys, batch_dims)
        if entry and not opts.keep_final_obs:
            moved = tuple(k for k in leaves if k not in entry)
    rules = Rules.of(opts, obs_only, layout.kind)
    exact = TRAJ_IDS in leaves
    has_restart = (opts.is_init_key is not None and opts.is_init_key in leaves) or (
        opts.step_count_key is not None and opts.step_count_key in leaves
    )
    ends = not obs_only and layout.kind != "stream_key"
    marks = NO_MARKS
    if rules.marks and (has_restart or ends):
        # Without trajectory ids (no collector) a stored batch-end truncation is an end, not a mark.
        marks = ANY_MARKS if exact else UNSTORED_MARKS
    group = 0
    if opts.joint_reset and opts.joint_key is None:
        group = opts.reset_group_size or layout.n_streams
    fills = None  # the next observations the kernel reads for the stored done rows
    if len(obs_keys) == 1 and not obs_only:
        dtype = leaves[("next", *obs_keys[0])].dtype
        if dtype not in (torch.float16, torch.bfloat16, torch.complex64, torch.complex128):
            fills = ("next", *obs_keys[0])  # (float16: numba lacks it)
    if final_mask is not None:
        flag_keys.append(final_mask)  # (checked by final_entries)
    return Schema(
        done, empty_entry, obs_keys, obs_only, obs_schema, final_of, final_mask, moved, rules,
        marks, group, exact,
        has_is_init=opts.is_init_key in leaves,
        has_step_count=any(k in leaves for k in opts.step_count_keys),
        fills=fills, **_role_keys(opts, views, bool(marks), flag_keys),
    )  # fmt: skip


def _role_keys(options: Options, views: Views, marks: bool, flag_keys: list) -> dict:
    """The keys :meth:`Schema.flags` reads by role, each checked here once.

    Returns:
        The schema's ``flag_keys`` (``flag_keys`` and the flag keys found here), ``restart``,
        ``count``, ``reward``, ``mark_keys`` and ``joint``.

    Raises:
        InputError: a flag key that is not one bool a row (a missing reward key is refused by
            :meth:`Reader.read`, after the held rows' keys are compared).
    """
    opts, leaves = options, views.tensors
    joint = None
    restart, count = restart_keys(opts, leaves)
    mark_keys = (None, None)
    if marks:
        mark_keys = tuple(k if k in leaves else None for k in DONE_KEYS[1:])
    if opts.joint_reset and opts.joint_key is not None:
        joint = opts.joint_key
    for name, key in (("is_init", restart), ("terminated", mark_keys[0]),
                      ("truncated", mark_keys[1]), ("joint_key", joint)):  # fmt: skip
        if key is not None and key not in flag_keys:
            row_flags(name, key, views)
            flag_keys.append(key)
    reward = _reward_key(opts)
    return dict(flag_keys=tuple(flag_keys), restart=restart, count=count, reward=reward,
                mark_keys=mark_keys, joint=joint)  # fmt: skip


def _reward_key(options: Options) -> tuple | None:
    """The reward key the reset-row check reads (None: not checked)."""
    key = options.reward_key
    if not options.check_reset_rows or key is None or options.mode != "next_step":
        return None
    return key


def no_reward(key: tuple, leaves: dict) -> InputError:
    """The error for a batch without the reward key the reset-row check reads."""
    found = [k for k in leaves if "reward" in str(k[-1])]
    name = f"reward_key={found[0]!r}" if found else "reward_key=KEY (the key of your reward)"
    return InputError(
        f"reward key {key_name(key)} is missing from the batch (reward-like keys found: "
        f"{found or 'none'}; keys: {sorted(leaves, key=str)}); the reset-row check reads it: "
        "a row after a done row must have reward 0 to be taken for a reset row, and without "
        "it data in the wrong mode (already clean, or same-step) would lose real rows. Fix: "
        f"pass {name}, or check_reset_rows=False to take every row after a done row for a "
        "reset row unchecked. Nothing was written."
    )


@dataclasses.dataclass
class Call:
    """What :meth:`Reader.read` found in a batch, checked."""

    device: torch.device | None
    layout: CallLayout
    views: Views  # every leaf, read as rows
    done: np.ndarray
    moved: dict  # the leaves to store (without a same-step final entry)
    carry: Carry | None = None  # None in disabled mode
    obs_keys: list = dataclasses.field(default_factory=list)
    obs_only: bool = False
    final_of: dict = dataclasses.field(default_factory=dict)
    final_present: np.ndarray | None = None
    restart: np.ndarray | None = None  # per row, it restarts its stream (Schema.flags)
    kernel_flags: tuple = ()  # (reward, terminated, truncated, joint): see Schema.flags
    ends: CallEnds | None = None  # time-aligned full transitions only
    rules: Rules | None = None
    schema: dict = dataclasses.field(default_factory=dict)  # obs key -> (dtype, feature shape)
    structure: Schema | None = None  # what the batch's structure decided (None: disabled mode)
    planned: tuple | None = None  # the kernel's plan (Reader._run_kernel)
    fingerprint: Fingerprint | None = None  # time-aligned full transitions only
    as_is: bool = True  # nothing to clean: the rows pass through as views


class Reader:
    """Reads batches for one cleaner, with the caches of its layouts and key sets.

    Args:
        options: the cleaner's options.
    """

    def __init__(self, options: Options):
        self.options = options
        self._layouts: dict = {}  # (batch size, names) -> CallLayout, for the fixed layouts
        self._schemas: dict = {}  # structure -> Schema
        # The fingerprint of the last read that got that far (a call that
        # fails leaves it here: the cleaner's undo reads it).
        self.fingerprint: Fingerprint | None = None

    def read(
        self,
        td: TensorDictBase,
        carry: Carry,
        before: Fingerprint | None,
        plan: bool = False,
        keep_lost: bool = False,
    ) -> Call:
        """Reads and checks a batch against ``carry``; changes nothing.

        Args:
            td: the batch.
            carry: the producer's carry state.
            before: the last call's fingerprint (a batch written again).
            plan: plan the call even where it has nothing to clean (the
                repair writes every row); else such a call is not planned
                (its rows pass through as views).
            keep_lost: rules that keep the rows whose next observation is
                lost, whatever ``on_lost_terminal_obs`` says (the repair masks
                them): ``call.rules``, and the plan made with the read.

        Raises:
            InputError, LayoutError, ContinuityError: bad or discontinuous input.
            SameBatchAgain: the batch is the last call's again (trajectory ids).
        """
        opts = self.options
        if not isinstance(td, TensorDictBase):
            raise InputError(
                f"expected a TensorDict, got {type(td).__name__}; use cleanbuf.clean() "
                "for dicts of arrays."
            )
        layout = self._layout(td, carry)
        views = batch_views(td, td.batch_dims, layout.n_rows)
        if views is None:  # (not a plain tree of CPU tensors that numpy can view)
            views = Views.of_batch(batch_leaves(td), td.batch_dims, layout.n_rows)
        leaves = views.tensors  # as stored; read as rows through views
        schema = self._schema(layout, views, td.batch_dims)
        done, restart, reward, term, trunc, joint, present = schema.flags(views)
        call = Call(td.device, layout, views, done, moved=leaves, restart=restart)
        call.kernel_flags = reward, term, trunc, joint
        if schema.empty_entry:
            call.moved = without_empty_final_entry(leaves, opts.final_obs_key)
        if opts.mode == "disabled":
            return call
        call.obs_keys, call.obs_only = schema.obs_keys, schema.obs_only
        call.schema = schema.obs_schema
        if (
            carry.obs_schema is not schema.obs_schema
            and carry.obs_schema
            and carry.obs_schema != schema.obs_schema
            and not carry.is_blank()  # (the costliest test, last)
        ):
            same_observations(carry.obs_schema, schema.obs_schema)
        if schema.final_of:
            call.final_of = schema.final_of
            call.final_present = present
        if schema.moved is not None:
            call.moved = {k: leaves[k] for k in schema.moved}
        if len(carry.held_stream) and (schema.empty_entry or carry.held_schema is not schema):
            same_schema_as_held(carry.held, call.moved, td.batch_dims)
        if schema.reward is not None and schema.reward not in leaves:
            raise no_reward(schema.reward, leaves)
        grow = layout.n_streams > carry.per_stream.shape[1]  # (more streams than carried)
        call.carry = carry.grown(layout.n_streams) if grow else carry
        call.rules = schema.rules
        if keep_lost and call.rules.drop_lost:  # (the repair masks lost rows: it keeps them)
            call.rules = call.rules._replace(drop_lost=False)
        call.structure = schema
        call.as_is = (
            not call.rules.successor
            and not np.count_nonzero(call.done)
            and call.carry.nothing_pending(schema.has_is_init, schema.has_step_count)
        )
        # One kernel call: the stream ends, and the plan unless the rows pass through.
        self._run_kernel(call, carry, before, plan or not call.as_is)
        if call.ends is not None and call.ends.broken >= 0:
            check(call.ends, call.obs_keys)  # (raises: a stream does not continue)
        return call

    def _schema(self, layout: CallLayout, views: Views, batch_dims: int) -> Schema:
        """The schema of the batch's structure: cached, else built with every check."""
        if views.parts is not None and layout.kind != "stream_key":
            key = layout.kind, batch_dims, views.parts  # (structure(), read in the walk)
        else:
            key = structure(layout, views.tensors, batch_dims)
        schema = self._schemas.get(key)
        if schema is None:
            schema = build_schema(self.options, layout, views, batch_dims)
            if len(self._schemas) < _CACHE_SIZE:
                self._schemas[key] = schema
        return schema

    def _run_kernel(self, call: Call, carry: Carry, before: Fingerprint | None, plan: bool) -> None:
        """Reads the stream ends and plans the call in one kernel call (:func:`one_pass`).

        Without ``plan`` the kernel call is :func:`stream_ends` alone. Sets ``call.ends``
        (time-aligned full transitions only), ``call.fingerprint`` and, with ``plan``,
        ``call.planned``.

        Raises:
            SameBatchAgain: the batch is the last call's again (trajectory ids).
        """
        opts, views, layout, schema = self.options, call.views, call.layout, call.structure
        rules, done, n = call.rules, call.done, layout.n_rows
        reward, term, trunc, joint = call.kernel_flags
        fills, stored = _NO_FILLS, _EMPTY_BOOL
        if plan and rules.reset_rows and not call.obs_only:
            if opts.terminal_obs_in_done_row:
                stored = done
            elif schema.fills is not None and (a := views[schema.fills]) is not None:
                fills = a.view(np.uint8) if a.dtype == np.bool_ else a
                fills = fills.reshape(n, -1)
            elif np.count_nonzero(done):  # several keys, or rows numpy cannot view
                stored = stored_rows(views, call.obs_keys, done)
        marks = schema.marks
        ends = NO_ENDS
        if not call.obs_only and layout.kind != "stream_key":
            ends = EndRows.of(
                views, call.obs_keys, layout.steps, carry.last,
                {} if before is None else before.rows, schema.exact,
                call.restart if opts.check_continuity else None,
            )  # fmt: skip
        if not plan:  # nothing to clean: the stream ends alone
            if not len(ends.obs):
                return
            k_ends = stream_ends(
                ends.obs, ends.next_obs, ends.steps, ends.last_next, ends.first_before,
                ends.open_before, ends.restart, ends.ids, ends.ids_before,
            )  # fmt: skip
        else:
            k_ends, call.planned = one_pass(
                n, layout.steps, layout.stream, done, fills, fills.dtype.kind == "f",
                fills.dtype.kind == "i", stored, joint, schema.group,
                NONE if call.final_present is None else call.final_present,
                bool(call.final_of), reward, call.restart, term, trunc, marks, ends.obs,
                ends.next_obs, ends.steps, ends.last_next, ends.first_before, ends.open_before,
                ends.restart, ends.ids, ends.ids_before,
                call.carry.per_stream, rules.reset_rows, rules.successor, rules.final,
                rules.stitch, rules.hold_done, rules.drop_lost,
            )  # fmt: skip
        if not len(ends.obs):  # no stream ends: observation-only rows, flat rows
            return
        first_k, last_k, cont, same, broken, first_ids = k_ends
        first, last = ends.split(first_k, last_k)
        if schema.exact:
            first[TRAJ_IDS] = first_ids
        fingerprint = {} if before is None else before.rows
        repeats = bool(fingerprint) and same and fingerprint.keys() == first.keys()
        call.fingerprint = self.fingerprint = Fingerprint(schema.exact, first, repeats)
        if schema.exact and repeats:
            raise SameBatchAgain
        open_now = ~done[layout.steps - 1 :: layout.steps]
        call.ends = CallEnds(LastRows(last, open_now), cont, first, repeats, broken)

    def _layout(self, td: TensorDictBase, carry: Carry) -> CallLayout:
        """The call's layout, checked against the streams of the calls before (cached per shape)."""
        opts = self.options
        names = td.names if td.batch_dims else None
        if opts.layout == "stream_key":
            for key, what in (
                (opts.stream_key, "it must hold each row's stream (env) id"),
                (opts.joint_key, "it must hold, per row, True on a done row whose whole "
                 "reset group was done on that step"),
            ):  # fmt: skip
                if key is not None and key not in td.keys(include_nested=True):
                    name = "stream" if key == opts.stream_key else "joint"
                    raise InputError(
                        f"{name} key {key_name(key)} is missing from the batch; {what}."
                    )
            ids = td.get(opts.stream_key)
            return resolve(td.batch_size, names, opts.layout, ids, carry.stream_ids)
        cache_key = (td.batch_size, None if names is None else tuple(names))
        layout = self._layouts.get(cache_key)
        if layout is None:
            layout = resolve(td.batch_size, names, opts.layout, None, None)
            if opts.joint_reset and opts.joint_key is None and layout.kind != "stream_key":
                group = opts.reset_group_size or layout.n_streams
                reset_groups(group, layout.n_streams, layout.stream_shape)
            if len(self._layouts) < _CACHE_SIZE:
                self._layouts[cache_key] = layout
        if carry.layout_kind is not None and (
            layout.kind != carry.layout_kind or layout.stream_shape != carry.stream_shape
        ):
            raise streams_changed(carry, layout)
        return layout
