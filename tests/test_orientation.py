"""One axis detector: the filter, the repair and the offline readers tell time the same way."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

from cleanbuf.engine._options import Options
from cleanbuf.engine._orientation import batch_time_axis, same_per_row, time_axis


def _chained(envs: int, steps: int, ends: list, seed: int) -> tuple:
    """[E, T] rows whose observation encodes (env, episode, step); ``ends`` rows are done.

    A done row's next observation is zero-filled, as a TorchRL collector
    stores it; every other row's next observation is its successor's
    observation.
    """
    rng = np.random.default_rng(seed)
    done = np.zeros((envs, steps), np.bool_)
    for e, t in ends:
        done[e % envs, t % steps] = True
    obs = np.zeros((envs, steps + 1, 3), np.float32)
    for e in range(envs):
        episode, step = 0, 0
        for t in range(steps + 1):
            obs[e, t] = [1000 * e + step, episode, rng.integers(1 << 20)]
            if t < steps and done[e, t]:
                episode, step = episode + 1, 0
            else:
                step += 1
    nxt = obs[:, 1:].copy()
    nxt[done] = 0.0
    return obs[:, :-1].copy(), nxt, done


@settings(max_examples=40, deadline=None)
@given(
    envs=st.integers(2, 6),
    steps=st.integers(2, 9),
    ends=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 8)), max_size=3),
    seed=st.integers(0, 1000),
)
@example(envs=2, steps=2, ends=[(0, 0), (0, 1)], seed=0)  # no open row along an axis: 0 rows
@example(envs=2, steps=2, ends=[(0, 0), (1, 0)], seed=0)  # no open pair in time: no verdict
def test_numpy_torch_and_tensordict_agree(envs, steps, ends, seed):
    """Bugs caught: the detectors disagreeing on the same data (the filter's
    first-write check, the repair's hint and the offline reader were three
    copies with three thresholds), a torch path that compares values where
    the numpy path compares bytes, and a swapped axis in the TensorDict
    reader (its done flags read along the wrong axis), and a torch path
    that failed on zero open rows along an axis (a reshape to ``[0, -1]``),
    and an axis of several steps with no open pair taken for one step (a
    verdict given with no pair compared along it).
    """
    obs, nxt, done = _chained(envs, steps, ends, seed)
    expected_last = 1 if (~done[:, :-1]).sum() >= 1 else None
    for flip in (False, True):
        o, n, d = (np.swapaxes(x, 0, 1) if flip else x for x in (obs, nxt, done))
        axis = time_axis(o, n, d)[0]
        assert axis == time_axis(torch.from_numpy(o), torch.from_numpy(n), d)[0]
        want = None if expected_last is None else (0 if flip else 1)
        assert axis == want
        td = TensorDict(
            {
                "observation": torch.from_numpy(o),
                ("next", "observation"): torch.from_numpy(n),
                ("next", "done"): torch.from_numpy(d)[..., None],
            },
            batch_size=list(d.shape),
        )
        assert batch_time_axis(td, Options()) == axis


def test_bytes_not_values():
    """Bug caught: a NaN next observation never equal to the NaN observation it
    continues (value compare), or -0.0 taken for 0.0, so a chain of NaN-marked
    or signed-zero rows reads as broken.
    """
    a = np.array([[np.nan, 1.0], [0.0, 2.0]])
    b = np.array([[np.nan, 1.0], [-0.0, 2.0]])
    assert same_per_row(a, b).tolist() == [True, False]
    assert same_per_row(torch.tensor(a), torch.tensor(b)).tolist() == [True, False]
    assert same_per_row(torch.tensor([[True]]), torch.tensor([[False]])).tolist() == [False]
