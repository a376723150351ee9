"""One-shot cleaning of a TensorDict or a dict of arrays, outside any buffer."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import NestedKey, TensorDictBase

from cleanbuf.engine._cleaner import STAT_NAMES, Cleaner
from cleanbuf.engine._dicts import slash_named, to_dict, to_tensordict
from cleanbuf.engine._errors import CleanbufWarning, InputError, lost_message, user_stacklevel
from cleanbuf.engine._options import Options, keyword_names, refuse_unknown
from cleanbuf.engine._orientation import time_axis
from cleanbuf.offline._formats import Shape
from cleanbuf.offline._names import obs_pair, roles


def clean(
    data: Any,
    *,
    mode: str | Any | None = None,
    layout: str | None = None,
    envs: int | None = None,
    keys: dict | None = None,
    batch_dims: int | None = None,
    dst: str | os.PathLike | None = None,
    return_stats: bool = False,
    stream_key: NestedKey | None = None,
    joint_reset: bool | str | None = None,
    reset_group_size: int | None = None,
    joint_key: NestedKey | None = None,
    on_lost_terminal_obs: str | None = None,
    terminal_obs_in_done_row: bool | None = None,
    check_reset_rows: bool = True,
    observation_keys: Sequence[NestedKey] | None = None,
    done_key: NestedKey | None = None,
    reward_key: NestedKey | None = ("next", "reward"),
    is_init_key: NestedKey | None = "is_init",
    step_count_key: NestedKey | None = "step_count",
    final_obs_key: NestedKey | None = None,
    keep_final_obs: bool = False,
    compact: bool = False,
    check_continuity: bool = True,
    producer_key: NestedKey | None = None,
    **unknown: Any,
) -> Any:
    """Cleans auto-reset data in one go; held rows are flushed at the end.

    What comes back depends on ``data`` and on two arguments, never on the
    data's content:

    ======================================  ==========================================
    call                                    returns
    ======================================  ==========================================
    ``clean(td)``                           a TensorDict of flat rows
    ``clean(rb)``, ``clean(path)``          a TensorDict of flat rows
    ``clean(dict_of_arrays)``               a dict of the same kind of arrays, same
                                            key style (nested, tuple or ``"a/b"``)
    ``clean(sb3_buffer)``                   a dict of numpy arrays under SB3's names
                                            (``"observations"``, ...), flat rows
    ``clean(data_of_0_rows)``               the data's keys, no row (a dict, or a
                                            TensorDict of flat rows)
    ``clean(..., return_stats=True)``       ``(rows, stats)``, rows as above
    ``clean(path, dst=DST)``                the stats (the rows are written to DST)
    ======================================  ==========================================

    Args:
        data: a TensorDict, or a (nested) dict of numpy arrays or torch
            tensors with keys like ``"observation"`` and
            ``{"next": {"observation", "reward", "done"}}`` (tuple keys such
            as ``("next", "done")`` work too, and so do names as in the
            ``.npz`` format, ``"next/done"``, which the result keeps); or
            stored data whose layout is recovered as ``cleanbuf audit``
            does: a TorchRL ``ReplayBuffer`` or storage filled without the
            filter, a path (an ``rb.dumps`` directory, a TensorDict memmap
            directory, a ``.npz`` or HDF5 file), or a Stable-Baselines3
            ``ReplayBuffer``. A dict with a reward is read as stored arrays
            are: its layout (``[N]``, ``[T, E]``, ``[E, T]``) and names
            (CleanRL's, offline-RL's) from the data, unless ``batch_dims``
            or an engine layout (``"time_last"``, ``"step"``,
            ``stream_key=``) is given.
        mode: as for :class:`cleanbuf.AutoresetFilter`; None: for stored
            data, what the audit found, else "next_step".
        layout: "time_first" (``[T, E]``), "time_last" (``[E, T]``),
            "flat", or the filter's "step" / "stream_key"; None: read from
            the data. A dict, an SB3 buffer or a path read as stored arrays
            comes back as flat rows under the source's names, with each
            row's env in ``"_cleanbuf/env"``.
        envs: with ``layout="flat"``: the rows are this many envs' rows,
            one env after the other.
        keys: ``{role: name}`` for arrays named otherwise (as
            :func:`cleanbuf.audit` takes it).
        batch_dims: for dicts, the number of batch dimensions; None reads
            it from the done array (a trailing dimension of size 1 is a
            flag dimension).
        dst: for a path, where to write the cleaned dataset (``.npz``,
            ``.h5`` / ``.hdf5``, or a directory: see
            :func:`cleanbuf.offline.clean_dataset`); None returns the rows
            instead.
        return_stats: also return the counters (as ``filt.stats``).
        stream_key: as for the filter.
        joint_reset: as for the filter; also "yes", "no" or "auto" (None:
            for stored data, what the audit found).
        reset_group_size: as for the filter.
        joint_key: as for the filter.
        on_lost_terminal_obs: as for the filter.
        terminal_obs_in_done_row: as for the filter.
        check_reset_rows: as for the filter.
        observation_keys: as for the filter.
        done_key: as for the filter.
        reward_key: as for the filter.
        is_init_key: as for the filter.
        step_count_key: as for the filter.
        final_obs_key: as for the filter.
        keep_final_obs: as for the filter.
        compact: as for the filter.
        check_continuity: as for the filter.
        producer_key: as for the filter.
        **unknown: nothing: a misspelt option raises, naming the options.

    Returns:
        See the table above.

    Raises:
        CleanbufError: an unknown option, data that does not fit the
            options, or unreadable data (named, with the fix).

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
    unknown = refuse_unknown(unknown, keyword_names(clean)[1:], "clean()")
    options = {**_chosen(locals()), **unknown}
    empty = _no_rows(data)
    if empty is not None:  # nothing to clean: the source's keys, no row
        return (empty, dict.fromkeys(STAT_NAMES, 0)) if return_stats else empty
    stored = _stored(data, dst, options)
    if stored is not None:
        if dst is not None:
            return stored.stats
        return (stored.rows, stored.stats) if return_stats else stored.rows
    if batch_dims is None and _as_stored_arrays(data, options):
        out, stats = _clean_arrays(data, options)
        return (out, stats) if return_stats else out
    as_dict = isinstance(data, Mapping) and not isinstance(data, TensorDictBase)
    if not as_dict and not isinstance(data, TensorDictBase):
        from cleanbuf.offline._sources import not_data

        raise InputError(not_data(data))
    opts = Options.build(**options)
    if as_dict:
        td, as_numpy = to_tensordict(
            data, "clean()", batch_dims, takes_batch_dims=True, done_key=opts.done_key
        )
    else:
        td, as_numpy = data, False
    cleaner = Cleaner(opts)
    out = cleaner(td)
    _warn_lost(cleaner)
    rest = cleaner.flush()
    if rest.batch_size[0]:
        out = torch.cat([out, rest])
    out = to_dict(out, as_numpy, slash_named(data)) if as_dict else out
    return (out, cleaner.stats) if return_stats else out


def _no_rows(data: Any) -> Any:
    """Data of 0 rows as the empty result it cleans to (its keys kept); None otherwise.

    A TensorDict with a zero batch dimension comes back as 0 flat rows; a
    dict whose arrays are all empty, as a copy of itself.

    Examples:
        >>> import numpy as np
        >>> _no_rows({"obs": np.zeros((0, 3)), "next": {"done": np.zeros(0, bool)}})
        {'obs': array([], shape=(0, 3), dtype=float64), 'next': {'done': array([], dtype=bool)}}
    """
    if isinstance(data, TensorDictBase):
        if not data.batch_dims or data.batch_size.numel():
            return None
        return data.flatten(0, data.batch_dims - 1).clone() if data.batch_dims > 1 else data.clone()
    if not isinstance(data, Mapping) or not data:
        return None
    leaves = list(_leaf_values(data))
    if not leaves or any(not hasattr(a, "shape") or not len(a.shape) or a.shape[0] for a in leaves):
        return None
    return copy.deepcopy(data)


def _leaf_values(data: Mapping):
    for value in data.values():
        if isinstance(value, Mapping):
            yield from _leaf_values(value)
        else:
            yield value


def _warn_lost(cleaner: Cleaner) -> None:
    """Warns when the clean stored lost terminal observations as NaN by default.

    As the filter does: next-step data, no ``on_lost_terminal_obs`` chosen;
    done rows at the end of the data, whose reset rows were never stored
    (every collection ends with some), are counted, not warned about.
    """
    opts, n_lost = cleaner.options, cleaner.count("terminal_obs_missing")
    if n_lost and opts.mode == "next_step" and opts.on_lost_terminal_obs is None:
        warnings.warn(
            CleanbufWarning(lost_message(n_lost, "clean()")), stacklevel=user_stacklevel()
        )


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
    slash = not isinstance(data, Mapping) or slash_named(data)  # (an SB3 buffer: its names)
    out = to_dict(rows, as_numpy, slash)
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
        from cleanbuf.offline._sources import buffer_name

        _refuse_mixed(data)

        with tempfile.TemporaryDirectory(prefix="cleanbuf-") as tmp:
            ds = from_buffer(data, os.path.join(tmp, "dump"))
            # (named as the caller knows it: errors never name the temporary dump)
            ds = dataclasses.replace(ds, path=buffer_name(data))
            return clean_dataset(ds, None, **options)
    return None


def _refuse_mixed(rb: Any) -> None:
    """Refuses a buffer holding rows written before and after a filter was attached.

    The filter (a transform of ``rb``) counted, at its first write, the
    rows the buffer already held (``rows_before_attach``): those are raw,
    the later ones cleaned, and no layout cleans both in one pass. The
    error names the rows to clean alone, as a call that runs.
    """
    transforms = getattr(getattr(rb, "_transform", None), "transforms", ())
    before = max((int(getattr(t, "rows_before_attach", 0) or 0) for t in transforms), default=0)
    if before and before < len(rb):
        raise InputError(
            f"this buffer holds {before} row(s) written before its AutoresetFilter was attached "
            f"(not cleaned) and {len(rb) - before} written through it (cleaned): no one layout "
            f"reads both. Clean the first ones alone: rows = cleanbuf.clean(rb[:{before}], "
            'layout="flat") (while the buffer has not wrapped).'
        )


def _chosen(arguments: dict) -> dict:
    """The options of a :func:`clean` call that differ from its defaults (what the user chose).

    Those left out are the audit's (stored data) or the cleaner's defaults.
    """
    out = {}
    for name, default in _CLEAN_DEFAULTS.items():
        value = arguments[name]
        if value is not default and not (type(value) is type(default) and value == default):
            out[name] = value
    return out


_NOT_OPTIONS = ("data", "batch_dims", "dst", "return_stats")
_CLEAN_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(clean).parameters.items()
    if p.kind is p.KEYWORD_ONLY and name not in _NOT_OPTIONS
}
