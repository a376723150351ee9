"""Helpers of the on-policy tests: policies, small fixed networks, the estimators."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.modules import OneHotCategorical, ProbabilisticActor
from torchrl.objectives.value import GAE, TD0Estimator, TDLambdaEstimator, VTrace

from tests.oracle import STREAM

GAMMA, LMBDA = 0.99, 0.95
COMPARED = ("observation", ("next", "observation"), "action", ("next", "reward"),
            ("next", "done"), ("next", "terminated"), ("next", "truncated"))  # fmt: skip


def mixed_policy(td):
    """Deterministic CartPole policy: streams 0, 1 balance (they reach the time
    limit: truncations), streams 2, 3 push left (terminations within ~10 steps).
    """
    obs = td["observation"]
    e = torch.arange(obs.shape[0])
    push = (obs[..., 2] + 0.3 * obs[..., 3] + 0.02 * (e - 1.5)) > 0
    push = torch.where(e >= 2, torch.zeros_like(push), push)
    td.set("action", nn.functional.one_hot(push.long(), 2).float())
    td.set(STREAM, e.clone())
    return td


def mixed_actions(obs: np.ndarray) -> np.ndarray:
    """:func:`mixed_policy` for raw Gymnasium loops (integer actions)."""
    e = np.arange(len(obs))
    push = (obs[:, 2] + 0.3 * obs[:, 3] + 0.02 * (e - 1.5)) > 0
    return np.where(e >= 2, 0, push).astype(np.int64)


def raw_loop(mode, n_envs: int, steps: int, limit: int, with_info: bool) -> TensorDict:
    """A raw Gymnasium sync vector-env loop on CartPole, stored time first ``[T, E]``.

    ``DISABLED`` resets done envs explicitly (the oracle).
    """
    venv = gym.make_vec(
        "CartPole-v1",
        num_envs=n_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": mode},
        max_episode_steps=limit,
    )
    from cleanbuf import step_rows

    rows = []
    obs, _ = venv.reset(seed=0)
    for _ in range(steps):
        action = mixed_actions(obs)
        next_obs, reward, terminated, truncated, info = venv.step(action)
        rows.append(step_rows(obs, action, next_obs, reward, terminated, truncated,
                              info if with_info else None, env_ids=True))  # fmt: skip
        obs = next_obs
        done = terminated | truncated
        if mode == gym.vector.AutoresetMode.DISABLED and done.any():
            reset_obs, _ = venv.reset(options={"reset_mask": done})
            obs = np.where(done[:, None], reset_obs, next_obs)
    venv.close()
    return torch.stack(rows, 0)


def value_net(n_obs: int = 4) -> TensorDictModule:
    """A small fixed random value network."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(n_obs, 16), nn.Tanh(), nn.Linear(16, 1))
    return TensorDictModule(net, ["observation"], ["state_value"])


def actor(seed: int = 1, n_obs: int = 4) -> ProbabilisticActor:
    """A small fixed random CartPole actor (one-hot actions)."""
    torch.manual_seed(seed)
    net = TensorDictModule(nn.Linear(n_obs, 2), ["observation"], ["logits"])
    return ProbabilisticActor(
        net, in_keys=["logits"], distribution_class=OneHotCategorical, return_log_prob=True
    )


def add_behaviour_log_prob(td: TensorDict, key="action_log_prob") -> TensorDict:
    """Writes the log-probability of the stored actions under another fixed actor."""
    with torch.no_grad():
        dist = actor(seed=2).get_dist(td)
        td.set(key, dist.log_prob(td["action"]))
    return td


ESTIMATORS = {
    "GAE": lambda **kw: GAE(gamma=GAMMA, lmbda=LMBDA, value_network=value_net(), **kw),
    "TD0": lambda **kw: TD0Estimator(gamma=GAMMA, value_network=value_net(), **kw),
    "TDLambda": lambda **kw: TDLambdaEstimator(
        gamma=GAMMA, lmbda=LMBDA, value_network=value_net(), **kw
    ),
    "VTrace": lambda **kw: VTrace(
        gamma=GAMMA, value_network=value_net(), actor_network=actor(), **kw
    ),
}


def estimate(name: str, td: TensorDict, **kw) -> TensorDict:
    """Runs estimator ``name`` on ``td`` (with a behaviour log-prob for V-trace)."""
    td = td.clone()
    est = ESTIMATORS[name](**kw)
    if name == "VTrace":
        est.set_keys(sample_log_prob="action_log_prob")
        add_behaviour_log_prob(td)
    with torch.no_grad():
        est(td)
    return td


def compare_valid_rows(repaired, oracle, time_dim=-1, mask_key=("collector", "mask")):
    """Per stream, the repaired valid rows against the oracle's rows.

    The rows must be equal on :data:`COMPARED`; returns, per stream, the
    largest advantage and value-target error on the rows up to the oracle's
    last episode end in the compared range (later rows depend on steps that
    one of the two runs has not collected), and the number of rows compared.
    """
    if time_dim == 0:
        repaired, oracle = repaired.transpose(0, 1), oracle.transpose(0, 1)
    worst, n_rows = 0.0, 0
    for e in range(oracle.shape[0]):
        r, o = repaired[e], oracle[e]
        r = r[r[mask_key].reshape(-1)]
        n = min(len(r), len(o))
        for key in COMPARED:
            a, b = r[key][:n], o[key][:n].to(r[key].dtype)
            assert torch.equal(a, b), (e, key)
        ends = o["next", "done"][:n].reshape(-1).nonzero()
        m = int(ends[-1]) + 1
        for key in ("advantage", "value_target"):
            worst = max(worst, float((r[key][:m] - o[key][:m]).abs().max()))
        n_rows += m
    return worst, n_rows
