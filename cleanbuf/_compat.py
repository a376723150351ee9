"""The places where cleanbuf leans on what its dependencies do not promise.

Each function here uses a private name or an implementation detail of
torch, tensordict or torchrl (or of CPython), falls back to public behaviour
when that is gone, and has a test in ``tests/test_compat.py`` that fails
when the private name disappears, so a new release shows up there first.
"""

from __future__ import annotations

import sys
from typing import Any


def calling_replay_buffer(max_frames: int = 12) -> Any | None:
    """The TorchRL ``ReplayBuffer`` whose ``extend`` / ``add`` is running the caller.

    A TorchRL transform is not told which buffer it serves; the filter
    needs it once, to check that the buffer's storage takes flat rows. It
    looks up the call stack for a frame whose ``self`` is a replay buffer
    (``sys._getframe``, CPython's and PyPy's). None when there is none (the
    transform called directly) or frames cannot be read.

    Examples:
        >>> calling_replay_buffer() is None
        True
    """
    from torchrl.data import ReplayBuffer

    getframe = getattr(sys, "_getframe", None)
    if getframe is None:
        return None
    frame = getframe(1)
    for _ in range(max_frames):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, ReplayBuffer):
            return owner
        frame = frame.f_back
    return None
