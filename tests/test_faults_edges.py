"""Fault cases at the edges: step_rows, RolloutRepair, for_env, clean() from Python.

Each case is a bad call put into a good run (:mod:`tests.faults`): a clear
cleanbuf error naming the argument or key, what was expected, what came and
the fix, with nothing changed (byte-equal state, nothing written, the rest
of the run as if the call never came); or handled, the run ending as the
good one. ``python -m tests.faults`` prints the cases per outcome.

The good runs: a raw Gymnasium next-step loop on CartPole, one step per
call into a filter (``layout="step"``); TorchRL-style ``[E, T]`` batches
into a :class:`cleanbuf.RolloutRepair`; dicts of numpy arrays into
:func:`cleanbuf.clean`, one call each.
"""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer

import cleanbuf
from cleanbuf import (
    AutoresetFilter,
    CleanbufError,
    ContinuityError,
    InputError,
    LayoutError,
    RolloutRepair,
    step_rows,
)
from tests.batches import assert_same_rows
from tests.faults import (
    HANDLED,
    Case,
    FilterSubject,
    Subject,
    clear,
    good_calls,
    run_case,
    state_bytes,
)
from tests.oracle import compare_streams, streams_from_rows
from tests.rollout_helpers import mixed_actions, raw_loop

E, STEPS = 4, 24
AM = gym.vector.AutoresetMode


# --------------------------------------------------------------- good runs
@functools.cache
def raw_steps() -> tuple:
    """A raw next-step CartPole loop, 4 envs, time limit 8: each step's
    ``(obs, action, next_obs, reward, terminated, truncated, info)``.
    """
    venv = gym.make_vec("CartPole-v1", num_envs=E, vectorization_mode="sync",
                        max_episode_steps=8)  # fmt: skip
    steps, (obs, _) = [], venv.reset(seed=0)
    for _ in range(STEPS):
        action = mixed_actions(obs)
        next_obs, reward, terminated, truncated, info = venv.step(action)
        steps.append((obs, action, next_obs, reward, terminated, truncated, info))
        obs = next_obs
    venv.close()
    return tuple(steps)


def step_items() -> list:
    return [step_rows(*s) for s in raw_steps()]


def with_step(at: int, **changes):
    """Step ``at``'s arguments for step_rows, some replaced."""
    names = ("obs", "action", "next_obs", "reward", "terminated", "truncated", "info")
    args = dict(zip(names, raw_steps()[at], strict=True))
    args.update(changes)
    return args


def bad_step(**changes):
    """A bad call: step_rows with some of the current step's arguments replaced."""

    def call(subject, good, at):
        subject.feed(step_rows(**with_step(at, **changes)))

    return call


def other_form(transform):
    """A handled call: the current step given in another form (it replaces it)."""

    def call(subject, good, at):
        subject.feed(step_rows(**transform(with_step(at))))

    return call


def step_subject() -> FilterSubject:
    return FilterSubject({"mode": "next_step", "layout": "step"})


class RepairSubject(Subject):
    """A :class:`cleanbuf.RolloutRepair`; what it wrote is the batches it returned."""

    def __init__(self, **options):
        self.repair = RolloutRepair("next_step", **options)
        self.out: list = []

    def feed(self, item):
        self.out.append(self.repair(item))

    def state(self) -> bytes:
        return state_bytes(self.repair.state_dict())

    def written(self) -> tuple:
        return len(self.out), tuple(tuple(o.batch_size) for o in self.out)

    def finish(self):
        flushed = self.repair.flush()
        out = self.out + ([] if flushed is None else [flushed])
        return torch.cat([_td(o) for o in out], dim=-1), self.repair.stats


def _td(out) -> TensorDict:
    """A returned batch as a TensorDict (a dict of tensors in gives one out)."""
    if isinstance(out, TensorDict):
        return out
    return TensorDict(out, batch_size=out["collector"]["mask"].shape)


class CleanSubject(Subject):
    """:func:`cleanbuf.clean` on dicts of numpy arrays, one call per batch (no state)."""

    def __init__(self):
        self.out: list = []

    def feed(self, item):
        self.out.append(cleanbuf.clean(item))

    def state(self) -> bytes:
        return b""  # clean() keeps nothing between calls

    def written(self) -> int:
        return len(self.out)

    def finish(self):
        rows = [TensorDict({k: torch.from_numpy(v) for k, v in o.items()}, [len(o["next/done"])])
                for o in self.out]  # fmt: skip
        return torch.cat(rows), {}


def clean_items() -> list:
    """Good batches as dicts of numpy arrays, keyed as in .npz files."""
    return [
        {"/".join(k) if isinstance(k, tuple) else k: v.numpy() for k, v in b.items(True, True)}
        for b in good_calls(traj_ids=False)
    ]


def bad_clean(change):
    def call(subject, good, at):
        subject.feed(change(dict(good[at])))

    return call


def bad_repair(change):
    def call(subject, good, at):
        subject.feed(change(good[at].clone()))

    return call


def bad_for_env(make):
    def call(subject, good, at):
        AutoresetFilter.for_env(make())

    return call


def bad_repair_for_env(make):
    def call(subject, good, at):
        RolloutRepair.for_env(make())

    return call


def _reward_shape_e(a):
    return {**a, "reward": a["reward"].reshape(E, 1), "terminated": a["terminated"][:, None]}


def _as_torch(a):
    t = {k: torch.as_tensor(a[k]) for k in ("obs", "action", "next_obs", "reward")}
    return {**a, **t, "terminated": torch.as_tensor(a["terminated"])}


def _as_lists(a):
    return {**a, "reward": a["reward"].tolist(), "terminated": a["terminated"].tolist(),
            "truncated": a["truncated"].tolist()}  # fmt: skip


def _sb3(a):
    """The step as Stable-Baselines3 gives it: dones and a list of infos."""
    infos = [{"TimeLimit.truncated": bool(t)} for t in a["truncated"]]
    return {**a, "terminated": a["terminated"] | a["truncated"], "truncated": None, "info": infos}


def _without(d, key):
    return {k: v for k, v in d.items() if k != key}


def _with_nan(d):
    d = dict(d)
    d["observation"] = np.full_like(d["observation"], np.nan)
    return d


CASES = [
    # step_rows: each argument's shape, named with what was expected and the fix.
    Case(
        "step_rows: 0-dim reward",
        bad_step(reward=np.float64(1.0)),
        clear(InputError, "reward", "shape [4]", "0-dim", "Pass the reward array"),
        at=3,
        bug="IndexError: tuple index out of range",
    ),
    Case(
        "step_rows: reward [E, 2]",
        bad_step(reward=np.ones((E, 2))),
        clear(InputError, "reward", "[4]", "got shape [4, 2]"),
    ),
    Case(
        "step_rows: reward of E - 1 envs",
        bad_step(reward=np.ones(E - 1)),
        clear(InputError, "reward", "[4]", "got shape [3]"),
    ),
    Case(
        "step_rows: terminated [2, 2]",
        bad_step(terminated=np.zeros((2, 2), bool)),
        clear(InputError, "terminated", "shape [E]", "got shape [2, 2]", "Pass the terminated"),
        bug="RuntimeError: shape '[2, 1]' is invalid for input of size 4",
    ),
    Case(
        "step_rows: 0-dim terminated, vector reward",
        bad_step(terminated=False),
        clear(InputError, "terminated", "shape [E]", "got shape []"),
    ),
    Case(
        "step_rows: truncated of 3 envs",
        bad_step(truncated=np.zeros(3, bool)),
        clear(InputError, "truncated", "[4]", "got shape [3]"),
    ),
    Case(
        "step_rows: terminated 0.5",
        bad_step(terminated=np.full(E, 0.5)),
        clear(InputError, "terminated", "booleans", "float64"),
    ),
    Case(
        "step_rows: SB3 infos of 1 env",
        bad_step(truncated=None, info=[{}]),
        clear(InputError, "info is a list of 1", "one info dict per env (4", "VecEnv"),
        bug="RuntimeError: shape '[4, 1]' is invalid for input of size 1",
    ),
    Case(
        "step_rows: SB3 infos of 5 envs",
        bad_step(truncated=None, info=[{}] * 5),
        clear(InputError, "info is a list of 5", "(4, from terminated)"),
    ),
    Case(
        "step_rows: SB3 infos not dicts",
        bad_step(truncated=None, info=[None] * E),
        clear(InputError, "info is a list of 4 entries (NoneType)", "one info dict per env"),
    ),
    Case(
        "step_rows: final_obs of 2 envs",
        bad_step(info={"final_obs": np.array([None, None], object)}),
        clear(InputError, "info['final_obs'] has 2 entries", "one per env (4)"),
    ),
    Case(
        "step_rows: info a str",
        bad_step(info="oops"),
        clear(InputError, "info must be Gymnasium's info dict", "got str"),
    ),
    Case(
        "step_rows: truncated=None with a dict info",
        bad_step(truncated=None),
        clear(InputError, "truncated=None is for Stable-Baselines3", "pass truncated="),
    ),
    Case(
        "step_rows: action None",
        bad_step(action=None),
        clear(InputError, "action is None", "shape [4, ...]", "Pass what the vector env"),
        bug="TypeError: can't convert np.ndarray of type numpy.object_",
    ),
    Case(
        "step_rows: actions as a list of None",
        bad_step(action=[None] * E),
        clear(InputError, "action must be an array of numbers", "NoneType", "one entry per env"),
    ),
    Case("step_rows: obs None", bad_step(obs=None), clear(InputError, "obs is None", "[4, ...]")),
    Case(
        "step_rows: next_obs of 3 envs",
        bad_step(next_obs=np.zeros((3, 4), np.float32)),
        clear(InputError, "next_obs must have the envs first", "[4, ...]", "got shape [3, 4]"),
    ),
    Case(
        "step_rows: a Dict obs with a short leaf",
        bad_step(obs={"a": np.zeros((E, 2)), "b": np.zeros(3)}),
        clear(InputError, "obs['b']", "[4, ...]", "got shape [3]"),
    ),
    Case(
        "step_rows: reset of 3 envs",
        bad_step(reset=np.zeros(3, bool)),
        clear(InputError, "reset", "[4]", "got shape [3]"),
    ),
    Case(
        "step_rows: reset of 2s",
        bad_step(reset=np.full(E, 2)),
        clear(InputError, "reset must be booleans", "int64"),
    ),
    # step_rows: the same step in other forms.
    Case("step_rows: torch tensors", other_form(_as_torch), HANDLED, replaces=True),
    Case(
        "step_rows: reward and terminated [E, 1]",
        other_form(_reward_shape_e),
        HANDLED,
        replaces=True,
    ),
    Case("step_rows: Python lists", other_form(_as_lists), HANDLED, replaces=True),
    Case(
        "step_rows: a Stable-Baselines3 step", other_form(_sb3), HANDLED, replaces=True, at=7
    ),  # a truncation at step 7 (time limit 8): read from the infos
    # for_env: what a single env or an env id gets.
    Case(
        "for_env: an env id",
        bad_for_env(lambda: "CartPole-v1"),
        clear(
            CleanbufError, "not its id ('CartPole-v1')", "gymnasium.make_vec", "needs no cleaning"
        ),
        bug="'cannot tell how str auto-resets'",
    ),
    Case(
        "RolloutRepair.for_env: an env id",
        bad_repair_for_env(lambda: "CartPole-v1"),
        clear(CleanbufError, "not its id", "needs no cleaning"),
    ),
    Case(
        "for_env: an unknown object",
        bad_for_env(object),
        clear(CleanbufError, "cannot tell how object", "explicit mode"),
    ),
    Case(
        "for_env: a single gymnasium.make env",
        lambda subject, good, at: AutoresetFilter.for_env(gym.make("CartPole-v1")),
        HANDLED,
        check=lambda s, filt: _assert_pass_through(filt),
    ),
    Case(
        "RolloutRepair.for_env: a single env",
        lambda subject, good, at: RolloutRepair.for_env(gym.make("CartPole-v1")),
        HANDLED,
        check=lambda s, rep: _assert_pass_through(rep),
    ),
]
STEP_CASES = list(CASES)

REPAIR_CASES = [
    Case(
        "repair: a [T, E] rollout, default layout, first batch",
        bad_repair(lambda b: b.transpose(0, 1).contiguous()),
        clear(LayoutError, "looks time-first [T, E]", "size 6", "layout='time_first'"),
        at=0,
        bug="ResetRowError about the mode",
    ),
    Case(
        "repair: a [T, E] rollout after [E, T] batches",
        bad_repair(lambda b: b.transpose(0, 1).contiguous()),
        clear(LayoutError, "looks time-first [T, E]", "layout='time_first'"),
        at=2,
    ),
    Case(
        "repair: an empty batch [E, 0]",
        bad_repair(lambda b: b[:, :0]),
        HANDLED,
        check=lambda s, r: _assert_empty_out(s),
        bug="numpy 'cannot reshape array of size 0'",
    ),
    Case(
        "repair: batch_size []",
        bad_repair(lambda b: b[0, 0]),
        clear(LayoutError, "batch_size=[]", "[*E, T]", "layout='time_first'"),
    ),
    Case(
        "repair: an unnamed 1-D batch",
        bad_repair(lambda b: b[0]),
        clear(LayoutError, "1-D batch", "refine_names('time')", "layout='time_first'"),
    ),
    Case(
        "repair: a list",
        bad_repair(lambda b: [b]),
        clear(InputError, "expected a TensorDict or a dict of arrays", "got list"),
    ),
    Case(
        "repair: fewer streams",
        bad_repair(lambda b: b[:2]),
        clear(LayoutError, "the streams changed", "[3]", "[2, 6]", "its own RolloutRepair"),
    ),
    Case(
        "repair: float done",
        bad_repair(lambda b: b.set(("next", "done"), b["next", "done"].float())),
        clear(InputError, "('next', 'done')", "torch.bool", "float32", ".bool()"),
    ),
    Case(
        "repair: no done key",
        bad_repair(lambda b: b.exclude(("next", "done"))),
        clear(InputError, "no done key", "('next', 'done')", "done_key="),
    ),
    Case(
        "repair: no next observation",
        bad_repair(lambda b: b.exclude(("next", "observation"))),
        clear(InputError, "no observation key", "observation_keys="),
    ),
    Case(
        "repair: two done flags per row",
        bad_repair(lambda b: b.set(("next", "done"), b["next", "done"].expand(3, 6, 2))),
        clear(InputError, "one flag per row", "[2]", "done_key="),
    ),
    Case(
        "repair: a dict mixing numpy and torch",
        bad_repair(
            lambda b: {"observation": b["observation"].numpy(), "next": {"done": b["next", "done"]}}
        ),  # fmt: skip
        clear(InputError, "mixes numpy arrays and torch tensors"),
    ),
    Case(
        "repair: a dict without done",
        bad_repair(lambda b: {"observation": b["observation"]}),
        clear(InputError, "no done key in the dict", "'next/done'", "done_key="),
    ),
    Case(
        "repair: a dict with a list",
        bad_repair(lambda b: {"observation": [1, 2]}),
        clear(InputError, "holds list", "numpy arrays or torch tensors"),
    ),
    Case(
        "repair: a dict whose arrays disagree",
        bad_repair(
            lambda b: {
                "observation": b["observation"][:2],
                "next": {"done": b["next", "done"], "observation": b["next", "observation"]},
            }
        ),
        clear(InputError, "disagree on the batch shape", "[3, 6]", "[2, 6, 1]"),
    ),
    Case(
        "repair: the batch as a dict of tensors",
        bad_repair(lambda b: b.to_dict()),
        HANDLED,
        replaces=True,
    ),
    Case(
        "repair: an expanded (non-contiguous) batch",
        bad_repair(lambda b: b.apply(lambda x: x.transpose(0, 1).contiguous().transpose(0, 1))),
        HANDLED,
        replaces=True,
    ),
]

CLEAN_CASES = [
    Case(
        "clean: no done key",
        bad_clean(lambda d: _without(d, "next/done")),
        clear(InputError, "no done key in the dict", "'next/done'", "done_key="),
    ),
    Case(
        "clean: float done 0/1 (as Stable-Baselines3 stores it)",
        bad_clean(lambda d: {**d, "next/done": d["next/done"] * 1.0}),
        HANDLED,
        check=lambda s, r: _assert_same_as_bool_done(s),
    ),
    Case(
        "clean: float done neither 0 nor 1",
        bad_clean(lambda d: {**d, "next/done": d["next/done"] * 0.5}),
        clear(InputError, "next/done", "0/1", "float64", "--key done="),
    ),
    Case(
        "clean: no next observation",
        bad_clean(lambda d: _without(d, "next/observation")),
        clear(InputError, "no observation key", "observation_keys="),
    ),
    Case(
        "clean: arrays of other lengths",
        bad_clean(lambda d: {**d, "action": d["action"][:2]}),
        clear(InputError, "different numbers of rows", "'action': 2", "one entry per transition"),
    ),
    Case(
        "clean: a list leaf",
        bad_clean(lambda d: {**d, "action": [0, 1]}),
        clear(InputError, "holds list", "numpy arrays or torch tensors"),
    ),
    Case(
        "clean: numpy and torch mixed",
        bad_clean(lambda d: {**d, "action": torch.from_numpy(d["action"])}),
        HANDLED,
        check=lambda s, r: _assert_same_as_bool_done(s, mixed=True),
    ),
    Case(
        "clean: an unknown mode",
        lambda s, g, at: cleanbuf.clean(g[at], mode="next"),
        clear(CleanbufError, "mode='next'", "'next_step'", "for_env"),
    ),
    Case(
        "clean: an unknown option",
        lambda s, g, at: cleanbuf.clean(g[at], resets=True),
        clear(CleanbufError, "unknown option(s) ['resets']", "the options are"),
    ),
    Case(
        "clean: NaN observations, layout not said",
        bad_clean(_with_nan),
        clear(InputError, "cannot tell the time axis", "layout="),
    ),
    Case(
        "clean: NaN observations, layout said",
        lambda s, g, at: s.out.append(cleanbuf.clean(_with_nan(g[at]), layout="time_last")),
        HANDLED,
        check=lambda s, r: _assert_nan_kept(s),
    ),
]

CASES = STEP_CASES + REPAIR_CASES + CLEAN_CASES


def _assert_pass_through(obj):
    assert obj.options.mode == "disabled", obj
    assert "needs no cleaning" in repr(obj), repr(obj)


def _assert_empty_out(subject):
    out = subject.out.pop()  # a no-op: what it returned is no part of the run
    assert out.batch_size == torch.Size([3, 0]) and out["collector", "mask"].shape == (3, 0)


def _assert_same_as_bool_done(subject, mixed=False):
    """The rows of the good batch: done flags stored as 0.0/1.0 read as
    flags (the float dtype given back, the source's), or a leaf given as a
    tensor among numpy arrays read as the array it holds.
    """
    out = subject.out.pop()
    want = cleanbuf.clean(clean_items()[1])
    done = np.asarray(out["next/done"])  # (tensors out where a tensor came in)
    assert done.dtype == (np.bool_ if mixed else np.float64), done.dtype
    for k in want:
        got = np.asarray(out[k])
        assert np.array_equal(got.astype(want[k].dtype), want[k], equal_nan=True), k


def _assert_nan_kept(subject):
    """NaN observations are data: cleaned as any other value, kept as given."""
    out = subject.out.pop()
    assert np.isnan(out["observation"]).all() and len(out["observation"]) > 0


@pytest.mark.parametrize("case", STEP_CASES, ids=lambda c: c.name)
def test_step_rows_and_for_env_faults(case):
    """Bugs caught: each case's own (its ``bug``), and any bad call that
    leaves the raw-loop filter changed or the rest of the run different.
    """
    run_case(case, step_subject, step_items())


@pytest.mark.parametrize("case", REPAIR_CASES, ids=lambda c: c.name)
def test_rollout_repair_faults(case):
    """Bugs caught: each case's own, and a rejected batch that changes the
    repair's state (held column, counts) or what later batches return.
    """
    run_case(case, RepairSubject, good_calls())


@pytest.mark.parametrize("case", CLEAN_CASES, ids=lambda c: c.name)
def test_clean_faults(case):
    """Bugs caught: each case's own, and an unclear error (numpy's, torch's)
    where a dict passed to clean() is malformed.
    """
    run_case(case, CleanSubject, clean_items())


# ------------------------------------------------- the fixes, against oracles
def _loop_with_resets(mode, with_reset: bool, steps: int = 60, at=(17, 33)):
    """A raw CartPole loop (4 envs, time limit 12) that resets some envs itself
    mid-run: envs 0 and 2 after their 17th real step, every env after its
    33rd (real steps: reset rows not counted, so both modes reset each env
    at the same point of its stream). ``DISABLED`` is the oracle: it also
    resets done envs, and marks every episode start with ``reset=``.
    """
    venv = gym.make_vec("CartPole-v1", num_envs=E, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": mode}, max_episode_steps=12)  # fmt: skip
    explicit = mode == AM.DISABLED
    filt = AutoresetFilter("disabled" if explicit else "next_step", layout="step")
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    obs, _ = venv.reset(seed=0)
    reset, real, was_done = np.ones(E, bool), np.zeros(E, int), np.zeros(E, bool)
    try:
        for _ in range(steps):
            action = mixed_actions(obs)
            next_obs, reward, terminated, truncated, info = venv.step(action)
            kw = {"reset": reset} if with_reset else {}
            rb.extend(step_rows(obs, action, next_obs, reward, terminated, truncated, info,
                                env_ids=True, **kw))  # fmt: skip
            real += 1 if explicit else ~was_done
            obs, done = next_obs, terminated | truncated
            was_done = done
            ended = done if explicit else np.zeros(E, bool)
            if ended.any():
                fresh, _ = venv.reset(options={"reset_mask": ended})
                obs = np.where(ended[:, None], fresh, obs)
            mid = np.isin(real, at) & ~done & ((np.arange(E) % 2 == 0) | (real == at[1]))
            if mid.any():
                fresh, _ = venv.reset(options={"reset_mask": mid})
                obs = np.where(mid[:, None], fresh, obs)
            reset = ended | mid
    finally:
        venv.close()
    filt.flush(rb)
    return rb[: len(rb)], filt.stats


def test_step_rows_reset_mask_ends_the_episode_as_an_explicit_reset():
    """A raw next-step loop that resets envs itself mid-run passes
    ``step_rows(..., reset=mask)``. Bugs caught: no way to say so (the
    filter raising ContinuityError, as it still does without ``reset=``),
    the restart not taken as an episode start (the old episode's rows, the
    new one's ``is_init`` and the observations differing from the
    explicit-reset run), a reset env's first row dropped as a reset row.
    """
    with pytest.raises(ContinuityError, match=r"step_rows\(\.\.\., reset=mask\)|InitTracker"):
        _loop_with_resets(AM.NEXT_STEP, with_reset=False)
    rows, stats = _loop_with_resets(AM.NEXT_STEP, with_reset=True)
    oracle, oracle_stats = _loop_with_resets(AM.DISABLED, with_reset=True)
    assert compare_streams(streams_from_rows(rows), streams_from_rows(oracle), min_rows=50) == 0
    assert stats["reset_rows_dropped"] > 0 and stats["terminal_obs_missing"] == 0
    assert rows["is_init"].sum() >= 3 * E  # the first rows, the mid-run resets, the episodes


def _single_env_loop(env, explicit: bool, steps: int = 80):
    """A single-env CartPole loop into the filter ``for_env(env)`` builds."""
    filt = AutoresetFilter.for_env(env)
    rb = ReplayBuffer(storage=LazyTensorStorage(1000), transform=filt)
    obs, _ = env.reset(seed=3)
    for _ in range(steps):
        action = int(obs[2] + 0.3 * obs[3] > 0.05)
        next_obs, reward, terminated, truncated, info = env.step(action)
        rb.extend(step_rows(obs, action, next_obs, reward, terminated, truncated, info))
        obs = next_obs
        if explicit and (terminated or truncated):
            obs, _ = env.reset()
    filt.flush(rb)
    return rb[: len(rb)], filt


def test_a_single_env_step_is_one_row_and_needs_no_cleaning():
    """A single (non-vector) env's step through ``step_rows``. Bugs caught:
    the bare IndexError of a 0-dim reward, for_env refusing a single env as
    an unknown producer, an Autoreset-wrapped env (next-step) passed through
    with its reset rows, rows differing from the explicit-reset loop.
    """
    limit = {"max_episode_steps": 15}
    auto = gym.wrappers.Autoreset(gym.make("CartPole-v1", **limit))
    rows, filt = _single_env_loop(auto, explicit=False)
    oracle, plain = _single_env_loop(gym.make("CartPole-v1", **limit), explicit=True)
    assert plain.options.mode == "disabled" and "needs no cleaning" in repr(plain)
    assert filt.options.mode == "next_step" and filt.stats["reset_rows_dropped"] > 0
    assert rows.batch_size[0] == 80 - filt.stats["reset_rows_dropped"]
    assert_same_rows(rows, oracle[: rows.batch_size[0]])
    assert plain.stats["rows_out"] == 80 and oracle["observation"].shape == (80, 4)


def test_repair_of_one_env_stored_cleanrl_style_keeps_its_shape():
    """One env in a raw loop, rollout stored as CleanRL does (done ``[T, 1]``,
    observations ``[T, 1, 4]``). Bug caught: the mask returned ``[T]`` while
    the arrays came back ``[T, 1, ...]``; the rows must also be those of the
    same rollout given as a TensorDict ``[T, 1]``.
    """
    td = raw_loop(AM.NEXT_STEP, 1, 60, 9, with_info=False).exclude("env_id")
    arrays = {
        "observation": td["observation"].numpy(),
        "action": td["action"].squeeze(-1).numpy(),
        "next": {k: td["next", k].squeeze(-1).numpy() if k != "observation"
                 else td["next", k].numpy() for k in td["next"].keys()},
    }  # fmt: skip
    assert arrays["next"]["done"].shape == (60, 1) and arrays["observation"].shape == (60, 1, 4)
    venv = gym.make_vec("CartPole-v1", num_envs=1, vectorization_mode="sync")
    out = RolloutRepair.for_env(venv)(arrays)
    want = RolloutRepair.for_env(venv)(td)
    venv.close()
    assert out["collector"]["mask"].shape == (60, 1)
    assert np.array_equal(out["collector"]["mask"], want["collector", "mask"].numpy())
    assert np.array_equal(out["next"]["observation"], want["next", "observation"].numpy())
    assert 0 < (~out["collector"]["mask"]).sum() < 60


def test_repair_counts_an_episode_per_done_row_returned():
    """Batches whose last step is a collector's mark (``set_truncated=True``),
    some of them real episode ends. Bug caught: ``episodes_completed`` short
    of the done rows returned (17 for 18): the marks still undecided at
    ``flush()`` are returned done but were never counted.
    """
    from tests.batches import grid_td
    from tests.reference import simulate

    for seed in range(4):
        raw, _ = simulate(np.random.default_rng(seed), 3, 30, max_len=4, mark_every=5)
        batch = grid_td(raw, (3,), marks=True)
        repair = RolloutRepair("next_step")
        out = [repair(batch[:, t : t + 5]) for t in range(0, 30, 5)] + [repair.flush()]
        out = torch.cat(out, dim=-1)
        valid = out["collector", "mask"]
        done_rows = int(out["next", "done"].squeeze(-1)[valid].sum())
        assert repair.stats["episodes_completed"] == done_rows > 0, seed
        assert out["next", "done"][:, -1].all()  # the flushed marks: returned done


@pytest.mark.slow
def test_repair_for_env_of_a_multi_sync_collector_as_the_filter():
    """``RolloutRepair.for_env(MultiSyncCollector)``: its docstring said such
    collectors are refused, yet it works. Bugs caught: the doc and the
    behaviour disagreeing; the workers' batches ``[W, E, T]`` repaired as
    one reset group (the valid rows then differ from the filter's, which
    the multi-process tests hold to the explicit-reset run).
    """
    from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector

    from tests.workers import ENVS_PER_WORKER, push_left, worker_env

    collector = MultiSyncCollector([worker_env] * 2, push_left, frames_per_batch=2 * 2 * 16,
                                   total_frames=2 * 2 * 16 * 4)  # fmt: skip
    try:
        collector.set_seed(0)
        repair = RolloutRepair.for_env(collector, observation_keys=["observation"])
        filt = AutoresetFilter.for_env(collector, observation_keys=["observation"])
        assert repair.options.reset_group_size == ENVS_PER_WORKER
        repaired, rows = [], []
        for batch in collector:
            repaired.append(repair(batch.clone()))
            rows.append(filt.inv(batch.clone()))
    finally:
        collector.shutdown()
    repaired.append(repair.flush())
    rows.append(filt.flush())
    out = torch.cat([r for r in repaired if r is not None], dim=-1)
    rows = torch.cat([r for r in rows if r is not None and r.batch_size[0]])
    valid = out[out["collector", "mask"]].exclude(("collector", "mask"))
    for stream in valid["env_id"].unique():
        assert_same_rows(valid[valid["env_id"] == stream], rows[rows["env_id"] == stream])
    assert repair.stats["reset_rows_masked"] == filt.stats["reset_rows_dropped"] > 0
    assert "MultiSyncCollector" in RolloutRepair.for_env.__doc__
    async_collector = MultiAsyncCollector([worker_env] * 2, push_left, frames_per_batch=32,
                                          total_frames=64)  # fmt: skip
    try:
        with pytest.raises(CleanbufError, match="several producers"):
            RolloutRepair.for_env(async_collector)
    finally:
        async_collector.shutdown()
