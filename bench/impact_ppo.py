"""PPO for ``bench/impact.py``: on-policy data as TorchRL stores it, repaired, explicit-reset.

TorchRL's ``ClipPPOLoss`` and ``GAE`` on ``[8, T]`` collector batches, three
kinds of the same data:

* ``torchrl``: ``GymEnv(name, num_envs=8)`` batches as they come (reset
  rows chain into the next episode, truncations bootstrap from TorchRL's
  zero-filled next observation, joint resets lose the terminal one);
* ``cleanbuf``: the same producer with ``RolloutRepair`` as the collector's
  ``postproc`` (``on_lost_terminal_obs="drop"``), GAE on the whole batch,
  the update on the valid rows;
* ``oracle``: ``cleanbuf.lossless_gym_env`` (explicit resets).

Besides the final greedy return, each run measures, with its final critic
and policy, the error of its own pipeline's GAE advantages against GAE on
the explicit-reset run of the same seeds (deterministic policy, so the two
runs take the same steps), on the episode-end rows and on the others. The
oracle's is 0 by construction.
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import Collector
from torchrl.envs import GymEnv, GymWrapper, set_exploration_type
from torchrl.envs.utils import ExplorationType
from torchrl.modules import (
    MLP,
    NormalParamExtractor,
    OneHotCategorical,
    ProbabilisticActor,
    TanhNormal,
    ValueOperator,
)
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

import cleanbuf
from cleanbuf import CleanbufWarning, RolloutRepair

NUM_ENVS, STEPS, EPOCHS, MINIBATCH = 8, 128, 4, 256
GAMMA, LMBDA = 0.99, 0.95
MASK = ("collector", "mask")


@dataclass(frozen=True)
class PPOTask:
    """One PPO setup."""

    env: str
    frames: int
    lr: float
    entropy: float
    evals: int  # evaluations of the greedy policy over training
    horizon: int  # the env's time limit
    error_limit: int  # the time limit of the advantage-error run (episode ends)
    limit: int | None = None  # a time limit shorter than the env's own (None: its own)

    def make_kwargs(self) -> dict:
        """``gymnasium.make`` arguments: the time limit, where the task sets one."""
        return {} if self.limit is None else {"max_episode_steps": self.limit}


PPO_TASKS = {
    "cartpole-ppo": PPOTask("CartPole-v1", 100_000, 3e-4, 0.01, 10, 500, 16),
    "pendulum-ppo": PPOTask("Pendulum-v1", 100_000, 3e-4, 0.0, 10, 200, 50),
    # a 100-step limit: once the pole stays up, every episode ends by the
    # time limit, and every truncation must bootstrap the value of staying
    # up (about 100 at gamma 0.99); TorchRL's all-zero observation is a
    # balanced pole, the repair's lost ones (envs truncated together) the
    # row's own observation; two greedy evaluations a run (the curve's
    # points), as the ten of the others cost as much as a short run's training
    "cartpole100-ppo": PPOTask("CartPole-v1", 100_000, 3e-4, 0.01, 2, 100, 100, limit=100),
}


def next_step_env(name: str, num_envs: int, **kwargs) -> GymEnv:
    """``GymEnv(name, num_envs=N)`` stepping its vector env in-process: the same rows.

    ``GymEnv(name, num_envs=N)`` builds a Gymnasium ``AsyncVectorEnv`` in
    next-step mode (one process per env); this builds the ``SyncVectorEnv``
    in the same mode behind the same wrapper, so the data is the same
    (reset rows, zero-filled and jointly reset terminal observations), and
    it runs several times faster on a 2-core machine. (``GymWrapper`` refuses
    a next-step vector env handed to it; only ``GymEnv`` builds one.)
    """
    return _SyncGymEnv(name, num_envs=num_envs, **kwargs)


class _SyncGymEnv(GymEnv):
    def _async_env(self, *args, **kwargs):  # GymEnv's one hook for its vector env
        return gym.vector.SyncVectorEnv(*args, **kwargs)


def mlp(n_in: int, n_out: int) -> nn.Sequential:
    """A 64x64 MLP that takes any float observation (MuJoCo's are float64)."""
    return nn.Sequential(_Float32(), MLP(n_in, n_out, num_cells=[64, 64]))


class _Float32(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


def _nets(env, task: PPOTask):
    n_obs = env.observation_spec["observation"].shape[-1]
    spec = env.action_spec_unbatched
    critic = ValueOperator(mlp(n_obs, 1), in_keys=["observation"])
    if task.env.startswith("CartPole"):
        net = TensorDictModule(mlp(n_obs, 2), ["observation"], ["logits"])
        actor = ProbabilisticActor(
            net, in_keys=["logits"], spec=spec, distribution_class=OneHotCategorical,
            return_log_prob=True,
        )  # fmt: skip
        return actor, critic
    return tanh_normal_actor(n_obs, spec, return_log_prob=True), critic


def tanh_normal_actor(n_obs: int, spec, return_log_prob: bool) -> ProbabilisticActor:
    """A 64x64 TanhNormal policy for a continuous action ``spec`` (SAC and PPO share it)."""
    n_act = spec.shape[-1]
    net = nn.Sequential(mlp(n_obs, 2 * n_act), NormalParamExtractor())
    return ProbabilisticActor(
        TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
        in_keys=["loc", "scale"],
        spec=spec,
        distribution_class=TanhNormal,
        distribution_kwargs={"low": spec.space.low, "high": spec.space.high},
        return_log_prob=return_log_prob,
    )


def _update(batch, variant: str, gae, loss, optim) -> int:
    """GAE on the whole batch, then PPO epochs; returns the non-finite losses."""
    with torch.no_grad():
        gae(batch)
    rows = batch[batch[MASK]] if variant == "cleanbuf" else batch.reshape(-1)
    nans = 0
    for _ in range(EPOCHS):
        for idx in torch.randperm(len(rows)).split(MINIBATCH):
            out = loss(rows[idx])
            total = out["loss_objective"] + out["loss_critic"] + out.get("loss_entropy", 0)
            if not torch.isfinite(total):
                nans += 1
                continue
            optim.zero_grad()
            total.backward()
            nn.utils.clip_grad_norm_(loss.parameters(), 0.5)
            optim.step()
    return nans


def run_ppo(
    task_name: str, variant: str, seed: int, quick: bool, greedy_return, frames: int | None = None
) -> dict:
    """Trains one PPO agent; returns its curve, final return and advantage errors.

    ``frames`` overrides the task's length (``--frames`` of ``bench.impact``).
    """
    task = PPO_TASKS[task_name]
    if quick:
        task = PPOTask(**{**task.__dict__, "frames": NUM_ENVS * STEPS * 2, "evals": 1})
    elif frames is not None:
        task = PPOTask(**{**task.__dict__, "frames": frames})
    torch.manual_seed(seed)
    np.random.seed(seed)
    if variant == "oracle":
        env = cleanbuf.lossless_gym_env(task.env, NUM_ENVS, **task.make_kwargs())
    else:
        env = next_step_env(task.env, NUM_ENVS, **task.make_kwargs())
    env.set_seed(seed)
    actor, critic = _nets(env, task)
    postproc = None
    if variant == "cleanbuf":
        postproc = RolloutRepair.for_env(env, on_lost_terminal_obs="drop")
    collector = Collector(
        env, actor, frames_per_batch=NUM_ENVS * STEPS, total_frames=task.frames,
        postproc=postproc,
    )  # fmt: skip
    gae = GAE(gamma=GAMMA, lmbda=LMBDA, value_network=critic)
    loss = ClipPPOLoss(actor, critic, entropy_coeff=task.entropy, normalize_advantage=True)
    optim = torch.optim.Adam(loss.parameters(), lr=task.lr)
    curve, frames, nans = [], 0, 0
    every = max(task.frames // task.evals, 1)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CleanbufWarning)
        for batch in collector:
            n = NUM_ENVS * STEPS
            frames += n
            nans += _update(batch, variant, gae, loss, optim)
            collector.update_policy_weights_()
            if frames // every != (frames - n) // every:
                curve.append((frames, greedy_return(task, actor, seed)))
    collector.shutdown()
    env.close()
    return {
        "task": task_name,
        "variant": variant,
        "seed": seed,
        "curve": curve,
        "final_return": curve[-1][1],
        "advantage_error": advantage_errors(task, actor, critic, variant, seed),
        "nan_losses": nans,
        "repair_stats": None if postproc is None else postproc.stats,
        "seconds": time.perf_counter() - start,
    }


def _error_env(task: PPOTask, explicit: bool):
    """The producer with a short time limit: GymEnv(num_envs), or its explicit-reset twin."""
    if not explicit:
        return next_step_env(task.env, NUM_ENVS, max_episode_steps=task.error_limit)
    make = functools.partial(gym.make, task.env, max_episode_steps=task.error_limit)
    disabled = gym.vector.AutoresetMode.DISABLED
    return GymWrapper(gym.vector.SyncVectorEnv([make] * NUM_ENVS, autoreset_mode=disabled))


def _rollout(env, policy, seed: int, steps: int):
    env.set_seed(seed)
    with set_exploration_type(ExplorationType.DETERMINISTIC), torch.no_grad():
        td = env.rollout(steps, policy, break_when_any_done=False)
    env.close()
    return td


def advantage_errors(task: PPOTask, policy, critic, variant: str, seed: int) -> dict:
    """|A - A_explicit| of this variant's GAE pipeline, episode-end rows and others.

    Both runs take the same steps (same seeds, deterministic policy); the
    data as TorchRL stores it is aligned with the explicit-reset run by
    dropping its reset rows (those the repair masks). The repaired data's
    lost terminal observations are NaN here, which TorchRL's estimators read
    as the training's ``"drop"`` does (the row's own observation).
    """
    steps = max(3 * task.error_limit, 128)
    raw = _rollout(_error_env(task, False), policy, 30_000 + seed, steps)
    want = _rollout(_error_env(task, True), policy, 30_000 + seed, steps)
    # "nan": its lost rows stay valid (TorchRL's estimators read them as "drop"
    # does), so the mask is False exactly on the reset rows
    repair = RolloutRepair(joint_reset=True, on_lost_terminal_obs="nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CleanbufWarning)
        repaired = torch.cat([repair(raw), repair.flush()], -1)
    gae = GAE(gamma=GAMMA, lmbda=LMBDA, value_network=critic)
    with torch.no_grad():
        for td in (raw, repaired, want):
            gae(td)
    got = {"torchrl": raw, "cleanbuf": repaired, "oracle": want}[variant]
    keep = torch.ones(want.batch_size, dtype=torch.bool) if variant == "oracle" else repaired[MASK]
    end, other = [], []
    for e in range(NUM_ENVS):
        a = got["advantage"][e][keep[e]].squeeze(-1)
        b = want["advantage"][e].squeeze(-1)
        n = min(len(a), len(b))
        done = want["next", "done"][e, :n].squeeze(-1)
        last = int(done.nonzero().max()) + 1 if done.any() else 0
        err, done = (a[:last] - b[:last]).abs(), done[:last]
        end.append(err[done])
        other.append(err[~done])
    end, other = torch.cat(end), torch.cat(other)
    return {
        "end_rows": float(end.mean()) if len(end) else float("nan"),
        "other_rows": float(other.mean()) if len(other) else float("nan"),
        "end_rows_max": float(end.max()) if len(end) else float("nan"),
    }


def ppo_table(results: list[dict], interval) -> str:
    """The PPO summary table, as printed."""
    lines = [
        "| task | data | seeds | final return (mean ± 95% CI) | advantage error, end rows "
        "(mean / max) | advantage error, other rows | non-finite losses |",
        "|---|---|---|---|---|---|---|",
    ]
    for task in PPO_TASKS:
        for variant in ("torchrl", "cleanbuf", "oracle"):
            rs = [r for r in results if r["task"] == task and r["variant"] == variant]
            if not rs:
                continue
            m, h = interval([r["final_return"] for r in rs])
            err = [r["advantage_error"] for r in rs]
            end = np.nanmean([x["end_rows"] for x in err])
            end_max = np.nanmax([x["end_rows_max"] for x in err])
            other = np.nanmean([x["other_rows"] for x in err])
            nans = sum(r["nan_losses"] for r in rs)
            lines.append(
                f"| {task} | {variant} | {len(rs)} | {m:.1f} ± {h:.1f} | {end:.3f} / "
                f"{end_max:.3f} | {other:.3f} | {nans} |"
            )
    return "\n".join(lines)
