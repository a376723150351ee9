"""Synthetic next-step batches as TensorDicts (from ``tests.reference.simulate``)."""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict

from tests.reference import simulate

KEYS = {
    "obs": ("observation",),
    "next_obs": ("next", "observation"),
    "reward": ("next", "reward"),
    "done": ("next", "done"),
    "is_init": ("is_init",),
    "step_count": ("step_count",),
    "next_step_count": ("next", "step_count"),
    "payload": ("action",),
}
FINAL_KEYS = {"final": ("next", "final_obs"), "final_ok": ("next", "_final_obs")}
DTYPES = {
    "done": torch.bool,
    "is_init": torch.bool,
    "step_count": torch.int64,
    "next_step_count": torch.int64,
    "final_ok": torch.bool,
}


def grid_td(raw, stream_shape, *, final=False, obs_only=False, marks=False):
    """Raw rows of equal-length streams as a TensorDict [*E, T].

    ``final`` adds the same-step final-observation entry and its mask;
    ``obs_only`` leaves out ``("next", "observation")``; ``marks`` adds
    ``("next", "terminated")`` (the env's own ends) and
    ``("next", "truncated")`` (the collector's batch-end marks), and the
    collector's ``("collector", "traj_ids")`` (a new id at each episode
    start, the reset row's being the next episode's, as TorchRL numbers
    them): only a collector marks batch ends, and its rows carry them.
    """
    steps = len(raw[0])
    td = TensorDict(batch_size=[*stream_shape, steps])
    keys = KEYS | (FINAL_KEYS if final else {})
    if obs_only:
        keys = {f: k for f, k in keys.items() if f != "next_obs"}
    for f, key in keys.items():
        vals = [[r[f] for r in rows] for rows in raw]
        t = torch.tensor(vals, dtype=DTYPES.get(f, torch.float32))
        td.set(key, t.reshape(*stream_shape, steps, 1))
    if marks:
        mark = torch.tensor([[r["mark"] for r in rows] for rows in raw])
        done = td.get(("next", "done")).reshape(mark.shape)
        td.set(("next", "truncated"), mark.reshape(*stream_shape, steps, 1))
        td.set(("next", "terminated"), (done & ~mark).reshape(*stream_shape, steps, 1))
        starts = torch.tensor([[bool(r["is_init"]) for r in rows] for rows in raw])
        traj = starts.reshape(-1).cumsum(0).reshape(starts.shape)
        td.set(("collector", "traj_ids"), traj.reshape(*stream_shape, steps))
    td.set(
        "stream",
        torch.arange(len(raw)).reshape(*stream_shape, 1).expand(*stream_shape, steps).clone(),
    )
    return td


def next_step_batch(n_streams=2, steps=12, seed=0, **kwargs):
    """A [n_streams, steps] next-step batch with episode ends (zero-filled)."""
    raw, _ = simulate(np.random.default_rng(seed), n_streams, steps, max_len=4, **kwargs)
    return grid_td(raw, (n_streams,))


def same_step_batch(n_streams=2, steps=12, seed=0, final=True, **kwargs):
    """A [n_streams, steps] same-step batch, with the final-observation entry."""
    raw, _ = simulate(
        np.random.default_rng(seed), n_streams, steps, mode="same_step", max_len=4, **kwargs
    )
    return grid_td(raw, (n_streams,), final=final)


def assert_same_rows(got, want, where=""):
    """Asserts two TensorDicts hold the same keys and rows, NaN equal to NaN."""
    assert got.batch_size == want.batch_size, (where, got.batch_size, want.batch_size)
    assert set(got.keys(True, True)) == set(want.keys(True, True)), f"{where}: keys differ"
    for key in want.keys(True, True):
        torch.testing.assert_close(
            got[key],
            want[key],
            rtol=0,
            atol=0,
            equal_nan=True,
            msg=lambda m, key=key: f"{where} key {key}: {m}",
        )
