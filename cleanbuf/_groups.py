"""Batches from several producers in turn: which producer a batch continues.

With ``producer_key`` (TorchRL's trajectory ids) the cleaner keeps one carry
per producer, such as each worker of a ``MultiAsyncCollector`` whose batches
are extended from the parent, one worker's ``[E, T]`` batch at a time.
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
    if td.batch_dims < 2 or key not in td.keys(include_nested=True):
        raise InputError(
            f"producer_key={key!r} needs [*E, T] batches holding that key (TorchRL's "
            f"trajectory ids); got batch_size={list(td.batch_size)} and keys "
            f"{sorted(td.keys(True, True), key=str)}. Extend the buffer with the "
            "collector's batches as they come."
        )
    ids = td.get(key).reshape(*td.batch_size).reshape(-1, td.batch_size[-1])
    return ids[:, 0].cpu().numpy(), ids[:, -1].cpu().numpy()


def producer_of(groups: list[Carry], first_ids: np.ndarray) -> int:
    """The producer whose streams a batch continues; ``len(groups)`` for a new one.

    A trajectory id belongs to one stream of one producer (TorchRL draws them
    from one pool for all workers), so a batch whose first row of any stream
    carries the id of a producer's last row continues that producer. A batch
    that continues none is a producer's first, or every stream of its
    producer ended (or restarted) at the batch boundary: then any producer
    whose streams all ended, with nothing held, pending or open, is as good
    as a new one.

    Examples:
        >>> a, b = Carry(traj_ids=np.array([3, 4])), Carry(traj_ids=np.array([5, 6]))
        >>> producer_of([a, b], np.array([7, 6]))  # stream 1 continues trajectory 6
        1
        >>> producer_of([a, b], np.array([8, 9]))  # no stream continues: a blank one
        0
        >>> producer_of([], np.array([8, 9]))  # the first producer
        0
    """
    for g, carry in enumerate(groups):
        if len(carry.traj_ids) == len(first_ids) and np.any(carry.traj_ids == first_ids):
            return g
    for g, carry in enumerate(groups):
        if carry.is_blank():
            return g
    return len(groups)
