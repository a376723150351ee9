"""The start-up floor of any numba kernel: one trivial kernel, cached like cleanbuf's.

A process that calls a cached numba kernel pays for importing numba and, on
the first call, for numba's typing and target contexts (its registries, its
runtime), whatever the kernel does. ``bench.child`` measures that floor by
calling :func:`first_call` in the same process as a plain extend.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True)
def _count(flags):
    n = 0
    for f in flags:
        n += f
    return n


def first_call() -> int:
    """Calls the kernel once (from numba's cache after the first process).

    Examples:
        >>> first_call()
        3
    """
    return int(_count(np.array([1, 0, 1, 1], np.uint8)))
