"""Reading and writing transition data on disk.

Four formats:

* a TorchRL replay-buffer dump (``rb.dumps(dir)``, any of its storages): a
  directory with ``storage/`` (a TensorDict memmap of the whole capacity),
  ``storage/storage_metadata.json`` (how many slots are filled) and
  ``writer/metadata.json`` (the cursor: where the next write goes, so
  where the oldest row of a full buffer is);
* a TensorDict memmap directory (``td.memmap(dir)``): every row is data;
* a ``.npz`` file of arrays named by their TensorDict key, nested keys
  joined by ``/`` (``"next/observation"``);
* an HDF5 file (``.h5`` / ``.hdf5``, needs ``h5py``: the ``hdf5`` extra)
  of datasets named the same way (``next`` a group).

Memmap directories and dumps are read as memory maps, in the order they
were written; ``.npz`` and HDF5 files are read into memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import warnings
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from cleanbuf.engine._errors import InputError
from cleanbuf.offline._compat import storage_tensors
from cleanbuf.offline._marker import DONE_KEYS, ENV_ARRAY, done_digest, read_dir, write_dir

DUMP, MEMMAP, NPZ, HDF5 = "torchrl-dump", "memmap", "npz", "hdf5"
HDF5_SUFFIXES = (".h5", ".hdf5")


@dataclasses.dataclass
class Dataset:
    """Transition data read from disk.

    Attributes:
        format: ``"torchrl-dump"``, ``"memmap"``, ``"npz"`` or ``"hdf5"``.
        path: where it was read.
        data: the storage's slots (memory maps for a dump or a memmap
            directory): ``[N]`` rows, or ``[N, T]`` chunks of ``T`` time
            steps of one env (a TorchRL collector writing into a plain
            storage).
        order: the filled slots in the order they were written (a full
            circular buffer starts at the writer's cursor).
        capacity: the number of slots of the storage.
        wrapped: the buffer was filled and overwritten its oldest slots.
        env: each row's env index (write order) where ``cleanbuf clean``
            stored it, with ``mark``, its marker (see
            :mod:`cleanbuf.offline._marker`); None elsewhere.
    """

    format: str
    path: str
    data: TensorDictBase
    order: np.ndarray
    capacity: int
    wrapped: bool
    env: np.ndarray | None = None
    mark: dict | None = None

    @property
    def chunk(self) -> int:
        """Time steps per slot: 1 for rows, ``T`` for ``[N, T]`` chunks."""
        return int(self.data.shape[1]) if self.data.batch_dims > 1 else 1

    @property
    def n_rows(self) -> int:
        """The number of valid rows."""
        return len(self.order) * self.chunk

    def _index(self, positions: np.ndarray) -> tuple:
        """The storage index of rows in write order.

        A slice where they are consecutive slots (a view of the memory map,
        no copy), else indices.
        """
        if self.chunk == 1:
            slots = self.order[positions]
            if len(slots) and slots[-1] - slots[0] == len(slots) - 1:
                if np.array_equal(np.diff(slots), np.ones(len(slots) - 1, slots.dtype)):
                    return (slice(int(slots[0]), int(slots[-1]) + 1),)
            return (torch.as_tensor(slots),)
        slots = torch.as_tensor(self.order[positions // self.chunk])
        return slots, torch.as_tensor(positions % self.chunk)

    def rows(self, positions: np.ndarray) -> TensorDictBase:
        """The rows at ``positions`` (in write order).

        A view of the memory maps for consecutive slots, else a copy.
        """
        return self.data[self._index(positions)]

    def column(self, key: tuple, positions: np.ndarray) -> np.ndarray:
        """One key of the rows at ``positions`` (in write order), as numpy."""
        return self.data.get(key)[self._index(positions)].numpy()


def plain_leaves(td: TensorDictBase) -> dict:
    """Every leaf of ``td`` as a plain tensor on the same memory (memory maps too).

    Slicing a tensordict ``MemoryMappedTensor`` builds a file path for the
    slice, about 0.15 ms a slice on this machine, which made a third of an
    offline clean's time; a plain tensor on the same memory slices in a
    microsecond.

    Examples:
        >>> td = TensorDict({"a": torch.zeros(3)}, batch_size=[3]).memmap_()
        >>> type(plain_leaves(td)["a",]).__name__
        'Tensor'
    """
    return {_tuple(k): v.as_subclass(torch.Tensor) for k, v in td.items(True, True)}


def _json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read {path}: {err}") from err


def _check_sizes(path: str) -> None:
    """Checks, before tensordict opens them, that the memmap files hold their tensors.

    ``TensorDict.load_memmap`` would grow a truncated file to its size with
    zeros, which both hides the damage and writes into the source.
    """
    for folder, _, files in os.walk(path):
        if "meta.json" not in files:
            continue
        meta = _json(os.path.join(folder, "meta.json"))
        for name, entry in meta.items():
            if not isinstance(entry, dict) or "shape" not in entry or "dtype" not in entry:
                continue
            dtype = getattr(torch, str(entry["dtype"]).replace("torch.", ""), None)
            filename = os.path.join(folder, f"{name}.memmap")
            if dtype is None or not os.path.exists(filename):
                continue
            need = math.prod(entry["shape"]) * dtype.itemsize
            have = os.path.getsize(filename)
            if have < need:
                raise InputError(
                    f"{filename} (shape {entry['shape']}, {entry['dtype']}) holds {have} bytes "
                    f"of the {need} its tensor needs: the directory is truncated or partly "
                    "copied. Copy it again."
                )


def _load_memmap(path: str) -> TensorDictBase:
    _check_sizes(path)
    try:
        data = TensorDict.load_memmap(path)
    except Exception as err:  # tensordict raises many kinds on a bad directory
        raise InputError(
            f"{path} is not a readable TensorDict memmap directory ({type(err).__name__}: "
            f"{err}). A truncated or partly copied directory reads like this: copy it again."
        ) from err
    # Plain tensors on the same memory maps: see plain_leaves.
    return data.apply(lambda t: t.as_subclass(torch.Tensor))


def _dump(path: str) -> Dataset:
    storage_dir = os.path.join(path, "storage")
    data = _load_memmap(storage_dir)
    capacity = int(data.shape[0])
    length = int(_json(os.path.join(storage_dir, "storage_metadata.json")).get("len", capacity))
    writer = os.path.join(path, "writer", "metadata.json")
    meta = _json(writer) if os.path.exists(writer) else {}
    cursor = int(meta.get("cursor", length)) % max(capacity, 1)
    written = int(meta.get("write_count", length))
    wrapped = length == capacity and written > capacity
    if wrapped:
        order = np.concatenate([np.arange(cursor, capacity), np.arange(cursor)])
    else:
        data, order = data[:length], np.arange(length)  # a view: the filled slots
    return Dataset(DUMP, path, data, order, capacity, wrapped)


def _npz(path: str) -> Dataset:
    try:
        arrays = np.load(path)  # a zip: read into memory, key by key
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read {path} as .npz: {err}") from err
    return _arrays(path, NPZ, {name: arrays[name] for name in arrays.files})


def _arrays(path: str, fmt: str, arrays: dict) -> Dataset:
    """Arrays named by key path (``"next/observation"``), one entry per row."""
    if not arrays:
        raise InputError(f"{path} holds no arrays.")
    n = {name: a.shape[0] if a.ndim else 0 for name, a in arrays.items()}
    if len(set(n.values())) != 1:
        raise InputError(
            f"{path}: the arrays have different numbers of rows {n}; every array must hold "
            "one entry per transition."
        )
    rows = next(iter(n.values()))
    env = arrays.pop(ENV_ARRAY, None)  # cleanbuf clean's env index: not data
    if not arrays:
        raise InputError(f"{path} holds no arrays but {ENV_ARRAY}.")
    tensors = {tuple(name.split("/")): torch.from_numpy(a) for name, a in arrays.items()}
    data = TensorDict(tensors, batch_size=[rows])
    return Dataset(fmt, path, data, np.arange(rows), rows, False, env)


def _hdf5(path: str) -> Dataset:
    try:
        import h5py
    except ImportError as err:
        raise InputError(f"{path}: reading HDF5 needs h5py; pip install 'cleanbuf[hdf5]'.") from err
    arrays: dict = {}
    try:
        with h5py.File(path, "r") as f:
            f.visititems(
                lambda name, obj: (
                    arrays.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None
                )
            )
    except OSError as err:
        raise InputError(f"cannot read {path} as HDF5: {err}") from err
    return _arrays(path, HDF5, arrays)


def _marked(folder: str) -> dict:
    env, mark = read_dir(folder)
    return {"env": env, "mark": mark}


def read(path: str) -> Dataset:
    """Reads a dump directory, a memmap directory, a ``.npz`` or an HDF5 file.

    Raises:
        InputError: the path does not exist or is in no known format.

    Examples:
        >>> import tempfile, torch
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(4))
        >>> _ = rb.extend(TensorDict({"obs": torch.arange(6.0)}, [6]))
        >>> d = tempfile.mkdtemp(); rb.dumps(d)
        >>> ds = read(d)
        >>> ds.format, ds.wrapped, ds.data["obs"][torch.as_tensor(ds.order)].tolist()
        ('torchrl-dump', True, [2.0, 3.0, 4.0, 5.0])
    """
    if not os.path.exists(path):
        raise InputError(f"{path} does not exist.")
    if os.path.isdir(path):
        if os.path.isdir(os.path.join(path, "storage")):
            return dataclasses.replace(_dump(path), **_marked(path))
        if os.path.exists(os.path.join(path, "meta.json")):
            data = _load_memmap(path)
            n = data.shape[0]
            return Dataset(MEMMAP, path, data, np.arange(n), n, False, **_marked(path))
    elif path.endswith(".npz"):
        return _npz(path)
    elif path.endswith(HDF5_SUFFIXES):
        return _hdf5(path)
    raise InputError(
        f"{path} is in no format cleanbuf reads: a TorchRL replay-buffer dump (a directory "
        "written by rb.dumps, with storage/ and writer/), a TensorDict memmap directory (with "
        "meta.json), a .npz file of arrays named by key ('next/observation'), or an HDF5 "
        "file (.h5, .hdf5) of datasets named the same way."
    )


class Collect:
    """Keeps the rows in memory (cleaning to no path): :attr:`rows` after commit."""

    def __init__(self):
        self.parts: list = []
        self.rows: TensorDictBase | None = None

    def write(self, rows: TensorDictBase, env: Any = None) -> None:
        """Appends rows (``env``, their env index, is for a file writer only)."""
        if rows.batch_size[0]:
            self.parts.append(rows)

    def commit(self, mark: dict | None = None) -> None:
        """Joins the rows (``mark`` is for a file writer only)."""
        self.rows = torch.cat(self.parts) if self.parts else TensorDict(batch_size=[0])

    def abort(self) -> None:
        """Drops the rows."""
        self.parts = []


def from_buffer(rb: Any, tmp: str) -> Dataset:
    """A TorchRL replay buffer (or its storage) as a :class:`Dataset`.

    It is dumped (``rb.dumps``) into ``tmp`` and read back: the write order
    of a wrapped buffer is known only to its writer, which the dump saves.
    """
    from torchrl.data import ReplayBuffer

    if not isinstance(rb, ReplayBuffer):
        rb = ReplayBuffer(storage=rb)  # a storage: rows in slot order, none overwritten
    with warnings.catch_warnings():
        # A buffer filled by rb.loads has no last cursor: TorchRL warns that
        # its save hooks may shift rows wrongly. The dump read here uses no
        # such hook (the order comes from the writer's cursor), so the
        # warning tells the user nothing.
        warnings.filterwarnings("ignore", message="last_cursor is None")
        rb.dumps(tmp)
    return read(tmp)


class Writer:
    """Writes rows to a new dataset in a format, into a temporary directory.

    :meth:`commit` moves it to its place in one rename; until then nothing
    is at ``dst``, and :meth:`abort` (or a crash) leaves nothing there
    either (the temporary directory sits next to ``dst``, named
    ``.DST.cleanbuf-tmp-*``).

    Rows go to a TorchRL ``LazyMemmapStorage`` (memory maps: the memory used
    stays that of the rows being written), one slice per write, whose
    files are the output's: a dump's ``storage/`` (``rb.dumps`` then finds
    them in place and copies nothing) or a memmap directory (cut to the
    rows written at the end). A ``.npz`` or HDF5 file is read whole from
    it: those formats are for data that fits in memory.

    With the rows goes each row's env index (:mod:`cleanbuf.offline._marker`).
    A dump is laid out for ``capacity`` rows and, when the rows written fit
    ``fit`` (the source buffer's size), cut to ``fit``: ``rb.loads`` reads
    it into a buffer built as the source's was.
    """

    def __init__(
        self, fmt: str, dst: str, capacity: int, force: bool = False, fit: int | None = None
    ):
        from torchrl.data import LazyMemmapStorage, ReplayBuffer

        dst = os.path.abspath(dst)
        if os.path.exists(dst) and not force:
            raise InputError(f"{dst} exists; pass --force (force=True) to replace it.")
        self.fmt, self.dst, self.n, self.fit = fmt, dst, 0, fit
        self.capacity: int | None = None  # a dump's, once committed: rb.loads needs it
        self.env: list[np.ndarray] = []  # each row's env index, per write
        self.done: list[np.ndarray] = []  # each row's done flag, per write
        self._leaves: dict | None = None  # the output's files as plain tensors, once laid out
        parent = os.path.dirname(dst)
        os.makedirs(parent, exist_ok=True)
        self.tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.cleanbuf-tmp-", dir=parent)
        self.out = os.path.join(self.tmp, "out")
        rows_dir = {DUMP: os.path.join(self.out, "storage"), MEMMAP: self.out}.get(fmt)
        self.rb = ReplayBuffer(
            storage=LazyMemmapStorage(
                max(capacity, 1), scratch_dir=rows_dir or os.path.join(self.tmp, "rows")
            )
        )

    def write(self, rows: TensorDictBase, env: Any = None) -> None:
        """Appends rows (a slice write: ``rb.extend`` scatters by index, 2x slower).

        ``env`` holds their env index (-1 where unknown).

        Leaves the cleaner already gathered into their place (:meth:`slot`)
        are not copied onto themselves; the last row goes through the
        storage, which then counts the rows written.
        """
        m = rows.batch_size[0]
        if not m:
            return
        lo, hi = self.n, self.n + m
        self.env.append(np.full(m, -1, np.int32) if env is None else np.asarray(env, np.int32))
        self.done.append(_done_of(rows))
        fields = plain_leaves(rows) if self._leaves else None
        if fields is not None and fields.keys() == self._leaves.keys():
            for key, value in fields.items():
                dest = self._leaves[key][lo:hi]
                if value.data_ptr() != dest.data_ptr() or value.shape != dest.shape:
                    dest.copy_(value)
            self.rb.storage.set(slice(hi - 1, hi), rows[m - 1 :])
        else:
            self.rb.storage.set(slice(lo, hi), rows)
        self.n = hi

    def slot(self, key: Any, rows: int) -> torch.Tensor | None:
        """The output's next ``rows`` rows of ``key``, to gather into; None if not laid out."""
        storage = self.rb.storage
        if not storage.initialized or self.n + rows > storage.max_size:
            return None
        if self._leaves is None:
            tensors = storage_tensors(storage)
            self._leaves = {} if tensors is None else plain_leaves(tensors)
        leaf = self._leaves.get(key)
        return None if leaf is None else leaf[self.n : self.n + rows]

    def _capacity(self) -> int:
        """The rows the dump holds room for: ``fit`` if the rows fit it, else as laid out."""
        size = self.rb.storage.max_size
        return self.fit if self.fit is not None and self.n <= self.fit < size else size

    def commit(self, mark: dict | None = None) -> None:
        """Finishes the dataset (with ``mark``, cleanbuf's marker) and moves it to ``dst``."""
        out = self.out
        if not self.n:
            raise InputError(f"no row is left to write to {self.dst}; nothing was written.")
        env = np.concatenate(self.env)
        mark = {**(mark or {}), "rows": self.n, "done": done_digest(np.concatenate(self.done))}
        if self.fmt == DUMP:
            capacity, size = self._capacity(), self.rb.storage.max_size
            self.capacity = capacity
            self.rb.dumps(out)
            del self.rb  # unmap the files before they are cut
            if capacity < size:
                _cut_rows(os.path.join(out, "storage"), size, capacity)
            with open(os.path.join(out, "writer", "metadata.json"), "w") as f:
                json.dump({"cursor": self.n % capacity, "write_count": self.n}, f)
            write_dir(out, env, mark)
        elif self.fmt == MEMMAP:
            capacity = self.rb.storage.max_size
            del self.rb  # unmap the files before they are cut
            _cut_rows(out, capacity, self.n)
            write_dir(out, env, mark)
        else:
            stored = self.rb.storage.get(slice(0, self.n))
            arrays = {"/".join(_tuple(k)): v.numpy() for k, v in stored.items(True, True)}
            arrays[ENV_ARRAY] = env
            out = os.path.join(self.tmp, "out")
            if self.fmt == NPZ:
                with open(out, "wb") as f:
                    np.savez(f, **arrays)
            else:
                import h5py

                with h5py.File(out, "w") as f:
                    for name, a in arrays.items():
                        f.create_dataset(name, data=a)
        if os.path.lexists(self.dst):  # --force: the old one goes only now
            os.replace(self.dst, os.path.join(self.tmp, "old"))
        os.replace(out, self.dst)
        self.abort()

    def abort(self) -> None:
        """Removes the temporary directory."""
        shutil.rmtree(self.tmp, ignore_errors=True)


def _cut_rows(path: str, capacity: int, n: int) -> None:
    """Cuts a TensorDict memmap directory of ``capacity`` rows to its first ``n``.

    Each file holds its tensor row-major, so the first ``n`` rows are its
    first bytes: the files are truncated and the shapes in every
    ``meta.json`` rewritten.
    """
    for folder, _, files in os.walk(path):
        if "meta.json" not in files:
            continue
        meta = _json(os.path.join(folder, "meta.json"))
        for name, entry in meta.items():
            if isinstance(entry, dict) and entry.get("shape", [None])[:1] == [capacity]:
                row = math.prod(entry["shape"][1:])
                dtype = getattr(torch, str(entry["dtype"]).replace("torch.", ""))
                os.truncate(os.path.join(folder, f"{name}.memmap"), n * row * dtype.itemsize)
                entry["shape"] = [n, *entry["shape"][1:]]
        if meta.get("shape", [None])[:1] == [capacity]:
            meta["shape"] = [n, *meta["shape"][1:]]
        with open(os.path.join(folder, "meta.json"), "w") as f:
            json.dump(meta, f)


def _done_of(rows: TensorDictBase) -> np.ndarray:
    """Each row's done flag, as the audit reads it (any done entry of the row)."""
    keys = {_tuple(k) for k in rows.keys(True, True)}
    key = next((k for k in DONE_KEYS if k in keys), None)
    m = rows.batch_size[0]
    if key is None:
        return np.zeros(m, bool)
    return rows.get(key).reshape(m, -1).any(1).numpy()


def _tuple(key: Any) -> tuple:
    return key if isinstance(key, tuple) else (key,)
