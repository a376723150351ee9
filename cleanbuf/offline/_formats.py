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
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from cleanbuf.engine._errors import CleanbufError, CleanbufWarning, InputError
from cleanbuf.engine._keys import DONE_KEYS
from cleanbuf.engine._orientation import time_axis
from cleanbuf.offline._axes import check_layout, env_after_env, flatten
from cleanbuf.offline._compat import lay_out, storage_tensors
from cleanbuf.offline._marker import (
    ENV_ARRAY,
    done_digest,
    env_if_fresh,
    read_dir,
    write_dir,
)
from cleanbuf.offline._names import FLAG_ROLES, ROLE_KEYS, check_keys, need, obs_pair, roles
from cleanbuf.offline._scratch import (
    check_free,
    clear_leftovers,
    make,
    remove,
    reserve,
    size_text,
    space_for,
)

DUMP, MEMMAP, NPZ, HDF5 = "torchrl-dump", "memmap", "npz", "hdf5"
HDF5_SUFFIXES = (".h5", ".hdf5")
# Suffixes of files cleanbuf does not write: a DST named so is refused
# rather than written as a directory that its name belies.
OTHER_FILE_SUFFIXES = (
    ".npy", ".pt", ".pth", ".pkl", ".pickle", ".zip", ".tar", ".gz", ".json", ".csv",
    ".parquet", ".zarr", ".txt",
)  # fmt: skip
WRITTEN = (
    "a .npz file (DST ending .npz), an HDF5 file (.h5, .hdf5), or a directory (DST ending "
    "with a slash, or any name when SRC is a directory: a TorchRL dump, or a TensorDict "
    "memmap directory when SRC is one)"
)


class OutputCheckError(CleanbufError):
    """The output of ``cleanbuf clean``, read back, is not what was written."""


def output_format(dst: str, src_format: str) -> str:
    """The format ``dst`` names: its suffix for a file, else a directory.

    A directory is a TorchRL dump, or a memmap directory when SRC is one.
    A name without a file suffix is a directory where SRC is one, and is
    refused where SRC is a file: cleanbuf reads a file by its suffix, so
    the output could not be read back.

    Raises:
        InputError: ``dst`` names a file format cleanbuf does not write,
            or no format for a file source.

    Examples:
        >>> output_format("clean.h5", NPZ), output_format("runs/rb_clean", MEMMAP)
        ('hdf5', 'memmap')
        >>> output_format("runs/rb_clean/", NPZ), output_format("runs/rb.v2", DUMP)
        ('torchrl-dump', 'torchrl-dump')
        >>> output_format("clean.pkl", NPZ)
        Traceback (most recent call last):
        ...
        cleanbuf.engine._errors.InputError: DST clean.pkl names a format cleanbuf does not ...
    """
    suffix = os.path.splitext(dst.rstrip("/" + os.sep))[1].lower()
    if suffix == ".npz":
        return NPZ
    if suffix in HDF5_SUFFIXES:
        return HDF5
    if suffix in OTHER_FILE_SUFFIXES:
        raise InputError(f"DST {dst} names a format cleanbuf does not write; it writes {WRITTEN}.")
    directory = MEMMAP if src_format == MEMMAP else DUMP
    if dst.endswith(("/", os.sep)) or src_format in (DUMP, MEMMAP):
        return directory
    raise InputError(
        f"DST {dst} names no format: name it {dst.rstrip('/')}.npz (a .npz file), .h5 (HDF5) "
        f"or {dst.rstrip('/')}/ (a TorchRL dump directory); cleanbuf reads a file by its suffix."
    )


@dataclasses.dataclass(frozen=True)
class Shape:
    """How the user says stored arrays are laid out and named (None: from the data).

    Attributes:
        layout: ``"time_first"`` (``[T, E, ...]``), ``"time_last"``
            (``[E, T, ...]``) or ``"flat"`` (``[N, ...]`` rows).
        envs: with ``"flat"``, the rows are this many envs' rows, one env
            after the other.
        keys: ``{role: name}`` for arrays named otherwise than a known set.
    """

    layout: str | None = None
    envs: int | None = None
    keys: dict | None = None

    def __post_init__(self):
        check_layout(self.layout, self.envs)
        object.__setattr__(self, "keys", check_keys(self.keys) or None)

    def flags(self) -> str:
        """The command-line flags that say this (``" --layout time_first"``).

        Examples:
            >>> Shape("flat", 4, {"reward": "r"}).flags()
            ' --layout flat --envs 4 --key reward=r'
        """
        out = "" if self.layout is None else f" --layout {self.layout}"
        out += "" if self.envs is None else f" --envs {self.envs}"
        return out + "".join(f" --key {r}={n}" for r, n in (self.keys or {}).items())

    def kwargs(self) -> str:
        """The same as Python keyword arguments (``', layout="time_first"'``)."""
        out = "" if self.layout is None else f', layout="{self.layout}"'
        out += "" if self.envs is None else f", envs={self.envs}"
        return out + ("" if not self.keys else f", keys={self.keys!r}")


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
            :mod:`cleanbuf.offline._marker`), or where a ``[T, E]`` /
            ``[E, T]`` rectangle gave it; None elsewhere.
        names: TorchRL key -> the source's name, for arrays read under
            another name (``obs``, ``observations``, ...): the writer
            gives them their names back. casts: TorchRL key -> the source
            dtype of done flags stored as numbers.
        layout: ``"flat"``, ``"time_first"`` or ``"time_last"``, the
            source's leading dims; None where the data did not tell
            (``undecided`` says why: the audit then cannot tell).
        layout_why: the evidence for the layout. name_set: the names
            the arrays use (``"torchrl"``, ``"cleanrl"``, ``"offline-rl"``,
            ``"sb3"``). shape: what the user said (:class:`Shape`).
    """

    format: str
    path: str
    data: TensorDictBase
    order: np.ndarray
    capacity: int
    wrapped: bool
    env: np.ndarray | None = None
    mark: dict | None = None
    names: dict = dataclasses.field(default_factory=dict)
    casts: dict = dataclasses.field(default_factory=dict)
    layout: str | None = "flat"
    layout_why: str = ""
    undecided: str | None = None
    name_set: str = "torchrl"
    shape: Shape = dataclasses.field(default_factory=Shape)

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
    """A JSON object from a file; an :class:`InputError` naming the file if it is none."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError) as err:
        raise InputError(f"cannot read {path}: {err}") from err
    if not isinstance(value, dict):
        raise InputError(
            f"{path} holds a JSON {type(value).__name__}, not the object (dict) it should: "
            "the file is damaged. Write or copy it again."
        )
    return value


def _int_entry(meta: dict, key: str, path: str, default: int, what: str) -> int:
    """An integer entry of a metadata file, ``default`` when absent.

    Examples:
        >>> _int_entry({"cursor": 3}, "cursor", "writer/metadata.json", 0, "a slot")
        3
        >>> _int_entry({"cursor": "x7"}, "cursor", "writer/metadata.json", 0, "a slot")
        Traceback (most recent call last):
        ...
        cleanbuf.engine._errors.InputError: writer/metadata.json: 'cursor' is 'x7', not an ...
    """
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InputError(
            f"{path}: {key!r} is {value!r}, not an integer >= 0 ({what}): the file is damaged, "
            "and without it the order of the rows is unknown. Dump the buffer again "
            "(rb.dumps), or copy the file from the original dump."
        )
    return value


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
            if not isinstance(dtype, torch.dtype):
                continue
            if not os.path.exists(filename):
                raise InputError(
                    f"{filename} is missing: {os.path.join(folder, 'meta.json')} lists {name!r} "
                    f"(shape {entry['shape']}, {entry['dtype']}) but its file is not there. "
                    "The directory is partly copied: copy it again."
                )
            shape = entry["shape"]
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise InputError(
                    f"{os.path.join(folder, 'meta.json')}: the shape of {name!r} is {shape!r}, "
                    "not a list of sizes: the file is damaged. Copy the directory again."
                )
            need = math.prod(shape) * dtype.itemsize
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


COMPACT_STATE = "cleanbuf_compact.pt"
"""In a dump's ``storage/``: a ``cleanbuf.CompactStorage``'s links and side table."""


def _next_observations(data: TensorDictBase, path: str) -> TensorDictBase:
    """A compact storage's rows with each ``("next", k)`` rebuilt, as the storage's ``get`` does.

    A ``cleanbuf.CompactStorage`` dumps each observation once and, in
    ``path``, per slot a link (``>= 0``: the slot whose observation is this
    row's next one; ``<= -2``: side-table entry ``-2 - link``; ``-1``: an
    empty slot) and the side table of next observations, one tensor per
    observation key.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        keys = [tuple(k) for k in state["observation_keys"] or []]
        link = state["link"].long() if keys else None
        side = state["side"]
    except Exception as err:
        raise InputError(
            f"{path}: the links of a cleanbuf.CompactStorage dump, not readable "
            f"({type(err).__name__}: {err}). Dump the buffer again (rb.dumps)."
        ) from err
    data = data.clone(recurse=False)
    for key in keys:
        obs = data.get(key)
        if link is None or link.shape[0] != obs.shape[0]:
            raise InputError(
                f"{path}: links for {0 if link is None else link.shape[0]} slots, but the "
                f"storage has {obs.shape[0]}: the file does not belong to this dump. Dump "
                "the buffer again (rb.dumps)."
            )
        table = side[keys.index(key)]
        value = torch.zeros_like(obs)
        linked = (link >= 0).nonzero().flatten()
        value[linked] = obs[link[linked]]
        in_side = (link <= -2).nonzero().flatten()
        value[in_side] = table[-2 - link[in_side]]
        data.set(("next", *key), value)
    return data


def _dump(path: str) -> Dataset:
    storage_dir = os.path.join(path, "storage")
    data = _load_memmap(storage_dir)
    if os.path.exists(os.path.join(storage_dir, COMPACT_STATE)):
        data = _next_observations(data, os.path.join(storage_dir, COMPACT_STATE))
    capacity = int(data.shape[0])
    stored = os.path.join(storage_dir, "storage_metadata.json")
    length = _int_entry(_json(stored), "len", stored, capacity, "the slots filled")
    two_d = data.batch_dims == 2 and not length % max(int(data.shape[-1]), 1)
    if length > capacity and not (two_d and length // data.shape[-1] <= capacity):
        raise InputError(
            f"{stored}: 'len' is {length}, more than the {capacity} slots of the storage: the "
            "file does not belong to this storage. Dump the buffer again (rb.dumps)."
        )
    writer = os.path.join(path, "writer", "metadata.json")
    meta = _json(writer) if os.path.exists(writer) else {}
    if length > capacity and data.batch_dims == 2 and not length % data.shape[1]:
        return _dump_2d(path, data, length // data.shape[1], meta, writer)
    where = "the slot the next write goes to, so where the oldest row is"
    cursor = _int_entry(meta, "cursor", writer, length, where) % max(capacity, 1)
    written = _int_entry(meta, "write_count", writer, length, "the rows ever written")
    wrapped = length == capacity and written > capacity
    if wrapped:
        order = np.concatenate([np.arange(cursor, capacity), np.arange(cursor)])
    else:
        data, order = data[:length], np.arange(length)  # a view: the filled slots
    return Dataset(DUMP, path, data, order, capacity, wrapped)


def _dump_2d(path: str, data: TensorDictBase, steps: int, meta: dict, writer: str) -> Dataset:
    """A dump of a storage built with ``ndim=2``: ``[time slots, envs]``, read as ``[T, E]``.

    TorchRL writes an ``[E, T]`` batch into such a storage along its first
    dimension (time), one env per column; ``len`` counts elements, the
    writer's cursor and count time slots. The filled slots, oldest first
    (from the cursor once it wrapped), are read as a ``time_first``
    rectangle, its layout checked against the chains as any told layout.
    """
    capacity = int(data.shape[0])
    where = "the time slot the next write goes to, so where the oldest step is"
    cursor = _int_entry(meta, "cursor", writer, steps, where) % max(capacity, 1)
    written = _int_entry(meta, "write_count", writer, steps, "the time steps ever written")
    wrapped = steps == capacity and written > capacity
    order = np.r_[cursor:capacity, 0:cursor] if wrapped else np.arange(steps)
    rect = data[torch.as_tensor(order)]
    ds = from_tensordict(path, DUMP, rect, Shape("time_first"))
    why = f"a storage of ndim=2 ([time, env] slots); {ds.layout_why}"
    return dataclasses.replace(ds, wrapped=wrapped, layout_why=why)


def _npz(path: str, shape: Shape) -> Dataset:
    """A ``.npz`` file, read into memory; never unpickled."""
    head = _head(path, "a .npz archive")
    if not head.startswith(b"PK"):
        what = "a single .npy array" if head.startswith(b"\x93NUMPY") else "not a zip archive"
        raise InputError(
            f"{path} is not a .npz file ({what}; np.savez writes a zip archive of .npy arrays, "
            "named by key). Save the data with np.savez."
        )
    arrays, name = {}, None
    try:
        with np.load(path, allow_pickle=False) as archive:  # a zip: read key by key
            for name in archive.files:
                arrays[name] = archive[name]
                if not isinstance(arrays[name], np.ndarray):  # numpy gives bytes for a non-.npy
                    raise ValueError(f"{name!r} is not a .npy array")
    except ValueError as err:
        if "pickle" in str(err):  # numpy's message advises allow_pickle: never passed on
            raise InputError(
                f"{path}: array {name!r} holds Python objects (dtype object), not numbers. "
                "cleanbuf reads numeric arrays only and never unpickles a file (that can run "
                "any code): save it with numeric arrays."
            ) from None
        raise _damaged(path, ".npz", err) from err
    except Exception as err:  # zipfile, zlib and numpy raise many kinds on a damaged file
        raise _damaged(path, ".npz", err) from err
    return _arrays(path, NPZ, _numeric(path, arrays), shape)


def _head(path: str, what: str) -> bytes:
    """The first bytes of a file; an :class:`InputError` if it is empty."""
    with open(path, "rb") as f:
        head = f.read(8)
    if not head:
        raise InputError(
            f"{path} is empty (0 bytes), not {what}: an interrupted save or copy leaves such "
            "a file. Save or copy it again."
        )
    return head


def _damaged(path: str, what: str, err: BaseException) -> InputError:
    """The error for a file of a known format that cannot be read whole."""
    said = str(err) if len(str(err)) <= 200 else f"{str(err)[:200]}..."
    return InputError(
        f"{path} is a damaged {what} file, truncated or corrupted ({type(err).__name__}: "
        f"{said}); an interrupted save or copy leaves such a file. Save or copy it again."
    )


def _numeric(path: str, arrays: dict) -> dict:
    """The arrays, each of numbers or booleans; an :class:`InputError` naming one that is not."""
    for name, a in arrays.items():
        if a.dtype.kind not in "biuf":
            raise InputError(
                f"{path}: array {name!r} has dtype {a.dtype}, not numbers or booleans; "
                "cleanbuf reads transitions of numeric arrays. Store it as numbers, or leave it "
                "out of the file."
            )
    return arrays


def _arrays(path: str, fmt: str, arrays: dict, shape: Shape | None = None) -> Dataset:
    """Arrays named by key path (``"next/observation"``) as rows in write order.

    Their names are mapped to TorchRL's keys (:mod:`cleanbuf.offline._names`),
    and leading dims ``[T, E]`` or ``[E, T]`` are read as flat rows, step
    after step, each with its env (:mod:`cleanbuf.offline._axes`).
    """
    shape = shape or Shape()
    if not arrays:
        raise InputError(f"{path} holds no arrays.")
    env = arrays.pop(ENV_ARRAY, None)  # cleanbuf clean's env index: not data
    if not arrays:
        raise InputError(f"{path} holds no arrays but {ENV_ARRAY}.")
    n = {name: a.shape[0] if a.ndim else 0 for name, a in arrays.items()}
    if len(set(n.values())) != 1:
        raise InputError(
            f"{path}: the arrays have different numbers of rows {n}; every array must hold "
            "one entry per transition."
        )
    if not any(n.values()):
        raise InputError(
            f"{path} holds 0 rows (every array is empty: {sorted(arrays)}): nothing to audit "
            "or clean."
        )
    which, renamed = roles(list(arrays), shape.keys)
    arrays = {renamed.get(name, name): a for name, a in arrays.items()}
    need(set(arrays), path, renamed)
    convention = _sb3_convention(arrays, renamed, which, shape)
    note = "; ".join(filter(None, [convention, _done_as_data(arrays, renamed, shape, path)]))
    names = {_tuple(tuple(k.split("/"))): src for src, k in renamed.items()}
    casts = {}
    for name in [ROLE_KEYS[r] for r in FLAG_ROLES if ROLE_KEYS[r] in arrays]:
        arrays[name], cast = _flags(arrays[name], name, path)
        if cast is not None:
            casts[tuple(name.split("/"))] = cast
    dims = _leading(arrays, shape, path)
    layout, why, undecided = "flat", "", None
    if dims == 2:
        arrays, env, layout, why, undecided = _rectangle(arrays, shape, path)
    elif shape.envs is not None:
        arrays = env_after_env(arrays, shape.envs, path)
        arrays, env, _ = flatten(arrays, time=1)
        why = f"{shape.envs} envs' rows one env after the other (as told)"
    why = "; ".join(filter(None, [why, note]))
    rows = len(next(iter(arrays.values())))
    tensors = {tuple(name.split("/")): torch.from_numpy(a) for name, a in arrays.items()}
    data = TensorDict(tensors, batch_size=[rows])
    return Dataset(
        fmt, path, data, np.arange(rows), rows, False, env,
        names=names, casts=casts, layout=layout, layout_why=why, undecided=undecided,
        name_set=which, shape=shape,
    )  # fmt: skip


def _sb3_convention(arrays: dict, renamed: dict, which: str, shape: Shape) -> str:
    """Reads Stable-Baselines3's ``dones`` / ``timeouts`` by the convention that filled them.

    SB3's own algorithms store ``dones = terminated | truncated`` and the
    truncations again in ``timeouts``; CleanRL's DQN / SAC / TD3 call
    ``rb.add(..., terminations, infos)``, so ``dones`` holds the
    terminations only and ``timeouts`` (from the infos'
    ``TimeLimit.truncated``) the truncations. Either way an episode ends at
    ``dones | timeouts`` and terminates at ``dones & ~timeouts``. A
    ``timeouts`` row outside ``dones`` happens only in CleanRL's
    convention: ``dones`` is then read as the terminations (and written
    back under its name), so the episode ends are their or.

    Returns:
        The note for the report: the convention found.

    Examples:
        >>> arrays = {"next/done": np.array([1, 0, 0.0]), "next/truncated": np.array([0, 1, 0.0])}
        >>> renamed = {"dones": "next/done", "timeouts": "next/truncated"}
        >>> _sb3_convention(arrays, renamed, "sb3", Shape())[:32]
        'CleanRL convention (dones = term'
        >>> sorted(arrays), renamed["dones"]
        (['next/terminated', 'next/truncated'], 'next/terminated')
    """
    done, term, trunc = (ROLE_KEYS[r] for r in ("done", "terminated", "truncated"))
    told = set(shape.keys or {})
    source = {v: k for k, v in renamed.items()}
    if which != "sb3" or told & {"done", "terminated", "truncated"}:
        return ""
    if source.get(done) != "dones" or source.get(trunc) != "timeouts" or term in arrays:
        return ""
    dones = np.asarray(arrays[done]) != 0
    timeouts = (np.asarray(arrays[trunc]) != 0).reshape(dones.shape)
    if not timeouts.any():
        return (
            "timeouts never set: the episode ends are dones (SB3's and CleanRL's ways agree; "
            "a buffer built with handle_timeout_termination=False stores no truncation)"
        )
    outside = int((timeouts & ~dones).sum())
    if not outside:
        return (
            "SB3 convention (dones = terminated | truncated, timeouts the truncations): "
            "episode ends = dones"
        )
    arrays[term] = arrays.pop(done)
    renamed["dones"] = term
    return (
        f"CleanRL convention (dones = terminations only: {outside} timeouts row(s) outside "
        "dones): episode ends = dones | timeouts, terminations = dones & ~timeouts"
    )


def _done_as_data(arrays: dict, renamed: dict, shape: Shape, path: str) -> str:
    """Reads a done array that contradicts ``terminated`` / ``truncated`` as data.

    A transition's done is ``terminated | truncated``. An array named as
    the done flag that says otherwise means something else: CleanRL's PPO
    stores in ``dones`` whether each row's observation *starts* an episode
    (its ``next_done``, one step later). Read as the done flag it would give
    a confident and wrong verdict; it is kept as data, under its own name,
    and the note says so. With TorchRL's names (``next/done`` cannot be
    kept under its name as data) it is an error naming the fix. Where only
    one of ``terminated`` / ``truncated`` is stored (Stable-Baselines3's
    ``timeouts``), done must cover it.

    Returns:
        The note for the report ("" when done agrees, or is absent).
    """
    done = ROLE_KEYS["done"]
    parts = [ROLE_KEYS[r] for r in ("terminated", "truncated") if ROLE_KEYS[r] in arrays]
    if done not in arrays or not parts or "done" in (shape.keys or {}):
        return ""
    d = np.asarray(arrays[done]) != 0
    ends = [(np.asarray(arrays[k]) != 0).reshape(d.shape) for k in parts]
    either = np.logical_or.reduce(ends)
    bad = int((d != either).sum() if len(parts) == 2 else (either & ~d).sum())
    if not bad:
        return ""
    source = {v: k for k, v in renamed.items()}
    told = " | ".join(source.get(k, k) for k in parts)
    if done not in source:
        raise InputError(
            f"{path}: {done} disagrees with {told} on {bad} row(s); a transition's done is "
            f"terminated | truncated. Fix: store {done} as their or, or store under another "
            "name an array that means something else (whether a row starts an episode), or "
            f"read {done} alone as the episode ends: --done-key {done} (in Python "
            f"keys={{'done': '{done}'}}, done_key=('next', 'done'))."
        )
    name = source.pop(done)
    arrays[name] = arrays.pop(done)
    del renamed[name]
    return (
        f"{name} disagrees with {told} on {bad} row(s) (as CleanRL PPO's next_done does): "
        f"kept as data; done read from {told}"
    )


def _flags(a: np.ndarray, name: str, path: str) -> tuple[np.ndarray, Any]:
    """Done flags as bool (SB3 stores them as float 0/1), and the source dtype."""
    if a.dtype == np.bool_:
        return a, None
    if a.dtype.kind in "iuf" and np.isin(a, (0, 1)).all():
        return a.astype(bool), a.dtype
    raise InputError(
        f"{path}: {name} must hold done flags (bool, or numbers 0/1); got dtype {a.dtype} "
        "with other values. Name the right array with --key done=NAME (keys={'done': NAME})."
    )


def _leading(arrays: dict, shape: Shape, path: str) -> int:
    """The number of leading dims every array shares: 1 (rows) or 2 (a rectangle)."""
    flag = next(a for k, a in arrays.items() if k in [ROLE_KEYS[r] for r in FLAG_ROLES])
    dims = flag.ndim - 1 if flag.ndim > 1 and flag.shape[-1] == 1 else flag.ndim
    if shape.layout is not None and dims in (1, 2) and dims != (shape.layout != "flat") + 1:
        raise _contradicted(arrays, shape, dims, list(flag.shape), path)
    if shape.layout == "flat":
        dims = 1
    elif shape.layout is not None:
        dims = 2
    if dims not in (1, 2):
        raise InputError(
            f"{path}: the done flags have shape {list(flag.shape)}; cleanbuf reads rows [N] or "
            "rectangles [T, E] / [E, T] (one flag per row). Reshape the arrays to one of those."
        )
    lead = {k: tuple(a.shape[:dims]) for k, a in arrays.items()}
    first = tuple(flag.shape[:dims])
    bad = {k: list(s) for k, s in lead.items() if s != first}
    if bad:
        raise InputError(
            f"{path}: every array must start with the same {dims} dims as the done flags "
            f"{list(first)} (one entry per transition); these differ: {bad}."
        )
    return dims


def _evidence(arrays: dict) -> tuple[int | None, str]:
    """The time axis of ``[A, B]`` arrays as their chains show it, and why (see ``time_axis``)."""
    done = np.zeros(next(iter(arrays.values())).shape[:2], np.bool_)
    for r in FLAG_ROLES:
        if ROLE_KEYS[r] in arrays:
            done |= arrays[ROLE_KEYS[r]].reshape(done.shape)
    obs, next_obs = obs_pair(arrays)
    return time_axis(arrays[obs], arrays[next_obs], done)


def _flag(layout: str) -> str:
    return f"--layout {layout} (layout={layout!r})"


def _contradicted(arrays: dict, shape: Shape, dims: int, flag: list, path: str) -> InputError:
    """The error for a declared layout whose leading dims the done flags contradict.

    ``flat`` on ``[A, B]`` flags (a rectangle read as rows would give each
    row ``B`` flags), or ``time_first`` / ``time_last`` on ``[N]`` flags.
    The message names the layout the data points to.
    """
    told = _flag(shape.layout)
    if dims == 1:
        return InputError(
            f"{path}: {told} says the arrays are a rectangle [T, E] / [E, T], but the done "
            f"flags have shape {flag}, one flag per row: the data is flat rows. Pass "
            f"{_flag('flat')} (with --envs N / envs=N if N envs' rows come one env after the "
            "other), or leave the layout out to read it from the data."
        )
    time, why = _evidence(arrays)
    if time is None:
        points = f"a rectangle: --layout time_first or time_last (layout=...); {why}"
    else:
        layout = ("time_first", "time_last")[time]
        points = f"{'[T, E]' if time == 0 else '[E, T]'} arrays ({why}): pass {_flag(layout)}"
    return InputError(
        f"{path}: {told} says one row per entry of the first axis, but the done flags have "
        f"shape {flag}: the data contradicts it. It reads as {points}, or leave the layout "
        "out to read it from the data."
    )


def _rectangle(arrays: dict, shape: Shape, path: str = "") -> tuple:
    """``[A, B]`` arrays as flat rows with each row's env, the layout told or found.

    A told layout is checked against the chains: where they run along the
    other axis, the error names the layout they point to.
    """
    time, why = _evidence(arrays)
    undecided = None if time is not None else f"the time axis: {why}"
    if shape.layout is not None:
        told = 0 if shape.layout == "time_first" else 1
        if time is not None and time != told:
            layout = ("time_first", "time_last")[time]
            raise InputError(
                f"{path}: {_flag(shape.layout)} says time runs along axis {told}, but the "
                f"data contradicts it: {why}, so time runs along axis {time}: the arrays are "
                f"{'[T, E]' if time == 0 else '[E, T]'}. Pass {_flag(layout)}, or leave the "
                "layout out to read it from the data."
            )
        time, why, undecided = told, "as told" if time is None else f"as told; {why}", None
    rows, env, _ = flatten(arrays, 0 if time is None else time)
    layout = None if time is None else ("time_first", "time_last")[time]
    return rows, env, layout, why, undecided


def _hdf5(path: str, shape: Shape) -> Dataset:
    try:
        import h5py
    except ImportError as err:
        raise InputError(f"{path}: reading HDF5 needs h5py; pip install 'cleanbuf[hdf5]'.") from err
    arrays: dict = {}
    head = _head(path, "an HDF5 file")
    if not head.startswith(b"\x89HDF\r\n\x1a\n"):  # (files with a user block excepted)
        if not h5py.is_hdf5(path):
            raise InputError(
                f"{path} is not an HDF5 file (no HDF5 signature). Save the data with h5py "
                "(datasets named by key, 'next' a group)."
            )
    try:
        with h5py.File(path, "r") as f:
            f.visititems(
                lambda name, obj: (
                    arrays.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None
                )
            )
    except Exception as err:  # h5py raises OSError, KeyError, RuntimeError on damage
        raise _damaged(path, "HDF5", err) from err
    return _arrays(path, HDF5, _numeric(path, arrays), shape)


def _marked(folder: str) -> dict:
    env, mark = read_dir(folder)
    return {"env": env, "mark": mark}


def read(path: str, shape: Shape | None = None) -> Dataset:
    """Reads a dump directory, a memmap directory, a ``.npz`` or an HDF5 file.

    ``shape`` says how the arrays are laid out and named (by default, as
    the data shows it).

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
    shape = shape or Shape()
    if not os.path.exists(path):
        raise InputError(f"{path} does not exist.")
    if os.path.isdir(path):
        if os.path.isdir(os.path.join(path, "storage")):
            ds, marked = _dump(path), _marked(path)
            if marked["env"] is not None:  # written by cleanbuf clean: its env marks say
                return dataclasses.replace(ds, **marked)
            if shape != Shape() and ds.data.batch_dims == 1:
                # Rows told how to read (--layout, --envs, --key): in the order written
                # (the filled slots as they are, or a wrapped buffer's from its oldest).
                rows = ds.data[torch.as_tensor(ds.order)] if ds.wrapped else ds.data
                told = from_tensordict(path, DUMP, rows, shape)
                return dataclasses.replace(told, capacity=ds.capacity, wrapped=ds.wrapped)
            return ds
        if os.path.exists(os.path.join(path, "meta.json")):
            data = _load_memmap(path)
            if data.batch_dims > 1 or shape != Shape() or not _torchrl_named(data):
                # a rectangle or other names: read as arrays (into memory)
                ds = from_tensordict(path, MEMMAP, data, shape)
                marked = _marked(path)
                return ds if marked["env"] is None else dataclasses.replace(ds, **marked)
            n = data.shape[0]
            return Dataset(MEMMAP, path, data, np.arange(n), n, False, **_marked(path))
    elif path.endswith(".npz"):
        return _npz(path, shape)
    elif path.endswith(HDF5_SUFFIXES):
        return _hdf5(path, shape)
    pickled = (
        " A pickled Stable-Baselines3 buffer (model.save_replay_buffer, save_to_pkl) is read "
        "in Python, never unpickled by cleanbuf: rb = stable_baselines3.common.save_util."
        "load_from_pkl(path), then cleanbuf.audit(rb) or cleanbuf.clean(rb)."
        if path.endswith((".pkl", ".pickle"))
        else ""
    )
    raise InputError(
        f"{path} is in no format cleanbuf reads: a TorchRL replay-buffer dump (a directory "
        "written by rb.dumps, with storage/ and writer/), a TensorDict memmap directory (with "
        "meta.json), a .npz file of arrays named by key ('next/observation'), or an HDF5 "
        f"file (.h5, .hdf5) of datasets named the same way.{pickled}"
    )


def _torchrl_named(data: TensorDictBase) -> bool:
    names = ["/".join(_tuple(k)) for k in data.keys(True, True)]
    return roles(names)[0] == "torchrl"


def from_tensordict(path: str, fmt: str, data: TensorDictBase, shape: Shape) -> Dataset:
    """A TensorDict (or a memmap directory's) as arrays: see :func:`from_arrays`."""
    arrays = {"/".join(_tuple(k)): v.numpy() for k, v in data.items(True, True)}
    return _arrays(path, fmt, arrays, shape)


def from_arrays(name: str, arrays: dict, shape: Shape | None = None) -> Dataset:
    """A dict of arrays in memory (``"/"``-named, numpy) as a :class:`Dataset`."""
    return _arrays(name, "dict", dict(arrays), shape)


class Collect:
    """Keeps the rows in memory (cleaning to no path): :attr:`rows` after commit."""

    def __init__(self, names: dict | None = None, casts: dict | None = None):
        self.parts: list = []
        self.env: list = []
        self.names, self.casts = names or {}, casts or {}  # the source's names and dtypes
        self.rows: TensorDictBase | None = None
        self.env_rows: np.ndarray | None = None

    def write(self, rows: TensorDictBase, env: Any = None) -> None:
        """Appends rows (with the source's names) and ``env``, their env index."""
        m = rows.batch_size[0]
        if m:
            self.parts.append(source_names(rows, self.names, self.casts))
            self.env.append(np.full(m, -1, np.int64) if env is None else np.asarray(env))

    def commit(self, mark: dict | None = None, rows: int | None = None) -> None:
        """Joins the rows; they must be ``rows`` (``mark`` is for a file writer only)."""
        self.rows = torch.cat(self.parts) if self.parts else TensorDict(batch_size=[0])
        self.env_rows = np.concatenate(self.env) if self.env else np.zeros(0, np.int64)
        if rows is not None and rows != self.rows.batch_size[0]:
            raise OutputCheckError(
                f"{self.rows.batch_size[0]} rows were collected where {rows} were cleaned "
                "(rows_out). This is a bug in cleanbuf: please report it."
            )

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
    if not getattr(rb.storage, "initialized", True) or not len(rb.storage):
        raise InputError(
            f"{type(rb).__name__}({type(rb.storage).__name__}) holds no rows (len 0): nothing "
            "to audit or clean. Audit or clean a buffer once it holds rows."
        )
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
    ``.DST.cleanbuf-tmp-*``; one that a killed run left is removed by the
    next run for the same ``dst``, which tells ``say``: see
    :mod:`cleanbuf.offline._scratch`). A full disk is a
    :class:`~cleanbuf.offline._scratch.NoSpaceError` naming ``dst`` and the
    space needed: the output's files are allocated before a row is
    written through their memory maps.

    Rows go to a TorchRL ``LazyMemmapStorage`` (memory maps: the memory used
    stays that of the rows being written), one slice per write, whose
    files are the output's: a dump's ``storage/`` (``rb.dumps`` then finds
    them in place and copies nothing) or a memmap directory (cut to the
    rows written at the end). A ``.npz`` or HDF5 file is read whole from
    it: those formats are for data that fits in memory.

    With the rows goes each row's env index (:mod:`cleanbuf.offline._marker`).
    A dump is laid out for ``capacity`` rows and, when the rows written fit
    ``fit`` (the source buffer's size), cut to ``fit``: ``rb.loads`` reads
    it into a buffer built as the source's was. Without ``fit`` (a source
    that is no buffer) it is cut to the rows written. ``keys``, the roles the
    user named (``--key``), are those :meth:`commit` reads the output with.
    """

    def __init__(
        self,
        fmt: str,
        dst: str,
        capacity: int,
        force: bool = False,
        fit: int | None = None,
        names: dict | None = None,
        casts: dict | None = None,
        say: Callable[[str], None] | None = None,
        keys: dict | None = None,
    ):
        from torchrl.data import LazyMemmapStorage, ReplayBuffer

        dst = os.path.abspath(dst)
        if os.path.exists(dst) and not force:
            raise InputError(f"{dst} exists; pass --force (force=True) to replace it.")
        self.fmt, self.dst, self.n, self.fit = fmt, dst, 0, fit
        self.names, self.casts = names or {}, casts or {}  # the source's names and dtypes
        self.keys = keys  # the roles the user named (--key): the output is read back with them
        self.capacity: int | None = None  # a dump's, once committed: rb.loads needs it
        self.env: list[np.ndarray] = []  # each row's env index, per write
        self.done: list[np.ndarray] = []  # each row's done flag, per write
        self._leaves: dict | None = None  # the output's files as plain tensors, once laid out
        self.need = 0  # the bytes the output's files take, once laid out
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        clear_leftovers(dst, say or _warn)
        self.tmp, self._lock = make(dst)
        # A file has its format's suffix: the check in commit reads it back by it.
        self.out = os.path.join(self.tmp, "out" + {NPZ: ".npz", HDF5: ".h5"}.get(fmt, ""))
        self.rows_dir = {DUMP: os.path.join(self.out, "storage"), MEMMAP: self.out}.get(
            fmt, os.path.join(self.tmp, "rows")
        )
        try:
            storage = LazyMemmapStorage(max(capacity, 1), scratch_dir=self.rows_dir)
            self.rb = ReplayBuffer(storage=storage)
        except BaseException:
            self.abort()
            raise

    def write(self, rows: TensorDictBase, env: Any = None) -> None:
        """Appends rows (a slice write: ``rb.extend`` scatters by index, 2x slower).

        ``env`` holds their env index (-1 where unknown).

        Leaves the cleaner already gathered into their place (:meth:`slot`)
        are not copied onto themselves. The rows written are counted here
        (``self.n``), not by the storage: its count grows by the length of
        each ``set``, which a copy straight into its files bypasses; the
        output's row count is set from ``self.n`` in :meth:`commit`.
        """
        m = rows.batch_size[0]
        if not m:
            return
        self.done.append(done_of_rows(rows))
        rows = source_names(rows, self.names, self.casts)  # laid out and stored as SRC names them
        if not self.rb.storage.initialized:
            self._lay_out(rows)
        lo, hi = self.n, self.n + m
        self.env.append(np.full(m, -1, np.int32) if env is None else np.asarray(env, np.int32))
        fields = plain_leaves(rows) if self._leaves else None
        if fields is not None and fields.keys() == self._leaves.keys():
            for key, value in fields.items():
                dest = self._leaves[key][lo:hi]
                if value.data_ptr() != dest.data_ptr() or value.shape != dest.shape:
                    dest.copy_(value)
        else:
            self.rb.storage.set(slice(lo, hi), rows)
        self.n = hi

    def _lay_out(self, rows: TensorDictBase) -> None:
        """Lays out the output's files for every row, their space taken before any write.

        The storage's files are sparse: once the disk is known to have room,
        they are laid out (``_compat.lay_out``) and allocated
        (``_scratch.reserve``) before a row goes through their maps.
        """
        storage = self.rb.storage
        self.need = storage.max_size * _row_bytes(rows)
        check_free(self.dst, self.need)
        with space_for(self.dst, self.need):
            lay_out(storage, rows)
        reserve(self.rows_dir, self.dst, self.need)

    def slot(self, key: Any, rows: int) -> torch.Tensor | None:
        """The output's next ``rows`` rows of ``key``, to gather into; None if not laid out."""
        storage = self.rb.storage
        if self.names or self.casts:  # the rows are renamed on their way: no slot
            return None
        if not storage.initialized or self.n + rows > storage.max_size:
            return None
        if self._leaves is None:
            tensors = storage_tensors(storage)
            self._leaves = {} if tensors is None else plain_leaves(tensors)
        leaf = self._leaves.get(key)
        return None if leaf is None else leaf[self.n : self.n + rows]

    def _capacity(self) -> int:
        """The rows the dump holds room for.

        ``fit`` (the source buffer's size) if the rows fit it, else as laid
        out; without ``fit`` (a source that is no buffer), the rows written.
        """
        size = self.rb.storage.max_size
        if self.fit is None:
            return self.n
        return self.fit if self.n <= self.fit < size else size

    def commit(self, mark: dict | None = None, rows: int | None = None) -> None:
        """Finishes the dataset and moves it to ``dst`` once it reads back whole.

        Args:
            mark: cleanbuf's marker (see :mod:`cleanbuf.offline._marker`).
            rows: the rows the caller wrote (the cleaner's ``rows_out``);
                None: those counted by :meth:`write`.

        Raises:
            OutputCheckError: the output, read back as a reader reads it,
                does not hold ``rows`` rows with the done flags written;
                nothing is moved to ``dst``.
        """
        if not self.n:
            raise InputError(f"no row is left to write to {self.dst}; nothing was written.")
        with space_for(self.dst, self.need):
            self._finish(mark)
        self._check(self.n if rows is None else rows)
        if os.path.lexists(self.dst):  # --force: the old one goes only now
            os.replace(self.dst, os.path.join(self.tmp, "old"))
        os.replace(self.out, self.dst)
        self.abort()

    def _check(self, rows: int) -> None:
        """Reads the output back as :func:`read` does and compares it with what was written.

        Its rows (a dump's ``len``, a file's arrays) and their done flags
        must be the ``rows`` rows written, in order.
        """
        done = np.concatenate(self.done)
        try:
            back = read(self.out, Shape(keys=self.keys))
            n, every = back.n_rows, np.arange(back.n_rows)
            keys = {_tuple(k) for k in back.data.keys(True, True)}
            got = done_of(keys, lambda k: back.column(k, every), n) if n == len(done) else None
        except CleanbufError as err:
            raise OutputCheckError(
                f"the cleaned output of {self.dst} cannot be read back ({err}); nothing was "
                "written to it. This is a bug in cleanbuf: please report it."
            ) from err
        fresh = got is not None and env_if_fresh(back.env, back.mark, got) is not None
        if n != rows or n != self.n or not fresh or not np.array_equal(got, done):
            what = "different done flags or env index" if n == rows == self.n else f"{n} rows"
            raise OutputCheckError(
                f"the cleaned output of {self.dst}, read back, holds {what}, where {rows} rows "
                f"were cleaned (rows_out) and {self.n} written; nothing was written to it. "
                "This is a bug in cleanbuf: please report it."
            )

    def _finish(self, mark: dict | None) -> None:
        """Writes the dataset at ``self.out``, with its marker; its row count is ``self.n``."""
        out = self.out
        env = np.concatenate(self.env)
        mark = {**(mark or {}), "rows": self.n, "done": done_digest(np.concatenate(self.done))}
        if self.fmt == DUMP:
            capacity, size = self._capacity(), self.rb.storage.max_size
            self.capacity = capacity
            self.rb.dumps(out)
            del self.rb  # unmap the files before they are cut
            if capacity < size:
                _cut_rows(os.path.join(out, "storage"), size, capacity)
            _set_len(os.path.join(out, "storage", "storage_metadata.json"), self.n)
            with open(os.path.join(out, "writer", "metadata.json"), "w") as f:
                json.dump({"cursor": self.n % capacity, "write_count": self.n}, f)
            write_dir(out, env, mark)
        elif self.fmt == MEMMAP:
            capacity = self.rb.storage.max_size
            del self.rb  # unmap the files before they are cut
            _cut_rows(out, capacity, self.n)
            write_dir(out, env, mark)
        else:
            # The storage's tensors up to the rows written (its own count does not
            # know of the rows copied straight into them). Without the private
            # name, no row was copied so: storage.get counts them all.
            tensors = storage_tensors(self.rb.storage)
            if tensors is None:
                tensors = self.rb.storage.get(slice(0, self.n))
            stored = plain_leaves(tensors)
            arrays = {"/".join(k): v[: self.n].numpy() for k, v in stored.items()}
            arrays[ENV_ARRAY] = env
            size = sum(a.nbytes for a in arrays.values())  # the file, next to the maps
            what = f"its file, written from its rows ({size_text(self.need)}, on the same disk),"
            check_free(self.dst, size, what)
            with space_for(self.dst, size, what):
                _save_file(self.fmt, out, arrays)

    def abort(self) -> None:
        """Removes the temporary directory."""
        if self._lock is not None or os.path.exists(self.tmp):
            remove(self.tmp, self._lock)
            self._lock = None


def _set_len(path: str, n: int) -> None:
    """Sets a dump's ``len`` (``storage/storage_metadata.json``) to the ``n`` rows written.

    TorchRL writes there the count its storage kept, which grows by the
    length of each ``set``: the writer's copies straight into the files
    bypass it, so the count is set from what was written.
    """
    meta = _json(path)
    meta["len"] = n
    with open(path, "w") as f:
        json.dump(meta, f)


def _save_file(fmt: str, out: str, arrays: dict) -> None:
    """Writes arrays to a ``.npz`` or HDF5 file at ``out``."""
    if fmt == NPZ:
        with open(out, "wb") as f:
            np.savez(f, **arrays)
        return
    import h5py

    with h5py.File(out, "w") as f:
        for name, a in arrays.items():
            f.create_dataset(name, data=a)


def _row_bytes(rows: TensorDictBase) -> int:
    """The bytes one row takes, every key."""
    m = max(rows.batch_size[0], 1)
    return sum(leaf.numel() * leaf.element_size() for leaf in rows.values(True, True)) // m


def _warn(note: str) -> None:
    warnings.warn(note, CleanbufWarning, stacklevel=3)


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


def done_of_rows(rows: TensorDictBase) -> np.ndarray:
    """Each row's done flag, as the audit reads it (:func:`done_of`)."""
    keys = {_tuple(k) for k in rows.keys(True, True)}
    m = rows.batch_size[0]
    return done_of(keys, lambda k: rows.get(k).reshape(m, -1).numpy(), m)


def done_of(keys: set, column: Any, n: int) -> np.ndarray:
    """Per row, done: ``("next", "done")`` if stored, else terminated | truncated.

    The engine's rule (:data:`cleanbuf.engine._keys.DONE_KEYS`), on any columns.

    ``column(key)`` gives a key's ``[n, ...]`` values.
    """
    present = [DONE_KEYS[0]] if DONE_KEYS[0] in keys else [k for k in DONE_KEYS[1:] if k in keys]
    out = np.zeros(n, bool)
    for k in present:
        out |= column(k).reshape(n, -1).astype(bool).any(1)
    return out


def source_names(rows: TensorDictBase, names: dict, casts: dict) -> TensorDictBase:
    """Rows with the source's names and flag dtypes back (see ``Dataset.names``).

    Examples:
        >>> td = TensorDict({("next", "done"): torch.tensor([True])}, [1])
        >>> out = source_names(td, {("next", "done"): "dones"}, {("next", "done"): np.float32})
        >>> out["dones"]
        tensor([1.])
    """
    if not names and not casts:
        return rows
    out = TensorDict(batch_size=rows.batch_size)
    for k, v in rows.items(True, True):
        k = _tuple(k)
        if k in casts:
            v = v.to(torch.from_numpy(np.zeros(0, casts[k])).dtype)
        out.set(tuple(names[k].split("/")) if k in names else k, v)
    return out


def _tuple(key: Any) -> tuple:
    return key if isinstance(key, tuple) else (key,)
