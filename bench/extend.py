"""Benchmark: rb.extend of [8, 128] collector batches with and without the filter.

Cases: MuJoCo-like rows (17 float obs, 6 float action) and Atari-like rows
(4x84x84 uint8 obs), with 2% and 10% reset rows. For each case it times,
alternately in one run, a plain ``rb.extend(batch.reshape(-1))`` (the
baseline), ``rb.extend(batch)`` through :class:`cleanbuf.AutoresetFilter`,
and the naive idiom (a transform doing ``td[keep_mask]``), and prints the
medians and the median of the per-round ratios.

Run: ``.venv/bin/python -m bench.extend`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numba
import numpy as np
import tensordict
import torch
import torchrl
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs.transforms import Transform

from cleanbuf import AutoresetFilter

E, T = 8, 128


class NaiveFilter(Transform):
    """The naive idiom: drop rows that follow a done row with ``td[keep_mask]``."""

    def __init__(self):
        super().__init__(in_keys=[], out_keys=[])

    def _inv_call(self, td):
        done = td["next", "done"].squeeze(-1)
        keep = torch.ones_like(done)
        keep[..., 1:] = ~done[..., :-1]
        return td[keep]


def make_batch(kind: str, reset_frac: float, seed: int = 0) -> TensorDict:
    """A next-step [E, T] batch: episodes of ~1/reset_frac - 1 steps, each
    followed by its reset row. No done row in the last two steps, so the
    same batch can be extended again and again with consistent state."""
    rng = np.random.default_rng(seed)
    length = max(1, round(1 / reset_frac) - 1)
    done = np.zeros((E, T), bool)
    reset = np.zeros((E, T), bool)
    for e in range(E):
        t = int(rng.integers(0, length))
        while t < T - 2:
            done[e, t] = True
            reset[e, t + 1] = True
            t += length + 1
    if kind == "mujoco":
        obs = torch.randn(E, T, 17)
        nobs = torch.randn(E, T, 17)
        action = torch.randn(E, T, 6)
    else:
        obs = torch.randint(0, 256, (E, T, 4, 84, 84), dtype=torch.uint8)
        nobs = torch.randint(0, 256, (E, T, 4, 84, 84), dtype=torch.uint8)
        action = torch.randint(0, 6, (E, T, 1))
    reward = torch.ones(E, T, 1)
    reward[torch.from_numpy(reset)] = 0.0
    done_t = torch.from_numpy(done).unsqueeze(-1)
    step = torch.arange(T).expand(E, T).unsqueeze(-1).clone()
    return TensorDict(
        {
            "observation": obs,
            "action": action,
            "is_init": torch.from_numpy(reset).unsqueeze(-1),
            "step_count": step,
            ("collector", "traj_ids"): torch.zeros(E, T, dtype=torch.int64),
            "next": {
                "observation": nobs,
                "reward": reward,
                "done": done_t,
                "terminated": done_t.clone(),
                "truncated": torch.zeros_like(done_t),
                "step_count": step + 1,
            },
        },
        batch_size=[E, T],
    )


def _time(fn, device: str) -> float:
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_case(kind: str, reset_frac: float, rounds: int, device: str = "cpu") -> dict:
    batch = make_batch(kind, reset_frac).to(device)
    capacity = E * T * 4

    def storage():
        return LazyTensorStorage(capacity, device=device)

    rbs = {
        "plain": ReplayBuffer(storage=storage()),
        "filter": ReplayBuffer(storage=storage(), transform=AutoresetFilter()),
        "naive": ReplayBuffer(storage=storage(), transform=NaiveFilter()),
    }
    calls = {
        "plain": lambda: rbs["plain"].extend(batch.reshape(-1)),
        "filter": lambda: rbs["filter"].extend(batch),
        "naive": lambda: rbs["naive"].extend(batch),
    }
    for fn in calls.values():  # warm up: storage allocation, numba, caches
        for _ in range(3):
            fn()
    times = {k: [] for k in calls}
    order = list(calls)
    for r in range(rounds):
        for name in order[r % 3:] + order[: r % 3]:
            times[name].append(_time(calls[name], device))
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = {
        k: statistics.median(a / b for a, b in zip(times[k], times["plain"]))
        for k in ("filter", "naive")
    }
    kept = rbs["filter"].transform[0].stats
    return {
        "case": f"{kind}, {reset_frac:.0%} reset rows",
        "plain_ms": med["plain"] * 1e3,
        "filter_ms": med["filter"] * 1e3,
        "naive_ms": med["naive"] * 1e3,
        "filter_ratio": ratio["filter"],
        "naive_ratio": ratio["naive"],
        "dropped_frac": kept["reset_rows_dropped"] / kept["rows_in"],
    }


def machine(device: str) -> str:
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    return (
        f"{where}; {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s); "
        f"python {platform.python_version()}, torch {torch.__version__}, torchrl "
        f"{torchrl.__version__}, tensordict {tensordict.__version__}, numba "
        f"{numba.__version__}, numpy {np.__version__}"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds (smoke run)")
    parser.add_argument("--device", default="cpu", help="where the batches and storage live")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for kind, rounds in (("mujoco", 200), ("atari", 25)):
        for frac in (0.02, 0.10):
            rows.append(bench_case(kind, frac, 5 if args.quick else rounds, args.device))
    print(machine(args.device))
    print()
    print("| case | plain extend (ms) | with filter (ms) | naive td[keep] (ms) | filter / plain | naive / plain | naive / filter |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['plain_ms']:.3f} | {r['filter_ms']:.3f} | {r['naive_ms']:.3f} | "
            f"{r['filter_ratio']:.2f} | {r['naive_ratio']:.2f} | {r['naive_ratio'] / r['filter_ratio']:.2f} |"
        )


if __name__ == "__main__":
    main()
