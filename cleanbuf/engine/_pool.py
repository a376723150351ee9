"""Output buffers reused across calls, so that large copies land in warm memory.

A fresh allocation of a large output (an Atari-like batch is about 58 MB)
costs more in page faults than the copy itself. The pool keeps one buffer
per key and hands it out again only when nothing else references its
memory any more: a tensor storage copies what it is given and drops it, so
the buffer is free again at the next call; a ``ListStorage`` (or a user)
that keeps the rows keeps the memory referenced, and the pool then
allocates a new buffer instead of overwriting rows someone still holds.
"""

from __future__ import annotations

import torch

from cleanbuf.engine._compat import storage_use_count

# Below this many bytes an allocation is cheap (no page faults): no pooling.
MIN_POOLED_BYTES = 1 << 20


_use_count = storage_use_count  # None where torch cannot tell: never reuse


class BufferPool:
    """One reusable output buffer per key.

    Examples:
        >>> pool = BufferPool()
        >>> a = pool.take("obs", (1024, 512), torch.float32, torch.device("cpu"))
        >>> ptr = a.data_ptr()
        >>> del a  # the caller is done with it (a tensor storage copied it)
        >>> pool.take("obs", (1000, 512), torch.float32, torch.device("cpu")).data_ptr() == ptr
        True
        >>> kept = pool.take("obs", (1000, 512), torch.float32, torch.device("cpu"))
        >>> again = pool.take("obs", (1000, 512), torch.float32, torch.device("cpu"))
        >>> again.data_ptr() == kept.data_ptr()
        False
        >>> pool.take("small", (10, 4), torch.float32, torch.device("cpu")) is None
        True
    """

    def __init__(self):
        self._buffers: dict = {}

    def take(
        self, key, shape: tuple, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor | None:
        """An uninitialized tensor of ``shape`` in reused memory.

        None for a small one (cheap to allocate: let the caller allocate it).
        """
        rows, feature = shape[0], tuple(shape[1:])
        row_bytes = dtype.itemsize
        for d in feature:
            row_bytes *= d
        if rows * row_bytes < MIN_POOLED_BYTES:
            return None
        entry = self._buffers.get(key)
        if entry is not None:
            buf, idle = entry
            if (
                buf.dtype == dtype
                and buf.device == device
                and tuple(buf.shape[1:]) == feature
                and buf.shape[0] >= rows
                and _use_count(buf) == idle
            ):
                return buf[:rows]
        buf = torch.empty(shape, dtype=dtype, device=device)
        idle = _use_count(buf)
        if idle is not None:
            self._buffers[key] = (buf, idle)
        return buf[:rows]

    def __getstate__(self) -> dict:
        # Buffers are a cache: never pickle (or deep-copy) them.
        return {}

    def __setstate__(self, state: dict) -> None:
        self._buffers = {}
