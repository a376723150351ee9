"""A filter's copies publishing their states, so the original sees them all.

Once the buffer is shared with worker processes (TorchRL calls the
filter's ``share_memory_``) or the filter is pickled while Ray runs (for a
Ray actor), every copy of the filter publishes its cleaner's state after
each call: to a directory (:class:`~cleanbuf.online._copies.CopyStates`) or
to a small Ray actor (:class:`~cleanbuf.online._ray.RayStates`). The filter
that the user holds sums their counters and flushes their held rows.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from cleanbuf.engine._cleaner import STAT_NAMES, Cleaner
from cleanbuf.engine._options import Options
from cleanbuf.online._copies import CopyStates, new_copy_name
from cleanbuf.online._ray import RayStates, ray_running


class Copies:
    """Where a filter's copies publish, and the name this copy publishes under.

    Pickled into another process (or copied), it forgets its name: each
    copy publishes under its own, drawn at its first publication there.

    Examples:
        >>> copies = Copies(CopyStates())
        >>> copies.publish({"stats": {"rows_in": 3}})
        >>> list(copies.load().values())
        [{'stats': {'rows_in': 3}}]
    """

    def __init__(self, states: CopyStates | RayStates):
        self.states = states
        self._own: tuple[int, str] | None = None  # (pid, name) of this copy

    def __getstate__(self) -> dict:
        return {"states": self.states, "_own": None}

    @property
    def own(self) -> str:
        """This copy's name (a new one in a new process)."""
        pid = os.getpid()
        if self._own is None or self._own[0] != pid:
            self._own = (pid, new_copy_name())
        return self._own[1]

    def publish(self, state: dict) -> None:
        """Publishes this copy's state (replacing the one it published before)."""
        self.states.publish(self.own, state)

    def add(self, state: dict) -> None:
        """Publishes another copy's state under a new name (a checkpoint's copies)."""
        self.states.publish(new_copy_name(), state)

    def load(self) -> dict:
        """Every copy's last published state, by copy name (sorted)."""
        return self.states.load()

    def others(self) -> list:
        """Every other copy's last published state."""
        own = self.own
        return [s for n, s in self.load().items() if n != own]


def shared(states: CopyStates | RayStates, state: dict) -> Copies:
    """Starts publishing: the copies' store, with ``state`` (this copy's) in it."""
    copies = Copies(states)
    copies.publish(state)
    return copies


def for_ray(copies: Copies | None, state: dict) -> Copies | None:
    """The store a filter pickled now should take along.

    Pickled while Ray runs, for a Ray actor: a Ray store, unless the filter
    publishes already.
    """
    if copies is None and ray_running():
        return shared(RayStates(), state)
    return copies


def summed_stats(states: dict) -> dict:
    """The counters summed over every copy's last published state (``states``)."""
    total = dict.fromkeys(STAT_NAMES, 0)
    for state in states.values():
        for k, v in state["stats"].items():
            total[k] += int(v)
    return total


def flush_copies(
    copies: Copies, options: Options, write: Callable[[TensorDictBase], Any] | None
) -> tuple[TensorDictBase, dict]:
    """Flushes every copy's last published state (the buffer is shared).

    Their held rows, in one write; each copy's state then shows them
    stored. Call it once the workers are done (after the collector's
    ``shutdown()``): a worker still running would publish its state
    again, held rows included.

    Args:
        copies: the store, with this copy's current state published.
        options: the filter's options.
        write: stores the rows (may raise: then no state is rewritten);
            None to return them.

    Returns:
        ``(rows, this copy's cleaner state after the flush)``, for its
        cleaner to load.
    """
    cleaners, states = {}, copies.load()
    for name, state in states.items():
        cleaners[name] = Cleaner(options)
        cleaners[name].load_state_dict(state)
    parts = [c.flush() for c in cleaners.values()]
    parts = [p for p in parts if p.batch_size[0]]
    rows = torch.cat(parts) if parts else TensorDict({}, batch_size=[0])
    if write is not None and rows.batch_size[0]:
        write(rows)  # raises before any state is rewritten
    flushed = {name: cleaner.state_dict() for name, cleaner in cleaners.items()}
    for name, state in flushed.items():  # what else a copy published stays
        copies.states.publish(name, {**states[name], **state})
    return rows, flushed[copies.own]


def check_states(states: list, options: Options) -> None:
    """Refuses a checkpoint's copy states that a cleaner with ``options`` cannot load.

    Raises:
        InputError: a state is not a cleanbuf state, or has other options.
    """
    for state in states:
        Cleaner(options).load_state_dict(state)


def add_copies(copies: Copies | None, states: list) -> Copies | None:
    """Publishes a checkpoint's other copies' ``states``; returns the store.

    A filter that did not publish yet starts publishing to a directory.
    """
    if states and copies is None:
        copies = Copies(CopyStates())
    for state in states:
        copies.add(state)
    return copies
