"""The places where this side of cleanbuf leans on what torchrl do not promise.

Each function here uses a private name or an implementation detail, falls
back to public behaviour when that is gone, and has a test in
``tests/test_compat.py`` that fails when the private name disappears, so a
new release shows up there first.
"""

from __future__ import annotations

from typing import Any


def storage_tensors(storage: Any) -> Any | None:
    """The TensorDict behind a TorchRL tensor storage, every slot of it.

    ``storage._storage``: the public ``storage.get`` stops at the filled
    slots, and the offline writer gathers rows straight into the next
    ones. None where the name is gone (the writer then copies the rows).
    """
    return getattr(storage, "_storage", None)
