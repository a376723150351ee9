"""Batches from several producers in turn: which producer a batch continues.

With ``producer_key`` (TorchRL's trajectory ids), or inside a Ray actor,
the cleaner keeps one carry per producer: each worker of a
``MultiAsyncCollector`` whose batches are extended from the parent, one
worker's ``[E, T]`` batch at a time, or each Ray collector extending one
Ray replay buffer.
"""

from __future__ import annotations

import numpy as np
from tensordict import TensorDictBase

from cleanbuf._carry import Carry
from cleanbuf._errors import InputError


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


def candidates(groups: list[Carry], first_ids: np.ndarray) -> tuple[list[int], list[int]]:
    """The producers a batch may continue, most likely first.

    A trajectory id belongs to one stream of one producer when the
    producers draw them from one pool (a multi-process collector's workers
    do), so a batch whose first row of any stream carries the id of a
    producer's last row continues that producer. Producers with pools of
    their own (each Ray collector has one) can share ids, so the
    observations decide among the matching ones (the cleaner's continuity
    check). A batch that continues none is a producer's first, or every
    stream of its producer ended (or restarted) at the batch boundary: then
    any producer whose streams all ended, with nothing held, pending or
    open, is as good as a new one.

    Returns:
        ``(matching, others)``: the producers sharing a trajectory id with
        the batch, in order; then the blank ones and ``len(groups)`` (a new
        producer).

    Examples:
        >>> a, b = Carry(traj_ids=np.array([3, 4])), Carry(traj_ids=np.array([5, 6]))
        >>> candidates([a, b], np.array([7, 6]))  # stream 1 continues trajectory 6
        ([1], [0, 1, 2])
        >>> candidates([a, b], np.array([5, 4]))  # either: the observations decide
        ([0, 1], [0, 1, 2])
        >>> candidates([], np.array([8, 9]))  # the first producer
        ([], [0])
    """
    matching = [
        g
        for g, carry in enumerate(groups)
        if len(carry.traj_ids) == len(first_ids) and np.any(carry.traj_ids == first_ids)
    ]
    blank = [g for g, carry in enumerate(groups) if carry.is_blank()]
    return matching, [*blank, len(groups)]
