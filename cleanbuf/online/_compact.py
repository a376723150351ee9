"""The compact storage: each observation stored once, next observations rebuilt exactly.

A cleaned transition holds its observation twice: as ``obs`` of row t and
as ``("next", obs)`` of row t, which within a stream is ``obs`` of the
stream's next row, except at episode ends and stream cuts. A
:class:`CompactStorage` stores ``obs`` only, and per row one int32
*link*:

- ``link >= 0``: the slot whose ``obs`` is, byte for byte, this row's
  ``("next", obs)`` (every observation key). A link is made only after that
  byte comparison, at write time: exact by construction;
- ``link <= -2``: this row's ``("next", obs)`` is in a small *side table*, at
  ``-2 - link``. Episode ends, rows whose terminal observation the filter
  marked lost (NaN), stream cuts, and the last written row of each stream
  (until its successor comes in a later write, is verified, and frees the
  entry) live there.

Which stored row follows which comes from a per-row stream index that the
:class:`~cleanbuf.AutoresetFilter` adds to its rows when its buffer's
storage is a ``CompactStorage`` (a column this storage reads and never
stores); rows written without it are read as one stream in write order.
The index only says where to look: every link is verified, so a wrong one
costs a side-table entry, never a wrong observation.

TorchRL's writer keeps the cursor. A round-robin ring overwrites the
oldest slots first, and a row always links to a row written after it, so
a row whose successor is overwritten has been overwritten already. A
write anywhere else (a gap after a failed write, ``write_at``) first moves
the next observation of every row still linking into the slots written to
the side table. A writer that chooses its own slots
(``TensorDictMaxValueWriter``) is refused at the first write.
"""

from __future__ import annotations

import functools
import json
import math
from multiprocessing.context import get_spawning_popen
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import NestedKey, TensorDict, TensorDictBase
from torchrl.data import LazyTensorStorage

from cleanbuf.engine._errors import InputError, LayoutError, StateError
from cleanbuf.engine._keys import NEXT, may_be_observation
from cleanbuf.online._compact_links import (
    commit_links,
    continues_ring,
    copy_rows,
    gather_next,
    plan_links,
    rows_linking_into,
    rows_match,
    write_links,
)

STREAM_KEY = "_cleanbuf_stream"
"""The per-row stream index the filter adds for a compact storage (never stored)."""

MARKER = "cleanbuf_compact.json"
"""The file that marks a compact storage's dump (``rb.dumps(path)``: in ``path/storage``)."""

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INTS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[n, words]`` integers, so that ``==`` compares bytes (NaN, -0.0).

    The widest integer word that divides a row (and its offset) is used:
    a ``[4, 84, 84]`` uint8 frame is compared as 3528 int64 words.
    """
    x = x.reshape(x.shape[0], -1)
    if x.stride(-1) != 1:
        x = x.contiguous()
    row = x.shape[1] * x.dtype.itemsize
    offset = x.storage_offset() * x.dtype.itemsize
    for size in (8, 4, 2, 1):
        if size >= x.dtype.itemsize and not row % size and not offset % size:
            break
    if size == x.dtype.itemsize and not (
        x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool
    ):
        return x
    if x.shape[0] > 1 and x.stride(0) != x.shape[1]:
        x = x.contiguous()
    return x.view(_INTS[size])


def rows_equal(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per row, whether ``x`` and ``y`` hold the same bytes.

    Examples:
        >>> nan = float("nan")
        >>> rows_equal(torch.tensor([[nan], [0.0]]), torch.tensor([[nan], [-0.0]])).tolist()
        [True, False]
    """
    if x.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool, device=x.device)
    return (_bits(x) == _bits(y)).all(1)


def host_words(x: torch.Tensor) -> np.ndarray:
    """A CPU tensor's rows as a numpy ``[n, words]`` integer view, for a byte comparison.

    The widest word that divides a row is used; nothing is copied unless a
    row is not contiguous (then the copy is read only).

    Examples:
        >>> host_words(torch.zeros(3, 17)).dtype, host_words(torch.zeros(3, 17)).shape
        (dtype('int32'), (3, 17))
    """
    if x.requires_grad:
        x = x.detach()
    if x.dtype == torch.bfloat16:  # (no numpy twin)
        x = (
            x.view(torch.int16)
            if x.ndim and x.stride(-1) == 1
            else x.contiguous().view(torch.int16)
        )
    a = x.numpy()
    a = a.reshape(a.shape[0], math.prod(a.shape[1:]))
    if a.shape[1] > 1 and a.strides[1] != a.itemsize:
        a = np.ascontiguousarray(a)
    row = a.shape[1] * a.itemsize
    size = 8 if not row % 8 else 4 if not row % 4 else 2 if not row % 2 else 1
    if size < a.itemsize:  # (a row of one 2-byte word, say: keep the dtype's width)
        size = a.itemsize
    return a.view(_NP_INTS[size]) if row else a.view(np.uint8)


def is_compact(storage: Any) -> bool:
    """Whether ``storage`` is a :class:`CompactStorage` (the filter then adds stream indices)."""
    return isinstance(storage, CompactStorage)


def check_compact_load(rb: Any) -> None:
    """Refuses a filter state saved beside a compact buffer, loaded by a buffer without one.

    ``rb.dumps`` / ``rb.state_dict`` of a buffer over a
    :class:`CompactStorage` save its rows without ``("next", obs)``;
    TorchRL's ``LazyTensorStorage`` loads them as they are, and reading
    ``("next", obs)`` of a sample fails (a bare ``KeyError``). The
    filter's state says that its buffer was compact, and TorchRL loads the
    filter after the storage, so the filter names the mistake here. ``rb``
    None (a filter loaded on its own): nothing to check.
    """
    if rb is None or is_compact(getattr(rb, "storage", None)):
        return
    raise StateError(
        f"this state (rb.loads / rb.load_state_dict) was saved by a buffer whose storage is "
        f"a cleanbuf.CompactStorage, which stores each observation once and rebuilds "
        f"('next', obs) at sample time; this buffer's storage is "
        f"{type(rb.storage).__name__}, which has just loaded the rows without their next "
        "observations (reading ('next', obs) of a sample would fail with KeyError). Build the "
        "buffer with storage=cleanbuf.CompactStorage(max_size) (the same max_size as the "
        "saved one) and load again; to get a plain buffer, load into a CompactStorage and "
        "extend a LazyTensorStorage buffer without a filter (the rows are cleaned already) "
        "with rb.storage[:]."
    )


def with_stream_index(
    td: TensorDictBase, layout: str | None, stream_key: Any, *, owned: bool = False
) -> TensorDictBase:
    """``td`` (a shallow copy) with each row's stream index under :data:`STREAM_KEY`.

    The index is the env's position in the batch (``[*E, T]``: the flat
    index of ``*E``; ``[T, *E]``: of ``*E``; one step ``[E]``: of E), the
    stream key's value for flat rows, and 0 for one stream ``[T]``. The
    cleaner passes the column through with its row, held rows included.

    Args:
        td: the batch, as the filter gets it.
        layout: the filter's ``layout`` option.
        stream_key: the filter's ``stream_key`` option.
        owned: ``td`` is the filter's own shallow copy (TorchRL's ``inv``
            makes one): the column is set on it, no copy made.

    Returns:
        The batch with the column (the caller's batch is unchanged).

    Examples:
        >>> td = TensorDict({"obs": torch.zeros(2, 3)}, batch_size=[2, 3])
        >>> with_stream_index(td, None, None)[STREAM_KEY].tolist()
        [[0, 0, 0], [1, 1, 1]]
    """
    shape = td.batch_size
    device = td.device
    value = None
    if layout == "stream_key" and stream_key is not None:
        value = td.get(stream_key, None)
    if isinstance(value, torch.Tensor):
        ids = value.reshape(*shape, -1)[..., 0].to(torch.int64)
        if device is not None:
            ids = ids.to(device)
    else:
        ids = _positions(tuple(shape), layout, device)
    out = td if owned and not td.is_locked else td.copy()
    out.set(STREAM_KEY, ids)
    return out


@functools.lru_cache(maxsize=32)
def _positions(shape: tuple, layout: str | None, device: Any) -> torch.Tensor:
    """The stream index of every row of a batch of ``shape`` (read only: shared)."""
    if len(shape) <= 1 and layout != "step":
        ids = torch.zeros(shape, dtype=torch.int64, device=device)
    elif layout == "step":
        ids = torch.arange(math.prod(shape), device=device).reshape(shape)
    elif layout == "time_first":
        envs = math.prod(shape[1:])
        ids = torch.arange(envs, device=device).reshape(shape[1:]).expand(shape)
    else:  # [*E, T]
        envs = math.prod(shape[:-1])
        ids = torch.arange(envs, device=device).reshape(*shape[:-1], 1).expand(shape)
    return ids


class CompactStorage(LazyTensorStorage):
    """A replay-buffer storage that keeps each observation once and gives back every next one.

    Use it as the ``storage`` of a TorchRL ``ReplayBuffer`` whose transform
    is an :class:`~cleanbuf.AutoresetFilter`, with TorchRL's own
    round-robin writer and any sampler (``RandomSampler``,
    ``PrioritizedSampler``, ``SliceSampler``). ``("next", k)`` is not
    stored for an observation key ``k``: ``get`` rebuilds it from the
    ``k`` of the row that follows in the same stream, or from a small side
    table at episode ends, lost terminal observations, stream cuts and
    the newest row of each stream. Every sample equals, bit for bit and
    key for key, what a ``LazyTensorStorage`` of the same buffer returns.
    The link table, the side table and the sample's gathers live on the
    storage's ``device``. ``state_dict``, ``rb.dumps`` / ``rb.loads`` and
    ``rb.empty()`` work as with TorchRL's storages.

    Args:
        max_size: the number of rows the storage holds.
        device: where rows, links and the side table live ("auto": the
            first batch's device).
        observation_keys: the keys stored once (None: every root key
            stored with a ``("next", k)`` twin of the same dtype and shape,
            done, reward and bookkeeping keys excluded).

    Raises:
        LayoutError: ``ndim`` other than 1, or (at the first write) a
            writer that chooses its own slots.
        InputError: (at the first write) no observation key to keep once,
            or a declared key without its ``("next", k)`` twin.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import ReplayBuffer
        >>> from cleanbuf import AutoresetFilter, CompactStorage
        >>> rb = ReplayBuffer(storage=CompactStorage(100), transform=AutoresetFilter("next_step"))
        >>> batch = TensorDict({  # [E=1, T=4]: done at t=1, reset row at t=2
        ...     "observation": torch.tensor([[[0.0], [1.0], [2.0], [10.0]]]),
        ...     ("next", "observation"): torch.tensor([[[1.0], [0.0], [10.0], [11.0]]]),
        ...     ("next", "reward"): torch.tensor([[[1.0], [1.0], [0.0], [1.0]]]),
        ...     ("next", "done"): torch.tensor([[[False], [True], [False], [False]]]),
        ... }, batch_size=[1, 4])
        >>> _ = rb.extend(batch)
        >>> rb[:]["next", "observation"].flatten().tolist()
        [1.0, 2.0, 11.0]
        >>> rb.storage.side_rows  # the episode's end and the newest row
        2
    """

    def __init__(
        self,
        max_size: int,
        *,
        device: torch.device | str = "cpu",
        observation_keys: list[NestedKey] | None = None,
        ndim: int = 1,
    ):
        if ndim != 1:
            raise LayoutError(
                f"CompactStorage(ndim={ndim}): a compact storage holds flat rows (ndim=1), "
                "which is what AutoresetFilter writes. Build it with ndim=1 (the default)."
            )
        super().__init__(max_size, device=device)
        declared = None
        if observation_keys is not None:
            declared = [(k,) if isinstance(k, str) else tuple(k) for k in observation_keys]
        self._declared = declared
        self._compare_on_host = True  # (False: the device path, which tests also run on the CPU)
        self._reset_links()

    # ----------------------------------------------------------- state
    def _reset_links(self) -> None:
        self._obs_keys: list[tuple] | None = None  # set at the first write
        self._link: torch.Tensor | None = None  # int32 [max_size], on the device
        self._link_host: torch.Tensor | None = None  # its host copy (itself on the CPU)
        self._side: TensorDict | None = None  # ("next", k) rows, [capacity]
        # The bookkeeping the kernels keep (host index arrays, never observations):
        self._free = np.zeros(0, dtype=np.int64)  # free side entries (a stack)
        self._n_free = 0
        self._pend_stream = np.zeros(0, dtype=np.int64)  # sorted stream ids
        self._pend_slot = np.zeros(0, dtype=np.int64)  # their newest slot
        self._next_slot = 0  # where an in-order write starts
        self._checked_writer = False

    def _set_link(self, link: torch.Tensor) -> None:
        """Takes ``link`` (on the device) and makes its host copy."""
        self._link = link
        self._link_host = link if link.device.type == "cpu" else link.cpu()

    @property
    def _host_compare(self) -> bool:
        """Whether writes and reads run kernels on the rows (CPU) or torch ops (device)."""
        return self._compare_on_host and torch.device(self.device).type == "cpu"

    def _to_device(self, x: np.ndarray) -> torch.Tensor:
        """A host index array as a tensor on the storage's device (no copy on the CPU)."""
        t = torch.from_numpy(x)
        device = torch.device(self.device)  # (resolved at the first write)
        return t if device.type == "cpu" else t.to(device)

    @property
    def side_rows(self) -> int:
        """The rows whose next observation is in the side table now."""
        return 0 if self._side is None else self._side.batch_size[0] - self._n_free

    @property
    def observation_keys(self) -> list[tuple] | None:
        """The keys stored once (known after the first write)."""
        return None if self._obs_keys is None else list(self._obs_keys)

    def nbytes(self) -> int:
        """The bytes this storage holds: rows, links and side table (allocated, not used)."""
        total = 0
        if self._storage is not None:
            total += sum(t.numel() * t.element_size() for t in self._storage.values(True, True))
        if self._link is not None:
            total += self._link.numel() * self._link.element_size()
            if self._link_host is not self._link:
                total += self._link_host.numel() * self._link_host.element_size()
        if self._side is not None:
            total += sum(t.numel() * t.element_size() for t in self._side.values(True, True))
        total += self._free.nbytes + self._pend_slot.nbytes + self._pend_stream.nbytes
        return total

    # ----------------------------------------------------------- first write
    def _check_writer(self) -> None:
        from torchrl.data.replay_buffers.writers import RoundRobinWriter

        for owner in self._attached_entities:
            writer = getattr(owner, "_writer", None)
            if writer is not None and not isinstance(writer, RoundRobinWriter):
                raise LayoutError(
                    f"CompactStorage needs a writer that writes rows in order (TorchRL's "
                    f"RoundRobinWriter, the default); this buffer's writer is "
                    f"{type(writer).__name__}, which chooses its own slots, so a row's next "
                    "observation could be overwritten out of turn. Build the buffer without "
                    "writer= (or with writer=RoundRobinWriter()), or use LazyTensorStorage "
                    "with this writer. Nothing was written."
                )
        self._checked_writer = True

    def _find_keys(self, data: TensorDictBase) -> list[tuple]:
        leaves = {k if isinstance(k, tuple) else (k,): v for k, v in data.items(True, True)}
        if self._declared is not None:
            missing = [k for k in self._declared if k not in leaves or (NEXT, *k) not in leaves]
            if missing:
                raise InputError(
                    f"CompactStorage(observation_keys=...): {missing} not found with a "
                    f"('next', ...) twin in the rows written (keys: {sorted(leaves, key=str)}). "
                    "Name keys stored both at the root and under 'next'. Nothing was written."
                )
            keys = list(self._declared)
        else:
            keys = []
            for k, v in leaves.items():
                twin = leaves.get((NEXT, *k))
                if (
                    may_be_observation(k)
                    and k[0] != STREAM_KEY
                    and twin is not None
                    and isinstance(v, torch.Tensor)
                    and twin.dtype == v.dtype
                    and twin.shape == v.shape
                ):
                    keys.append(k)
        if not keys:
            raise InputError(
                "CompactStorage found no observation key stored with its ('next', k) twin "
                f"of the same dtype and shape in the rows written (keys: "
                f"{sorted(leaves, key=str)}), so nothing can be stored once. Use "
                "LazyTensorStorage, or pass observation_keys=[...]. Nothing was written."
            )
        for k in keys:
            a, b = leaves[k], leaves[(NEXT, *k)]
            if a.dtype != b.dtype or a.shape != b.shape:
                raise InputError(
                    f"CompactStorage: {k} is {a.dtype} {list(a.shape)} but {(NEXT, *k)} is "
                    f"{b.dtype} {list(b.shape)}; a key stored once needs its twin alike. "
                    "Leave it out of observation_keys. Nothing was written."
                )
        return keys

    # ----------------------------------------------------------- side table
    def _reserve(self, need: int, freed: int = 0) -> None:
        """Grows the side table (by doubling): ``need`` entries free once ``freed`` more are."""
        if self._n_free + freed >= need:
            return
        cap = self._side.batch_size[0]
        new_cap = max(2 * cap, cap + need - self._n_free - freed, 64)
        side = TensorDict(
            {
                k: torch.empty((new_cap, *v.shape[1:]), dtype=v.dtype, device=v.device)
                for k, v in self._side.items(True, True)
            },
            batch_size=[new_cap],
            device=self._side.device,
        )
        side[:cap] = self._side
        self._side = side
        free = np.empty(new_cap, dtype=np.int64)
        free[: self._n_free] = self._free[: self._n_free]
        free[self._n_free : self._n_free + new_cap - cap] = np.arange(new_cap - 1, cap - 1, -1)
        self._free = free
        self._n_free += new_cap - cap

    def _alloc(self, n: int) -> np.ndarray:
        """``n`` free side entries (the table grows by doubling)."""
        self._reserve(n)
        self._n_free -= n
        return self._free[self._n_free : self._n_free + n].copy()

    # ----------------------------------------------------------- write
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Writes rows at ``cursor``; their next observations become links or side entries."""
        one, rows = self._rows_to_write(cursor, data)
        n = rows.batch_size[0]
        slots = self._slots_written(cursor)
        sid = self._stream_ids(rows, n)
        if slots.shape[0] != n:
            raise InputError(
                f"CompactStorage: a write of {n} rows at {slots.shape[0]} slots. Write rows "
                "through the replay buffer (rb.extend / rb.add). Nothing was written."
            )
        keys = self._obs_keys if self._obs_keys is not None else self._find_keys(rows)
        nkeys = self._next_keys(rows, keys)
        if n > self.max_size:  # only the last max_size rows stay (as TorchRL stores them)
            rows = rows[-self.max_size :]
            slots, sid = slots[-self.max_size :], sid[-self.max_size :]
            cursor = torch.from_numpy(slots)
        if self._in_order_write(cursor, rows, one, slots, sid, keys, nkeys, set_cursor):
            return
        first = self._link is None
        link = np.full(self.max_size, -1, dtype=np.int32) if first else self._link_host.numpy()
        plan = plan_links(
            sid, slots, link, self._pend_stream, self._pend_slot, self._next_slot, set_cursor
        )
        ordered, a, b, adjacent, l_pos, l_sid, j_row, j_pos, j_entry, freed = plan
        # Rows linking into the slots written other than by ring order (a gap, write_at):
        # their next observations move to the side table (read before the write).
        detach = None
        if not first and not ordered:
            rows_in = rows_linking_into(link, slots)
            if rows_in.shape[0]:
                at = self._to_device(link[rows_in].astype(np.int64))
                detach = (rows_in, [self._storage.get(k)[at] for k in keys])
        # CPU rows: numpy views of (obs, next obs) per key, compared and copied in kernels
        words = None
        if self._host_compare:
            words = [
                (host_words(rows.get(k)), host_words(rows.get(nk))) for k, nk in zip(keys, nkeys)
            ]
        eq, ok = self._compare(rows, keys, nkeys, words, a, b, adjacent, j_pos, j_entry)
        stored = rows.exclude(STREAM_KEY, *nkeys)
        super().set(cursor, stored[0] if one else stored, set_cursor=set_cursor)
        if first:
            self._first_layout(keys, nkeys, rows, link, self.device)
        if detach is not None:
            self._detach(detach, nkeys, link)
        self._reserve(
            a.shape[0] - np.count_nonzero(eq) + l_pos.shape[0], freed + np.count_nonzero(ok)
        )
        self._n_free, side_pos, side_entry, self._pend_stream, self._pend_slot = commit_links(
            link, slots, a, b, eq, j_row, j_pos, ok, l_pos, l_sid, self._pend_stream,
            self._pend_slot, self._free, self._n_free,
        )  # fmt: skip
        if side_pos.shape[0]:
            self._write_side(rows, nkeys, words, side_pos, side_entry)
        if self._link_host is not self._link:  # the links changed: to the device copy
            touched = [slots, j_row[ok]] + ([] if detach is None else [detach[0]])
            self._push_links(touched)
        if n:
            self._next_slot = (int(slots[-1]) + 1) % self.max_size

    @staticmethod
    def _stream_ids(rows: TensorDictBase, n: int) -> np.ndarray:
        """Each row's stream (the filter's column; none: one stream), on the host."""
        sid = rows.get(STREAM_KEY, None)
        if sid is None:
            return np.full(n, -1, dtype=np.int64)
        return sid.reshape(-1).to(device="cpu", dtype=torch.int64).numpy()  # (small)

    def _in_order_write(self, cursor, rows, one, slots, sid, keys, nkeys, set_cursor) -> bool:
        """The common write in one kernel call: CPU rows, one key, continuing the ring.

        Returns whether it wrote (else :meth:`set` takes the general path).
        """
        if not (
            len(keys) == 1
            and self._link is not None
            and self._host_compare
            and set_cursor
            and slots.shape[0]
            and continues_ring(slots, self._next_slot, self.max_size)
        ):
            return False
        obs, nxt = host_words(rows.get(keys[0])), host_words(rows.get(nkeys[0]))
        stored = rows.exclude(STREAM_KEY, *nkeys)
        super().set(cursor, stored[0] if one else stored, set_cursor=set_cursor)
        link = self._link_host.numpy()
        while True:
            need, n_free, pend_stream, pend_slot = write_links(
                sid, slots, link, self._pend_stream, self._pend_slot, self._free, self._n_free,
                obs, nxt, self._side_words(nkeys[0]),
            )  # fmt: skip
            if not need:
                break
            self._reserve(need, n_free)  # (nothing was changed: grow, then again)
        self._n_free, self._pend_stream, self._pend_slot = n_free, pend_stream, pend_slot
        self._next_slot = (int(slots[-1]) + 1) % self.max_size
        return True

    def _write_side(self, rows, nkeys, words, side_pos, side_entry) -> None:
        """The next observations of the rows at ``side_pos`` into side entries ``side_entry``."""
        if words is not None:
            for nk, (_, nxt) in zip(nkeys, words):
                copy_rows(self._side_words(nk), side_entry, nxt, side_pos)
            return
        at, pos = self._to_device(side_entry), self._to_device(side_pos)
        for nk in nkeys:
            self._side.get(nk)[at] = rows.get(nk)[pos]

    def _side_words(self, nk: tuple) -> np.ndarray:
        """A writable numpy view of the side table's ``nk`` rows (CPU)."""
        side = self._side.get(nk)
        assert side.is_contiguous()  # (allocated here: a view, never a copy)
        return host_words(side)

    def _detach(self, detach: tuple, nkeys: list[tuple], link: np.ndarray) -> None:
        """The next observations of rows linking into the slots written, to the side table."""
        rows_in, values = detach
        entries = self._alloc(rows_in.shape[0])
        at = self._to_device(entries)
        for nk, v in zip(nkeys, values):
            self._side.get(nk)[at] = v
        link[rows_in] = -2 - entries

    def _push_links(self, touched: list[np.ndarray]) -> None:
        """The links of the slots ``touched`` from the host copy to the device copy."""
        idx = torch.from_numpy(np.concatenate(touched))
        self._link[idx.to(self._link.device)] = self._link_host[idx].to(self._link.device)

    def _rows_to_write(self, cursor: Any, data: Any) -> tuple[bool, TensorDictBase]:
        """(whether ``data`` is one row at an int cursor, the rows as ``[n]`` on the device)."""
        if not isinstance(data, TensorDictBase):
            raise InputError(
                f"CompactStorage stores TensorDict rows; got {type(data).__name__}. Use "
                "LazyTensorStorage for other data. Nothing was written."
            )
        if not self._checked_writer:
            self._check_writer()
        one = isinstance(cursor, int) or (isinstance(cursor, torch.Tensor) and cursor.ndim == 0)
        one = one and data.batch_dims == 0
        rows = data.unsqueeze(0) if one else data
        if self.device == "auto":
            self.device = rows.device if rows.device is not None else torch.device("cpu")
        if rows.device != self.device:
            rows = rows.to(self.device)
        return one, rows

    @staticmethod
    def _next_keys(rows: TensorDictBase, keys: list[tuple]) -> list[tuple]:
        nkeys = [(NEXT, *k) for k in keys]
        for k, nk in zip(keys, nkeys):
            if not isinstance(rows.get(nk, None), torch.Tensor):
                raise InputError(
                    f"CompactStorage: the rows written have {k} but not {nk}; every "
                    "write needs both (AutoresetFilter writes both; with "
                    "Collector(compact_obs=True) keep the filter's compact=False). Nothing "
                    "was written."
                )
        return nkeys

    def _first_layout(self, keys, nkeys, rows, link: np.ndarray, device) -> None:
        """The keys, the links (``link``: their host copy) and an empty side table."""
        self._obs_keys = keys
        link_t = torch.from_numpy(link)  # the host copy the kernels write
        self._link_host = link_t
        self._link = link_t if torch.device(device).type == "cpu" else link_t.to(device)
        self._side = TensorDict(
            {
                nk: torch.empty(
                    (0, *rows.get(nk).shape[1:]), dtype=rows.get(nk).dtype, device=device
                )
                for nk in nkeys
            },
            batch_size=[0],
            device=device,
        )
        self._free = np.zeros(0, dtype=np.int64)
        self._n_free = 0

    def _compare(self, rows, keys, nkeys, words, a, b, adjacent, j_pos, j_entry):
        """Per pair, and per pending row to join, whether the bytes match (host bools)."""
        if words is not None:  # CPU rows: compared in place, a kernel call per key
            eq = np.ones(a.shape[0], np.bool_)
            ok = np.ones(j_pos.shape[0], np.bool_)
            for nk, (obs, nxt) in zip(nkeys, words):
                if a.shape[0]:
                    rows_match(nxt, obs, a, b, eq)
                if j_pos.shape[0]:
                    rows_match(self._side_words(nk), obs, j_entry, j_pos, ok)
            return eq, ok
        same = joined = None
        if a.shape[0]:
            if adjacent:  # in row order: compare views, no gather
                for k, nk in zip(keys, nkeys):
                    x = rows_equal(rows.get(nk)[:-1], rows.get(k)[1:])
                    same = x if same is None else same & x
            else:
                at, bt = self._to_device(a), self._to_device(b)
                for k, nk in zip(keys, nkeys):
                    x = rows_equal(rows.get(nk)[at], rows.get(k)[bt])
                    same = x if same is None else same & x
        if j_pos.shape[0]:
            at, pos = self._to_device(j_entry), self._to_device(j_pos)
            for k, nk in zip(keys, nkeys):
                x = rows_equal(self._side.get(nk)[at], rows.get(k)[pos])
                joined = x if joined is None else joined & x
        empty = torch.zeros(0, dtype=torch.bool)
        same = empty if same is None else same
        joined = empty if joined is None else joined
        both = torch.cat([same.cpu(), joined.cpu()]).numpy()  # (one transfer each)
        eq, ok = both[: same.shape[0]], both[same.shape[0] :]
        if adjacent and a.shape[0]:
            eq = eq[a]
        return np.ascontiguousarray(eq), np.ascontiguousarray(ok)

    def _slots_written(self, cursor: Any) -> np.ndarray:
        if isinstance(cursor, slice):
            r = range(self.max_size)[cursor]
            return np.arange(r.start, r.stop, r.step, dtype=np.int64)
        if isinstance(cursor, range):
            return np.arange(cursor.start, cursor.stop, cursor.step, dtype=np.int64)
        if isinstance(cursor, torch.Tensor):
            if cursor.dtype == torch.int64 and cursor.device.type == "cpu" and cursor.ndim == 1:
                return cursor.numpy()  # (the writer's own index: read, never written)
            return cursor.reshape(-1).to(device="cpu", dtype=torch.int64).numpy()
        return np.asarray(cursor, dtype=np.int64).reshape(-1)

    # ----------------------------------------------------------- read
    def get(self, index: Any) -> Any:
        """The rows at ``index``, with ``("next", k)`` rebuilt for every key stored once."""
        out = super().get(index)
        if self._obs_keys is None:
            return out
        slots = self._slots_read(index)
        if self._host_compare:  # CPU: one kernel pass per key
            flat = slots.reshape(-1).numpy()
            link = self._link_host.numpy()
            for k in self._obs_keys:
                rows, side = self._storage.get(k), self._side.get((NEXT, *k))
                value = torch.empty((flat.shape[0], *rows.shape[1:]), dtype=rows.dtype)
                gather_next(link, flat, host_words(rows), host_words(side), host_words(value))
                out.set((NEXT, *k), value.reshape(*slots.shape, *value.shape[1:]))
            return out
        link = self._link[slots.reshape(-1)].long()
        side_rows = (link < 0).nonzero().flatten()
        entries = -2 - link[side_rows]
        target = link.clamp_min(0)
        for k in self._obs_keys:
            value = self._storage.get(k)[target]
            value[side_rows] = self._side.get((NEXT, *k))[entries]
            out.set((NEXT, *k), value.reshape(*slots.shape, *value.shape[1:]))
        return out

    def _slots_read(self, index: Any) -> torch.Tensor:
        length = len(self)
        if isinstance(index, int):
            return torch.as_tensor(index % length if index < 0 else index, device=self._link.device)
        if isinstance(index, torch.Tensor) and index.dtype != torch.bool:
            index = index.to(self._link.device, torch.int64)
            return torch.where(index < 0, index + length, index)
        if isinstance(index, (list, tuple)) and all(isinstance(i, int) for i in index):
            t = torch.as_tensor(index, dtype=torch.int64, device=self._link.device)
            return torch.where(t < 0, t + length, t)
        return torch.arange(length, device=self._link.device)[index]

    # ----------------------------------------------------------- lifecycle
    def _empty(self) -> None:
        super()._empty()
        checked = self._checked_writer
        keys, link, side = self._obs_keys, self._link, self._side
        self._reset_links()
        self._checked_writer = checked
        if link is not None:  # the layout stays; every side entry is free again
            self._obs_keys = keys
            self._set_link(link.fill_(-1))
            self._side = side
            cap = side.batch_size[0]
            self._free = np.arange(cap - 1, -1, -1, dtype=np.int64)
            self._n_free = cap

    def _compact_state(self) -> dict:
        return {
            "observation_keys": None
            if self._obs_keys is None
            else [list(k) for k in self._obs_keys],
            "link": self._link,
            # the next observations of the side table, one tensor per key (in key order)
            "side": None
            if self._side is None
            else [self._side.get((NEXT, *k)) for k in self._obs_keys],
            "side_capacity": 0 if self._side is None else self._side.batch_size[0],
            # the host index arrays, as tensors on the storage's device
            "free": self._state_tensor(self._free[: self._n_free]),
            "pend_stream": self._state_tensor(self._pend_stream),
            "pend_slot": self._state_tensor(self._pend_slot),
            "next_slot": self._next_slot,
        }

    def _state_tensor(self, x: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(x.copy())
        return t if self._link is None else t.to(self._link.device)

    def state_dict(self) -> dict[str, Any]:
        """TorchRL's storage state, with the links and the side table under ``"compact"``."""
        state = super().state_dict()
        state["compact"] = self._compact_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads what :meth:`state_dict` returned (a plain storage's state is refused)."""
        compact = state_dict.get("compact")
        if compact is None:
            raise StateError(
                "CompactStorage.load_state_dict: this state has no 'compact' entry, so it is "
                "not a CompactStorage's (a LazyTensorStorage's state holds every next "
                "observation). Load it into the storage that saved it. Nothing was changed."
            )
        super().load_state_dict(state_dict)
        self._load_compact(compact)

    def _load_compact(self, compact: dict) -> None:
        device = self.device if self.device != "auto" else torch.device("cpu")
        keys = compact["observation_keys"]
        if keys is None:
            checked = self._checked_writer
            self._reset_links()
            self._checked_writer = checked
            return
        self._obs_keys = [tuple(k) for k in keys]
        self._set_link(compact["link"].to(device).clone())
        cap = compact["side_capacity"]
        self._side = TensorDict(
            {(NEXT, *k): t.to(device).clone() for k, t in zip(self._obs_keys, compact["side"])},
            batch_size=[cap],
            device=device,
        )
        free = compact["free"].to(device="cpu", dtype=torch.int64).numpy()
        self._free = np.empty(cap, dtype=np.int64)
        self._free[: free.shape[0]] = free
        self._n_free = free.shape[0]
        self._pend_stream = compact["pend_stream"].to("cpu", torch.int64).numpy().copy()
        self._pend_slot = compact["pend_slot"].to("cpu", torch.int64).numpy().copy()
        self._next_slot = int(compact["next_slot"])

    def dumps(self, path: Any) -> None:
        """Saves the rows (TorchRL's format) and, beside them, the links and side table."""
        super().dumps(path)
        path = Path(path)
        torch.save(self._compact_state(), path / "cleanbuf_compact.pt")
        with open(path / MARKER, "w") as file:
            json.dump({"format": "cleanbuf.CompactStorage", "version": 1}, file)

    def loads(self, path: Any) -> None:
        """Loads what :meth:`dumps` saved (a plain storage's dump is refused)."""
        path = Path(path)
        if not (path / MARKER).exists():
            raise StateError(
                f"CompactStorage.loads({str(path)!r}): no {MARKER} there, so this is not a "
                "CompactStorage's dump. Load it into a LazyTensorStorage (or the storage "
                "that saved it). Nothing was changed."
            )
        compact = torch.load(path / "cleanbuf_compact.pt", weights_only=False)
        super().loads(path)
        self._load_compact(compact)

    def __getstate__(self) -> dict:
        if get_spawning_popen() is not None:
            raise LayoutError(
                "a CompactStorage cannot be shared with worker processes: its links and side "
                "table change size and live in this process. Let the workers send their "
                "batches (a collector without replay_buffer=, or MultiSyncCollector / "
                "MultiAsyncCollector iterated here) and call rb.extend(batch) in this process."
            )
        return super().__getstate__()

    def __repr__(self) -> str:
        keys = self._obs_keys
        return (
            f"CompactStorage(max_size={self.max_size}, len={len(self)}, device={self.device}, "
            f"observation_keys={keys}, side_rows={self.side_rows})"
        )
