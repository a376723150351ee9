"""The floor of the one-pass design: what a filter call costs with its structure cached.

A prototype of the per-call path the cost issue asks for, on the e2e
case ``[8, 128]`` MuJoCo-like at 2% reset rows (TorchRL collector rows,
next-step mode, zero-filled terminal observations):

* the schema (leaf keys, observation pairs, flag keys, each leaf's mover,
  the output's nesting) is built once per batch structure and cached;
* per call: one numpy view per flag column, one ``@njit`` pass that
  decides every row (reset rows dropped, the done row's next observation
  taken from the reset row's observation, ``is_init`` of the first kept
  row of an episode, held rows at a call's end, continuity of each stream
  with the carry), one gather per leaf, one patch, one TensorDict build.

It keeps the carry it needs for the case (one held done row per stream
at most, each stream's last next observation) and nothing else: no
retry, no other modes. It is a measure of the design, not a cleaner.
``python -m bench.one_pass`` prints its cost over the no-op transform
next to the filter's, from the same alternated rounds as ``bench.run``.

Measured here (x86_64, 2 cores, torch 2.13.0+cpu, torchrl 0.14.1,
tensordict 0.14.3, numba 0.68.1; other work on the machine): see the
commit that added this file and ``bench/README.md``.
"""

from __future__ import annotations

import statistics

import numba
import numpy as np
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs.transforms import Transform

from bench.data import ReshapeOnly
from bench.run import Feed, alternate_fed, chained
from cleanbuf import AutoresetFilter


@numba.njit(cache=True)
def plan_one_pass(done, reward, obs, nobs, steps, held, last, keep, src, dst):
    """Every per-row decision of a next-step call, in one pass over the rows.

    Args:
        done: ``[N]`` done flags (rows stream-major, ``steps`` a stream).
        reward: ``[N]`` rewards (a reset row's is 0).
        obs: ``[N, D]`` observations (the first row of each stream and the
            rows after a done row are read).
        nobs: ``[N, D]`` next observations (the last row of each stream is read).
        steps: rows per stream.
        held: per stream, the held done row's slot (-1: none); updated.
        last: per stream, the last next observation (continuity); updated.
        keep: out, the rows to emit.
        src: out, the row each stitched next observation comes from.
        dst: out, the output row it goes to (``-1 - s``: stream s's held row).

    Returns:
        ``(kept, stitched, code)``; code 0, or 1: a reset row with a reward
        (the configuration is wrong), 2: a stream does not continue.
    """
    n_streams = done.shape[0] // steps
    kept = 0
    stitched = 0
    for s in range(n_streams):
        base = s * steps
        if last[s, 0] == last[s, 0]:  # not NaN: a stream seen before
            for d in range(obs.shape[1]):
                if obs[base, d] != last[s, d] and held[s] < 0:
                    return kept, stitched, 2
        for t in range(steps):
            r = base + t
            if held[s] >= 0:  # r is the reset row of the held done row
                if reward[r] != 0 or done[r]:
                    return kept, stitched, 1
                src[stitched] = r
                dst[stitched] = -1 - s  # the held row of stream s
                stitched += 1
                held[s] = -1
                continue
            if t > 0 and done[r - 1]:
                if reward[r] != 0 or done[r]:
                    return kept, stitched, 1
                src[stitched] = r
                dst[stitched] = kept - 1
                stitched += 1
                continue
            keep[kept] = r
            kept += 1
        if done[base + steps - 1]:
            held[s] = keep[kept - 1]
            kept -= 1
        for d in range(obs.shape[1]):
            last[s, d] = nobs[base + steps - 1, d]
    return kept, stitched, 0


def leaves_of(td, prefix=()) -> list:
    """``[(key, tensor)]`` of every leaf, walking the TensorDict's own dict.

    About a thirtieth of what the public ``items(True, True)`` takes.
    """
    out = []
    for k, v in td._tensordict.items():
        if isinstance(v, torch.Tensor):
            out.append(((*prefix, k), v))
        else:
            out.extend(leaves_of(v, (*prefix, k)))
    return out


class Schema:
    """What depends only on a batch's structure, computed (and checked) once."""

    def __init__(self, td, leaves: list):
        self.n = td.batch_size.numel()
        self.steps = td.batch_size[-1]
        self.streams = self.n // self.steps
        self.keys = [k for k, _ in leaves]
        self.index = {k: i for i, k in enumerate(self.keys)}
        # the output's nesting, built once: (path of dicts, leaf name) per leaf
        self.nest = [(k[:-1], k[-1]) for k in self.keys]


def signature(td, leaves: list) -> tuple:
    return (td.batch_size, *((k, v.dtype, v.shape) for k, v in leaves))


class OnePass(Transform):
    """The prototype transform (see the module docstring)."""

    def __init__(self):
        super().__init__(in_keys=[], out_keys=[])
        self.schemas: dict = {}
        self.held = None
        self.last = None

    def _inv_call(self, td):
        leaves = leaves_of(td)
        sig = signature(td, leaves)
        schema = self.schemas.get(sig)
        if schema is None:
            schema = self.schemas[sig] = Schema(td, leaves)
        n, ix = schema.n, schema.index
        arrays = [v.numpy().reshape(n, -1) for _, v in leaves]
        obs, nobs = arrays[ix["observation",]], arrays[ix["next", "observation"]]
        done = arrays[ix["next", "done"]].reshape(n)
        reward = arrays[ix["next", "reward"]].reshape(n)
        if self.held is None:
            self.held = np.full(schema.streams, -1, np.int64)
            self.last = np.full((schema.streams, obs.shape[1]), np.nan, obs.dtype)
        held, last = self.held.copy(), self.last.copy()
        keep = np.empty(n, np.int64)
        src = np.empty(n, np.int64)
        dst = np.empty(n, np.int64)
        kept, stitched, code = plan_one_pass(
            done, reward, obs, nobs, schema.steps, held, last, keep, src, dst
        )
        if code:
            raise ValueError(f"code {code}")
        keep = keep[:kept]
        taken = [a.take(keep, 0) for a in arrays]
        src, dst = src[:stitched], dst[:stitched]
        inner = dst >= 0
        taken[ix["next", "observation"]][dst[inner]] = obs[src[inner]]
        out: dict = {}
        for (path, name), a, (_, v) in zip(schema.nest, taken, leaves):
            d = out
            for p in path:
                d = d.setdefault(p, {})
            d[name] = torch.from_numpy(a).view(kept, *v.shape[2:])
        self.held, self.last = held, last
        return TensorDict._new_unsafe(out, batch_size=torch.Size([kept]))


def main() -> None:
    torch.set_num_threads(1)
    rounds = 300
    windows = chained("mujoco", 0.02, 8, 128, rounds + 3)
    rbs = {
        "no-op": ReplayBuffer(storage=LazyTensorStorage(4096), transform=ReshapeOnly()),
        "one-pass": ReplayBuffer(storage=LazyTensorStorage(4096), transform=OnePass()),
        "filter": ReplayBuffer(storage=LazyTensorStorage(4096), transform=AutoresetFilter()),
    }
    feeds = {name: Feed(windows) for name in rbs}
    times = alternate_fed({k: rb.extend for k, rb in rbs.items()}, feeds, rounds)
    for name in ("one-pass", "filter"):
        cost = statistics.median(a - b for a, b in zip(times[name], times["no-op"]))
        print(f"{name}: {cost * 1e6:.0f} us over the no-op transform per [8, 128] extend")


if __name__ == "__main__":
    main()
