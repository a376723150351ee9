"""The README's audit example: a buffer filled without the filter, audited and drawn.

``python -m bench.audit_plot [DIR]`` (from the repository root) collects CartPole with TorchRL's
``GymEnv(num_envs=4)`` and a random policy, 64 steps a batch, into
``ReplayBuffer(LazyTensorStorage(1000))`` by ``rb.extend`` of each batch's
rows (1600 rows: the buffer wraps), dumps it to ``DIR/rb`` (default
``runs/rb``), then runs ``cleanbuf audit DIR/rb --plot bench/audit.png``
(the picture in the README) and ``cleanbuf clean DIR/rb DIR/rb_clean``.
"""

from __future__ import annotations

import os
import sys

import torch
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv
from torchrl.envs.utils import RandomPolicy

from cleanbuf.check.cli import main as cli


def dump(path: str) -> None:
    """Collects 1600 CartPole rows into a 1000-row buffer, dumped to ``path``."""
    torch.manual_seed(0)
    env = GymEnv("CartPole-v1", num_envs=4)
    env.set_seed(0)
    rb = ReplayBuffer(storage=LazyTensorStorage(1000))
    collector = Collector(
        env, RandomPolicy(env.action_spec), frames_per_batch=64, total_frames=1600
    )
    try:
        for batch in collector:
            rb.extend(batch.reshape(-1))
    finally:
        collector.shutdown()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    rb.dumps(path)


if __name__ == "__main__":
    runs = sys.argv[1] if len(sys.argv) > 1 else "runs"
    src = os.path.join(runs, "rb")
    dump(src)
    cli(["audit", src, "--plot", os.path.join(os.path.dirname(__file__), "audit.png")])
    cli(["clean", src, os.path.join(runs, "rb_clean"), "--force", "--no-progress"])
    sys.exit(cli(["audit", os.path.join(runs, "rb_clean")]))
