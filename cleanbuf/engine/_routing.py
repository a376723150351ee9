"""Several producers: which producer's carry a batch continues.

With ``producer_key`` (TorchRL's trajectory ids), or inside a Ray actor, the
cleaner keeps one carry per producer (each ``MultiAsyncCollector`` worker whose
``[E, T]`` batches the parent extends, or each Ray collector extending one Ray
replay buffer). :func:`producer_key` says whether a batch is routed at all;
:func:`route` cleans it against the first producer it continues.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tensordict import TensorDictBase

from cleanbuf.engine._errors import ContinuityError, InputError
from cleanbuf.engine._keys import TRAJ_IDS, Views
from cleanbuf.engine._options import Options
from cleanbuf.engine._read import Fingerprint, restart_rows
from cleanbuf.engine._state import Carry


def route(
    cleaner: Any, td: TensorDictBase, key: tuple, before: Fingerprint | None
) -> TensorDictBase:
    """Cleans ``td`` against the carry of its producer; returns ``cleaner.clean``'s result.

    Tries the producers in :func:`candidates`' order; a refusal changes
    nothing. With one id pool (``producer_key``), a batch sharing ids with
    producers it does not continue is refused (skipped or repeated); where
    producers may share ids (``cleaner.many_producers``), it starts a new one.

    Args:
        cleaner: the cleaner (its ``state``, ``options``, ``many_producers``, ``clean``).
        td: the batch, ``[*E, T]``.
        key: the trajectory-id key (:func:`producer_key`).
        before: the last call's fingerprint (or None), passed to ``cleaner.clean``.
    """
    state = cleaner.state
    producers = state.producers
    first, last = trajectory_ends(td, key)
    restarts = None
    if cleaner.many_producers and cleaner.options.producer_key is None:
        # pools of their own: ids shared by chance
        restarts = first_restarts(td, cleaner.options)
    matching, others = candidates(producers, first, restarts)
    refused = None
    for producer in matching:
        try:
            out = _clean_as(cleaner, producer, td, before)
            break
        except ContinuityError as err:
            refused = refused or err
    else:
        if refused is not None and not cleaner.many_producers:
            raise refused
        for producer in others:  # the last, a new producer, refuses nothing
            try:
                out = _clean_as(cleaner, producer, td, before)
                break
            except ContinuityError:
                continue  # an id it shares by chance: its open streams say no
    state.carry.traj_ids = last
    if producer == len(producers):
        producers.append(state.carry)
    producers[producer] = state.carry
    state.stats["rows_held"] = sum(len(c.held_stream) for c in producers)
    return out


def _clean_as(
    cleaner: Any, producer: int, td: TensorDictBase, before: Fingerprint | None
) -> TensorDictBase:
    """``cleaner.clean`` against producer ``producer``'s carry (a new one past the last)."""
    producers = cleaner.state.producers
    cleaner.state.carry = producers[producer] if producer < len(producers) else Carry()
    return cleaner.clean(td, before)  # commits into state.carry, or raises having changed nothing


def trajectory_ends(td: TensorDictBase, key: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The trajectory ids of the first and of the last row of each stream.

    Raises:
        InputError: the batch is not ``[*E, T]`` or has no such key.
    """
    ids = td.get(key, None) if td.batch_dims >= 2 else None  # get: see Cleaner._producer_key
    if ids is None:
        raise InputError(
            f"producer_key={key!r} needs [*E, T] batches holding that key (TorchRL's "
            f"trajectory ids); got batch_size={list(td.batch_size)} and keys "
            f"{sorted(td.keys(True, True), key=str)}. Extend the buffer with the "
            "collector's batches as they come."
        )
    ids = ids.reshape(*td.batch_size).reshape(-1, td.batch_size[-1])
    return ids[:, 0].cpu().numpy(), ids[:, -1].cpu().numpy()


def first_restarts(td: TensorDictBase, options: Options) -> np.ndarray | None:
    """Per stream, whether the batch's first row starts an episode after a real reset.

    :func:`cleanbuf.engine._read.restart_rows` of each stream's first row; None
    when the batch says nothing of resets. ``td`` is ``[*E, T]``.
    """
    dim = td.batch_dims - 1  # time
    first = {}
    for key in (options.is_init_key, options.step_count_key):
        value = td.get(key, None) if key is not None else None  # (a lazy stack: get, not keys)
        if value is not None:
            first[key] = value.select(dim, 0)
    restart = restart_rows(options, Views(first, dim, int(np.prod(td.batch_size[:-1]))))
    return restart if len(restart) else None


def candidates(
    producers: list[Carry], first_ids: np.ndarray, restarts: np.ndarray | None = None
) -> tuple[list[int], list[int]]:
    """The producers a batch may continue, most likely first.

    A stream keeps its trajectory id until its episode ends (a batch-end mark
    aside); a new episode takes an id above every id its producer gave. So a
    producer's next batch has, per stream, its last row's id or one above all
    of them. With separate id pools (Ray) ids are shared by chance, and the
    continuity check decides among the candidates.

    Args:
        producers: one carry per producer (``traj_ids``: its last rows' ids).
        first_ids: the batch's first trajectory id per stream.
        restarts: per stream, the batch's first row restarts it (separate id
            pools only: a restart takes a new id, so a shared one is chance).

    Returns:
        ``(matching, others)``: the consistent producers sharing an id with
        the batch on an open stream, then those sharing one only on ended
        streams; then the other consistent ones (closest ids below first),
        those sharing an id by chance, the blank ones and ``len(producers)``
        (a new producer).

    Examples:
        >>> a, b = Carry(traj_ids=np.array([3, 4])), Carry(traj_ids=np.array([5, 6]))
        >>> candidates([a, b], np.array([7, 6]))  # stream 1 continues trajectory 6
        ([1], [0, 2])
        >>> candidates([a, b], np.array([3, 6]))  # 6 > 4, but 3 < 6: a (b, blank, as new)
        ([0], [1, 2])
        >>> candidates([a, b], np.array([8, 9]))  # every stream restarted: closest first
        ([], [1, 0, 2])
        >>> candidates([], np.array([8, 9]))  # the first producer
        ([], [0])
        >>> candidates([a, b], np.array([5, 6]), restarts=np.array([True, True]))
        ([], [0, 1, 2])
    """
    matching, ended, restarted, by_chance = [], [], [], []
    for g, carry in enumerate(producers):
        last = carry.traj_ids
        if len(last) != len(first_ids):
            continue
        same = last == first_ids
        if not np.all(same | (first_ids > last.max())):
            continue
        open_ = carry.last.open
        if len(open_) != len(same):
            open_ = np.zeros(len(same), np.bool_)
        if np.any(open_ & ~same):
            continue  # an open stream keeps its id
        if restarts is not None and np.any(same & restarts):
            by_chance.append(g)
        elif np.any(same & open_):
            matching.append(g)
        elif same.any():  # only on ended streams (continuity cannot refuse those)
            ended.append(g)
        else:
            restarted.append((int(first_ids.min() - last.max()), g))
    matching += ended
    blank = [g for g, carry in enumerate(producers) if carry.is_blank()]
    others = [g for _, g in sorted(restarted)] + by_chance
    others += [g for g in blank if g not in others and g not in matching]
    return matching, [*others, len(producers)]


def producer_key(options: Options, many_producers: bool, td: TensorDictBase) -> tuple | None:
    """The key that tells the batch's producer, or None for one producer."""
    key = options.producer_key
    if key is not None or not many_producers:
        return key
    if options.layout in (None, "time_last") and td.batch_dims >= 2:
        # get, not keys(): a LazyStackedTensorDict (a batch Ray carried)
        # does not list its nested keys as containing them.
        if td.get(TRAJ_IDS, None) is not None:
            return TRAJ_IDS
    return None
