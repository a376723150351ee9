"""The storage check: the buffer a filter writes into must take flat rows."""

from __future__ import annotations

from typing import Any

from tensordict import TensorDictBase

from cleanbuf.engine._errors import LayoutError
from cleanbuf.engine._keys import TRAJ_IDS


def is_storage_init(td: TensorDictBase) -> bool:
    """Whether ``td`` is TorchRL's storage-initialisation batch.

    A multi-process collector writes it to initialise the buffer's storage
    before its workers start (all zeros, one step, trajectory ids
    included), and removes it right after with ``rb.empty()``.
    """
    if not td.batch_dims or td.batch_size[-1] != 1 or TRAJ_IDS not in td.keys(True, True):
        return False
    return not any(v.any() for v in td.values(True, True))


def check_storage(rb: Any = None) -> None:
    """Refuses a buffer that cannot take the filter's rows.

    The filter's output is flat rows, which TorchRL cannot write into a
    storage with more than one batch dimension (it fails after the
    filter has moved on). A ``RayReplayBuffer(transport="distributed")``
    binds the size of an extend's reply at its first extend, and the
    number of rows the filter leaves changes from call to call. The buffer
    is the one whose ``extend`` / ``add`` runs the caller (none: nothing
    to check).

    Args:
        rb: the buffer (:func:`~cleanbuf.online._compat.calling_replay_buffer`),
            or None.

    Raises:
        LayoutError: the buffer cannot take flat rows of varying number.

    Examples:
        >>> check_storage()  # no buffer calling: nothing to refuse
    """
    if getattr(rb, "_distributed_service", None) is not None:
        raise LayoutError(
            "this RayReplayBuffer uses transport='distributed', which fixes the size of "
            "every extend's reply at the first extend; the number of rows AutoresetFilter "
            "leaves differs from call to call, so the second extend would fail. Use "
            "transport='ray' (the default). Nothing was written."
        )
    storage = getattr(rb, "storage", None) if rb is not None else None
    ndim = getattr(storage, "ndim", 1)
    if ndim > 1:
        raise LayoutError(
            f"the buffer's storage has ndim={ndim} ({type(storage).__name__}), but "
            "AutoresetFilter stores flat rows (each episode's reset rows are gone, so the "
            "[E, T] shape of a batch cannot be kept). Build the storage with ndim=1 (the "
            "default): the rows keep their ('collector', 'traj_ids'), and a SliceSampler "
            "with traj_key=('collector', 'traj_ids') samples sequences from them. "
            "Nothing was written."
        )
