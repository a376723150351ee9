"""Synthetic next-step datasets on disk, Atari-sized, for the offline benchmark and tests.

Rows as a collector writes them with ``rb.extend(batch.reshape(-1))``:
batches of ``E`` envs x ``T`` steps, env by env. Each observation is a
``uint8`` frame whose first bytes encode (env, step), so that every state
is unique; episodes end at random; after each end comes a reset row
(reward 0, from the terminal state to the next episode's first), and the
done row's next observation is zeros (TorchRL's zero fill).
"""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict

FRAME = 84 * 84  # bytes per observation


def _frame(env: np.ndarray, state: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((len(env), width), np.uint8)
    out[:, :4] = np.asarray(env, "<u4").view(np.uint8).reshape(-1, 4)
    out[:, 4:12] = np.asarray(state, "<u8").view(np.uint8).reshape(-1, 8)
    out[:, 12:] = (state % 251).astype(np.uint8)[:, None]
    return out


def write_memmap(
    path: str,
    batches: int,
    envs: int = 4,
    steps: int = 64,
    width: int = FRAME,
    end_prob: float = 0.02,
    seed: int = 0,
) -> int:
    """Writes a TensorDict memmap directory of next-step rows; returns its size in bytes."""
    rng = np.random.default_rng(seed)
    n = batches * envs * steps
    data = TensorDict(
        {
            "observation": torch.empty(n, width, dtype=torch.uint8),
            "action": torch.empty(n, 1, dtype=torch.int64),
            ("next", "observation"): torch.empty(n, width, dtype=torch.uint8),
            ("next", "reward"): torch.empty(n, 1),
            ("next", "done"): torch.empty(n, 1, dtype=torch.bool),
        },
        batch_size=[n],
    ).memmap_like(path)
    state = np.arange(envs, dtype=np.int64) * 10**9  # each env's state counter
    pending = np.zeros(envs, bool)  # a reset row comes next
    row = 0
    for _ in range(batches):
        for e in range(envs):
            s, obs, nxt, rew, done = state[e], [], [], [], []
            for _ in range(steps):
                if pending[e]:  # reset row: terminal state -> new first state
                    obs.append(s), nxt.append(s + 10**6), rew.append(0.0), done.append(False)
                    s, pending[e] = s + 10**6, False
                    continue
                end = rng.random() < end_prob
                obs.append(s), nxt.append(-1 if end else s + 1), rew.append(1.0), done.append(end)
                s, pending[e] = s + 1, end
            state[e] = s
            o = np.asarray(obs)
            x = np.asarray(nxt)
            frames_next = _frame(np.full(steps, e), np.maximum(x, 0), width)
            frames_next[x < 0] = 0  # zero-filled terminal observation
            sl = slice(row, row + steps)
            data["observation"][sl] = torch.from_numpy(_frame(np.full(steps, e), o, width))
            data["next", "observation"][sl] = torch.from_numpy(frames_next)
            data["next", "reward"][sl] = torch.tensor(rew).unsqueeze(-1)
            data["next", "done"][sl] = torch.tensor(done).unsqueeze(-1)
            data["action"][sl] = 0
            row += steps
    return n * (2 * width + 8 + 4 + 1)
