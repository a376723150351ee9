"""The interpreter-exit check: held rows that no flush ever stored are said.

A filter warns when it is garbage-collected while holding rows (a
forgotten ``filt.flush(rb)``). A ``Collector(..., replay_buffer=rb)``
keeps the buffer and its filter alive to the end of the process, so that
warning never comes; this one does: at interpreter exit, each filter
still alive and holding rows warns once (on stderr, as warnings go).
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any

_FILTERS: weakref.WeakSet = weakref.WeakSet()  # every live filter (weakly: none kept alive)
_REGISTERED = False


def watch(filt: Any) -> None:
    """Adds a filter to those looked at on exit (registers the exit hook once)."""
    global _REGISTERED
    if not _REGISTERED:
        atexit.register(_say_held)
        _REGISTERED = True
    _FILTERS.add(filt)


def _say_held() -> None:
    """Each live filter holding rows never stored warns (see ``_say_unflushed_at_exit``)."""
    for filt in list(_FILTERS):
        try:
            filt._say_unflushed_at_exit()
        except Exception:  # a half-built filter, a warning filter set to "error"
            pass
