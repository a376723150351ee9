"""Data in memory as a :class:`~cleanbuf.offline._formats.Dataset`.

``cleanbuf.audit`` and ``cleanbuf.clean`` take, besides a path:

* a TorchRL ``ReplayBuffer`` or storage (dumped first: its writer knows the
  write order of a wrapped buffer);
* a dict of numpy arrays or torch tensors (nested, or named as in a
  ``.npz`` file, ``"next/observation"``), or a TensorDict, with leading
  dims ``[N]``, ``[T, E]`` or ``[E, T]``;
* a Stable-Baselines3 ``ReplayBuffer`` (arrays ``[buffer_size, n_envs,
  ...]``, ``pos`` the next slot, ``full`` once it wrapped): its filled
  slots, oldest first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from cleanbuf.engine._dicts import leaves as dict_leaves
from cleanbuf.engine._errors import InputError
from cleanbuf.offline._formats import Dataset, Shape, from_arrays, from_buffer, from_tensordict

SB3_ARRAYS = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")


def is_sb3_buffer(source: Any) -> bool:
    """A Stable-Baselines3 ``ReplayBuffer`` (read by its attributes, SB3 not imported)."""
    return all(hasattr(source, a) for a in ("observations", "pos", "full", "buffer_size"))


def sb3_arrays(rb: Any) -> dict:
    """A Stable-Baselines3 ``ReplayBuffer``'s filled slots, oldest first, ``[T, E, ...]``.

    A full buffer wrapped: its oldest slot is ``pos`` (the next to be
    overwritten), so the rows are ``pos..end`` then ``0..pos``.

    Raises:
        InputError: a buffer built with ``optimize_memory_usage=True``
            (no next observations stored: the next slot's observation
            stands for them, and is overwritten at the cursor).
    """
    if (
        getattr(rb, "optimize_memory_usage", False)
        or getattr(rb, "next_observations", None) is None
    ):
        raise InputError(
            "a Stable-Baselines3 ReplayBuffer built with optimize_memory_usage=True stores no "
            "next observations, which the audit compares; build it with "
            "optimize_memory_usage=False."
        )
    if not isinstance(rb.observations, np.ndarray):
        raise InputError(
            "a Stable-Baselines3 ReplayBuffer with dict observations (DictReplayBuffer) is not "
            "read; pass its arrays as a dict (keys={'obs': NAME, ...})."
        )
    pos, size = int(rb.pos), int(rb.buffer_size)
    order = np.r_[pos:size, 0:pos] if rb.full else np.arange(pos)
    return {name: getattr(rb, name)[order] for name in SB3_ARRAYS if hasattr(rb, name)}


def _numpy(data: Mapping) -> tuple[dict, bool]:
    """A (nested) dict of arrays as ``"/"``-named numpy arrays; whether it held tensors."""
    if isinstance(data, TensorDictBase):
        leaves = data.cpu().items(True, True)
        return {"/".join(k if isinstance(k, tuple) else (k,)): v.numpy() for k, v in leaves}, True
    arrays = dict_leaves(data, "cleanbuf.audit() or cleanbuf.clean()")
    out = {
        "/".join(map(str, k)): v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else v
        for k, v in arrays.items()
    }
    return out, any(isinstance(v, torch.Tensor) for v in arrays.values())


def dataset(source: Any, shape: Shape, tmp: str) -> tuple[Dataset, str, str | None]:
    """Data in memory as a Dataset, its name, and the name a fix's call gives it.

    Args:
        source: a TorchRL buffer or storage, a dict, a TensorDict or an
            SB3 ``ReplayBuffer``.
        shape: what the user said about layout and names.
        tmp: a directory a TorchRL buffer is dumped into.

    Returns:
        ``(dataset, name, python)``; ``python`` is None for a TorchRL
        buffer (the report then says ``rb``), else ``"data"``.
    """
    if isinstance(source, TensorDictBase):
        return (
            from_tensordict("TensorDict", "tensordict", source.cpu(), shape),
            "TensorDict",
            "data",
        )
    if isinstance(source, Mapping):
        return from_arrays("dict", _numpy(source)[0], shape), "dict of arrays", "data"
    if is_sb3_buffer(source):
        if shape.layout not in (None, "time_first"):
            raise InputError(
                f"layout={shape.layout!r}: a Stable-Baselines3 ReplayBuffer is [buffer_size, "
                "n_envs] (time first) by construction; leave layout out."
            )
        name = type(source).__name__
        shape = Shape("time_first", None, shape.keys)
        # A full buffer is read from pos, its oldest slot; its first rows may
        # be reset rows whose done rows were overwritten (orphans, dropped).
        ds = from_arrays(name, sb3_arrays(source), shape)
        why = ds.layout_why.replace("as told", "[buffer_size, n_envs] by construction", 1)
        ds = dataclasses.replace(ds, wrapped=bool(source.full), layout_why=why)
        return ds, name, "rb"
    from torchrl.data import ReplayBuffer
    from torchrl.data.replay_buffers.storages import Storage

    if not isinstance(source, (ReplayBuffer, Storage)):
        raise InputError(not_data(source))
    return from_buffer(source, tmp), buffer_name(source), None


def not_data(source: Any) -> str:
    """The one line for an object that is no data cleanbuf reads, naming what is.

    Examples:
        >>> not_data(42)[:46]
        'got int, which is no data cleanbuf reads: pass'
    """
    return (
        f"got {type(source).__name__}, which is no data cleanbuf reads: pass a path (an "
        "rb.dumps directory, a TensorDict memmap directory, a .npz or HDF5 file), a TorchRL "
        "ReplayBuffer or storage, a TensorDict, a dict of arrays, or a Stable-Baselines3 "
        "ReplayBuffer."
    )


def buffer_name(source: Any) -> str:
    """A TorchRL buffer or storage as its class and its storage's size.

    Examples:
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> buffer_name(ReplayBuffer(storage=LazyTensorStorage(1000)))
        'ReplayBuffer(LazyTensorStorage(1000))'
        >>> buffer_name(LazyTensorStorage(10))
        'LazyTensorStorage(10)'
    """
    storage = getattr(source, "storage", None)
    if storage is None:
        return f"{type(source).__name__}({getattr(source, 'max_size', '')})"
    return f"{type(source).__name__}({buffer_name(storage)})"
