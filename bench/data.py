"""Synthetic collector batches and the identity transform, the floor of any transform."""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.envs.transforms import Transform

E, T = 8, 128


def make_batch(
    kind: str,
    reset_frac: float,
    n_envs: int = E,
    steps: int = T,
    seed: int = 0,
    device=None,
    obs_size: int = 17,
) -> TensorDict:
    """A next-step [n_envs, steps] batch shaped like TorchRL collector output
    (``device=None``, as TorchRL's ``Collector`` yields it, unless ``device``
    is given).

    Episodes last about ``1 / reset_frac - 1`` steps, each followed by its
    reset row (reward 0, is_init, step_count 0). No done row in the last two
    steps, and each stream's observations chain as a collector's do (a row's
    next observation is the next row's observation, the last row's is the
    first row's; a done row's is zero-filled), so that consecutive windows
    of one long batch chain as a collector's batches do (see
    ``bench.run.chained``). ``reset_frac=0`` gives a batch
    without episode ends. ``kind`` is "mujoco" (``obs_size`` float obs, 17
    by default, 6 float action) or "atari" (4x84x84 uint8 obs).
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
        states = torch.randn(n_envs, steps, obs_size)
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


class Identity(Transform):
    """The floor of any write-path transform: ``inv`` returns its input unchanged.

    Fed the same flat, device-declared batches as a plain extend, it costs
    only TorchRL's transform path (``ReplayBuffer.extend`` through
    ``Compose.inv`` and ``Transform.inv``); no filter that hands the buffer
    a batch can cost less.
    """

    def __init__(self):
        super().__init__(in_keys=[], out_keys=[])

    def _inv_call(self, td):
        return td
