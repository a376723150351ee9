"""The places where this side of cleanbuf leans on what torchrl do not promise.

Each function here uses a private name or an implementation detail, falls
back to public behaviour when that is gone, and has a test in
``tests/test_compat.py`` that fails when the private name disappears, so a
new release shows up there first.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any


def storage_tensors(storage: Any) -> Any | None:
    """The TensorDict behind a TorchRL tensor storage, every slot of it.

    ``storage._storage``: the public ``storage.get`` stops at the filled
    slots, and the offline writer gathers rows straight into the next
    ones. None where the name is gone (the writer then copies the rows).
    """
    return getattr(storage, "_storage", None)


INIT = "_init"  # LazyMemmapStorage's method that lays out its files


def lay_out(storage: Any, rows: Any) -> None:
    """Lays out a lazy TorchRL storage's files for ``rows`` without writing a row.

    ``storage._init(rows[0])``, what ``storage.set`` calls on its first
    write: the public ``set`` lays the memory-mapped files out and writes
    through them in one call, and a page written before its blocks are
    allocated kills the process on a full disk. Where the name is gone,
    the first row is written (``set_cursor=False``: not counted), a page
    of each file before they are allocated.
    """
    init = getattr(storage, INIT, None)
    if callable(init):
        init(rows[0])
    else:
        storage.set(slice(0, 1), rows[:1], set_cursor=False)


@contextlib.contextmanager
def quiet_torchrl_log():
    """TorchRL's INFO lines held back for the duration (its logger at WARNING at least).

    TorchRL logs a line as each storage is laid out ("Initialized
    LazyMemmapStorage ..."): the offline writer's storage is a means, not
    something the user made, and the line is noise among a command's
    report or a call's result. The logger's level is put back after.

    Examples:
        >>> with quiet_torchrl_log():
        ...     logging.getLogger("torchrl").level >= logging.WARNING
        True
    """
    log = logging.getLogger("torchrl")
    level = log.level
    log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        log.setLevel(level)
