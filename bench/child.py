"""Measurements that need a fresh process: start-up time and peak memory.

Run by ``bench/run.py`` as ``python -m bench.child startup plain|numba|filter`` or
``python -m bench.child memory plain|filter``; prints one JSON line.
"""

from __future__ import annotations

import gc
import json
import resource
import sys
import time

T0 = time.perf_counter()


def startup(variant: str) -> dict:
    """Imports, builds a buffer, extends it once with a small batch."""
    import torch
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    t1 = time.perf_counter()
    transform = None
    if variant == "filter":
        import cleanbuf

        transform = cleanbuf.AutoresetFilter()
    elif variant == "numba":  # the floor of numba kernels: import numba, call one cached kernel
        from bench.numba_floor import first_call

        first_call()
    E, T = 8, 128
    done = torch.zeros(E, T, 1, dtype=torch.bool)
    done[:, 10] = True
    reward = torch.ones(E, T, 1)
    reward[:, 11] = 0
    batch = TensorDict(
        {
            "observation": torch.zeros(E, T, 17),
            ("next", "observation"): torch.zeros(E, T, 17),
            ("next", "reward"): reward,
            ("next", "done"): done,
        },
        [E, T],
    )
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=transform)
    rb.extend(batch if variant == "filter" else batch.reshape(-1))
    t2 = time.perf_counter()
    return {"total_s": t2 - T0, "torch_import_s": t1 - T0, "after_import_s": t2 - t1}


def _status_bytes(field: str) -> int | None:
    """A memory field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes,
    or None where there is none.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def _peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM: unlike ru_maxrss,
    it does not inherit the parent's peak across fork and exec).
    """
    peak = _status_bytes("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if peak is None else peak


def _rss() -> int:
    """This process's resident memory now, in bytes (0 where unknown)."""
    return _status_bytes("VmRSS") or 0


def memory(variant: str) -> dict:
    """Streams 1 GB of Atari-like [8, 128] batches into a 4-batch buffer; peak RSS.

    Both variants import cleanbuf and run its kernels once on a tiny batch
    (numba, LLVM and the loaded kernels weigh about 150 MB), then extend a
    throwaway buffer of their own kind once with a small Atari-like batch.
    ``warm_bytes``, the resident memory after that warm-up, shows what the
    filter's process holds once, whatever it streams (about 0.6 MiB more
    than the plain one: code and state its first extend touches). The
    difference of the peaks is that plus what the filter holds for the
    data.
    """
    import torch
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    import cleanbuf
    from bench.data import make_batch

    torch.set_num_threads(1)
    cleanbuf.clean(make_batch("mujoco", 0.10, n_envs=2, steps=32))

    def buffer(capacity: int) -> ReplayBuffer:
        transform = cleanbuf.AutoresetFilter() if variant == "filter" else None
        return ReplayBuffer(storage=LazyTensorStorage(capacity), transform=transform)

    def extend(rb: ReplayBuffer, batch) -> None:
        rb.extend(batch if variant == "filter" else batch.reshape(-1))

    extend(buffer(256), make_batch("atari", 0.10, n_envs=2, steps=32))
    gc.collect()  # a transform and its buffer form a cycle
    warm = _rss()
    batch_bytes = 0
    streamed = 0
    rb = buffer(4 * 1024)
    template = make_batch("atari", 0.02)
    ids = template.get(("collector", "traj_ids"))
    while streamed < 2**30:
        batch = template.clone()  # fresh memory each batch, as a collector hands over
        batch.set(("collector", "traj_ids"), ids + 10**6 * (streamed // 2**20))  # never reused
        batch_bytes = sum(v.numel() * v.element_size() for v in batch.values(True, True))
        extend(rb, batch)
        streamed += batch_bytes
        del batch
    peak = _peak_rss()
    return {
        "peak_bytes": peak,
        "warm_bytes": warm,
        "batch_bytes": batch_bytes,
        "streamed_bytes": streamed,
    }


if __name__ == "__main__":
    what, variant = sys.argv[1], sys.argv[2]
    print(json.dumps({"startup": startup, "memory": memory}[what](variant)))
