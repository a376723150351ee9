"""One-shot cleaning of a TensorDict or a dict of arrays, outside any buffer."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from cleanbuf.engine._cleaner import Cleaner
from cleanbuf.engine._errors import InputError
from cleanbuf.engine._keys import DONE_KEYS
from cleanbuf.engine._options import Options
from cleanbuf.offline._axes import time_axis
from cleanbuf.offline._formats import Shape
from cleanbuf.offline._names import obs_pair, roles


def _parts(key: Any) -> tuple:
    """A dict key as a TensorDict key path; ``"next/done"`` is ``("next", "done")``.

    The ``.npz`` format names nested keys so (see :mod:`cleanbuf.offline._formats`).

    Examples:
        >>> _parts("next/done"), _parts(("next", "done")), _parts("observation")
        (('next', 'done'), ('next', 'done'), ('observation',))
    """
    parts = key if isinstance(key, tuple) else (key,)
    return tuple(
        p for part in parts for p in (part.split("/") if isinstance(part, str) else [part])
    )


def _flatten(data: Mapping, prefix: tuple = ()) -> dict:
    out = {}
    for k, v in data.items():
        key = prefix + _parts(k)
        if isinstance(v, Mapping):
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _to_td(data: Mapping, batch_dims: int | None) -> tuple[TensorDictBase, bool]:
    leaves = _flatten(data)
    tensors, is_numpy = {}, []
    for k, v in leaves.items():
        if isinstance(v, np.ndarray):
            tensors[k] = torch.from_numpy(v)
            is_numpy.append(True)
        elif isinstance(v, torch.Tensor):
            tensors[k] = v
            is_numpy.append(False)
        else:
            raise InputError(
                f"key {k!r} holds {type(v).__name__}; a dict passed to clean() must hold "
                "numpy arrays or torch tensors (nested dicts allowed)."
            )
    if len(set(is_numpy)) > 1:
        raise InputError(
            "the dict mixes numpy arrays and torch tensors; pass one kind so that the "
            "result can be returned as the same kind."
        )
    done = next((tensors[k] for k in DONE_KEYS if k in tensors), None)
    if batch_dims is None:
        if done is None:
            raise InputError(
                "cannot infer the batch dimensions of a dict without a done key: expected "
                f"one of {', '.join(map(str, DONE_KEYS))} (or 'next/done' as in .npz files), "
                f"found keys {sorted(tensors, key=str)}. Add the done flags or pass batch_dims=."
            )
        batch_dims = done.dim() - 1 if done.dim() > 1 and done.shape[-1] == 1 else done.dim()
    shapes = {k: tuple(v.shape[:batch_dims]) for k, v in tensors.items()}
    first = next(iter(shapes.values()))
    bad = {k: list(s) for k, s in shapes.items() if s != first}
    if bad:
        raise InputError(
            f"arrays disagree on the batch shape (first {batch_dims} dims): expected "
            f"{list(first)} for every key, got {bad}. Fix the shapes or pass batch_dims=."
        )
    td = TensorDict(batch_size=list(first))
    for k, v in tensors.items():
        td.set(k, v)
    return td, bool(is_numpy and is_numpy[0])


def _slash_named(data: Mapping) -> bool:
    """The dict names nested keys as ``.npz`` files do (``"next/done"``), not nested."""
    return any(isinstance(k, str) and "/" in k for k in data) and not any(
        isinstance(v, Mapping) for v in data.values()
    )


def _to_dict(td: TensorDictBase, as_numpy: bool, slash_named: bool = False) -> dict:
    out: dict = {}
    for k, v in td.items(include_nested=True, leaves_only=True):
        k = k if isinstance(k, tuple) else (k,)
        if slash_named:
            out["/".join(k)] = v.numpy() if as_numpy else v
            continue
        node = out
        for part in k[:-1]:
            node = node.setdefault(part, {})
        node[k[-1]] = v.numpy() if as_numpy else v
    return out


def clean(
    data: Any,
    *,
    batch_dims: int | None = None,
    dst: str | None = None,
    return_stats: bool = False,
    **options: Any,
) -> Any:
    """Cleans auto-reset data in one go; held rows are flushed at the end.

    Args:
        data: a TensorDict, or a (nested) dict of numpy arrays or torch
            tensors with keys like ``"observation"`` and
            ``{"next": {"observation", "reward", "done"}}`` (tuple keys such
            as ``("next", "done")`` work too, and so do names as in the
            ``.npz`` format, ``"next/done"``, which the result keeps); or
            stored data whose layout
            is recovered as ``cleanbuf audit`` does: a TorchRL
            ``ReplayBuffer`` or storage filled without the filter (by a
            collector or ``rb.extend``), or a path (an ``rb.dumps``
            directory, a TensorDict memmap directory, a ``.npz`` or HDF5
            file), or a Stable-Baselines3 ``ReplayBuffer``. A dict with a
            reward is read as stored arrays are: its layout (``[N]``,
            ``[T, E]``, ``[E, T]``) and names (CleanRL's, offline-RL's)
            from the data, unless ``batch_dims`` or an engine layout
            (``"time_last"``, ``"step"``, ``stream_key=``) is given.
        batch_dims: for dicts, the number of batch dimensions; None infers it
            from the done array (a trailing dimension of size 1 is a feature
            dimension).
        dst: for a path, where to write the cleaned dataset (same format);
            None returns the rows instead.
        return_stats: also return the counters (``filt.stats``).
        **options: ``layout`` (``"time_first"``, ``"time_last"``,
            ``"flat"``), ``envs`` and ``keys`` as :func:`cleanbuf.audit`
            takes them (a dict, an SB3 buffer or a path then comes back
            as flat rows under the source's names, with each row's env in
            ``"_cleanbuf/env"``), and the options of
            :class:`cleanbuf.AutoresetFilter`, ``mode``
            included (default "next_step"; for stored data, what the audit
            found).

    Returns:
        Flat cleaned rows, as a TensorDict for a TensorDict, a buffer, a
        storage or a path, and as a nested dict of the same array kind for
        a dict; ``(rows, stats)`` with ``return_stats``. With ``dst``, the
        stats only.

    Examples:
        >>> import numpy as np
        >>> data = {  # one stream; done at t=1, reset row at t=2
        ...     "observation": np.array([0.0, 1.0, 2.0, 10.0], np.float32),
        ...     "next": {
        ...         "observation": np.array([1.0, 2.0, 2.0, 11.0], np.float32),
        ...         "reward": np.array([1.0, 1.0, 0.0, 1.0], np.float32),
        ...         "done": np.array([False, True, False, False]),
        ...     },
        ... }
        >>> out = clean(data, layout="time_last")
        >>> out["next"]["observation"].tolist()
        [1.0, 2.0, 11.0]
    """
    stored = _stored(data, dst, options)
    if stored is not None:
        if dst is not None:
            return stored.stats
        return (stored.rows, stored.stats) if return_stats else stored.rows
    if batch_dims is None and _as_stored_arrays(data, options):
        out, stats = _clean_arrays(data, options)
        return (out, stats) if return_stats else out
    as_dict = isinstance(data, Mapping) and not isinstance(data, TensorDictBase)
    if as_dict:
        td, as_numpy = _to_td(data, batch_dims)
    else:
        td, as_numpy = data, False
    cleaner = Cleaner(Options.build(**options))
    out = cleaner(td)
    rest = cleaner.flush()
    if rest.batch_size[0]:
        out = torch.cat([out, rest])
    out = _to_dict(out, as_numpy, _slash_named(data)) if as_dict else out
    return (out, cleaner.stats) if return_stats else out


def _as_stored_arrays(data: Any, options: dict) -> bool:
    """Whether in-memory data goes the way stored arrays go (names and layout read).

    A Stable-Baselines3 buffer, and a dict or TensorDict whose names are
    not TorchRL's, whose layout is said (``"time_first"``, ``"flat"``,
    ``envs=``, ``keys=``), or whose ``[A, B]`` arrays chain along their
    first axis (``[T, E]``), and any dict with a reward (its layout and
    envs read as the audit reads them). TensorDicts (collector batches
    ``[*E, T]``, rows) and the engine's own layouts (``"time_last"``,
    ``"step"``, ``stream_key=``) go to the cleaner as they are.
    """
    from cleanbuf.offline._sources import _numpy, is_sb3_buffer

    if is_sb3_buffer(data):
        return True
    if not isinstance(data, (Mapping, TensorDictBase)) or options.get("stream_key") is not None:
        return False
    layout = options.get("layout")
    if layout in ("time_first", "flat") or options.get("envs") or options.get("keys"):
        return True
    if layout is not None:
        return False
    arrays = _numpy(data)[0]
    if roles(list(arrays))[0] != "torchrl":
        return True
    pair, done = obs_pair(arrays), arrays.get("next/done")
    if pair is None or done is None:
        return False
    if not isinstance(data, TensorDictBase):  # a dict: stored arrays, read as the audit reads
        return "next/reward" in arrays
    if done.ndim < 2 or (done.ndim == 2 and done.shape[1] == 1):
        return False
    done = done.reshape(done.shape[:2])
    return time_axis(arrays[pair[0]], arrays[pair[1]], done.astype(bool))[0] == 0


def _clean_arrays(data: Any, options: dict) -> tuple[Any, dict]:
    """Cleans a dict, a TensorDict or an SB3 buffer as stored arrays are cleaned.

    The result keeps the source's names, flat rows, with each row's env
    under ``"_cleanbuf/env"`` (a ``[T, E]`` rectangle loses its shape when
    rows are dropped).
    """
    from cleanbuf.offline._clean_files import clean_dataset
    from cleanbuf.offline._sources import dataset

    shape = Shape(*(options.pop(k, None) for k in ("layout", "envs", "keys")))
    ds = dataset(data, shape, "")[0]
    done = clean_dataset(ds, None, **options)
    rows, env = done.rows, torch.as_tensor(done.env)
    if isinstance(data, TensorDictBase):
        rows.set(("_cleanbuf", "env"), env)
        return rows, done.stats
    as_numpy = not (isinstance(data, Mapping) and _has_tensors(data))
    slash = not isinstance(data, Mapping) or _slash_named(data)  # (an SB3 buffer: its names)
    out = _to_dict(rows, as_numpy, slash_named=slash)
    if slash:
        out["_cleanbuf/env"] = env.numpy() if as_numpy else env
    else:
        out.setdefault("_cleanbuf", {})["env"] = env.numpy() if as_numpy else env
    return out, done.stats


def _has_tensors(data: Mapping) -> bool:
    return any(
        _has_tensors(v) if isinstance(v, Mapping) else isinstance(v, torch.Tensor)
        for v in data.values()
    )


def _stored(data: Any, dst: str | None, options: dict) -> Any:
    """Cleans a path, a replay buffer or a storage; None for anything else."""
    from cleanbuf.offline._clean_files import clean_dataset
    from cleanbuf.offline._formats import from_buffer

    if isinstance(data, (str, os.PathLike)):
        return clean_dataset(os.fspath(data), dst, **options)
    if dst is not None:
        raise InputError("dst= is for a path: clean(path, dst=...) writes a new dataset.")
    from torchrl.data import ReplayBuffer
    from torchrl.data.replay_buffers.storages import Storage

    if isinstance(data, (ReplayBuffer, Storage)):
        with tempfile.TemporaryDirectory(prefix="cleanbuf-") as tmp:
            return clean_dataset(from_buffer(data, os.path.join(tmp, "dump")), None, **options)
    return None
