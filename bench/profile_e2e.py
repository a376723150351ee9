"""Profiles the filter's end-to-end extends (the cases of ``bench.run --e2e-only``).

``python -m bench.profile_e2e [mujoco|step|clean|atari|repair] [calls]`` prints
cProfile's top functions by total time, cumulative and own, over ``calls``
extends of distinct chained batches through the filter's buffer.
"""

from __future__ import annotations

import cProfile
import pstats
import sys

import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

from bench.run import TRAJ_IDS, Feed, chained
from cleanbuf import AutoresetFilter, RolloutRepair


def setup(case: str, n: int):
    """The call to profile and its feed."""
    if case == "step":
        drop = ("is_init", "step_count", ("next", "step_count"), TRAJ_IDS)
        steps = chained("mujoco", 0.02, 16, n + 3, 1, drop=drop)[0]
        windows = [steps[:, t].clone() for t in range(n + 3)]
        options = {"layout": "step"}
    elif case == "repair":
        windows = chained("mujoco", 0.02, 4, 128, n + 3)
        return RolloutRepair(), Feed(windows)
    else:
        kind = "atari" if case == "atari" else "mujoco"
        frac = 0.0 if case == "clean" else 0.02
        windows = chained(kind, frac, 8, 128, 4 if case == "atari" else n + 3)
        options = {}
    rb = ReplayBuffer(storage=LazyTensorStorage(4096), transform=AutoresetFilter(**options))
    return rb.extend, Feed(windows)


def main() -> None:
    torch.set_num_threads(1)
    case = sys.argv[1] if len(sys.argv) > 1 else "mujoco"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    call, feed = setup(case, n)
    for _ in range(3):
        call(feed.next())
    batches = [feed.next() for _ in range(n)]
    prof = cProfile.Profile()
    prof.enable()
    for b in batches:
        call(b)
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
