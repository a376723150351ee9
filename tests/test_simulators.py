"""step_rows on the GPU simulators' step formats, against the explicit-reset run.

Isaac Lab, mjlab's terminal extras and ManiSkill3 run through the
format-faithful envs of tests/simulators.py (their keys, shapes and dtypes
read from each simulator's source); the observations are wrapped so that
any copy to the host raises while step_rows reads them, which is the path
rows on a GPU take (step_rows has one path for torch tensors, on every
device). mjlab itself, where it installs, runs in
test_real_mjlab_equals_explicit_resets (a venv of its own: see its docstring).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

import cleanbuf
from cleanbuf import AutoresetFilter, InputError, TerminalObservationLostError, step_rows
from tests.simulators import (
    HostCopyError,
    IsaacLabEnv,
    ManiSkillEnv,
    MjlabEnv,
    explicit_reset_rows,
    no_host_copies,
    on_device,
    plain,
    policy,
)


def guarded(value):
    """The simulator's output as tensors that raise on a host copy (dicts kept, flags too)."""
    if isinstance(value, dict):
        return {k: guarded(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return on_device(value)
    return value


def autoreset_run(env, steps, rb, producer=None, time_outs=False):
    """Runs the auto-resetting env; each step through step_rows (guarded) into rb."""
    obs, _ = env.reset()
    for _ in range(steps):
        action = policy(obs)
        next_obs, reward, terminated, truncated, info = env.step(action)
        with no_host_copies():
            rows = step_rows(
                guarded(obs),
                action,
                guarded(next_obs),
                reward,
                terminated,
                None if time_outs else truncated,
                guarded(info),
                producer=producer,
            )
        rb.extend(plain(rows))
        obs = next_obs


def truth_rows(env, steps):
    """The explicit-reset run as the rows the filter should store, step after step."""
    out = explicit_reset_rows(env, steps)

    def cat(i):
        parts = [s[i] for s in out]
        if isinstance(parts[0], dict):
            return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        return torch.cat(parts)

    obs, action, next_obs, reward, terminated, truncated = (cat(i) for i in range(6))
    return obs, action, next_obs, reward, terminated, truncated


def assert_equal_rows(stored, truth, keep=None):
    """Every stored row equals the explicit-reset row (``keep``: the truth rows expected).

    Returns:
        The number of rows compared.
    """
    obs, action, next_obs, reward, terminated, truncated = truth
    keep = torch.ones(len(reward), dtype=torch.bool) if keep is None else keep

    def check(got, want, name):
        if isinstance(want, dict):
            for k in want:
                check(got[k], want[k], f"{name}[{k!r}]")
            return
        want = want[keep]
        torch.testing.assert_close(
            got.reshape(want.shape), want, rtol=0, atol=0, msg=lambda m: f"{name}: {m}"
        )

    assert len(stored) == int(keep.sum()), (len(stored), int(keep.sum()))
    check(stored["observation"], obs, "observation")
    check(stored["next", "observation"], next_obs, "next observation")
    check(stored["action"], action, "action")
    check(stored["next", "reward"], reward, "reward")
    check(stored["next", "terminated"], terminated, "terminated")
    check(stored["next", "truncated"], truncated, "truncated")
    return len(stored)


def buffer(n, **options):
    filt = AutoresetFilter("same_step", layout="step", **options)
    return filt, ReplayBuffer(storage=LazyTensorStorage(n), transform=filt)


def test_isaaclab_final_obs_at_1024_envs_equal_explicit_resets():
    """Isaac Lab (compute_final_obs=True), 1,024 envs a step, truncations read
    from extras["time_outs"], groups policy and critic. Bugs caught: the
    post-reset observation stored as a done row's next observation, one group
    restored and not the other, the time-outs left in terminated, an
    observation copied to the host on the way.
    """
    steps, n = 24, 1024
    filt, rb = buffer(steps * n)
    autoreset_run(IsaacLabEnv(n), steps, rb, time_outs=True)
    truth = truth_rows(IsaacLabEnv(n, auto_reset=False), steps)
    ends = int((truth[4] | truth[5]).sum())
    assert ends > 1000 and int(truth[4].sum()) > 100  # both kinds of end, many times
    assert assert_equal_rows(rb[:], truth) == steps * n
    assert filt.stats["terminal_obs_missing"] == 0


@pytest.mark.parametrize("producer", [None, "mjlab"])
def test_mjlab_terminal_extras_equal_explicit_resets(producer):
    """The extras["terminal"] of mjlab (the done envs only, in env_ids order), read
    from the keys or declared. Bugs caught: a done env's terminal row put in
    the wrong env (env_ids ignored), the mask not built from env_ids, a
    scatter done on the host.
    """
    steps, n = 30, 64
    filt, rb = buffer(steps * n)
    autoreset_run(MjlabEnv(n), steps, rb, producer=producer)
    truth = truth_rows(MjlabEnv(n, auto_reset=False), steps)
    assert int((truth[4] | truth[5]).sum()) > 100
    assert assert_equal_rows(rb[:], truth) == steps * n


@pytest.mark.parametrize("ignore_terminations", [False, True])
def test_maniskill_final_observation_equal_explicit_resets(ignore_terminations):
    """ManiSkill3's infos["final_observation"] with the mask
    infos["_final_observation"]; with ignore_terminations the episodes end
    only by time limit. Bugs caught: the mask ignored (a non-done env's
    observation replaced), a state observation (one tensor, no groups)
    not read.
    """
    steps, n = 30, 64
    filt, rb = buffer(steps * n)
    autoreset_run(ManiSkillEnv(n, ignore_terminations=ignore_terminations), steps, rb)
    truth = truth_rows(ManiSkillEnv(n, auto_reset=False, ignore_terminations=ignore_terminations),
                       steps)  # fmt: skip
    assert bool(truth[4].any()) != ignore_terminations and bool(truth[5].any())
    assert assert_equal_rows(rb[:], truth) == steps * n


@pytest.mark.parametrize(
    "env, off",
    [
        (IsaacLabEnv, {"compute_final_obs": False}),
        (MjlabEnv, {"capture_terminal_observations": False}),
    ],
)
def test_no_final_obs_counted_and_handled(env, off):
    """Isaac Lab without compute_final_obs, mjlab without its terminal extras:
    every done row's terminal observation is gone. Bugs caught: the
    post-reset observation stored as the terminal one (silently wrong), the
    loss not counted, "drop" keeping a row or dropping a good one, the
    default not raising.
    """
    steps, n = 20, 32
    truth = truth_rows(env(n, auto_reset=False), steps)
    done = truth[4] | truth[5]
    _, rb = buffer(steps * n)
    with pytest.raises(TerminalObservationLostError):
        autoreset_run(env(n, **off), steps, rb)
    filt, rb = buffer(steps * n, on_lost_terminal_obs="drop")
    autoreset_run(env(n, **off), steps, rb)
    assert assert_equal_rows(rb[:], truth, keep=~done) == steps * n - int(done.sum())
    assert filt.stats["lost_rows_dropped"] == int(done.sum()) > 40
    filt, rb = buffer(steps * n, on_lost_terminal_obs="nan")
    autoreset_run(env(n, **off), steps, rb)
    stored = rb[:]
    group = next(iter(truth[2]))
    nan_rows = stored["next", "observation", group].isnan().any(-1)
    assert torch.equal(nan_rows, done) and filt.stats["terminal_obs_missing"] == int(done.sum())
    keep = ~done
    torch.testing.assert_close(stored["next", "observation", group][keep], truth[2][group][keep])


def one_step(env_cls, **kwargs):
    """A step of 8 envs where some are done, returned as the simulator gives it."""
    env = env_cls(8, **kwargs)
    obs, _ = env.reset()
    while True:
        action = policy(obs)
        step = env.step(action)
        if bool((step[2] | step[3]).any()):
            return obs, action, step
        obs = step[0]


def test_declared_producer_contradicted_by_keys_is_refused():
    """A producer declared against the keys present, two formats at once, and
    an mjlab env_ids naming an env that is not done. Bugs caught: one
    simulator's entry read as another's (wrong rows, silently), an
    ambiguous info guessed.
    """
    obs, action, (nxt, reward, term, trunc, extras) = one_step(MjlabEnv)
    with pytest.raises(InputError, match=r"producer='isaaclab'.*'terminal' \(mjlab's\)"):
        step_rows(obs, action, nxt, reward, term, trunc, extras, producer="isaaclab")
    both = {**extras, "final_obs": dict(nxt)}
    with pytest.raises(InputError, match="isaaclab and mjlab at once.*producer="):
        step_rows(obs, action, nxt, reward, term, trunc, both)
    wrong = {"terminal": {**extras["terminal"], "env_ids": (extras["terminal"]["env_ids"] + 1) % 8}}
    done = (term | trunc).nonzero().reshape(-1)
    if not bool(torch.isin((done + 1) % 8, done).all()):
        with pytest.raises(InputError, match="not done at this step"):
            step_rows(obs, action, nxt, reward, term, trunc, wrong)
    with pytest.raises(InputError, match="producer='gym' is not known"):
        step_rows(obs, action, nxt, reward, term, trunc, extras, producer="gym")
    obs, action, (nxt, reward, term, trunc, extras) = one_step(IsaacLabEnv)
    extras["final_obs"] = {"policy": extras["final_obs"]["policy"]}
    with pytest.raises(InputError, match=r"\['policy'\]; expected the observation groups"):
        step_rows(obs, action, nxt, reward, term, trunc, extras)


def test_host_copy_guard_catches_a_copy():
    """The guard itself. Bug caught: a guard that never raises (every test of
    the device path would then pass on a host copy).
    """
    x = on_device(torch.ones(3, 2))
    copies = [
        lambda t: t.cpu(),
        lambda t: t.numpy(),
        lambda t: t.tolist(),
        lambda t: t.to("cpu"),
        lambda t: (t * 2).sum().item(),
        lambda t: np.zeros_like(np.asarray(t)),  # what step_rows did before its device path
    ]
    for copy in copies:
        with no_host_copies(), pytest.raises(HostCopyError):
            copy(x)
    assert x.cpu().tolist() == [[1.0, 1.0]] * 3  # outside the guard: a tensor


def test_lossless_mjlab_env_equals_explicit_resets():
    """LosslessMjlabEnv over an env with auto_reset=False: it resets the done
    envs and hands over their terminal observations as mjlab's terminal
    extras. Bugs caught: the terminal rows read after the reset (they would
    be the reset observations), a wrapper over an auto-resetting env
    accepted.
    """
    steps, n = 30, 64

    class Cfg:
        auto_reset = False

    env = MjlabEnv(n, auto_reset=False)
    env.cfg = Cfg()
    filt, rb = buffer(steps * n)
    autoreset_run(cleanbuf.LosslessMjlabEnv(env), steps, rb)
    truth = truth_rows(MjlabEnv(n, auto_reset=False), steps)
    assert assert_equal_rows(rb[:], truth) == steps * n
    assert filt.stats["terminal_obs_missing"] == 0
    Cfg.auto_reset = True
    with pytest.raises(cleanbuf.CleanbufError, match="cfg.auto_reset = False"):
        cleanbuf.LosslessMjlabEnv(env)


def _real_mjlab(auto_reset: bool, n: int):
    """The real Mjlab-Cartpole-Balance, n envs on the CPU (Warp's CPU device).

    Episodes of 2 s (40 steps; its own are 50 s, longer than a test) and
    no observation noise, so that two runs of the same seed and actions
    give the same rows.
    """
    import mjlab.tasks  # noqa: F401  (registers the tasks)
    from mjlab.envs import ManagerBasedRlEnv
    from mjlab.tasks.registry import load_env_cfg

    cfg = load_env_cfg("Mjlab-Cartpole-Balance")
    cfg.scene.num_envs = n
    cfg.episode_length_s = 2.0
    cfg.observations["actor"].enable_corruption = False
    cfg.auto_reset = auto_reset
    return ManagerBasedRlEnv(cfg=cfg, device="cpu")


def _real_mjlab_truth(steps: int, n: int, act) -> list:
    """The explicit-reset loop: auto_reset=False, done envs reset after each step."""
    torch.manual_seed(0)
    env = _real_mjlab(False, n)
    truth, (obs, _) = [], env.reset(seed=0)
    obs = {k: v.clone() for k, v in obs.items()}
    for t in range(steps):
        action = act(obs, t)
        next_obs, reward, terminated, truncated, _ = env.step(action)
        next_obs = {k: v.clone() for k, v in next_obs.items()}
        truth.append((obs, next_obs, terminated | truncated))
        obs = next_obs
        done = terminated | truncated
        if bool(done.any()):
            obs, _ = env.reset(env_ids=done.nonzero().squeeze(-1))
            obs = {k: v.clone() for k, v in obs.items()}
    env.close()
    return truth


def _mjlab_act(obs, t):
    """Deterministic actions that vary by env and step."""
    n = obs["actor"].shape[0]
    return torch.sin(torch.arange(n, dtype=torch.float32)[:, None] * 0.7 + t * 0.3)


def _through_the_filter(env, steps: int, **options) -> tuple:
    """An mjlab env's loop (its seed 0, :func:`_mjlab_act`) through step_rows and the filter."""
    filt, rb = buffer(steps * env.num_envs, **options)
    obs, _ = env.reset(seed=0)
    obs = {k: v.clone() for k, v in obs.items()}
    for t in range(steps):
        action = _mjlab_act(obs, t)
        step = env.step(action)
        rb.extend(step_rows(obs, action, *step, producer="mjlab"))
        obs = {k: v.clone() for k, v in step[0].items()}
    env.close()
    return filt, rb[:]


@pytest.mark.slow
def test_real_mjlab_equals_explicit_resets():
    """The real mjlab against the explicit-reset loop of the same seed and actions.

    Skipped where mjlab is not installed: mjlab 1.6.0 needs mujoco 3.11,
    not the pinned 4.0, and PyPI's torchvision, which does not load beside
    the CPU torch; run it in a venv of its own with ``pip install
    mjlab==1.6.0 -c <(echo torch==2.13.0)``. Mjlab-Cartpole-Balance with
    64 envs on the CPU:

    - ``auto_reset=False`` through ``LosslessMjlabEnv`` and the filter:
      every row equal, every terminal observation kept. Bugs caught: the
      wrapper reading the observations after mjlab's reset, mjlab's groups
      (actor, critic) not restored together, a done row dropped.
    - mjlab's own auto-reset (1.6.0 has no terminal extras): each done
      row's terminal observation is lost, counted, and dropped under
      ``on_lost_terminal_obs="drop"``; every other row equal. Bugs caught:
      the post-reset observation stored as a done row's next observation,
      a loss not counted.
    """
    pytest.importorskip("mjlab")
    steps, n = 100, 64
    truth = _real_mjlab_truth(steps, n, _mjlab_act)
    ends = torch.cat([d for _, _, d in truth])
    assert int(ends.sum()) >= n  # every env ended at least one episode

    torch.manual_seed(0)
    filt, stored = _through_the_filter(cleanbuf.LosslessMjlabEnv(_real_mjlab(False, n)), steps)
    assert len(stored) == steps * n and filt.stats["terminal_obs_missing"] == 0
    for group in ("actor", "critic"):
        for key, at in (("observation", 0), (("next", "observation"), 1)):
            want = torch.cat([row[at][group] for row in truth])
            name = (key, group) if isinstance(key, str) else (*key, group)
            torch.testing.assert_close(stored[name], want, rtol=0, atol=0)

    torch.manual_seed(0)
    filt, stored = _through_the_filter(_real_mjlab(True, n), steps, on_lost_terminal_obs="drop")
    assert filt.stats["terminal_obs_missing"] == int(ends.sum())
    assert len(stored) == steps * n - int(ends.sum())
    keep = ~ends
    for group in ("actor", "critic"):
        want = torch.cat([nxt[group] for _, nxt, _ in truth])[keep]
        torch.testing.assert_close(stored["next", "observation", group], want, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("env_cls", [IsaacLabEnv, MjlabEnv, ManiSkillEnv])
def test_formats_on_cuda_equal_explicit_resets(env_cls):
    """Each format with its tensors on a GPU, into a buffer on the GPU.
    Bugs caught: a final-observation entry or mask built on the CPU next to
    GPU rows (a device mismatch, or a silent copy), env_ids on the wrong
    device.
    """
    steps, n = 20, 256
    filt = AutoresetFilter("same_step", layout="step")
    rb = ReplayBuffer(storage=LazyTensorStorage(steps * n, device="cuda"), transform=filt)
    autoreset_run(env_cls(n, device="cuda"), steps, rb)
    stored = rb[:]
    assert stored["next", "done"].device.type == "cuda"
    truth = truth_rows(env_cls(n, auto_reset=False, device="cuda"), steps)
    assert assert_equal_rows(stored, truth) == steps * n
