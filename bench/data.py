"""Synthetic collector batches and the baselines the benchmarks compare against."""

from __future__ import annotations

import numba
import numpy as np
import torch
from tensordict import TensorDict
from torchrl.envs.transforms import Transform

from cleanbuf.engine._write import ROW_LOOP_BYTES, SMALL_ROW_BYTES, as_td

E, T = 8, 128


def make_batch(
    kind: str, reset_frac: float, n_envs: int = E, steps: int = T, seed: int = 0, device=None
) -> TensorDict:
    """A next-step [n_envs, steps] batch shaped like TorchRL collector output
    (``device=None``, as TorchRL's ``Collector`` yields it, unless ``device``
    is given).

    Episodes last about ``1 / reset_frac - 1`` steps, each followed by its
    reset row (reward 0, is_init, step_count 0). No done row in the last two
    steps, and each stream's observations chain as a collector's do (a row's
    next observation is the next row's observation, the last row's is the
    first row's; a done row's is zero-filled), so the same batch can be
    extended again and again with a consistent filter state and the
    filter's continuity check passes. Use :func:`alternating` for the
    trajectory ids of consecutive calls. ``reset_frac=0`` gives a batch
    without episode ends. ``kind`` is "mujoco" (17 float obs, 6 float
    action) or "atari" (4x84x84 uint8 obs).
    """
    rng = np.random.default_rng(seed)
    done = np.zeros((n_envs, steps), bool)
    reset = np.zeros((n_envs, steps), bool)
    if reset_frac > 0:
        length = max(1, round(1 / reset_frac) - 1)
        for e in range(n_envs):
            t = int(rng.integers(0, length))
            while t < steps - 2:
                done[e, t] = True
                reset[e, t + 1] = True
                t += length + 1
    if kind == "mujoco":
        states = torch.randn(n_envs, steps, 17)
        action = torch.randn(n_envs, steps, 6)
    else:
        states = torch.randint(0, 256, (n_envs, steps, 4, 84, 84), dtype=torch.uint8)
        action = torch.randint(0, 6, (n_envs, steps, 1))
    obs = states
    nobs = torch.roll(states, -1, dims=1)  # the last row's next observation is the first row's
    nobs[torch.from_numpy(done)] = 0  # TorchRL zero-fills a done row's next observation
    reward = torch.ones(n_envs, steps, 1)
    reward[torch.from_numpy(reset)] = 0.0
    done_t = torch.from_numpy(done).unsqueeze(-1)
    step = torch.arange(steps).expand(n_envs, steps).unsqueeze(-1).clone()
    return TensorDict(
        {
            "observation": obs,
            "action": action,
            "is_init": torch.from_numpy(reset).unsqueeze(-1),
            "step_count": step,
            ("collector", "traj_ids"): torch.from_numpy(
                np.cumsum(reset, axis=1) + 1000 * np.arange(n_envs)[:, None]
            ),
            "next": {
                "observation": nobs,
                "reward": reward,
                "done": done_t,
                "terminated": done_t.clone(),
                "truncated": torch.zeros_like(done_t),
                "step_count": step + 1,
            },
        },
        batch_size=[n_envs, steps],
        device=device,
    )


def alternating(batch: TensorDict) -> list:
    """The batch and a twin whose trajectory ids are new (the tensors are
    shared): extending them in turn is what a collector's consecutive calls
    look like (a trajectory id is never reused), where extending one batch
    again and again is a write repeated after a failure.
    """
    twin = batch.clone(recurse=False)
    twin.set(("collector", "traj_ids"), batch.get(("collector", "traj_ids")) + 10**6)
    return [batch, twin]


class NaiveFilter(Transform):
    """The naive idiom: drop the rows that follow a done row with ``td[keep_mask]``
    (as TorchRL's ``PolicyAgeFilter`` filters).
    """

    def __init__(self):
        super().__init__(in_keys=[], out_keys=[])

    def _inv_call(self, td):
        done = td["next", "done"].squeeze(-1)
        keep = torch.ones_like(done)
        keep[..., 1:] = ~done[..., :-1]
        return td[keep]


class ReshapeOnly(Transform):
    """The floor of TorchRL's transform machinery: a transform that only flattens
    (``td.reshape(-1)``, which keeps the batch's device, None for a collector
    batch, so the storage runs ``to()`` before writing, as for a plain extend).
    """

    def __init__(self):
        super().__init__(in_keys=[], out_keys=[])

    def _inv_call(self, td):
        return td.reshape(-1)


class MinimalCompaction(Transform):
    """The floor of any compacting filter: a precomputed row index, one gather
    per leaf, an unchecked TensorDict build. No planning, no patching, no
    state: what is left for cleanbuf to spend is above this.

    Each leaf moves the cheapest way we know, the way cleanbuf moves it:
    rows of at most ``SMALL_ROW_BYTES`` on the CPU with numpy's ``take``,
    larger rows with ``index_select``.

    ``keep_index`` is one index for every call, or a list of them used in
    turn, call after call (None: nothing to drop in that call, the batch is
    passed through flat, uncopied, as cleanbuf does).

    Like cleanbuf's, its output declares the device its leaves are on
    (``as_td``), so the storage writes it without a ``to()`` first.

    ``reuse=True`` copies the large rows into output buffers kept from the
    last call (safe here: the benchmark's tensor storage copies what it
    gets), which is the floor for them, where fresh memory costs page
    faults.
    """

    def __init__(self, keep_index, reuse: bool = False):
        super().__init__(in_keys=[], out_keys=[])
        self.keep_index = keep_index if isinstance(keep_index, list) else [keep_index]
        self.reuse = reuse
        self._buffers: dict = {}
        self._calls = 0

    def _inv_call(self, td):
        keep_index = self.keep_index[self._calls % len(self.keep_index)]
        self._calls += 1
        return self._compact(td, keep_index)

    def _compact(self, td, keep_index):
        """The rows ``keep_index`` of ``td``, flat (all of them, as views, for None)."""
        n = td.numel()
        out = {}
        index = None if keep_index is None else keep_index.numpy()
        for key, value in td.items(include_nested=True, leaves_only=True):
            key = key if isinstance(key, tuple) else (key,)
            if keep_index is not None and value.is_cpu and value.nbytes <= SMALL_ROW_BYTES * n:
                a = value.numpy()  # reshaped by numpy: cheaper than torch's reshape
                a = a.reshape((n,) + a.shape[td.batch_dims :])
                out[key] = torch.from_numpy(a.take(index, axis=0))
                continue
            flat = value.reshape(n, *value.shape[td.batch_dims :])
            if keep_index is None:
                out[key] = flat
            elif self.reuse:
                buf = self._buffers.get(key)
                if buf is None:
                    buf = self._buffers[key] = flat.index_select(0, keep_index)
                out[key] = torch.index_select(flat, 0, keep_index, out=buf)
            else:
                out[key] = flat.index_select(0, keep_index)
        return as_td(out, n if keep_index is None else len(keep_index), td.device)


def gymnasium_recipe(obs, actions, rewards, terms, truncs, next_obs):
    """Gymnasium's documented next-step replay-buffer recipe: a Python loop over
    steps and envs that skips the step after each episode end. Arrays are
    [T, E, ...] numpy; returns the kept transitions as a list of tuples.
    """
    buffer = []
    n_steps, n_envs = rewards.shape
    autoreset = np.zeros(n_envs, bool)
    for t in range(n_steps):
        for j in range(n_envs):
            if not autoreset[j]:
                buffer.append(
                    (
                        obs[t, j],
                        actions[t, j],
                        rewards[t, j],
                        terms[t, j],
                        truncs[t, j],
                        next_obs[t, j],
                    )
                )
        autoreset = np.logical_or(terms[t], truncs[t])
    return buffer


@numba.njit(cache=True)
def _plan_simple(done, n_envs, steps, after_reset):
    """The planning of :class:`MinimalCleaning`, in one pass over the flags.

    Returns ``(keep, shift, done_pos, done_src, init_pos, after_reset)``: the
    kept input rows; per kept row, the steps to subtract from its step
    counts; the output rows of the done rows and the input rows (their reset
    rows) that hold their terminal observations; the output rows that start
    an episode; and the new per-env flag.
    """
    n = n_envs * steps
    keep = np.empty(n, np.int64)
    shift = np.empty(n, np.int64)
    done_pos = np.empty(n, np.int64)
    done_src = np.empty(n, np.int64)
    init_pos = np.empty(n, np.int64)
    after = after_reset.copy()
    m = n_done = n_init = 0
    for e in range(n_envs):
        for t in range(steps):
            i = e * steps + t
            if t > 0 and done[i - 1]:  # the reset row: drop it, a new episode follows
                after[e] = True
                init_pos[n_init] = m
                n_init += 1
                continue
            if done[i]:
                done_pos[n_done] = m
                done_src[n_done] = i + 1
                n_done += 1
            keep[m] = i
            shift[m] = after[e]
            m += 1
    return keep[:m], shift[:m], done_pos[:n_done], done_src[:n_done], init_pos[:n_init], after


class MinimalCleaning(MinimalCompaction):
    """The floor of a correct filter on the benchmark batch: the cheapest code we
    found that stores exactly the rows cleanbuf stores (the benchmark
    checks that it does, call after call).

    Per call it plans from the done flags in one small numba pass, gathers
    the kept rows as :class:`MinimalCompaction` does (one ``ndarray.take`` or
    ``index_select`` per leaf), and then writes what cleaning must write,
    with numpy on the fresh rows: each done row's next observation (the
    observation of its reset row; rows of ``ROW_LOOP_BYTES`` or more one by
    one, as cleanbuf writes them), ``is_init`` on each new episode's first
    row, and one step less in both step counts of every row of an episode
    that began with a dropped reset row. Its only state is one flag per
    env: whether the episode running at the end of the call began that way.

    What it leaves out, which cleanbuf must do: input checks, other layouts
    and modes, the reset-row check, and done rows whose reset row comes in
    the next call (the benchmark batch has no done row in its last two
    steps, so every reset row and the new episode's first row are in the
    same call as their done row).
    """

    def __init__(self, reuse: bool = False):
        super().__init__(None, reuse)
        self._after_reset = None

    def _inv_call(self, td):
        n_envs, steps = td.batch_size
        if self._after_reset is None:
            self._after_reset = np.zeros(n_envs, bool)
        keep, shift, done_pos, done_src, init_pos, self._after_reset = _plan_simple(
            td.get(("next", "done")).numpy().reshape(-1), n_envs, steps, self._after_reset
        )
        out = self._compact(td, torch.from_numpy(keep))
        obs = td.get("observation").numpy().reshape(n_envs * steps, -1)
        next_obs = out.get(("next", "observation")).numpy().reshape(len(keep), -1)
        if obs.shape[1] * obs.itemsize >= ROW_LOOP_BYTES:  # large rows one by one, as cleanbuf
            for p, r in zip(done_pos.tolist(), done_src.tolist()):
                next_obs[p] = obs[r]
        else:
            next_obs[done_pos] = obs[done_src]
        out.get("is_init").numpy().reshape(-1)[init_pos] = True
        for key in ("step_count", ("next", "step_count")):
            count = out.get(key).numpy().reshape(-1)
            np.subtract(count, shift, out=count)
        return out
