"""Reading a batch: its leaves as flat rows, its done flags, its observation keys.

Part of the read step (:mod:`cleanbuf.engine._read`): :class:`Views`, the walk that reads them
(:func:`batch_views`), and the observation-key rule the offline side shares.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, is_leaf_nontensor

from cleanbuf.engine._compat import children_of
from cleanbuf.engine._errors import InputError, key_name

NEXT = "next"
# TorchRL's trajectory ids: one per trajectory, unique across a collector's workers, never reused.
TRAJ_IDS = ("collector", "traj_ids")
DONE_KEYS = (("next", "done"), ("next", "terminated"), ("next", "truncated"))
# Keys that live at the root and under "next" but are not observations.
NOT_OBSERVATIONS = {"done", "terminated", "truncated", "reward", "is_init", "step_count"}


def numpy_view(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a CPU tensor, or None (other devices, dtypes numpy lacks).

    Examples:
        >>> numpy_view(torch.zeros(2)).tolist()
        [0.0, 0.0]
        >>> numpy_view(torch.zeros(2, dtype=torch.bfloat16)) is None
        True
    """
    if not t.is_cpu or t.requires_grad:
        return None
    try:
        return t.numpy()
    except (TypeError, RuntimeError):  # bfloat16, float8, conjugate views, ...
        return None


class Views(dict):
    """A call's tensors by key, read as rows ``[prod(B), ...]``: numpy views and flat tensors.

    ``views[key]`` is the numpy view of the rows (None where :func:`numpy_view` gives none);
    :meth:`flat` is the tensor of rows. Each is made once, on first use; a leaf read only as
    numpy is never flattened by torch.

    Args:
        tensors: key -> tensor, with ``batch_dims`` leading batch dimensions.
        batch_dims: how many leading dimensions make up a row index.
        n_rows: the product of those dimensions (needed where ``batch_dims`` is not 1, and by
            :func:`done_flags`; else 0 will do).

    Examples:
        >>> views = Views({"a": torch.arange(6.0).reshape(2, 3)}, batch_dims=2, n_rows=6)
        >>> views["a"].shape, views.flat("a").shape
        ((6,), torch.Size([6]))
        >>> views["a"] is views["a"]
        True
    """

    def __init__(self, tensors: dict, batch_dims: int = 1, n_rows: int = 0):
        super().__init__()
        self.tensors = tensors
        self.batch_dims = batch_dims
        self.n_rows = n_rows
        self._rows = (n_rows,)
        self._flat = tensors if batch_dims == 1 else {}
        self.parts = None  # (key, dtype, shape) per leaf, where the walk read them

    @classmethod
    def of_batch(cls, tensors: dict, batch_dims: int, n_rows: int) -> Views:
        """The views of a call's leaves, every numpy view made at once.

        Examples:
            >>> views = Views.of_batch({"a": torch.zeros(2, 3)}, 2, 6)
            >>> views["a"].shape
            (6,)
        """
        views = cls(tensors, batch_dims, n_rows)
        rows = views._rows
        for key, t in tensors.items():
            a = numpy_view(t)
            if a is not None and batch_dims != 1:
                a = a.reshape(rows + a.shape[batch_dims:])
            views[key] = a
        return views

    def flat(self, key) -> torch.Tensor:
        """``tensors[key]`` with its batch dimensions flattened (a view where possible)."""
        x = self._flat.get(key)
        if x is None:
            x = self._flat[key] = self.tensors[key].flatten(0, self.batch_dims - 1)
        return x

    def __missing__(self, key):
        a = numpy_view(self.tensors[key])
        if a is not None and self.batch_dims != 1:
            a = a.reshape(self._rows + a.shape[self.batch_dims :])
        self[key] = a
        return a


def may_be_observation(key: tuple) -> bool:
    """Whether a root key can hold an observation: the one rule, online and offline alike.

    Examples:
        >>> may_be_observation(("pixels",)), may_be_observation(("step_count",))
        (True, False)
        >>> may_be_observation(("collector", "traj_ids"))
        False
    """
    return key[0] not in (NEXT, "collector") and key[-1] not in NOT_OBSERVATIONS


def batch_leaves(td: TensorDictBase) -> dict:
    """Returns every tensor leaf of ``td``, as stored ``[*batch, *feature]`` (not flattened).

    Args:
        td: the batch.

    Returns:
        A dict from nested key (always a tuple) to tensor, in the batch's key
        order.

    Raises:
        InputError: a leaf is not a tensor.

    Examples:
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"a": torch.zeros(2, 3, 4)}, batch_size=[2, 3])
        >>> batch_leaves(td)[("a",)].shape
        torch.Size([2, 3, 4])
    """
    leaves: dict = {}
    if _walk(td, (), leaves):
        return _plain(leaves)
    # Lazy stacks, non-tensor leaves: TensorDict's iterator, told not to skip non-tensor data.
    leaves = {}
    for key, value in td.items(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor):
        key = key if isinstance(key, tuple) else (key,)
        if not isinstance(value, torch.Tensor):
            raise InputError(
                f"key {key_name(key)} holds {type(value).__name__}, not a tensor; cleanbuf "
                "moves tensor leaves only. Exclude it before the filter "
                "(data.exclude(key)) or store it as a tensor."
            )
        leaves[key] = value
    return _plain(leaves)


def batch_views(td: TensorDictBase, batch_dims: int, n_rows: int) -> Views | None:
    """Every leaf of a plain ``TensorDict`` tree with its numpy rows, in one walk.

    What :func:`batch_leaves` then :meth:`Views.of_batch` give, with ``views.parts`` holding
    each leaf's key, dtype and shape (:func:`cleanbuf.engine._read.structure`). None for any other
    batch (a lazy stack, a non-tensor leaf, a leaf off the CPU, one that requires grad, a dtype
    numpy lacks): the caller then takes the general path, which handles or refuses it.

    Examples:
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"a": torch.zeros(2, 3, 4), "b": {"c": torch.ones(2, 3)}}, [2, 3])
        >>> views = batch_views(td, 2, 6)
        >>> views[("a",)].shape, views.parts[0][2], list(views)
        ((6, 4), (2, 3, 4), [('a',), ('b', 'c')])
        >>> batch_views(td.bfloat16(), 2, 6) is None
        True
    """
    views = Views({}, batch_dims, n_rows)
    tensors, rows, parts = views.tensors, views._rows, []
    children = children_of(td) if type(td) is TensorDict else None
    if type(children) is not dict:
        return None
    # Depth first, in key order (the order of the output's keys), without recursion.
    stack = [((), iter(children.items()))]
    while stack:
        prefix, items = stack[-1]
        for key, value in items:
            if isinstance(value, torch.Tensor):
                try:  # (raises for every leaf the general path must see)
                    a = value.numpy()
                except (TypeError, RuntimeError):
                    return None
                k = (*prefix, key)
                shape = a.shape  # (a tuple: cheaper to slice than torch.Size, and equal)
                tensors[k] = value
                views[k] = a if batch_dims == 1 else a.reshape(rows + shape[batch_dims:])
                parts.append((k, value.dtype, shape))
                continue
            children = children_of(value) if type(value) is TensorDict else None
            if type(children) is not dict:
                return None
            stack.append(((*prefix, key), iter(children.items())))
            break
        else:
            stack.pop()
    views.parts = tuple(parts)
    return views


def _plain(leaves: dict) -> dict:
    """``leaves`` as data: detached (as TorchRL's collectors store them), and none on ``meta``.

    Detached, held rows keep no autograd graph alive.
    """
    for key, value in leaves.items():
        if value.requires_grad:
            leaves[key] = value.detach()
        if value.is_meta:
            raise InputError(
                f"key {key_name(key)} is on device 'meta' (shapes without data); expected "
                "a tensor with values (cpu or cuda). Fix: materialise the batch "
                "(data.to('cpu') after filling it) before the filter."
            )
    return leaves


def _walk(td: TensorDictBase, prefix: tuple, leaves: dict) -> bool:
    """Collects the tensor leaves of a plain ``TensorDict`` tree; False for any other node."""
    children = children_of(td) if type(td) is TensorDict else None
    if type(children) is not dict:
        return False
    for key, value in children.items():
        if isinstance(value, torch.Tensor):
            leaves[(*prefix, key)] = value
        elif not _walk(value, (*prefix, key), leaves):
            return False
    return True


def row_flags(name: str, key: tuple, rows: Views) -> np.ndarray:
    """The flags of ``rows.tensors[key]`` (one bool per row) as numpy ``[n_rows]``, checked.

    A CPU bool leaf is read through its numpy view; errors come from the torch path.

    Raises:
        InputError: the leaf is not ``torch.bool`` or holds more than one flag per row.
    """
    a = rows[key]
    n_rows = rows.n_rows
    if a is not None and a.dtype == np.bool_ and a.size == n_rows:
        return a.reshape(n_rows)
    value = rows.tensors[key]
    if value.dtype != torch.bool:
        raise InputError(
            f"{name} key {key_name(key)} must be torch.bool; got dtype {value.dtype}. "
            f"Fix: data.set({key!r}, data.get({key!r}).bool()) before the filter, or "
            "fix the producer."
        )
    if value.shape[rows.batch_dims :].numel() != 1:
        raise InputError(
            f"{name} key {key_name(key)} must hold one flag per row (shape [*batch] or "
            f"[*batch, 1]); got trailing shape {list(value.shape[rows.batch_dims :])}. "
            "Multi-agent done flags need one env-level done; pass done_key= with such a key."
        )
    return value.reshape(n_rows).cpu().numpy()


def done_flags(rows: Views, done_key: tuple | None) -> np.ndarray:
    """Returns the per-row done flag as a bool numpy array ``[n_rows]``.

    Read from ``done_key``, else ``("next", "done")``, else ``terminated | truncated``.

    Args:
        rows: the leaves, read as rows.
        done_key: the user's done key, or None.

    Raises:
        InputError: no done key, a done key that is not boolean or has
            more than one flag per row, or ``("next", "done")`` that
            disagrees with ``terminated | truncated``.

    Examples:
        >>> done_flags(Views({("next", "done"): torch.tensor([[False], [True]])}, 1, 2), None)
        array([False,  True])
    """
    source = done_source(rows, done_key)
    return source.of_flags({k: read_flags(rows, k) for k in (*source.keys, *source.agree)})


class DoneSource(NamedTuple):
    """Where a batch's done flags come from: worked out once per batch structure.

    Attributes:
        keys: the keys whose flags are or-ed into the done flag.
        agree: ``("next", "terminated")`` and/or ``("next", "truncated")``
            where the done flag is ``("next", "done")`` and they are
            present: done must agree with them on every row.
    """

    keys: tuple
    agree: tuple = ()

    def flags(self, rows: Views) -> np.ndarray:
        """The done flags of ``rows``, unchecked (rows already read and checked once)."""
        return self.of_flags({k: read_flags(rows, k) for k in self.keys}, check=False)

    def of_flags(self, flags: dict, check: bool = True) -> np.ndarray:
        """The done flag from each key's flags (``key -> bool [n_rows]``): the one rule.

        ``keys`` or-ed; with ``check``, done must agree with ``agree`` on every row: equal
        to ``terminated | truncated`` with both present, set wherever the one present is
        (a missed end would keep its reset row as a transition).

        Raises:
            InputError: done disagrees with its parts (a row named).

        Examples:
            >>> source = DoneSource((("next", "done"),), (("next", "terminated"),))
            >>> flags = {("next", "done"): np.array([True, False]),
            ...          ("next", "terminated"): np.array([True, False])}
            >>> source.of_flags(flags).tolist()
            [True, False]
        """
        keys, agree = self.keys, self.agree
        done = flags[keys[0]] if len(keys) == 1 else flags[keys[0]] | flags[keys[1]]
        if not check or not agree:
            return done
        ends = flags[agree[0]] if len(agree) == 1 else flags[agree[0]] | flags[agree[1]]
        bad = ends != done if len(agree) == 2 else ends & ~done
        if not np.count_nonzero(bad):
            return done
        row = int(np.flatnonzero(bad)[0])
        names = " | ".join(key_name(k) for k in agree)
        raise InputError(
            f"('next', 'done') must agree with {names}: expected done={bool(ends[row])} on row "
            f"{row} ({int(np.count_nonzero(bad))} row(s) disagree), got done={bool(done[row])}. "
            f"Fix: data.set(('next', 'done'), {names}) before the filter (TorchRL envs keep "
            "done == terminated | truncated), or pass done_key= naming the key that marks "
            "episode ends. Nothing was written."
        )


def done_source(rows: Views, done_key: tuple | None) -> DoneSource:
    """Finds and checks the keys of the done flags (their dtype and shape).

    Raises:
        InputError: no done key, or a done key that is not boolean or has
            more than one flag per row.
    """
    leaves = rows.tensors
    if done_key is None and DONE_KEYS[0] in leaves:  # the common case, first
        agree = tuple(k for k in DONE_KEYS[1:] if k in leaves)
        row_flags("done", DONE_KEYS[0], rows)
        for key in agree:
            row_flags(key[-1], key, rows)
        return DoneSource((DONE_KEYS[0],), agree)
    keys = [done_key] if done_key is not None else [k for k in DONE_KEYS[1:] if k in leaves]
    missing = [k for k in keys if k not in leaves]
    if not keys or missing:
        wanted = missing or list(DONE_KEYS)
        raise InputError(
            f"no done key: expected {wanted} in the batch, found keys "
            f"{sorted(leaves, key=str)}. Pass done_key= to name the key that marks "
            "episode ends."
        )
    for key in keys:
        row_flags("done", key, rows)
    return DoneSource(tuple(keys))


def read_flags(rows: Views, key: tuple) -> np.ndarray:
    """The flags of ``key`` (one bool per row) as numpy ``[n_rows]``, unchecked.

    For a key that :func:`row_flags` accepted in a batch of the same
    structure (the same dtype and shape): its values only are read.
    """
    a = rows[key]
    if a is not None:
        return a.reshape(rows.n_rows)
    return rows.tensors[key].reshape(rows.n_rows).cpu().numpy()


def observation_keys(leaves: dict, declared: tuple | None, bookkeeping: set) -> tuple[list, bool]:
    """Returns the observation keys, and whether the data is observation-only.

    Discovered as the keys that :func:`may_be_observation` allows and that have a
    ``("next", ...)`` twin; observation-only data (no twins) needs them declared.

    Args:
        leaves: the batch leaves, from :func:`batch_leaves`.
        declared: user-declared observation keys, or None to discover them.
        bookkeeping: extra root keys that are never observations.

    Returns:
        ``(keys, observation_only)``.

    Raises:
        InputError: no observation key; a declared key missing at the root;
            some declared keys with a ``("next", k)`` twin and some without;
            a twin of another shape or dtype.

    Examples:
        >>> leaves = {("obs",): torch.zeros(2, 3), ("next", "obs"): torch.zeros(2, 3),
        ...           ("next", "done"): torch.zeros(2, 1, dtype=torch.bool)}
        >>> observation_keys(leaves, None, set())
        ([('obs',)], False)
        >>> observation_keys({("obs",): torch.zeros(2, 3)}, [("obs",)], set())
        ([('obs',)], True)
    """
    if declared is None:
        keys = [
            k
            for k in leaves
            if may_be_observation(k) and k not in bookkeeping and (NEXT, *k) in leaves
        ]
        if not keys:
            raise InputError(
                "no observation key: expected at least one key present both at the root "
                f"and under 'next' (like 'observation' and ('next', 'observation')); found "
                f"keys {sorted(leaves, key=str)}. Pass observation_keys=[...] (required "
                "for observation-only data, such as Collector(compact_obs=True) output)."
            )
        return keys, False
    missing = [k for k in declared if k not in leaves]
    if missing:
        raise InputError(
            f"observation key(s) {', '.join(key_name(k) for k in missing)} missing from the batch "
            f"(found {sorted(leaves, key=str)}). Fix observation_keys=."
        )
    twins = [(NEXT, *k) in leaves for k in declared]
    if any(twins) and not all(twins):
        have = ", ".join(key_name(k) for k, t in zip(declared, twins) if t)
        lack = ", ".join(key_name(k) for k, t in zip(declared, twins) if not t)
        raise InputError(
            f"observation keys {have} have a ('next', ...) twin but {lack} do not; store "
            "every observation key under 'next' (full transitions) or none of them "
            "(observation-only), or fix observation_keys=."
        )
    if all(twins):
        for k in declared:
            check_same_layout(leaves, k, (NEXT, *k))
    return list(declared), not all(twins)


def check_same_layout(leaves: dict, key: tuple, other: tuple) -> None:
    """Raises unless ``other`` has the shape and dtype of ``key`` (so rows of one fit the other)."""
    a, b = leaves[key], leaves[other]
    if a.shape != b.shape or a.dtype != b.dtype:
        what = "dtype" if a.shape == b.shape else "shape"
        raise InputError(
            f"{key_name(other)} must have the shape and dtype of observation key "
            f"{key_name(key)}: expected shape {list(a.shape)} and dtype {a.dtype}, got shape "
            f"{list(b.shape)} and dtype {b.dtype} (the {what} differs). A next observation is "
            f"the same kind of value as an observation: fix the producer, or cast before the "
            f"filter (data.set({other!r}, data.get({other!r}).to({a.dtype}))) where only the "
            "dtype differs. Nothing was written."
        )


FINAL_KEYS = (
    ("next", "final_obs"),
    ("next", "final_observation"),
    ("next", "terminal_observation"),
)


def _common_parent(keys: list) -> tuple:
    """The longest key prefix that every key extends (``()`` if none)."""
    first = keys[0][:-1]
    n = 0
    while n < len(first) and all(len(k) > n + 1 and k[n] == first[n] for k in keys):
        n += 1
    return first[:n]


def final_entries(leaves: dict, declared: tuple | None, obs_keys: list, batch_dims: int = 1):
    """Finds the same-step final-observation entry for each observation key.

    The entry is ``declared`` or the first of :data:`FINAL_KEYS` present; see docs/rules.md,
    'Same-step mode'. In a sub-TensorDict the observation keys appear in full
    (``("next", "final_obs", "pixels")`` for ``"pixels"``) or relative to their common parent
    (``("next", "final_obs", "pos")`` for ``("observation", "pos")``).

    Args:
        leaves: the batch leaves.
        declared: the user's ``final_obs_key``, or None to look for the
            common names.
        obs_keys: the observation keys.
        batch_dims: the leaves' leading batch dimensions.

    Returns:
        ``(final_of, mask_key, entry_keys)``: observation key -> final-observation leaf key
        (empty: no entry); the per-row presence mask's key (None: present wherever the entry
        is); the leaf keys the entry and its mask occupy.

    Raises:
        InputError: the entry does not match the observation keys.

    Examples:
        >>> leaves = {("obs",): torch.zeros(2, 3), ("next", "final_obs"): torch.ones(2, 3)}
        >>> final_entries(leaves, None, [("obs",)])[0]
        {('obs',): ('next', 'final_obs')}
    """
    candidates = [declared] if declared is not None else list(FINAL_KEYS)
    prefix = None
    for c in candidates:
        if any(k[: len(c)] == c for k in leaves):
            prefix = c
            break
    if prefix is None:
        return {}, None, set()
    entry_keys = {k for k in leaves if k[: len(prefix)] == prefix}
    if prefix in leaves:
        if len(obs_keys) != 1:
            raise InputError(
                f"the final-observation entry {key_name(prefix)} is one tensor but there are "
                f"{len(obs_keys)} observation keys "
                f"({', '.join(key_name(k) for k in obs_keys)}); store it "
                "as a sub-TensorDict with one entry per observation key (for example "
                f"{(*prefix, *obs_keys[0])!r})."
            )
        final_of = {obs_keys[0]: prefix}
    else:
        # The observation keys in full, or relative to their common parent (Gymnasium's info).
        final_of = {k: (*prefix, *k) for k in obs_keys}
        parent = _common_parent(obs_keys)
        if parent and any(f not in leaves for f in final_of.values()):
            relative = {k: (*prefix, *k[len(parent) :]) for k in obs_keys}
            if all(f in leaves for f in relative.values()):
                final_of = relative
        missing = ", ".join(key_name(f) for f in final_of.values() if f not in leaves)
        if missing:
            raise InputError(
                f"the final-observation entry {key_name(prefix)} lacks {missing}; it needs one "
                f"entry per observation key ({', '.join(key_name(k) for k in obs_keys)}). Fix "
                "final_obs_key= or the stored entry."
            )
    for k, f in final_of.items():
        check_same_layout(leaves, k, f)
    mask_key = (*prefix[:-1], "_" + prefix[-1])
    if mask_key not in leaves:
        return final_of, None, entry_keys
    entry_keys.add(mask_key)
    mask = leaves[mask_key]
    if mask.dtype != torch.bool or mask.shape[batch_dims:].numel() != 1:
        raise InputError(
            f"the final-observation mask {key_name(mask_key)} must be one torch.bool per "
            f"row; got dtype {mask.dtype} and shape {list(mask.shape)}."
        )
    return final_of, mask_key, entry_keys


def without_empty_final_entry(leaves: dict, declared: tuple | None) -> dict:
    """``leaves`` without a final-observation entry whose mask says it holds nothing.

    For modes other than same-step, where the entry has no use (:func:`cleanbuf.step_rows` writes
    an empty one from a next-step producer's info). An entry with any observation in it is kept.

    Examples:
        >>> leaves = {("obs",): torch.zeros(2), ("next", "final_obs"): torch.zeros(2),
        ...           ("next", "_final_obs"): torch.zeros(2, dtype=torch.bool)}
        >>> sorted(without_empty_final_entry(leaves, None))
        [('obs',)]
    """
    for prefix in [declared] if declared is not None else FINAL_KEYS:
        mask = leaves.get((*prefix[:-1], "_" + prefix[-1]))
        if mask is None:
            continue
        if mask.dtype != torch.bool or bool(mask.any()):
            return leaves
        entry = (*prefix[:-1], "_" + prefix[-1])
        return {k: v for k, v in leaves.items() if k != entry and k[: len(prefix)] != prefix}
    return leaves
