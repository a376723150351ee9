"""Ray: the filter's copies in Ray actors, seen from the driver.

TorchRL's Ray replay buffer (``RayReplayBuffer(..., transform=filt)``)
pickles the filter into its actor, and a ``RayCollector`` pickles its
collectors' arguments (a filter given as ``postproc``) into each collector
actor. A filter pickled while Ray is running publishes every copy's state
(counters, held rows, per-stream flags) to a small Ray actor after each
call, so that the filter on the driver sums the counters and stores every
copy's held rows, also those of a collector actor that was killed, and on
any node. A state is published before the call that made it returns.

Ray's ``__ray_call__`` (a developer API of Ray actors) runs the flush of
the buffer actor's own copy inside that actor, where its buffer is.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any


def ray_running() -> bool:
    """Whether Ray is imported and initialised in this process."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


@functools.cache
def _in_actor(pid: int) -> bool:
    import ray

    return ray.get_runtime_context().get_actor_id() is not None


def in_ray_actor() -> bool:
    """Whether this process is a Ray actor (once Ray is initialised in it).

    Examples:
        >>> in_ray_actor()
        False
    """
    return ray_running() and _in_actor(os.getpid())


def is_ray_buffer(rb: Any) -> bool:
    """Whether ``rb`` is TorchRL's Ray replay buffer (the driver's handle on its actor)."""
    return getattr(rb, "service_backend", None) == "ray" and hasattr(rb, "_rb")


class _Store:
    """The Ray actor behind :class:`RayStates`."""

    def __init__(self):
        self.states: dict = {}

    def publish(self, name: str, state: dict) -> None:
        self.states[name] = state

    def load(self) -> dict:
        return dict(sorted(self.states.items()))


class RayStates:
    """Per-copy filter states held by a Ray actor (the Ray twin of ``CopyStates``).

    The actor takes no CPU and lives while a handle does: the driver's
    filter and its copies hold one.
    """

    def __init__(self):
        import ray

        self.actor = ray.remote(num_cpus=0)(_Store).remote()

    def publish(self, name: str, state: dict) -> None:
        """Stores one copy's state (replacing the one it published before)."""
        import ray

        ray.get(self.actor.publish.remote(name, state))

    def load(self) -> dict:
        """Every copy's last published state, by copy name (sorted)."""
        import ray

        return ray.get(self.actor.load.remote())


def flush_buffer_actor(rb: Any, filter_type: type) -> bool:
    """Flushes the filter inside a Ray replay buffer's actor, into that buffer.

    Args:
        rb: the driver's handle on the Ray replay buffer.
        filter_type: the filter's class (Ray sends it to the actor by
            reference), whose instance among the buffer's transforms is
            flushed.

    Returns:
        Whether the buffer's actor has a filter (False: nothing was done).
    """
    import ray

    return ray.get(rb._rb.__ray_call__.remote(_flush_here, filter_type))


def _flush_here(actor_rb: Any, filter_type: type) -> bool:
    for t in getattr(actor_rb, "_transform", None) or ():
        if isinstance(t, filter_type):
            t.flush(actor_rb)
            return True
    return False
