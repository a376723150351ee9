"""Stream ends: what each call's first and last rows say, read in one kernel pass.

Part of the read step (read -> plan -> write): the facts a call's read
compares with the state's last rows (:class:`LastRows`, kept in the
:class:`~cleanbuf.engine._state.Carry`).

Within a stream, a row's stored next observation is the next row's
observation, byte for byte, unless the row ended an episode. So the first
row of a stream in a call must have, as its observation, the next
observation of the previous call's last row of that stream, unless that row
was done or the first row restarts the stream (``is_init``). A mismatch
means the rows are not the stream the filter thinks: another producer's
batch (a ``MultiAsyncCollector`` yields its workers' batches in turn), a
skipped or repeated batch, or a reset the rows do not show.

The same comparison decides a collector's batch-end mark (a first row that
continues its stream after a done row means the done flag was only a mark),
and the first rows are the fingerprint that recognises a batch written again
(:class:`cleanbuf.engine._read.Fingerprint`). :func:`read_ends` reads all
three, and the continuity check, with one
:func:`~cleanbuf.engine._kernels.stream_ends` call per observation key,
over the rows' bytes (the trajectory ids ride along with the first key).

It needs time-aligned streams (``time_last`` and ``step`` layouts) and full
transitions (observation-only rows have no next observation to compare;
their held rows take the next call's first row as it is).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from cleanbuf.engine._errors import ContinuityError, key_name
from cleanbuf.engine._kernels import stream_ends
from cleanbuf.engine._keys import Views
from cleanbuf.engine._write import index_tensor

_NO_BYTES = np.zeros((0, 0), np.uint8)
_NO_FLAGS = np.zeros(0, np.bool_)
_NO_FLAGS.flags.writeable = False


class LastRows(NamedTuple):
    """Per stream, what the stream's next row must continue (part of the carry).

    (Named tuples: a call builds them, where a frozen dataclass costs
    several times more.)

    Attributes:
        next_obs: observation key -> the stored next observation of the
            stream's last row, as words ``[S, W]`` (:func:`words`; bytes
            ``uint8[S, B]`` in a state loaded from a state dict).
        open: bool ``[S]``: the next row must continue that row (it was
            not done). False for streams not seen yet.
    """

    next_obs: dict = {}  # (never written: every call builds a new one)  # noqa: RUF012
    open: np.ndarray = _NO_FLAGS


class CallEnds(NamedTuple):
    """What a time-aligned call's first and last rows say.

    Attributes:
        last: the call's last rows, for the next call.
        cont: uint8 ``[S]``: 1 where the stream's first row continues the
            previous call's last row (every observation key equal).
        first: key -> the first rows as words (the observations, and the
            trajectory ids when the rows have some): the retry fingerprint.
        repeats: every first row equals the fingerprint it was compared with.
        broken: the first stream whose first row does not continue its
            open last row and does not restart it (-1 if none, or where
            nothing was checked).
    """

    last: LastRows
    cont: np.ndarray
    first: dict
    repeats: bool
    broken: int = -1


def read_ends(
    rows: Views,
    obs_keys: list,
    steps: int,
    done: np.ndarray,
    before: LastRows,
    fingerprint: dict | None,
    fingerprint_keys: tuple = (),
    restart: np.ndarray | None = None,
) -> CallEnds:
    """Reads the first and the last row of each stream of a time-aligned call.

    The continuity check is read in the same pass: where ``restart`` is
    given, :attr:`CallEnds.broken` names the first stream that does not
    continue (raise with :func:`check`).

    Args:
        rows: the call's leaves, read as rows (stream after stream, ``steps``
            rows each).
        obs_keys: the observation keys.
        steps: rows per stream.
        done: bool ``[N]``, the rows' done flags.
        before: the previous call's last rows.
        fingerprint: the first rows of the call to compare with (the last
            call's), or None.
        fingerprint_keys: further keys of the fingerprint (trajectory ids).
        restart: bool ``[N]`` or empty, the rows that restart their stream
            (``is_init``), to check continuity; None not to check it.

    Examples:
        >>> rows = Views({("obs",): torch.arange(6.0), ("next", "obs"): torch.arange(1.0, 7.0)})
        >>> ends = read_ends(rows, [("obs",)], 3, np.zeros(6, bool), LastRows(), None)
        >>> ends.last.next_obs[("obs",)].view(np.float32).ravel().tolist()
        [3.0, 6.0]
        >>> later = Views({("obs",): torch.tensor([3.0, 7.0]), ("next", "obs"): torch.zeros(2)})
        >>> again = read_ends(later, [("obs",)], 1, np.zeros(2, bool), ends.last, None,
        ...                   restart=np.zeros(0, bool))
        >>> again.cont.tolist(), again.broken
        ([1, 0], 1)
    """
    fingerprint = fingerprint or {}
    cont, first, last, repeats = None, {}, {}, bool(fingerprint)
    open_before = _NO_FLAGS if restart is None else before.open
    restart = _NO_FLAGS if restart is None else restart
    broken = -1
    ids = []
    for k in fingerprint_keys:  # (a loop: a comprehension is one more Python call)
        ids.append((k, *row_words(rows, k, k, steps)))
    for k in obs_keys:
        obs, nxt, k_steps = row_words(rows, k, ("next", *k), steps)
        k_restart = restart if k_steps == steps or not len(restart) else restart[::steps].copy()
        # The fingerprint's further keys are read in the same pass where they line up.
        id_key, id_bytes, _, id_steps = ids.pop() if ids and ids[-1][3] == k_steps else (None,) * 4
        id_bytes = _NO_BYTES if id_key is None else id_bytes
        f, last_k, c, same, b, f_ids = stream_ends(
            obs,
            nxt,
            k_steps,
            words(before.next_obs.get(k), obs.dtype),
            words(fingerprint.get(k), obs.dtype),
            open_before,
            k_restart,
            id_bytes,
            words(fingerprint.get(id_key), id_bytes.dtype),
        )
        first[k], last[k] = f, last_k
        if id_key is not None:
            first[id_key] = f_ids
        cont = c if cont is None else cont & c
        repeats = repeats and same
        if b >= 0 and (broken < 0 or b < broken):  # broken for any key: broken
            broken = b
    for k, id_bytes, _, k_steps in ids:
        none = words(None, id_bytes.dtype)
        f, _, _, same, _, _ = stream_ends(
            id_bytes, id_bytes, k_steps, none, words(fingerprint.get(k), id_bytes.dtype),
            _NO_FLAGS, _NO_FLAGS, _NO_BYTES, _NO_BYTES,
        )  # fmt: skip
        first[k] = f
        repeats = repeats and same
    repeats = repeats and fingerprint.keys() == first.keys()
    return CallEnds(LastRows(last, ~done[steps - 1 :: steps]), cont, first, repeats, broken)


def check(ends: CallEnds, obs_keys: list) -> None:
    """Raises unless each stream's first row in a call continues its last row.

    Args:
        ends: the call's stream ends, read with the continuity check
            (:func:`read_ends` given ``restart``).
        obs_keys: the observation keys (for the message).

    Raises:
        ContinuityError: a stream's first row does not continue.
    """
    if ends.broken < 0:
        return
    bad = ends.broken
    keys = ", ".join(key_name(k) for k in obs_keys)
    raise ContinuityError(
        f"stream {bad} does not continue: the observation ({keys}) of its first row in this "
        "call differs from the next observation of its last row in the previous call, and "
        "neither row ends an episode or restarts the stream. Likely causes: batches from "
        "another producer (a MultiAsyncCollector yields its workers' batches in turn: build "
        "the filter with AutoresetFilter.for_env(collector), or give the collector the "
        "buffer), a batch skipped or written twice, a raw loop that does not set "
        "obs = next_obs after each step, or a reset the rows do not show: add "
        "InitTracker() to a TorchRL env; in a raw loop that calls envs.reset() (all or some "
        "envs), build that step's rows with cleanbuf.step_rows(..., reset=mask) (True for "
        "the envs reset), which marks them is_init. check_continuity=False turns this check "
        "off. Nothing was written."
    )


def as_bytes(x) -> np.ndarray:
    """Rows ``[R, ...]`` of a tensor or array as uint8 ``[R, B]`` (a copy where needed).

    Examples:
        >>> as_bytes(torch.tensor([[1.0], [2.0]])).shape
        (2, 4)
    """
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().contiguous()
        if not x.numel():
            return np.zeros((len(x), 0), np.uint8)
        return x.reshape(len(x), -1).view(torch.uint8).numpy()
    x = np.ascontiguousarray(x)
    return x.reshape(len(x), math.prod(x.shape[1:])).view(np.uint8)  # (-1 fails on 0 rows)


def row_words(rows: Views, key: tuple, next_key: tuple, steps: int) -> tuple:
    """The words of ``rows[key]`` and ``rows[next_key]``, and the rows per stream.

    Each row's bytes are viewed as the widest unsigned word that divides
    them (:func:`words`). The numpy views of the whole call where the rows
    have them (no copy); else (another device, a dtype numpy lacks) copies
    of just the first and the last rows, read as one row per stream.
    """
    a, b = rows[key], rows[next_key]
    if (
        a is not None
        and b is not None
        and a.flags.c_contiguous
        and b.flags.c_contiguous
        and a.dtype.kind != "O"
    ):
        n = len(a)
        width = math.prod(a.shape[1:])  # (-1 fails on 0 rows)
        a, b, n_steps = a.reshape(n, width), b.reshape(n, width), steps
    else:
        n = rows.n_rows or len(rows.flat(key))
        first = index_tensor(np.arange(0, n, steps))
        last = index_tensor(np.arange(steps - 1, n, steps))
        x, y = rows.flat(key), rows.flat(next_key)
        a = as_bytes(x.index_select(0, first.to(x.device)))
        b = as_bytes(y.index_select(0, last.to(y.device)))
        n_steps = 1
    width = a.shape[1] * a.itemsize
    word = _WORDS[min(width & -width, 8)] if width else _WORDS[1]
    return a.view(word), b.view(word), n_steps


_WORDS = {size: np.dtype(f"uint{8 * size}") for size in (1, 2, 4, 8)}
_NO_WORDS = {w: np.zeros((0, 0), w) for w in _WORDS.values()}


def words(x: np.ndarray | None, word: np.dtype) -> np.ndarray:
    """Rows of bytes ``[R, B]`` (or of other words) viewed as unsigned words ``word``.

    Empty (``[0, 0]``) for None, or where ``B`` is not a whole number of
    words (such rows differ in width from any rows of that word: they
    compare as different).

    Examples:
        >>> words(np.arange(8, dtype=np.uint8).reshape(1, 8), np.dtype(np.uint32)).shape
        (1, 2)
        >>> words(np.zeros((1, 6), np.uint8), np.dtype(np.uint32)).shape
        (0, 0)
    """
    if x is None:
        return _NO_WORDS[word]
    if x.dtype == word:
        return x
    if x.ndim != 2 or not x.flags.c_contiguous:
        return _NO_WORDS[word]
    x = x.view(np.uint8)
    if x.shape[1] % word.itemsize:
        return _NO_WORDS[word]
    return x.view(word)
