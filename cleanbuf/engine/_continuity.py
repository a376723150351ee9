"""Stream ends: what each call's first and last rows say, read in one kernel pass.

Part of the read step (read -> plan -> write): what a call compares with the
carry's last rows (:class:`LastRows`). See docs/rules.md, "Streams across
calls". The same first rows decide batch-end marks and are the fingerprint
of a batch written again (:class:`cleanbuf.engine._read.Fingerprint`); the
kernel is :func:`~cleanbuf.engine._kernels.stream_ends`, inside
:func:`~cleanbuf.engine._kernels.one_pass`.

Only time-aligned streams (``time_last``, ``step``) with full transitions
have stream ends: observation-only rows have no next observation to
compare (their held rows take the next call's first row as it is).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from cleanbuf.engine._errors import ContinuityError, key_name
from cleanbuf.engine._keys import TRAJ_IDS, Views
from cleanbuf.engine._write import index_tensor

_NO_BYTES = np.zeros((0, 0), np.uint8)
_NO_FLAGS = np.zeros(0, np.bool_)
_NO_FLAGS.flags.writeable = False


class LastRows(NamedTuple):
    """Per stream, what the stream's next row must continue (part of the carry).

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


class EndRows:
    """A call's stream ends as :func:`~cleanbuf.engine._kernels.one_pass` reads them.

    One observation key that numpy views whole: the rows themselves, as
    words, ``steps`` rows a stream. Otherwise (several keys, another device,
    not contiguous): each stream's first observation and last next
    observation, every key's bytes side by side, one row a stream. Either way
    the carry keeps each key's own rows (:meth:`split`), and the rows to
    compare with are read the same way.

    Attributes:
        obs: the rows (or first rows) as words; ``[0, 0]``: no stream ends
            (observation-only rows, flat rows with a stream key).
        next_obs: their next observations (or last ones), as ``obs``.
        steps: rows per stream in ``obs``.
        ids: the trajectory ids, read like ``obs`` (``[0, 0]``: none).
        open_before: per stream, the last call's last row was open (empty:
            continuity is not checked).
        last_next: the previous call's last next observations, read as
            ``next_obs`` (empty where none of the same keys and widths).
        first_before: the last call's first observations (the
            fingerprint), read as ``obs``.
        ids_before: the last call's first trajectory ids, read as ``ids``.
        restart: per row of ``obs``, the row restarts its stream (empty:
            none, or not checked).

    Examples:
        >>> rows = Views({("obs",): torch.arange(6.0), ("next", "obs"): torch.arange(1.0, 7.0)})
        >>> ends = EndRows.of(rows, [("obs",)], 3, LastRows(), {}, False, None)
        >>> first, last = ends.split(ends.obs[::3], ends.next_obs[2::3])
        >>> last[("obs",)].view(np.float32).ravel().tolist()
        [3.0, 6.0]
    """

    __slots__ = ("obs", "next_obs", "steps", "ids", "open_before", "restart", "last_next",
                 "first_before", "ids_before", "_keys")  # fmt: skip

    @classmethod
    def of(
        cls,
        rows: Views | None,
        obs_keys: list,
        steps: int,
        before: LastRows,
        fingerprint: dict,
        with_ids: bool,
        restart: np.ndarray | None,
    ) -> EndRows:
        """Reads the end rows of a time-aligned call.

        Args:
            rows: the call's leaves, read as rows (stream after stream,
                ``steps`` rows each); None for no ends.
            obs_keys: the observation keys.
            steps: rows per stream.
            before: the previous call's last rows.
            fingerprint: the first rows of the last call (key -> words).
            with_ids: the rows have trajectory ids (``TRAJ_IDS``).
            restart: bool ``[N]`` or empty, the rows that restart their
                stream, to check continuity; None not to check it.
        """
        self = object.__new__(cls)
        self.open_before = _NO_FLAGS if restart is None else before.open
        self.obs = self.next_obs = self.ids = _NO_BYTES
        self.last_next = self.first_before = self.ids_before = _NO_BYTES
        self.steps, self.restart, self._keys = 1, _NO_FLAGS, ()
        if rows is None or not obs_keys:
            return self
        # One key: the rows themselves, where numpy views them whole.
        whole = whole_words(rows, obs_keys[0], with_ids) if len(obs_keys) == 1 else None
        if whole is not None:
            key = obs_keys[0]
            obs, nxt, ids = whole
            self.obs, self.next_obs, self.ids, self.steps = obs, nxt, ids, steps
            self._keys = ((key, -1, 0),)
            self.restart = _NO_FLAGS if restart is None else restart
            self.last_next, self.first_before = words(
                obs.dtype, before.next_obs.get(key), fingerprint.get(key)
            )
            (self.ids_before,) = words(ids.dtype, fingerprint.get(TRAJ_IDS))
            return self
        firsts, lasts, keys, offset = [], [], [], 0
        for key in obs_keys:
            first, last = _end_bytes(rows, key, ("next", *key), steps)
            firsts.append(first)
            lasts.append(last)
            keys.append((key, offset, first.shape[1]))
            offset += first.shape[1]
        word = _WORDS[min(offset & -offset, 8)] if offset else _WORDS[1]
        self.obs = np.concatenate(firsts, axis=1).view(word)
        self.next_obs = np.concatenate(lasts, axis=1).view(word)
        self._keys = tuple(keys)
        if with_ids:
            ids = _end_bytes(rows, TRAJ_IDS, TRAJ_IDS, steps)[0]
            width = ids.shape[1]
            self.ids = ids.view(_WORDS[min(width & -width, 8)] if width else _WORDS[1])
        if restart is not None and len(restart):
            self.restart = restart[::steps].copy()
        self.last_next = self._joined(before.next_obs)
        self.first_before = self._joined(fingerprint)
        (self.ids_before,) = words(self.ids.dtype, fingerprint.get(TRAJ_IDS))
        return self

    def _joined(self, rows: dict) -> np.ndarray:
        """Each key's rows of ``rows`` side by side, as :attr:`obs` reads them.

        Empty where some key has none, or rows of another width or count.
        """
        parts = []
        for key, _, width in self._keys:
            x = rows.get(key)
            if x is None or x.ndim != 2 or not x.flags.c_contiguous:
                return _NO_WORDS[self.obs.dtype]  # (a state of other keys: nothing to compare)
            x = x.view(np.uint8)
            if x.shape[1] != width or (parts and len(x) != len(parts[0])):
                return _NO_WORDS[self.obs.dtype]
            parts.append(x)
        return words(self.obs.dtype, np.concatenate(parts, axis=1))[0]

    def split(self, first: np.ndarray, last: np.ndarray) -> tuple[dict, dict]:
        """First and last rows read as :attr:`obs` (one a stream), as each key's own rows.

        Returns:
            ``(first, last)``, each key -> words.
        """
        if len(self._keys) == 1 and self._keys[0][1] < 0:
            key = self._keys[0][0]
            return {key: first}, {key: last}
        a, b = first.view(np.uint8), last.view(np.uint8)
        return (
            {k: np.ascontiguousarray(a[:, o : o + w]) for k, o, w in self._keys},
            {k: np.ascontiguousarray(b[:, o : o + w]) for k, o, w in self._keys},
        )


NO_ENDS = EndRows.of(None, [], 1, LastRows(), {}, False, None)  # observation-only, flat rows


def _end_bytes(rows: Views, key: tuple, next_key: tuple, steps: int) -> tuple:
    """Each stream's first ``rows[key]`` and last ``rows[next_key]``, as bytes ``[S, B]``.

    Copies of just those rows, read on the rows' device (numpy slices where
    the rows have numpy views).
    """
    a, b = rows[key], rows[next_key]
    if a is not None and b is not None and a.dtype.kind != "O":
        return as_bytes(a[::steps]), as_bytes(b[steps - 1 :: steps])
    x, y = rows.flat(key), rows.flat(next_key)
    n = len(x)
    first = index_tensor(np.arange(0, n, steps))
    last = index_tensor(np.arange(steps - 1, n, steps))
    return (
        as_bytes(x.index_select(0, first.to(x.device))),
        as_bytes(y.index_select(0, last.to(y.device))),
    )


def check(ends: CallEnds, obs_keys: list) -> None:
    """Raises unless each stream's first row in a call continues its last row.

    Args:
        ends: the call's stream ends, read with the continuity check (a
            ``restart`` given to :meth:`EndRows.of`).
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


def whole_words(rows: Views, key: tuple, with_ids: bool) -> tuple | None:
    """``rows[key]``, ``rows[("next", *key)]`` and the trajectory ids as words ``[N, W]``, or None.

    Each row's bytes viewed as the widest unsigned word that divides them,
    without a copy (the ids empty without ``with_ids``). None where some of
    them have no C-contiguous numpy view (another device, a dtype numpy
    lacks, a slice): :class:`EndRows` then copies each stream's end rows
    instead.
    """
    out = []
    for k in (key, ("next", *key), TRAJ_IDS) if with_ids else (key, ("next", *key)):
        a = rows[k]
        if a is None or not a.flags.c_contiguous or a.dtype.kind == "O":
            return None
        n = len(a)
        width = math.prod(a.shape[1:])  # (-1 fails on 0 rows)
        size = width * a.itemsize
        out.append(a.reshape(n, width).view(_WORDS[min(size & -size, 8)] if size else _WORDS[1]))
    if not with_ids:
        out.append(_NO_BYTES)
    return tuple(out)


_WORDS = {size: np.dtype(f"uint{8 * size}") for size in (1, 2, 4, 8)}
_NO_WORDS = {w: np.zeros((0, 0), w) for w in _WORDS.values()}


def words(word: np.dtype, *rows: np.ndarray | None) -> list:
    """Rows of bytes ``[R, B]`` (or of other words) viewed as unsigned words ``word``.

    Each empty (``[0, 0]``) for None, or where ``B`` is not a whole number of
    words (then they compare as different from any rows of that word).

    Examples:
        >>> eight, six = np.zeros((1, 8), np.uint8), np.zeros((1, 6), np.uint8)
        >>> a, b = words(np.dtype(np.uint32), eight, six)
        >>> a.shape, b.shape
        ((1, 2), (0, 0))
    """
    out = []
    for x in rows:
        if x is None:
            x = _NO_WORDS[word]
        elif x.dtype != word:
            if x.ndim != 2 or not x.flags.c_contiguous or x.view(np.uint8).shape[1] % word.itemsize:
                x = _NO_WORDS[word]
            else:
                x = x.view(np.uint8).view(word)
        out.append(x)
    return out
