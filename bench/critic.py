"""Policy evaluation: what auto-reset artifacts do to a critic, without learning noise.

A fixed scripted policy (a simple controller with noise) collects one
rollout of ``[8 envs, T steps]`` per seed, and the same critic (a 64x64
MLP, the same initial weights) is fitted with the same estimator (TorchRL's
``GAE``: its ``"value_target"`` is the TD(lambda) return, gamma 0.99,
lambda 0.95) on three versions of that rollout:

* ``torchrl``: as TorchRL stores it. ``GymEnv(name, num_envs=8)``'s rows
  (``bench.impact_ppo.next_step_env``: the same wrapper over the same
  next-step vector env, stepped in-process): each reset row chains the old
  episode into the new one, a truncation bootstraps from the zero-filled
  next observation, envs ending on the same step lose their terminal
  observations. Every row is fitted, as a TorchRL user's PPO fits them.
* ``cleanbuf``: the same rows through ``RolloutRepair.for_env(env)`` (its
  defaults: a lost terminal observation is NaN, which the estimator reads
  as the row's own observation), GAE on the whole batch, the critic fitted
  on the rows ``("collector", "mask")`` keeps, as TorchRL's losses do.
* ``oracle``: ``cleanbuf.lossless_gym_env`` (explicit resets), fitted on
  the same states as the repaired version.

The policy's noise is a fixed function of the observation's bits, not a
random draw, so the policy is deterministic: the three versions hold the
same transitions (checked: the repaired version's valid rows are the
oracle's rows), and the dynamics being deterministic too, a state's
discounted return *is* its value. The fitting is PPO's critic update
without the actor: ``ROUNDS`` times, the estimator on the whole batch with
the current critic, then ``EPOCHS`` epochs of MSE on 256-row minibatches.

The truth: held-out episodes of the same policy (fresh seeds, one
Gymnasium env each, no vector env, no TorchRL), each state's discounted
Monte-Carlo return. A truncated episode is not cut at its time limit: the
simulation goes on past it (``TAIL`` steps, gamma**TAIL < 0.001, or until
it terminates), which is the value a truncation must bootstrap (the
time limit is not part of the state). The error ``|V(s) - G(s)|`` is
averaged over all states of those episodes, over the last ``NEAR`` states
before a truncation, and over the last ``NEAR`` states before a
termination.

Tasks, each with a time limit short enough that episodes end often:
Pendulum-v1 (200 steps, the env's own: every episode is truncated, all
envs together, so TorchRL loses every terminal observation), CartPole-v1
(85 steps: falls and time limits at different steps in each env) and
Hopper-v5 (120 steps: the same mix), twice: ``hopper`` with the critic's
input as it comes, as the other tasks, and ``hopper-std`` with it
standardized, as MuJoCo critics usually are.

Run ``python -m bench.critic`` (about 25 minutes on 2 cores; ``--tasks``
to choose, ``--quick`` for a smoke run). Writes ``bench/critic.json`` and
``bench/critic.png`` (``--out`` to change; ``--report critic.json``
prints the tables and redraws the plot). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torchrl.envs import set_exploration_type
from torchrl.envs.utils import ExplorationType
from torchrl.modules import ValueOperator
from torchrl.objectives.value import GAE

import cleanbuf
from bench.impact import _interval as t_interval
from bench.impact_ppo import mlp, next_step_env
from cleanbuf import CleanbufWarning, RolloutRepair

VARIANTS = ("torchrl", "cleanbuf", "oracle")
NUM_ENVS = 8
GAMMA, LMBDA = 0.99, 0.95
ROUNDS, EPOCHS, MINIBATCH, LR = 30, 4, 256, 1e-3
NEAR = 10  # "near an episode end": its last NEAR states
TAIL = 700  # steps simulated past a time limit: 0.99**700 < 0.001
EVAL_EPISODES = 24
MASK = ("collector", "mask")


def wobble(obs: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` smooth functions of the observation in ``[-1, 1]``: the policy's fixed "noise".

    ``sin(3 w_j . obs)`` with fixed random directions ``w_j``. Deterministic,
    so the same states give the same actions in every run of the same
    seeds; smooth, so the value of the perturbed controller is a smooth
    function of the state that a critic can fit, and a state's return is
    its value (a random draw, or a hash of the state, would put its
    variance into every state's error).
    """
    x = obs.to(torch.float32)
    gen = torch.Generator().manual_seed(1000 * n + x.shape[-1])
    w = torch.randn(n, x.shape[-1], generator=gen)
    return torch.sin(3 * (x[..., None, :] * w).sum(-1))


def _cartpole(obs: torch.Tensor) -> torch.Tensor:
    """Push toward the pole's fall, perturbed: some episodes fall within the limit, some not."""
    x = obs.to(torch.float32)
    push = (x[..., 2] + 0.2 * x[..., 3] + CARTPOLE_WOBBLE * wobble(x, 3).sum(-1)) > 0
    return torch.nn.functional.one_hot(push.long(), 2)


def _pendulum(obs: torch.Tensor) -> torch.Tensor:
    """Pump energy far from the top, a PD controller near it; perturbed by 0.6."""
    x = obs.to(torch.float32)
    cos, sin, speed = x[..., 0], x[..., 1], x[..., 2]
    angle = torch.atan2(sin, cos)
    pd = -8.0 * angle - 1.5 * speed
    pump = 2.0 * torch.sign(speed * cos + 1e-6)
    u = torch.where(cos > 0.85, pd, pump) + 0.6 * wobble(x, 1)[..., 0]
    return u.clamp(-2, 2).unsqueeze(-1)


def _hopper(obs: torch.Tensor) -> torch.Tensor:
    """Hold the joints at rest (PD), perturbed: some fall within the limit, some not."""
    x = obs.to(torch.float32)
    joints, speeds = x[..., 2:5], x[..., 8:11]
    u = -joints - 0.05 * speeds + HOPPER_WOBBLE * wobble(x, 3)
    return u.clamp(-1, 1)


CARTPOLE_WOBBLE, HOPPER_WOBBLE = 0.5, 0.3


@dataclass(frozen=True)
class CriticTask:
    """A fixed policy on an env with a short time limit."""

    env: str
    limit: int  # max_episode_steps
    steps: int  # T: steps of each env in the rollout
    policy: Callable[[torch.Tensor], torch.Tensor]
    value_scale: float  # the critic's output is multiplied by it (a fixed target scale)
    standardize: bool = False  # the critic's input standardized (the true states' mean, std)


TASKS = {
    # fixed horizon: every episode ends at the limit, all envs together
    "pendulum": CriticTask("Pendulum-v1", 200, 1000, _pendulum, 100.0),
    # falls (terminations) and time limits, at different steps in each env
    "cartpole": CriticTask("CartPole-v1", 85, 600, _cartpole, 30.0),
    "hopper": CriticTask("Hopper-v5", 120, 600, _hopper, 30.0),
    # the same with the critic's input standardized, as MuJoCo critics usually
    # are (a height near 1.2, velocities up to 10): an all-zero observation is
    # then far from every state the critic is fitted on
    "hopper-std": CriticTask("Hopper-v5", 120, 600, _hopper, 30.0, standardize=True),
}


def _rollout(env, task: CriticTask, seed: int):
    def policy(td):
        td["action"] = task.policy(td["observation"]).to(env.action_spec.dtype)
        return td

    env.set_seed(seed)
    with set_exploration_type(ExplorationType.DETERMINISTIC), torch.no_grad():
        td = env.rollout(task.steps, policy, break_when_any_done=False)
    env.close()
    return td


def collect(task: CriticTask, seed: int) -> tuple[dict, dict]:
    """The three versions of one rollout, each with the mask of the rows to fit."""
    env = next_step_env(task.env, NUM_ENVS, max_episode_steps=task.limit)
    repair = RolloutRepair.for_env(env)
    raw = _rollout(env, task, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CleanbufWarning)
        repaired = torch.cat([repair(raw.clone()), repair.flush()], -1)
    oracle = _rollout(
        cleanbuf.lossless_gym_env(task.env, NUM_ENVS, max_episode_steps=task.limit), task, seed
    )
    # the oracle fits the repaired version's states: its first rows of each env
    valid = repaired[MASK]
    n = valid.sum(-1)
    oracle_mask = torch.arange(task.steps).expand(NUM_ENVS, -1) < n[:, None]
    for e in range(NUM_ENVS):  # the pairing: the same transitions, row for row
        mine, true = repaired[e][valid[e]], oracle[e][: int(n[e])]
        nxt, true_nxt = mine["next", "observation"], true["next", "observation"]
        same_next = (nxt == true_nxt) | nxt.isnan()  # NaN: a terminal observation lost
        if not (torch.equal(mine["observation"], true["observation"]) and same_next.all()):
            raise RuntimeError(f"{task.env}: env {e}'s repaired rows are not the oracle's")
    every = torch.ones(raw.batch_size, dtype=torch.bool)
    data = {"torchrl": (raw, every), "cleanbuf": (repaired, valid), "oracle": (oracle, oracle_mask)}
    done = oracle["next", "done"][oracle_mask].squeeze(-1)
    term = oracle["next", "terminated"][oracle_mask].squeeze(-1)
    facts = {
        "rows": int(oracle_mask.sum()),
        "episodes_terminated": int(term.sum()),
        "episodes_truncated": int((done & ~term).sum()),
        "repair_stats": dict(repair.stats),
    }
    return data, facts


class _Standardize(nn.Module):
    def __init__(self, mean: torch.Tensor, std: torch.Tensor):
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(self.mean.dtype) - self.mean) / self.std


class _Scale(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def fit_critic(
    td,
    rows: torch.Tensor,
    task: CriticTask,
    seed: int,
    rounds: int = ROUNDS,
    standardize: _Standardize | None = None,
) -> ValueOperator:
    """PPO's critic update without the actor: GAE targets on the whole batch, MSE on ``rows``."""
    torch.manual_seed(seed)  # the same initial weights and minibatches for every version
    n_obs = td["observation"].shape[-1]
    layers = [mlp(n_obs, 1), _Scale(task.value_scale)]
    if standardize is not None:
        layers.insert(0, standardize)
    critic = ValueOperator(nn.Sequential(*layers), ["observation"])
    estimator = GAE(gamma=GAMMA, lmbda=LMBDA, value_network=critic)
    optim = torch.optim.Adam(critic.parameters(), lr=LR)
    index = rows.reshape(-1).nonzero().squeeze(-1)
    for _ in range(rounds):
        with torch.no_grad():
            estimator(td)
        flat = td.reshape(-1)[index]
        obs, target = flat["observation"], flat["value_target"]
        if not torch.isfinite(target).all():
            raise RuntimeError("non-finite value targets")
        for _ in range(EPOCHS):
            for mb in torch.randperm(len(index)).split(MINIBATCH):
                loss = (critic.module(obs[mb]) - target[mb]).pow(2).mean()
                optim.zero_grad()
                loss.backward()
                optim.step()
    return critic


def truth(task: CriticTask, seed: int, episodes: int) -> dict:
    """States of held-out episodes and their discounted returns, truncations continued.

    One Gymnasium env (seeded once, as a vector env seeds each sub-env) with
    a time limit ``TAIL`` steps past the task's: an episode that reaches the
    task's limit is truncated there, but its states' returns include the
    steps after it (until ``TAIL`` more or a termination).
    """
    env = gym.make(task.env, max_episode_steps=task.limit + TAIL)
    obs, _ = env.reset(seed=seed)
    states, returns, to_end, ended_by = [], [], [], []
    n_term = 0
    for episode in range(episodes):
        if episode:
            obs, _ = env.reset()
        seen, rewards, terminated = [], [], False
        while True:
            seen.append(np.asarray(obs, np.float32))
            with torch.no_grad():
                action = task.policy(torch.as_tensor(seen[-1]))
            if isinstance(env.action_space, gym.spaces.Discrete):
                step_action = int(action.argmax())
            else:
                step_action = action.numpy().astype(env.action_space.dtype)
            obs, reward, terminated, truncated, _ = env.step(step_action)
            rewards.append(float(reward))
            if terminated or truncated:
                break
        g, discounted = 0.0, np.empty(len(rewards))
        for t in range(len(rewards) - 1, -1, -1):
            g = rewards[t] + GAMMA * g
            discounted[t] = g
        length = min(len(rewards), task.limit)  # the episode under the task's limit
        ends_by_termination = terminated and len(rewards) <= task.limit
        n_term += ends_by_termination
        states.append(np.stack(seen[:length]))
        returns.append(discounted[:length])
        to_end.append(np.arange(length)[::-1].copy())
        ended_by.append(np.full(length, ends_by_termination))
    env.close()
    return {
        "states": torch.as_tensor(np.concatenate(states)),
        "returns": np.concatenate(returns),
        "to_end": np.concatenate(to_end),
        "terminated": np.concatenate(ended_by),
        "episodes_terminated": n_term,
        "episodes_truncated": episodes - n_term,
    }


def errors(critic: ValueOperator, ev: dict) -> dict:
    """Mean |V(s) - G(s)|: all states, the last NEAR before a truncation, before a termination."""
    with torch.no_grad():
        value = critic.module(ev["states"]).squeeze(-1).double().numpy()
    err = np.abs(value - ev["returns"])
    near = ev["to_end"] < NEAR
    trunc, term = near & ~ev["terminated"], near & ev["terminated"]
    return {
        "all": float(err.mean()),
        "near_truncation": float(err[trunc].mean()) if trunc.any() else math.nan,
        "near_termination": float(err[term].mean()) if term.any() else math.nan,
        "bias_near_truncation": float((value - ev["returns"])[trunc].mean())
        if trunc.any()
        else math.nan,
    }


def run(task_name: str, seed: int, quick: bool) -> list[dict]:
    """One seed of one task: the three versions fitted and scored on the same truth."""
    task = TASKS[task_name]
    start = time.perf_counter()
    data, facts = collect(task, seed)
    ev = truth(task, 50_000 + seed, EVAL_EPISODES // 4 if quick else EVAL_EPISODES)
    standardize = None
    if task.standardize:  # the same for the three versions: the true states' statistics
        td, rows = data["oracle"]
        states = td["observation"][rows].to(torch.float32)
        standardize = _Standardize(states.mean(0), states.std(0).clamp_min(1e-3))
    out = []
    for variant in VARIANTS:
        td, rows = data[variant]
        critic = fit_critic(td, rows, task, seed, 3 if quick else ROUNDS, standardize)
        out.append(
            {
                "task": task_name,
                "variant": variant,
                "seed": seed,
                "error": errors(critic, ev),
                "rows_fitted": int(rows.sum()),
                "mean_abs_return": float(np.abs(ev["returns"]).mean()),
                "eval_states": len(ev["returns"]),
                "eval_episodes_terminated": ev["episodes_terminated"],
                "eval_episodes_truncated": ev["episodes_truncated"],
                **facts,
            }
        )
    for r in out:
        r["seconds"] = time.perf_counter() - start
    return out


def _interval(xs: list[float]) -> tuple[float, float]:
    """Mean and half-width of a 95% t interval, NaN values (no such state in a seed) left out."""
    xs = [x for x in xs if not math.isnan(x)]
    return (math.nan, math.nan) if not xs else t_interval(xs)


COLUMNS = (
    ("all", "all states"),
    ("near_truncation", f"last {NEAR} before a truncation"),
    ("near_termination", f"last {NEAR} before a termination"),
)


def _cell(xs: list[float]) -> str:
    m, h = _interval(xs)
    return "-" if math.isnan(m) else f"{m:.2f} ± {h:.2f}"


def table(results: list[dict]) -> str:
    """Critic error by version, mean ± 95% CI over seeds, as printed."""
    head = " | ".join(f"\\|V - G\\|, {name}" for _, name in COLUMNS)
    lines = [
        f"| task | data | seeds | {head} | mean \\|G\\| |",
        "|---|---|---|" + "---|" * len(COLUMNS) + "---|",
    ]
    for task in TASKS:
        for variant in VARIANTS:
            rs = [r for r in results if r["task"] == task and r["variant"] == variant]
            if not rs:
                continue
            cells = " | ".join(_cell([r["error"][k] for r in rs]) for k, _ in COLUMNS)
            scale = statistics.fmean(r["mean_abs_return"] for r in rs)
            lines.append(f"| {task} | {variant} | {len(rs)} | {cells} | {scale:.1f} |")
    return "\n".join(lines)


def paired(results: list[dict]) -> str:
    """Seed-by-seed differences of critic error between versions, mean ± 95% CI."""
    head = " | ".join(name for _, name in COLUMNS)
    lines = [f"| task | difference | {head} |", "|---|---|" + "---|" * len(COLUMNS)]
    for task in TASKS:
        by = {(r["variant"], r["seed"]): r["error"] for r in results if r["task"] == task}
        seeds = sorted({s for _, s in by})
        for a, b in (("torchrl", "oracle"), ("cleanbuf", "oracle"), ("torchrl", "cleanbuf")):
            pairs = [(by[a, s], by[b, s]) for s in seeds if (a, s) in by and (b, s) in by]
            if not pairs:
                continue
            cells = " | ".join(_cell([x[k] - y[k] for x, y in pairs]) for k, _ in COLUMNS)
            lines.append(f"| {task} | {a} - {b} | {cells} |")
    return "\n".join(lines)


def facts_table(results: list[dict]) -> str:
    """What each task's rollouts held (summed over seeds)."""
    lines = [
        "| task | limit | rows fitted (oracle) | episodes ended by termination / truncation "
        "| reset rows masked | terminal obs lost (joint resets) | held-out states |",
        "|---|---|---|---|---|---|---|",
    ]
    for task in TASKS:
        rs = [r for r in results if r["task"] == task and r["variant"] == "oracle"]
        if not rs:
            continue
        stats = [r["repair_stats"] for r in rs]
        lines.append(
            f"| {task} | {TASKS[task].limit} | {sum(r['rows'] for r in rs)} | "
            f"{sum(r['episodes_terminated'] for r in rs)} / "
            f"{sum(r['episodes_truncated'] for r in rs)} | "
            f"{sum(s.get('reset_rows_masked', 0) for s in stats)} | "
            f"{sum(s.get('terminal_obs_missing', 0) for s in stats)} | "
            f"{sum(r['eval_states'] for r in rs)} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    """Critic error by version, per task: all states and near the two kinds of end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in TASKS if any(r["task"] == t for r in results)]
    cols = min(len(tasks), 2)
    rows = -(-len(tasks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.4 * cols, 3.6 * rows), squeeze=False)
    width = 0.26
    for ax in axes.flat[len(tasks) :]:
        ax.set_visible(False)
    for ax, task in zip(axes.flat, tasks, strict=False):
        for i, variant in enumerate(VARIANTS):
            rs = [r for r in results if r["task"] == task and r["variant"] == variant]
            stats = [_interval([r["error"][k] for r in rs]) for k, _ in COLUMNS]
            xs = np.arange(len(COLUMNS)) + (i - 1) * width
            means = [0 if math.isnan(m) else m for m, _ in stats]
            halves = [0 if math.isnan(h) else h for _, h in stats]
            ax.bar(xs, means, width, yerr=halves, capsize=3, label=variant)
        ax.set_xticks(np.arange(len(COLUMNS)))
        ax.set_xticklabels(["all states", "near a\ntruncation", "near a\ntermination"])
        ax.set_title(f"{task} ({TASKS[task].env}, limit {TASKS[task].limit})")
        ax.set_ylabel("critic error |V - G|")
        ax.legend()
    fig.suptitle(f"policy evaluation, GAE targets; mean and 95% CI over {_seeds(results)} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _seeds(results: list[dict]) -> int:
    return len({r["seed"] for r in results})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: CartPole, 3 rounds")
    parser.add_argument("--seeds", type=int, default=None, help="default: 5 (1 with --quick)")
    parser.add_argument("--tasks", nargs="*", default=None, help=f"default: {' '.join(TASKS)}")
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument(
        "--report",
        metavar="JSON",
        help="no fitting: the tables and plot (in --out) of a result file",
    )
    args = parser.parse_args()
    if args.report:
        with open(args.report) as f:
            report(json.load(f)["results"], os.path.join(args.out, "critic.png"))
        return
    torch.set_num_threads(1)
    tasks = args.tasks or (["cartpole"] if args.quick else list(TASKS))
    seeds = range(args.seeds if args.seeds is not None else (1 if args.quick else 5))
    name = "critic-quick" if args.quick else "critic"
    results = []
    for task in tasks:
        for seed in seeds:
            for r in run(task, seed, args.quick):
                results.append(r)
                e = r["error"]
                print(
                    f"{task} {r['variant']} seed {seed}: |V - G| all {e['all']:.3f}, "
                    f"near truncation {e['near_truncation']:.3f}, near termination "
                    f"{e['near_termination']:.3f}, {r['seconds']:.0f} s",
                    flush=True,
                )
            meta = {
                "machine": f"{platform.machine()} {os.cpu_count()} cores",
                "versions": {
                    "python": platform.python_version(),
                    "torch": torch.__version__,
                    "torchrl": __import__("torchrl").__version__,
                    "gymnasium": gym.__version__,
                    "cleanbuf": cleanbuf.__version__,
                },
                "quick": args.quick,
            }
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump({"meta": meta, "results": results}, f, indent=1)
    report(results, os.path.join(args.out, f"{name}.png"))


def report(results: list[dict], png: str | None) -> None:
    """Prints the three tables (and plots to ``png``)."""
    if png is not None:
        plot(results, png)
    print(facts_table(results))
    print(table(results))
    print(paired(results))


if __name__ == "__main__":
    main()
