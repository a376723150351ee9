"""Moves rows of tensors: one gather per leaf, on the leaf's device.

Rows move with ``torch.index_select`` into a preallocated output (faster
than the numba copiers it was measured against). Rows of at most
``SMALL_ROW_BYTES`` on the CPU (flags, rewards, step counts, MuJoCo-like
observations and actions) move with numpy's ``take`` instead: for them
torch's dispatch costs more than the copy. The measurements behind both
choices are in ``bench/README.md`` ("Design measurements"). Only the flags
ever visit the CPU; on a CUDA device the rows never leave it.
"""

from __future__ import annotations

import numpy as np
import torch

# Rows up to this size on the CPU move with numpy's take (see above).
SMALL_ROW_BYTES = 128


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
    """A call's tensors by key, read as rows: flat tensors and numpy views.

    Each view is made once, on first use.

    A batch ``[*B, ...]`` is read as rows ``[prod(B), ...]``. Flattening a
    tensor costs about a microsecond, and so does ``Tensor.numpy()``; a call
    reads some leaves several times (to move them, to patch them) and most
    leaves only as numpy (small rows move with ``ndarray.take``), so each view is
    made once, and a leaf read only as numpy is never flattened by torch.
    ``views[key]`` is the numpy view of the rows (None where
    :func:`numpy_view` gives none); :meth:`flat` is the tensor of rows.

    Args:
        tensors: key -> tensor, with ``batch_dims`` leading batch dimensions.
        batch_dims: how many leading dimensions make up a row index.
        n_rows: the product of those dimensions (read to shape the numpy
            rows when ``batch_dims`` is not 1, and by
            :func:`cleanbuf.engine._keys.done_flags`; 0 where neither happens).

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


def index_tensor(index: np.ndarray, device=None) -> torch.Tensor:
    """A numpy row index as a tensor on ``device``.

    Without torch's warning about read-only arrays (the shared empty index
    is one: copied, it costs nothing).

    Examples:
        >>> index_tensor(np.array([2, 0])).tolist()
        [2, 0]
    """
    t = torch.from_numpy(index) if index.flags.writeable else torch.tensor(index)
    return t if device is None else t.to(device)


class RowIndex:
    """A row index kept as numpy (for the planner) and as tensors (per device).

    Args:
        index: int64 source rows, in destination order.

    Examples:
        >>> idx = RowIndex(np.array([0, 2]))
        >>> idx.on(torch.device("cpu")).tolist()
        [0, 2]
    """

    def __init__(self, index: np.ndarray):
        self.index = index
        self._tensors: dict = {}

    def __len__(self) -> int:
        return len(self.index)

    def on(self, device: torch.device) -> torch.Tensor:
        """The index as a tensor on ``device`` (cached per device)."""
        if device not in self._tensors:
            self._tensors[device] = index_tensor(self.index, device)
        return self._tensors[device]


def gather(
    x: torch.Tensor,
    rows: RowIndex,
    head: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns ``cat([head, x[rows]])`` as a contiguous tensor, in one pass.

    Args:
        x: source rows (first dimension is the row).
        rows: the rows of ``x`` to take.
        head: rows to put first (the held rows released by this call), or
            None.
        out: where to write (``len(head) + len(rows)`` rows, contiguous), or
            None for a new tensor.

    Examples:
        >>> x = torch.arange(6.0).reshape(3, 2)
        >>> gather(x, RowIndex(np.array([2, 0]))).tolist()
        [[4.0, 5.0], [0.0, 1.0]]
        >>> gather(x, RowIndex(np.array([1])), head=torch.zeros(1, 2)).tolist()
        [[0.0, 0.0], [2.0, 3.0]]
    """
    n_head = 0 if head is None else len(head)
    if out is None and n_head == 0:
        if x.nbytes <= SMALL_ROW_BYTES * len(x) and x.is_cpu:
            a = numpy_view(x)
            if a is not None:
                return torch.from_numpy(a.take(rows.index, axis=0))
        return x.index_select(0, rows.on(x.device))
    index = rows.on(x.device)
    if out is None:
        out = torch.empty((n_head + len(rows), *x.shape[1:]), dtype=x.dtype, device=x.device)
    if n_head:
        out[:n_head] = head.to(x.device)
    torch.index_select(x, 0, index, out=out[n_head:])
    return out
