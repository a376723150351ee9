"""Does cleaning matter for learning? Dirty vs cleaned vs explicit-reset data.

Trains with TorchRL's own losses and small networks, from
``GymEnv(name, num_envs=8)`` data in three forms:

* ``torchrl``: as TorchRL stores it (``rb.extend(batch.reshape(-1))``):
  zero-filled terminal observations, reset rows kept;
* ``cleanbuf``: the same producer through ``AutoresetFilter`` with
  ``on_lost_terminal_obs="drop"``;
* ``oracle``: ``cleanbuf.lossless_gym_env`` (explicit resets: nothing lost,
  nothing bogus).

Tasks: SAC on ``Pendulum-v1`` (fixed horizon: every episode ends by the
200-step time limit, all envs together) and DQN on ``CartPole-v1``
(terminations at different steps: reset rows). Per run it records the
greedy policy's return over training and, at the end, the Bellman error
of the learned Q on explicit-reset data, on the episode-end rows (where the
dirty data differs) and on the others. On-policy: PPO (``ClipPPOLoss`` and
``GAE``) on both envs and on CartPole with a 100-step limit, with
``RolloutRepair`` as the cleaned form and the advantage error on the
episode-end rows (``bench/impact_ppo.py``).

Run ``python -m bench.impact`` (hours on 2 cores) or
``python -m bench.impact --quick`` (a smoke run of a few minutes). Writes
``bench/impact.json`` and ``bench/impact.png`` (``--out`` and ``--name`` to
change; ``--report A.json B.json`` prints the tables of earlier runs
together).
Not part of the test suite.
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
from dataclasses import dataclass

import gymnasium
import numpy as np
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictSequential
from torchrl.collectors import Collector
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.envs import GymEnv, set_exploration_type
from torchrl.envs.utils import ExplorationType
from torchrl.modules import (
    MLP,
    EGreedyModule,
    QValueActor,
    ValueOperator,
)
from torchrl.objectives import DQNLoss, SACLoss, SoftUpdate

import cleanbuf
from bench.impact_ppo import PPO_TASKS, ppo_table, run_ppo, tanh_normal_actor
from cleanbuf import AutoresetFilter, CleanbufWarning

VARIANTS = ("torchrl", "cleanbuf", "oracle")
NUM_ENVS = 8
GAMMA = 0.99


@dataclass(frozen=True)
class Task:
    """One training setup."""

    env: str
    algo: str
    frames: int
    random_frames: int
    updates_per_frame: float
    lr: float
    evals: int  # evaluations of the greedy policy over training
    horizon: int  # the env's time limit


TASKS = {
    "pendulum-sac": Task("Pendulum-v1", "sac", 20_000, 2_000, 0.5, 1e-3, 10, 200),
    "cartpole-dqn": Task("CartPole-v1", "dqn", 50_000, 2_000, 0.25, 1e-3, 10, 500),
}


def _producer(task: Task, variant: str, seed: int):
    if variant == "oracle":
        env = cleanbuf.lossless_gym_env(task.env, NUM_ENVS)
    else:
        env = GymEnv(task.env, num_envs=NUM_ENVS)
    env.set_seed(seed)
    return env


def _buffer(env, variant: str, capacity: int) -> ReplayBuffer:
    transform = None
    if variant == "cleanbuf":
        transform = AutoresetFilter.for_env(env, on_lost_terminal_obs="drop")
    return ReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=256, transform=transform)


def _sac(env, lr: float):
    n_obs = env.observation_spec["observation"].shape[-1]
    spec = env.action_spec_unbatched
    n_act = spec.shape[-1]
    actor = tanh_normal_actor(n_obs, spec, return_log_prob=False)
    q = ValueOperator(MLP(n_obs + n_act, 1, num_cells=[64, 64]), in_keys=["observation", "action"])
    loss = SACLoss(actor, q, num_qvalue_nets=2, loss_function="l2")
    loss.make_value_estimator(gamma=GAMMA)
    return actor, actor, loss, SoftUpdate(loss, tau=0.005)


def _dqn(env, lr: float, task: Task):
    n_obs = env.observation_spec["observation"].shape[-1]
    spec = env.action_spec_unbatched
    qnet = QValueActor(MLP(n_obs, spec.shape[-1], num_cells=[64, 64]), spec=spec)
    explore = TensorDictSequential(
        qnet,
        EGreedyModule(spec, eps_init=1.0, eps_end=0.05, annealing_num_steps=task.frames // 2),
    )
    loss = DQNLoss(qnet, action_space=spec, delay_value=True)
    loss.make_value_estimator(gamma=GAMMA)
    return qnet, explore, loss, SoftUpdate(loss, tau=0.01)


def _greedy_return(task: Task, policy, seed: int, n: int = 8) -> float:
    """Mean return of the greedy policy over one episode of each of n envs."""
    env = cleanbuf.lossless_gym_env(task.env, n)
    env.set_seed(10_000 + seed)
    with set_exploration_type(ExplorationType.DETERMINISTIC), torch.no_grad():
        td = env.rollout(task.horizon, policy, break_when_any_done=False)
    env.close()
    done = td["next", "done"].squeeze(-1)
    first_end = torch.where(done.any(-1), done.float().argmax(-1), done.shape[-1] - 1)
    reward = td["next", "reward"].squeeze(-1)
    steps = torch.arange(reward.shape[-1]).expand_as(reward)
    return float((reward * (steps <= first_end[:, None])).sum(-1).mean())


def _bellman_errors(task: Task, policy, loss, seed: int) -> dict:
    """|Q(s, a) - (r + gamma (1 - terminated) V(s'))| on explicit-reset data.

    V(s') is min-Q of the greedy action (SAC) or max-Q (DQN), with the
    true next observation. Split into the episode-end rows (where dirty
    data differs: truncation bootstraps, terminal states) and the others.
    """
    env = cleanbuf.lossless_gym_env(task.env, 16)
    env.set_seed(20_000 + seed)
    with set_exploration_type(ExplorationType.RANDOM), torch.no_grad():
        td = env.rollout(2 * task.horizon, policy, break_when_any_done=False).reshape(-1)
    env.close()
    with torch.no_grad():
        q_sa = _q(task, loss, td["observation"], td["action"])
        nxt = td["next"].select("observation").clone()
        with set_exploration_type(ExplorationType.DETERMINISTIC):
            nxt = policy(nxt)
        v_next = _q(task, loss, nxt["observation"], nxt["action"])
    term = td["next", "terminated"].squeeze(-1).float()
    target = td["next", "reward"].squeeze(-1) + GAMMA * (1 - term) * v_next
    err = (q_sa - target).abs()
    end = td["next", "done"].squeeze(-1)
    return {"end_rows": float(err[end].mean()), "other_rows": float(err[~end].mean())}


def _q(task: Task, loss, obs, action):
    """Q(s, a): the min over SAC's Q nets, or DQN's value of the (one-hot) action."""
    if task.algo == "sac":
        params = loss.qvalue_network_params
        qs = []
        for i in range(params.shape[0]):
            with params[i].to_module(loss.qvalue_network):
                qs.append(loss.qvalue_network.module(obs, action).squeeze(-1))
        return torch.stack(qs).min(0).values
    td = loss.value_network(TensorDict(observation=obs, batch_size=obs.shape[:-1]))
    return (td["action_value"] * action.float()).sum(-1)


def run(
    task_name: str, variant: str, seed: int, quick: bool, ppo_frames: int | None = None
) -> dict:
    """Trains one agent; returns its curve, final return and Bellman errors."""
    if task_name in PPO_TASKS:
        return run_ppo(task_name, variant, seed, quick, _greedy_return, ppo_frames)
    task = TASKS[task_name]
    if quick:
        short = {"frames": task.frames // 10, "random_frames": task.random_frames // 10, "evals": 2}
        task = Task(**{**task.__dict__, **short})
    torch.manual_seed(seed)
    np.random.seed(seed)
    env = _producer(task, variant, seed)
    if task.algo == "sac":
        policy, explore, loss, updater = _sac(env, task.lr)
    else:
        policy, explore, loss, updater = _dqn(env, task.lr, task)
    optim = torch.optim.Adam(loss.parameters(), lr=task.lr)
    rb = _buffer(env, variant, task.frames)
    collector = Collector(
        env,
        explore,
        frames_per_batch=NUM_ENVS * 8,
        total_frames=task.frames,
        init_random_frames=task.random_frames,
    )
    curve, frames, debt, nan_losses = [], 0, 0.0, 0
    every = task.frames // task.evals
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CleanbufWarning)
        for batch in collector:
            rb.extend(batch if variant == "cleanbuf" else batch.reshape(-1))
            frames += batch.numel()
            if frames >= task.random_frames and len(rb) >= 256:
                debt += batch.numel() * task.updates_per_frame
                while debt >= 1:
                    debt -= 1
                    out = loss(rb.sample())
                    total = sum(out[k] for k in out.keys() if k.startswith("loss"))
                    if not torch.isfinite(total):
                        nan_losses += 1
                    optim.zero_grad()
                    total.backward()
                    optim.step()
                    updater.step()
            if task.algo == "dqn":
                explore[1].step(batch.numel())
            if frames // every != (frames - batch.numel()) // every:
                curve.append((frames, _greedy_return(task, policy, seed)))
    collector.shutdown()
    errors = _bellman_errors(task, policy, loss, seed)
    stats = rb.transform[0].stats if variant == "cleanbuf" else None
    env.close()
    return {
        "task": task_name,
        "variant": variant,
        "seed": seed,
        "curve": curve,
        "final_return": curve[-1][1],
        "bellman_error": errors,
        "nan_losses": nan_losses,
        "filter_stats": stats,
        "seconds": time.perf_counter() - start,
    }


def _interval(xs: list[float]) -> tuple[float, float]:
    """Mean and half-width of a 95% t interval."""
    t95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}
    mean = statistics.fmean(xs)
    if len(xs) < 2:
        return mean, math.nan
    return mean, t95.get(len(xs) - 1, 2.0) * statistics.stdev(xs) / math.sqrt(len(xs))


def table(results: list[dict]) -> str:
    """The summary table, as printed and as pasted into docs/does-it-matter.md."""
    lines = [
        "| task | data | seeds | final return (mean ± 95% CI) | Bellman error, end rows | "
        "Bellman error, other rows | non-finite losses |",
        "|---|---|---|---|---|---|---|",
    ]
    for task in TASKS:
        for variant in VARIANTS:
            rs = [r for r in results if r["task"] == task and r["variant"] == variant]
            if not rs:
                continue
            m, h = _interval([r["final_return"] for r in rs])
            end = statistics.fmean(r["bellman_error"]["end_rows"] for r in rs)
            other = statistics.fmean(r["bellman_error"]["other_rows"] for r in rs)
            nans = sum(r["nan_losses"] for r in rs)
            lines.append(
                f"| {task} | {variant} | {len(rs)} | {m:.1f} ± {h:.1f} | {end:.2f} | "
                f"{other:.2f} | {nans} |"
            )
    return "\n".join(lines)


def paired(results: list[dict]) -> str:
    """Per task, the differences of final return between data kinds, seed by seed.

    The variants of a seed share its env seeds and torch seed (the same
    initial weights), so the paired difference is the sharper comparison.
    """
    lines = ["| task | difference | per seed | mean ± 95% CI |", "|---|---|---|---|"]
    for task in [*TASKS, *PPO_TASKS]:
        by = {(r["variant"], r["seed"]): r["final_return"] for r in results if r["task"] == task}
        seeds = sorted({s for _, s in by})
        for a, b in (("torchrl", "cleanbuf"), ("torchrl", "oracle"), ("cleanbuf", "oracle")):
            d = [by[a, s] - by[b, s] for s in seeds if (a, s) in by and (b, s) in by]
            if not d:
                continue
            m, h = _interval(d)
            per_seed = ", ".join(f"{x:.1f}" for x in d)
            lines.append(f"| {task} | {a} - {b} | {per_seed} | {m:.1f} ± {h:.1f} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    """Greedy return over training, mean and min-max band over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = [t for t in [*TASKS, *PPO_TASKS] if any(r["task"] == t for r in results)]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for variant in VARIANTS:
            rs = [r for r in results if r["task"] == task and r["variant"] == variant]
            if not rs:
                continue
            x = np.array([f for f, _ in rs[0]["curve"]])
            ys = np.array([[y for _, y in r["curve"]] for r in rs])
            ax.plot(x, ys.mean(0), label=variant)
            ax.fill_between(x, ys.min(0), ys.max(0), alpha=0.2)
        ax.set_title(f"{task} ({len(rs)} seeds)")
        ax.set_xlabel("frames")
        ax.set_ylabel("greedy return")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _meta(quick: bool) -> dict:
    return {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.processor()}",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torchrl": __import__("torchrl").__version__,
            "gymnasium": gymnasium.__version__,
            "cleanbuf": cleanbuf.__version__,
        },
        "quick": quick,
    }


def report(results: list[dict], png: str | None) -> None:
    """Prints the tables of ``results`` (and plots them to ``png``)."""
    if png is not None:
        plot(results, png)
    if any("bellman_error" in r for r in results):
        print(table(results))
    if any("advantage_error" in r for r in results):
        print(ppo_table(results, _interval))
    print(paired(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1/10 of the frames")
    parser.add_argument("--seeds", type=int, default=None, help="default: 5 (1 with --quick)")
    parser.add_argument("--first-seed", type=int, default=0, help="to split seeds over processes")
    parser.add_argument("--tasks", nargs="*", default=[*TASKS, *PPO_TASKS])
    parser.add_argument("--ppo-frames", type=int, default=None, help="PPO length (default 100k)")
    parser.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--name", default=None, help="output stem (default impact, impact-quick)")
    parser.add_argument(
        "--report", nargs="*", default=None, metavar="JSON",
        help="no training: the tables (and --name's plot) of these result files together",
    )  # fmt: skip
    args = parser.parse_args()
    name = args.name or ("impact-quick" if args.quick else "impact")
    if args.report is not None:
        results = []
        for path in args.report:
            with open(path) as f:
                results += json.load(f)["results"]
        report(results, os.path.join(args.out, f"{name}.png") if args.name else None)
        return
    torch.set_num_threads(1)
    n_seeds = args.seeds if args.seeds is not None else (1 if args.quick else 5)
    seeds = range(args.first_seed, args.first_seed + n_seeds)
    results = []
    for task in args.tasks:
        for seed in seeds:
            for variant in VARIANTS:
                r = run(task, variant, seed, args.quick, args.ppo_frames)
                results.append(r)
                err = r.get("bellman_error") or r["advantage_error"]
                kind = "Bellman" if "bellman_error" in r else "advantage"
                print(
                    f"{task} {variant} seed {seed}: return {r['final_return']:.1f}, "
                    f"{kind} error end/other {err['end_rows']:.3f}/"
                    f"{err['other_rows']:.3f}, {r['seconds']:.0f} s",
                    flush=True,
                )
                # after every run: a long run stopped early keeps what it did
                with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                    json.dump({"meta": _meta(args.quick), "results": results}, f, indent=1)
    report(results, os.path.join(args.out, f"{name}.png"))


if __name__ == "__main__":
    main()
