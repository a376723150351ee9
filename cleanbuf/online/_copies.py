"""The states of a filter's copies in other processes, for one view of them all.

A multi-process TorchRL collector given the buffer
(``MultiSyncCollector(..., replay_buffer=rb)``) shares the buffer (TorchRL
calls each transform's ``share_memory_``) and pickles it, filter included,
into every worker; each worker extends the buffer through its own copy. Once
shared, every copy publishes its state (counters, held rows, per-stream
flags) to one directory after each call, so that the filter in the parent
can sum the counters and store every copy's held rows at the end, also the
last published state of a worker that died.

A state is a file per copy, written whole and renamed into place, so a
reader never sees half a state.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
import weakref

import torch


def _remove(path: str, owner: int) -> None:
    if os.getpid() == owner:  # not a forked worker's exit
        shutil.rmtree(path, ignore_errors=True)


class CopyStates:
    """A directory of per-copy states, removed when its creator is collected.

    Examples:
        >>> states = CopyStates()
        >>> states.publish("a", {"stats": {"rows_in": 3}})
        >>> states.load()
        {'a': {'stats': {'rows_in': 3}}}
    """

    def __init__(self):
        self.path = tempfile.mkdtemp(prefix="cleanbuf-")
        self._finalizer = weakref.finalize(self, _remove, self.path, os.getpid())

    def __getstate__(self) -> dict:
        return {"path": self.path}  # copies read and write; only the creator removes

    def __setstate__(self, state: dict) -> None:
        self.path = state["path"]

    def publish(self, name: str, state: dict) -> None:
        """Writes one copy's state (replacing the one it published before)."""
        tmp = os.path.join(self.path, f".{name}.{os.getpid()}.tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(self.path, f"{name}.pt"))

    def load(self) -> dict:
        """Every copy's last published state, by copy name (sorted)."""
        names = sorted(f[:-3] for f in os.listdir(self.path) if f.endswith(".pt"))
        return {n: torch.load(os.path.join(self.path, f"{n}.pt")) for n in names}


def new_copy_name() -> str:
    """A name for this process's copy of a filter."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
