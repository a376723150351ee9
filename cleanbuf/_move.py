"""Moves rows of tensors: gathers of runs of consecutive rows.

On the CPU, rows move with the numba run copier on byte views (one memcpy per
run of kept rows; runs are long, as resets are rare). On other devices, rows
move with ``torch.index_select`` on the device; only the flags ever visit the
CPU.
"""

from __future__ import annotations

import numpy as np
import torch

from cleanbuf import _kernels


class Runs:
    """A row index, and its runs of consecutive rows (computed once, used per leaf).

    Args:
        index: int64 source rows, in destination order.

    Examples:
        >>> runs = Runs(np.array([0, 1, 2, 5, 6]))
        >>> runs.length.tolist()
        [3, 2]
    """

    def __init__(self, index: np.ndarray):
        self.index = index
        self.src_start, self.dst_start, self.length = _kernels.index_runs(index)
        self._torch_index: dict = {}

    def __len__(self) -> int:
        return len(self.index)

    def torch_index(self, device: torch.device) -> torch.Tensor:
        """The index as a tensor on ``device`` (cached per device)."""
        if device not in self._torch_index:
            self._torch_index[device] = torch.from_numpy(self.index).to(device)
        return self._torch_index[device]


def _bytes(x: torch.Tensor) -> np.ndarray:
    # x is contiguous; size-1 dimensions may still carry odd strides, which
    # the byte view refuses, so the row-major strides are spelled out.
    flat = x.reshape(x.shape[0], -1)
    flat = flat.as_strided(flat.shape, (flat.shape[1], 1))
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8).numpy()


def gather_into(out: torch.Tensor, offset: int, x: torch.Tensor, runs: Runs) -> None:
    """Writes ``x[runs.index]`` into ``out[offset : offset + len(runs)]``.

    Args:
        out: destination, contiguous, same dtype and trailing shape as ``x``.
        offset: first destination row.
        x: source rows (first dimension is the row).
        runs: the rows to take.

    Examples:
        >>> x = torch.arange(6.0).reshape(3, 2)
        >>> out = torch.zeros(3, 2)
        >>> gather_into(out, 1, x, Runs(np.array([2, 0])))
        >>> out.tolist()
        [[0.0, 0.0], [4.0, 5.0], [0.0, 1.0]]
    """
    if len(runs) == 0:
        return
    if x.device.type != "cpu" or x.numel() == 0 or not x.is_contiguous():
        out[offset : offset + len(runs)] = x.index_select(0, runs.torch_index(x.device))
        return
    _kernels.copy_runs(
        _bytes(x), _bytes(out), offset, runs.src_start, runs.dst_start, runs.length
    )


def gather(x: torch.Tensor, runs: Runs) -> torch.Tensor:
    """Returns ``x[runs.index]`` as a new contiguous tensor.

    Examples:
        >>> gather(torch.arange(5), Runs(np.array([3, 4]))).tolist()
        [3, 4]
    """
    out = torch.empty((len(runs), *x.shape[1:]), dtype=x.dtype, device=x.device)
    gather_into(out, 0, x, runs)
    return out
