"""TorchRL's own auto-reset path: ("next", obs) filled at done steps.

TorchRL's ``AutoResetTransform`` (and the native auto-reset path in
``envs/common.py``) puts the reset observation in the next step's root and
fills the done step's ``("next", obs)``: NaN for floats, -1 (the transform)
or 0 (the native path) for signed integers, False for booleans. No terminal
observation is kept, so those rows are lost terminal observations: the
filter applies its policy, the repair masks them, the audit counts them.
The truth is the same env run with TorchRL's explicit resets.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrl.envs import GymEnv

import cleanbuf
from cleanbuf import AutoresetFilter, RolloutRepair
from cleanbuf.engine._kernels import read_fills
from cleanbuf.engine._read import fill_marks

_ID = "CleanbufCounter-v0"


class Counter(gym.Env):
    """obs = [t, 100 * episode + t]; episode k ends at t = 2 + k % 4 (terminated
    when k is even, truncated otherwise).
    """

    def __init__(self, dtype="float32"):
        self.dtype = np.dtype(dtype)
        self.observation_space = gym.spaces.Box(-1000, 1000, (2,), self.dtype)
        self.action_space = gym.spaces.Discrete(2)
        self.k = -1

    def _obs(self):
        return np.array([self.t, 100 * self.k + self.t], self.dtype)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.k += 1
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        end = self.t == 2 + self.k % 4
        return (
            self._obs(),
            float(self.t),
            bool(end and self.k % 2 == 0),
            bool(end and self.k % 2),
            {},
        )


if _ID not in gym.registry:
    gym.register(_ID, entry_point=Counter)


class AutoResettingGymEnv(GymEnv):
    """A GymEnv that resets inside its step, as TorchRL's AutoResetTransform docs write it."""

    def _step(self, tensordict):
        tensordict = super()._step(tensordict)
        if tensordict["done"].any():
            tensordict.update(super().reset().exclude(*self.done_keys))
        return tensordict

    def _reset(self, tensordict=None, **kwargs):
        if tensordict is not None and "_reset" in tensordict:
            return tensordict.copy()
        return super()._reset(tensordict, **kwargs)


def runs(dtype, steps=40):
    """(auto-reset rollout, explicit-reset rollout), each [1, steps]."""
    auto = AutoResettingGymEnv(_ID, auto_reset=True, dtype=dtype)
    truth = GymEnv(_ID, dtype=dtype)
    policy = lambda td: td.set("action", torch.tensor([1, 0]))  # noqa: E731
    a = auto.rollout(steps, policy, break_when_any_done=False)
    b = truth.rollout(steps, policy, break_when_any_done=False)
    return a.unsqueeze(0), b.unsqueeze(0)


def test_nan_filled_rows_are_lost_observations():
    """Float observations, NaN-filled at done steps. Bugs caught: a NaN row
    stored as data (silently), "drop" dropping a good row, the repair
    bootstrapping from a NaN, the audit not counting them.
    """
    auto, truth = runs("float32")
    done = truth["next", "done"].reshape(-1)
    assert auto["next", "observation"].isnan().any(-1).reshape(-1).eq(done).all()
    n_done = int(done.sum())
    assert n_done >= 8
    filt = AutoresetFilter("same_step", on_lost_terminal_obs="drop")
    out = filt.inv(auto)
    want = truth.reshape(-1)[~done]
    assert len(out) == len(want) == 40 - n_done
    for key in ["observation", ("next", "observation"), ("next", "reward"), ("next", "done")]:
        torch.testing.assert_close(out[key], want[key], rtol=0, atol=0)
    assert filt.stats["lost_rows_dropped"] == n_done
    repaired = RolloutRepair("same_step", on_lost_terminal_obs="drop")(auto)
    mask = repaired["collector", "mask"].reshape(-1)  # the last step waits one batch
    assert torch.equal(mask, ~done[:-1])
    report = cleanbuf.audit(auto)
    assert report.next_obs_nan == n_done and report.lost == n_done
    assert "compute_final_obs=True" in str(report)  # what keeps them at the source


def test_minus_one_filled_integer_rows_through_the_filter():
    """Integer observations, filled with -1 at done steps by
    AutoResetTransform, through the filter and the repair in same-step mode
    (the mode of TorchRL's auto-reset path: the reset observation is the
    next step's root, no reset row). Bug caught: -1 rows stored as real
    terminal observations.
    """
    auto, truth = runs("int64")
    done = truth["next", "done"].reshape(-1)
    assert (auto["next", "observation"].reshape(40, -1)[done] == -1).all()
    filt = AutoresetFilter("same_step", on_lost_terminal_obs="drop")
    out = filt.inv(auto)
    want = truth.reshape(-1)[~done]
    torch.testing.assert_close(out["next", "observation"], want["next", "observation"])
    assert filt.stats["lost_rows_dropped"] == int(done.sum())
    repaired = RolloutRepair("same_step", on_lost_terminal_obs="drop")(auto)
    assert torch.equal(repaired["collector", "mask"].reshape(-1), ~done[:-1])


def test_audit_counts_minus_one_filled_integer_rows():
    """The audit of integer observations filled with -1 at done steps: read
    as NaN rows are, marked lost (no artifact to clean, every terminal
    observation counted lost, and the setting that keeps them named). Bug
    caught: the audit counting no lost terminal observation (it read only
    zero- and NaN-filled rows as filled).
    """
    auto, truth = runs("int64")
    n_done = int(truth["next", "done"].sum())
    report = cleanbuf.audit(auto)
    assert report.next_obs_nan == report.lost == n_done
    assert "-1" in str(report) and "compute_final_obs=True" in str(report)


def test_zero_filled_integer_rows_are_lost_observations():
    """Integer observations zero-filled at done steps, as TorchRL's native
    auto-reset path fills them (``_native_autoreset_set_invalid_next_observation``:
    NaN for floats, zeros otherwise). Bug caught: a zero-filled row stored
    as data.
    """
    auto, truth = runs("int64")
    done = truth["next", "done"].reshape(-1)
    nxt = auto["next", "observation"].clone()
    nxt.reshape(40, -1)[done] = 0  # the native path's fill
    auto["next", "observation"] = nxt
    filt = AutoresetFilter("same_step", on_lost_terminal_obs="drop")
    out = filt.inv(auto)
    want = truth.reshape(-1)[~done]
    torch.testing.assert_close(out["next", "observation"], want["next", "observation"])
    assert filt.stats["lost_rows_dropped"] == int(done.sum())


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(["int8", "int32", "int64", "uint8", "float32", "bool"]),
    width=st.integers(1, 9),
    kinds=st.lists(st.sampled_from(["zero", "minus", "nan", "data", "mixed"]), min_size=1),
)
def test_the_kernel_and_the_numpy_rule_read_fills_alike(dtype, width, kinds):
    """The numba scan (narrow rows, the filter's path) and the numpy rule
    (wide rows, the audit) on the same rows. Bugs caught: a -1 row read as
    filled in unsigned or boolean data, a row with one -1 element read as
    filled, a NaN row left unmarked once a nonzero element was seen, and the
    two paths disagreeing, so that the filter and the audit count different
    lost observations on the same data.
    """
    rows = []
    for kind in kinds:
        row = np.arange(1, width + 1, dtype=np.float64)
        if kind == "zero":
            row[:] = 0
        elif kind == "minus":
            row[:] = -1
        elif kind == "nan":
            row[-1] = np.nan
        elif kind == "mixed":
            row[0] = -1
        rows.append(row)
    x = np.array(rows)
    if dtype != "float32":
        x = np.nan_to_num(x, nan=7.0)
    x = x.astype(dtype) if dtype != "bool" else x != 0
    zero, marked = fill_marks(x)
    narrow = x.view(np.uint8) if x.dtype == np.bool_ else x
    k_zero = np.ones(len(x), np.bool_)
    k_marked = np.zeros(len(x), np.bool_)
    read_fills(
        narrow, np.arange(len(x)), x.dtype.kind == "f", x.dtype.kind == "i", k_zero, k_marked
    )
    assert k_marked.tolist() == marked.tolist()
    assert (k_zero & ~k_marked).tolist() == zero.tolist()
    if x.dtype.kind == "i":
        assert marked.tolist() == [bool((r == -1).all()) for r in rows]
    elif x.dtype.kind != "f":
        assert not marked.any()


def test_for_env_reads_auto_resetting_envs_as_same_step():
    """``for_env`` on an env built with ``auto_reset=True`` (alone and as
    ``SerialEnv`` workers). Bugs caught: such an env read as explicit resets
    (mode ``disabled``: the fills stored as data; the SerialEnv's workers
    were not looked at), a plain SerialEnv of single envs read as
    auto-resetting, a policy chosen for integer observations (NaN cannot
    mark them), a user's policy not overriding the one read.
    """
    from torchrl.envs import SerialEnv

    def auto(dtype="float32"):
        return AutoResettingGymEnv(_ID, auto_reset=True, dtype=dtype)

    for env in (auto(), SerialEnv(2, [auto, auto])):
        o = AutoresetFilter.for_env(env).options
        assert (o.mode, o.on_lost_terminal_obs) == ("same_step", "nan"), env
        assert RolloutRepair.for_env(env).options.mode == "same_step"
    plain = SerialEnv(2, [lambda: GymEnv(_ID)] * 2)
    assert AutoresetFilter.for_env(plain).options.mode == "disabled"
    ints = AutoresetFilter.for_env(SerialEnv(2, [lambda: auto("int64")] * 2)).options
    assert (ints.mode, ints.on_lost_terminal_obs) == ("same_step", None)
    rows, truth = runs("float32")
    done = truth["next", "done"].reshape(-1)
    filt = AutoresetFilter.for_env(auto(), on_lost_terminal_obs="drop")
    out = filt.inv(rows)
    torch.testing.assert_close(
        out["next", "observation"], truth.reshape(-1)[~done]["next", "observation"]
    )
    assert filt.stats["lost_rows_dropped"] == int(done.sum()) > 0
