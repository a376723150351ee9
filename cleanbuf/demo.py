"""Demo: TorchRL GymEnv("CartPole-v1", num_envs=8) into two buffers, with and without cleanbuf.

Run with ``python -m cleanbuf.demo`` (needs the ``gym`` extra). It collects
with a TorchRL ``Collector``, writes every batch into a plain buffer and into
one with :class:`cleanbuf.AutoresetFilter`, runs the same env with explicit
resets (the oracle), and prints what the filter found and whether the cleaned
buffer matches the oracle.
"""

from __future__ import annotations

import time
import warnings

import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

from cleanbuf import AutoresetFilter
from cleanbuf._oracle import (
    OracleMismatch,
    collect,
    compare_streams,
    make_env,
    streams_from_batches,
    streams_from_rows,
)

NUM_ENVS, STEPS_PER_BATCH, BATCHES = 8, 64, 8


def main() -> int:
    """Runs the demo; returns the process exit code (0 when the buffer matches)."""
    start = time.perf_counter()
    warnings.filterwarnings("ignore", message="Nested TransformedEnvs")
    frames = NUM_ENVS * STEPS_PER_BATCH
    env = make_env("CartPole-v1", NUM_ENVS)
    filt = AutoresetFilter.for_env(env)
    plain = ReplayBuffer(storage=LazyTensorStorage(100_000))
    cleaned = ReplayBuffer(storage=LazyTensorStorage(100_000), transform=filt)
    for batch in collect(env, frames, frames * BATCHES):
        plain.extend(batch.reshape(-1))
        cleaned.extend(batch)
    filt.flush(cleaned)
    env.close()

    raw = plain[: len(plain)]
    # CartPole pays 1 per real step: a stored reward of 0 is a reset row.
    bogus = int((raw["next", "reward"] == 0).sum())
    done = raw["next", "done"].reshape(-1)
    zeroed = int((raw["next", "observation"][done] == 0).all(-1).sum())

    oracle_env = make_env("CartPole-v1", NUM_ENVS, disabled=True)
    oracle = streams_from_batches(collect(oracle_env, frames, frames * BATCHES))
    oracle_env.close()
    rows = cleaned[: len(cleaned)]
    try:
        compare_streams(streams_from_rows(rows), oracle, min_rows=STEPS_PER_BATCH)
        verdict = "yes, row for row within each stream (lost terminal observations are NaN)"
        code = 0
    except OracleMismatch as err:
        verdict = f"NO: {err}"
        code = 1
    s = filt.stats
    print(f"filter: {filt!r}")
    print(f"rows collected:                          {len(plain)}")
    print(f"bogus reset rows in the plain buffer:    {bogus} ({bogus / len(plain):.1%})")
    print(f"done rows with a zero-filled next obs:   {zeroed} of {int(done.sum())}")
    print(f"reset rows dropped by the filter:        {s['reset_rows_dropped']}")
    print(f"terminal observations restored:          {s['next_obs_restitched']}")
    lost = s["terminal_obs_missing"]
    why = "  (all 8 envs done at once: TorchRL reset them jointly)" if lost else ""
    print(f"terminal observations lost (NaN):        {lost}{why}")
    print(f"rows in the cleaned buffer:              {len(cleaned)}")
    print(f"cleaned buffer matches explicit resets:  {verdict}")
    print(f"({time.perf_counter() - start:.1f} s, torch {torch.__version__})")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
