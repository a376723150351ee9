"""Test envs that step exactly as the GPU simulators do, and the host-copy guard.

Isaac Lab, mjlab (its terminal extras) and ManiSkill3 do not run on this
machine (or not in the version that has the format), so these envs produce
their step's keys, shapes and dtypes, read from each simulator's source:

* Isaac Lab ``ManagerBasedRLEnv.step``: ``(obs, reward, terminated,
  truncated, extras)``; ``obs`` the groups ``{"policy": [E, d], "critic":
  [E, d']}`` float32 after the reset; ``terminated`` / ``truncated`` bool
  ``[E]``; ``reward`` float32 ``[E]``; ``extras["time_outs"]`` the
  truncations; with ``compute_final_obs`` on, ``extras["final_obs"]`` the
  groups before the reset for the whole batch, on a step where an env reset.
* mjlab ``ManagerBasedRlEnv.step``: the same tuple with groups ``actor`` and
  ``critic``; with ``capture_terminal_observations`` on, ``extras["terminal"]
  = {"env_ids": done.nonzero().squeeze(-1), "observations": {group: [k, d]}}``
  on a step where an env reset; ``auto_reset=False`` returns the terminal
  observations and leaves the reset to ``reset(env_ids=...)``.
* ManiSkill3 ``ManiSkillVectorEnv.step``: a state observation ``[E, d]``
  float32; ``infos["final_observation"]`` (the whole batch before the reset),
  ``infos["_final_observation"] = dones`` (also ``final_info``,
  ``_final_info``, ``_elapsed_steps``) on a step where an env reset;
  ``ignore_terminations=True`` forces ``terminated`` to False.

The dynamics are one and the same for all three, and run with explicit
resets (``auto_reset=False``: the step returns the terminal observations,
the loop resets the done envs) they give the truth the cleaned rows must
equal. Observations encode their place: ``1000 * env + t`` (t: the step in
the episode) and the episode's number, so a wrong stitch shows in the value.
"""

from __future__ import annotations

import contextlib

import torch

HORIZON = 11  # time limit: truncated at t == HORIZON


class Dynamics:
    """E envs; env e's episode k terminates at t = 3 + (7e + 3k) % 9 when (e + k) % 3 == 0."""

    groups = ("policy", "critic")

    def __init__(self, num_envs, *, auto_reset=True, ignore_terminations=False, device="cpu"):
        self.num_envs = num_envs
        self.auto_reset = auto_reset
        self.ignore_terminations = ignore_terminations
        self.device = torch.device(device)
        self.env = torch.arange(num_envs, device=self.device)
        self.t = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self.episode = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        self.last_action = torch.zeros(num_envs, device=self.device)

    def observe(self):
        pos = (1000 * self.env + self.t).to(torch.float32)
        ep = self.episode.to(torch.float32)
        a, b = self.groups
        return {
            a: torch.stack([pos, ep], 1),
            b: torch.stack([pos, ep, self.last_action, -pos], 1),
        }

    def _reset_rows(self, mask):
        self.t = torch.where(mask, 0, self.t)
        self.episode = self.episode + mask.long()
        self.last_action = torch.where(mask, 0.0, self.last_action)

    def reset(self, seed=None, env_ids=None):
        if env_ids is None:
            mask = torch.ones(self.num_envs, dtype=torch.bool, device=self.device)
            self.t.zero_()
            self.episode.zero_()
            self.last_action.zero_()
        else:
            mask = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
            mask[env_ids] = True
            self._reset_rows(mask)
        return self.observe(), {}

    def _advance(self, action):
        action = action.reshape(self.num_envs, -1)[:, 0].to(torch.float32)
        self.t = self.t + 1
        self.last_action = action
        reward = action + self.t.to(torch.float32)
        end = 3 + (7 * self.env + 3 * self.episode) % 9
        terminated = (self.t == end) & ((self.env + self.episode) % 3 == 0)
        if self.ignore_terminations:
            terminated = torch.zeros_like(terminated)
        truncated = (self.t >= HORIZON) & ~terminated
        return reward, terminated, truncated


def policy(obs):
    """A deterministic action from the first group (or the state observation)."""
    x = obs if isinstance(obs, torch.Tensor) else next(iter(obs.values()))
    return (x[:, :1] % 5) - 2.0


class IsaacLabEnv(Dynamics):
    """Isaac Lab's ``ManagerBasedRLEnv`` step format."""

    def __init__(self, num_envs, *, compute_final_obs=True, **kwargs):
        super().__init__(num_envs, **kwargs)
        self.compute_final_obs = compute_final_obs

    def step(self, action):
        reward, terminated, truncated = self._advance(action)
        extras = {"log": {}, "time_outs": truncated}
        done = terminated | truncated
        if self.auto_reset and bool(done.any()):
            if self.compute_final_obs:
                extras["final_obs"] = self.observe()
            self._reset_rows(done)
        return self.observe(), reward, terminated, truncated, extras


class MjlabEnv(Dynamics):
    """mjlab's ``ManagerBasedRlEnv`` step format."""

    groups = ("actor", "critic")

    def __init__(self, num_envs, *, capture_terminal_observations=True, **kwargs):
        super().__init__(num_envs, **kwargs)
        self.capture = capture_terminal_observations

    def step(self, action):
        reward, terminated, truncated = self._advance(action)
        extras = {"log": {}}
        done = terminated | truncated
        if self.auto_reset and bool(done.any()):
            if self.capture:
                ids = done.nonzero(as_tuple=False).squeeze(-1)
                rows = {g: v[ids] for g, v in self.observe().items()}
                extras["terminal"] = {"env_ids": ids, "observations": rows}
            self._reset_rows(done)
        return self.observe(), reward, terminated, truncated, extras


class ManiSkillEnv(Dynamics):
    """ManiSkill3's ``ManiSkillVectorEnv`` step format (``obs_mode="state"``)."""

    def observe(self):
        return super().observe()["critic"]

    def step(self, action):
        reward, terminated, truncated = self._advance(action)
        infos = {"elapsed_steps": self.t.clone(), "success": terminated.clone()}
        done = terminated | truncated
        if self.auto_reset and bool(done.any()):
            final_obs = self.observe()
            final_info = dict(infos)
            self._reset_rows(done)
            infos["final_observation"] = final_obs
            infos["final_info"] = final_info
            infos["_final_info"] = done
            infos["_final_observation"] = done
            infos["_elapsed_steps"] = done
        return self.observe(), reward, terminated, truncated, infos


def explicit_reset_rows(env, steps):
    """The truth: (obs, action, next obs, reward, terminated, truncated) per step.

    ``env`` runs with ``auto_reset=False``: its step returns the terminal
    observations; the loop resets the done envs itself.
    """
    obs, _ = env.reset()
    out = []
    for _ in range(steps):
        action = policy(obs)
        next_obs, reward, terminated, truncated, _ = env.step(action)
        out.append((obs, action, next_obs, reward, terminated, truncated))
        done = terminated | truncated
        obs = next_obs
        if bool(done.any()):
            obs, _ = env.reset(env_ids=done.nonzero().squeeze(-1))
    return out


class HostCopyError(AssertionError):
    """An observation was copied to the host."""


_GUARD = [False]
_HOST_COPIES = {torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item}


class OnDevice(torch.Tensor):
    """A tensor that stands for one on a GPU: inside :func:`no_host_copies`,
    ``.cpu()``, ``.numpy()``, ``.tolist()``, ``.item()``, ``np.asarray`` and
    ``.to("cpu")`` raise :class:`HostCopyError`; outside, it is a tensor.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _GUARD[0]:
            to_cpu = func is torch.Tensor.to and any(
                str(a) == "cpu" or a == torch.device("cpu")
                for a in (*args[1:], kwargs.get("device"))
                if isinstance(a, (str, torch.device))
            )
            if func in _HOST_COPIES or to_cpu or func is torch.Tensor.__array__:
                raise HostCopyError(f"an observation copied to the host: {func.__name__}")
        return super().__torch_function__(func, types, args, kwargs)


@contextlib.contextmanager
def no_host_copies():
    """Within it, an :class:`OnDevice` tensor raises on any copy to the host."""
    _GUARD[0] = True
    try:
        yield
    finally:
        _GUARD[0] = False


def on_device(tree):
    """``tree``'s tensors as :class:`OnDevice` (the same storage)."""
    if isinstance(tree, dict):
        return {k: on_device(v) for k, v in tree.items()}
    return tree.as_subclass(OnDevice)


def plain(tree):
    """A TensorDict or tree with every :class:`OnDevice` tensor back to a plain one."""
    if hasattr(tree, "apply"):
        return tree.apply(lambda t: t.as_subclass(torch.Tensor))
    if isinstance(tree, dict):
        return {k: plain(v) for k, v in tree.items()}
    return tree.as_subclass(torch.Tensor)
