"""Stored data in the shapes and names people save it, against the oracle.

One small run per producer (4 envs, 64 steps, CartPole pushed left: an
episode ends about every 10 steps), each with its explicit-reset run:

* ``gym-next-step``: a raw Gymnasium ``SyncVectorEnv`` loop, next-step
  auto-reset (terminal observation stored in the done row and the reset
  row after it);
* ``torchrl-gymenv``: TorchRL ``GymEnv(num_envs=4)`` collector batches
  (done rows' next observations zero-filled, reset rows);
* ``same-step``: a Gymnasium same-step loop, saved without its final
  observations (the done row holds the next episode's first one);
* ``clean``: the explicit-reset loop itself.

Each is saved in every layout (``flat`` rows step after step, ``[T, E]``,
``[E, T]``) and name set (TorchRL, CleanRL, offline-RL) in every format
(``.npz``, HDF5, a dict in memory; a TorchRL dump of rows or collector
chunks; a Stable-Baselines3 ``ReplayBuffer``). Pruned: a dump holds
TorchRL names only, as rows or ``[E, T]`` chunks (TorchRL writes no
``[T, E]`` chunks); an SB3 buffer is ``[T, E]`` with SB3's names.

For each: the audit's verdict (never clean on dirty data, never an error
or "cannot tell" on clean data), the fix it prints run as printed, the
cleaned rows equal to the explicit-reset rows per env, the source's names
kept, and a re-audit of the output clean.
"""

from __future__ import annotations

import itertools
import os
import shlex
import sys

import gymnasium as gym
import h5py
import numpy as np
import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

import cleanbuf
from cleanbuf.check.cli import main
from cleanbuf.engine import _write
from cleanbuf.offline import _clean_files, audit, read
from cleanbuf.offline._formats import Shape
from cleanbuf.offline._sources import dataset
from tests.loops import ENVS, run_loop
from tests.oracle import collect, make_env

E, T = 4, 64
LAYOUTS = ["flat", "time_first", "time_last"]
CORE = [
    "observation",
    "action",
    "next/observation",
    "next/reward",
    "next/done",
    "next/terminated",
    "next/truncated",
]
NAMES = {
    "torchrl": {k: k for k in CORE},
    "cleanrl": dict(
        zip(CORE, ["obs", "actions", "next_obs", "rewards", "dones", "terminations", "truncations"])
    ),
    "offline-rl": dict(
        zip(
            CORE,
            [
                "observations",
                "actions",
                "next_observations",
                "rewards",
                None,
                "terminals",
                "timeouts",
            ],
        )
    ),
}
RESULTS: list = []  # the matrix's rows, printed at the end of the module


def _stack(steps) -> dict:
    """Per-step [E] rows as "/"-named [T, E, ...] arrays of the core keys."""
    out = {}
    for k in CORE:
        key = tuple(k.split("/"))
        out[k] = torch.stack([s.get(key) for s in steps]).numpy()
    return out


def _loop(mode) -> dict:
    name, kwargs, policy = ENVS["CartPole-terminates"]
    venv, steps = run_loop(name, kwargs, policy, E, T, mode)
    venv.close()
    return _stack(steps)


def _torchrl(disabled: bool) -> dict:
    env = make_env("CartPole-v1", E, disabled=disabled, trackers=False)
    batches = collect(env, E * 16, E * T)
    env.close()
    data = torch.cat(batches, dim=1)  # [E, T]
    out = {}
    for k in CORE:
        a = data.get(tuple(k.split("/"))).numpy()
        out[k] = np.swapaxes(a, 0, 1)
    out["action"] = out["action"].argmax(-1)[..., None]  # one-hot -> index, as a loop saves
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    """Each producer's auto-reset and explicit-reset runs, [T, E] arrays, run once."""
    modes = gym.vector.AutoresetMode
    oracle = _loop(modes.DISABLED)
    out = {
        "gym-next-step": (_loop(modes.NEXT_STEP), oracle),
        "same-step": (_loop(modes.SAME_STEP), oracle),
        "clean": (oracle, oracle),
        "torchrl-gymenv": (_torchrl(False), _torchrl(True)),
    }
    yield out
    _print_matrix()


def _lay(arrays: dict, layout: str) -> dict:
    if layout == "time_first":
        return dict(arrays)
    if layout == "time_last":
        return {k: np.ascontiguousarray(np.swapaxes(a, 0, 1)) for k, a in arrays.items()}
    return {k: a.reshape(T * E, *a.shape[2:]) for k, a in arrays.items()}  # step after step


def _name(arrays: dict, names: str) -> dict:
    table = NAMES[names]
    out = {}
    for k, a in arrays.items():
        if table[k] is None:
            continue
        if names != "torchrl" and a.ndim > 1 and a.shape[-1] == 1 and k != "observation":
            a = a[..., 0]  # CleanRL / D4RL store scalars without a feature dim
        out[table[k]] = a
    return out


def _save(fmt: str, arrays: dict, tmp) -> object:
    if fmt == "npz":
        path = str(tmp / "src.npz")
        np.savez(path, **arrays)
        return path
    if fmt == "hdf5":
        path = str(tmp / "src.h5")
        with h5py.File(path, "w") as f:
            for k, a in arrays.items():
                f.create_dataset(k, data=a)
        return path
    return dict(arrays)


def _dump(arrays: dict, layout: str, tmp) -> str:
    """A TorchRL buffer dump: rows step after step, or [E, T] collector chunks."""
    from tensordict import TensorDict

    lead = 1 if layout == "flat" else 2
    shape = next(iter(arrays.values())).shape[:lead]
    td = TensorDict({tuple(k.split("/")): torch.as_tensor(a) for k, a in arrays.items()}, shape)
    rb = ReplayBuffer(storage=LazyTensorStorage(T * E))
    if layout == "flat":
        rb.extend(td)
    else:  # a collector's writes: [E, 16] batches, one slot of 16 steps per env
        for t in range(0, T, 16):
            rb.extend(td[:, t : t + 16])
    path = str(tmp / "src")
    rb.dumps(path)
    return path


def _sb3(arrays: dict, size: int | None = None):
    """A Stable-Baselines3 ReplayBuffer filled step by step, as CleanRL's DQN fills it."""
    from gymnasium import spaces
    from stable_baselines3.common.buffers import ReplayBuffer as SB3Buffer

    obs_space = spaces.Box(-np.inf, np.inf, (4,), np.float32)
    steps = len(arrays["observation"]) if size is None else size
    rb = SB3Buffer(steps * E, obs_space, spaces.Discrete(2), "cpu", n_envs=E)  # / n_envs slots
    for t in range(len(arrays["observation"])):
        trunc = arrays["next/truncated"][t].reshape(E)
        rb.add(
            arrays["observation"][t],
            arrays["next/observation"][t],
            arrays["action"][t].reshape(E, 1),
            arrays["next/reward"][t].reshape(E),
            arrays["next/done"][t].reshape(E),
            [{"TimeLimit.truncated": bool(x)} for x in trunc],
        )
    return rb


def _rows_of(out) -> tuple[dict, np.ndarray]:
    """Cleaned output (a path or a dict) as TorchRL-named rows and each row's env."""
    ds = read(out) if isinstance(out, str) else dataset(out, Shape(), "")[0]
    env = ds.env
    assert env is not None and len(env) == ds.n_rows, "the output names each row's env"
    leaves = ds.data.items(True, True)
    return {"/".join(k) if isinstance(k, tuple) else k: v.numpy() for k, v in leaves}, env


def _compare(rows: dict, env: np.ndarray, oracle: dict, lost_ok: bool) -> int:
    """Asserts each env's cleaned rows equal its explicit-reset rows; returns NaN rows."""
    nan_rows = 0
    for e in range(E):
        got = {k: v[env == e] for k, v in rows.items()}
        n = len(got["observation"])
        assert n >= T * 0.8, f"env {e}: only {n} rows"
        flag = "next/terminated" if "next/terminated" in got else "next/done"  # SB3: dones
        for k in ["observation", "next/observation", "next/reward", flag]:
            x = got[k].reshape(n, -1).astype(np.float64)
            y = oracle[k][:n, e].reshape(n, -1).astype(np.float64)
            if k == "next/observation":
                lost = np.isnan(x).any(1)
                done = got[flag].reshape(n, -1).any(1)
                assert done[lost].all(), f"env {e}: NaN on a row that is not done"
                assert lost_ok or not lost.any(), f"env {e}: {lost.sum()} stored obs made NaN"
                nan_rows += int(lost.sum())
                x, y = x[~lost], y[~lost]
            assert np.array_equal(x, y), f"env {e}: {k} differs from the explicit-reset run"
    return nan_rows


def _run_fix(report, source, tmp):
    """Runs the fix the audit printed, as printed; returns the cleaned output."""
    command = report.command()  # as printed: DST a sibling of the source
    if report.python is not None:  # a call on the data in memory
        scope = {"cleanbuf": cleanbuf, "data": source, "rb": source}
        exec(command, scope)
        return scope["rows"]
    argv = shlex.split(command)
    assert argv[:2] == ["cleanbuf", "clean"], command
    assert main([*argv[1:], "--no-progress"]) == 0, command
    return argv[3]


CASES = [
    (fmt, layout, names, producer)
    for fmt, layout, names in itertools.product(
        ["npz", "hdf5", "dict"], ["flat", "time_first", "time_last"], list(NAMES)
    )
    for producer in ["gym-next-step", "torchrl-gymenv", "same-step", "clean"]
]
CASES += [
    ("dump", lay, "torchrl", p)
    for lay in ["flat", "time_last"]
    for p in ("gym-next-step", "torchrl-gymenv", "same-step", "clean")
]
CASES += [
    ("sb3", "time_first", "sb3", p)
    for p in ("gym-next-step", "torchrl-gymenv", "same-step", "clean")
]


CASES = [(*c, "one piece") for c in CASES]
# The multi-piece column: every write a piece of its own, every leaf gathered
# straight into the output's files, as a dataset of several hundred MB is.
CASES += [
    (fmt, layout, "torchrl", producer, "many pieces")
    for fmt, layout in [*itertools.product(["npz", "hdf5"], LAYOUTS), ("dump", "flat")]
    for producer in ("gym-next-step", "torchrl-gymenv", "same-step")
]
CASES += [("dump", "time_last", "torchrl", p, "many pieces") for p in ("gym-next-step", "clean")]


@pytest.mark.parametrize(
    "fmt, layout, names, producer, pieces", CASES, ids=["-".join(c) for c in CASES]
)
def test_matrix(runs, fmt, layout, names, producer, pieces, tmp_path, monkeypatch):
    """Bugs caught: a [T, E] or [E, T] rectangle read with the env axis as
    time (a false all-clear, or a wrong mode), CleanRL / offline-RL / SB3
    names not read, a suggested fix that fails or does not clean, cleaned
    rows that differ from the explicit-reset run (a wrong stitch, a stored
    terminal observation turned NaN, a real row dropped), the source's
    names lost in the copy, a cleaned copy that does not re-audit clean,
    a rectangle's steps per env reported as 0, and, in many pieces, an
    output that keeps the first piece's rows only.
    """
    if pieces == "many pieces":
        monkeypatch.setattr(_clean_files, "PIECE_BYTES", 1)
        monkeypatch.setattr(_write, "MIN_POOLED_BYTES", 0)
    data, oracle = runs[producer]
    if fmt == "sb3":
        source = _sb3(data)
    elif fmt == "dump":
        source = _dump(_lay(data, layout), layout, tmp_path)
    else:
        source = _save(fmt, _name(_lay(data, layout), names), tmp_path)
    report = audit(source)
    dirty = producer != "clean"
    assert report.undecided is None, str(report)
    assert report.clean is not dirty and report.status == int(dirty), str(report)
    want_mode = {"same-step": "same_step", "clean": "disabled"}.get(producer, "next_step")
    assert report.mode == want_mode, str(report)
    if layout != "flat" and fmt != "dump":  # a rectangle: its shape is the layout
        assert (report.envs, report.steps) == (E, T), str(report)
    if not dirty:  # a clean of clean data, with defaults, is no error either
        assert report.command() is not None
        if isinstance(source, str):
            out = str(tmp_path / ("dst" + source[len(str(tmp_path / "src")) :]))
            assert main(["clean", source, out, "--no-progress"]) == 0
        else:
            out = cleanbuf.clean(source)
    else:
        out = _run_fix(report, source, tmp_path)
    rows, env = _rows_of(out)
    nan_rows = _compare(rows, env, oracle, lost_ok=producer == "same-step")
    again = audit(out)
    assert again.clean and again.status == 0, str(again)
    if isinstance(out, str) and fmt in ("npz", "hdf5"):
        assert set(_name(_lay(data, layout), names)) <= _stored_names(out, fmt)
    RESULTS.append(
        (
            fmt,
            layout,
            names,
            producer,
            report.mode,
            "dirty" if dirty else "clean",
            nan_rows,
            "clean",
            pieces,
        )
    )


def _stored_names(path: str, fmt: str) -> set:
    if fmt == "npz":
        return set(np.load(path).files)
    names: list = []

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            names.append(name)

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return set(names)


def _print_matrix():
    if not RESULTS:
        return
    print("\nfmt    layout      names       producer        mode       verdict NaN re-audit pieces")
    for r in RESULTS:
        print(
            f"{r[0]:6s} {r[1]:11s} {r[2]:11s} {r[3]:15s} {r[4]:10s} {r[5]:7s} {r[6]!s:3s} "
            f"{r[7]:8s} {r[8]}"
        )


def _pendulum(mode, steps) -> dict:
    """2 Pendulum envs, 6-step limit: both envs end together every 6 steps."""
    name, kwargs, policy = ENVS["Pendulum-truncates"]
    venv, rows = run_loop(name, kwargs, policy, 2, steps, mode)
    venv.close()
    return _stack(rows)


def test_trailing_done_rows_are_no_joint_reset(tmp_path):
    """Both envs end together twice, the second time on the last step (no
    row after it). Bugs caught: done rows at the end of collection taken
    as evidence of joint resets (the clean then keeps reset rows as
    transitions and turns stored terminal observations into NaN), and a
    --joint-reset flag that can only be switched on.
    """
    modes = gym.vector.AutoresetMode
    data, oracle = _pendulum(modes.NEXT_STEP, 13), _pendulum(modes.DISABLED, 13)
    path = str(tmp_path / "src.npz")
    np.savez(path, **data)
    report = audit(path)
    assert (report.mode, report.joint_reset, report.joint_steps) == ("next_step", False, 0)
    assert report.trailing == 2 and report.reset_rows == 2 and report.status == 1
    assert "--joint-reset no" in report.command()
    out = _run_fix(report, path, tmp_path)
    rows, env = _rows_of(out)
    assert _compare_pendulum(rows, env, oracle) == 0  # nothing stored made NaN
    assert audit(out).clean
    # the flag is honoured both ways: forced joint resets keep the reset rows
    # as transitions, which the re-audit of that output shows
    forced, off = str(tmp_path / "joint.npz"), str(tmp_path / "nojoint.npz")
    assert main(["clean", path, forced, "--joint-reset", "yes", "--no-progress"]) == 0
    assert main(["clean", path, off, "--joint-reset", "no", "--no-progress"]) == 0
    assert audit(forced).status == 1 and audit(off).status == 0


def _compare_pendulum(rows, env, oracle) -> int:
    nan = 0
    for e in range(2):
        got = {k: v[env == e] for k, v in rows.items()}
        n = len(got["observation"])
        assert n == 12  # 13 steps less one reset row; the trailing done row kept
        for k in ["observation", "next/observation", "next/reward", "next/truncated"]:
            x, y = got[k].reshape(n, -1), oracle[k][:n, e].reshape(n, -1)
            nan += int(np.isnan(x).any(1).sum()) if x.dtype.kind == "f" else 0
            assert np.array_equal(x, y), f"env {e}: {k}"
    return nan


@pytest.mark.parametrize("fmt", ["npz", "dump"])
def test_too_little_evidence_is_said(runs, tmp_path, capsys, fmt):
    """One step of 4 envs ([1, E]: no env has two rows to compare), and
    flat rows env after env (no run continues another, so the envs are not
    in the data), in a ``.npz`` and in a TorchRL buffer dump. Bugs caught:
    "clean" (exit 0) on data the audit could not check, a fix printed that
    fails, and --layout flat --envs N not reading the rows as N envs (a
    dump's reader ignored it, and the audit asked again for the flags it
    was given).
    """
    data, oracle = runs["gym-next-step"]
    one = str(tmp_path / "one.npz")
    np.savez(one, **{k: a[:1] for k, a in data.items()})
    report = audit(one)
    assert report.undecided and not report.clean and report.status == 3
    assert main(["audit", one]) == 3
    assert "cannot tell" in capsys.readouterr().out
    env_after_env = {k: np.swapaxes(a, 0, 1).reshape(T * E, *a.shape[2:]) for k, a in data.items()}
    if fmt == "npz":
        flat = str(tmp_path / "flat.npz")
        np.savez(flat, **env_after_env)
    else:
        flat = _dump(env_after_env, "flat", tmp_path)
    assert audit(flat).status == 3 and main(["audit", flat]) == 3
    assert "--layout flat --envs N (rows of N envs" in capsys.readouterr().out
    with pytest.raises(cleanbuf.InputError, match=f"pass --layout flat --envs {E}"):
        audit(flat, envs=E)  # (the flag alone: the message gives the pair)
    told = audit(flat, layout="flat", envs=E)
    assert told.status == 1 and "--layout flat --envs 4" in told.command()
    assert main(["audit", flat, "--layout", "flat", "--envs", str(E)]) == 1
    out = _run_fix(told, flat, tmp_path)
    rows, env = _rows_of(out)
    _compare(rows, env, oracle, lost_ok=False)
    assert audit(out).clean


def test_missing_role_is_reported_and_key_names_it(runs, tmp_path, capsys):
    """CleanRL names, the reward saved as 'rew'. Bugs caught: the
    reset-row check silently skipped without a reward, an error that does
    not say which role is missing or how to name it, --key not read.
    """
    data, oracle = runs["torchrl-gymenv"]
    arrays = _name(data, "cleanrl")
    arrays["rew"] = arrays.pop("rewards")
    path = str(tmp_path / "src.npz")
    np.savez(path, **arrays)
    with pytest.raises(cleanbuf.InputError, match=r"reward.*--key reward=NAME"):
        audit(path)
    assert main(["audit", path]) == 2
    assert "--key reward=NAME" in capsys.readouterr().err
    report = audit(path, keys={"reward": "rew"})
    assert report.status == 1 and "--key reward=rew" in report.command()
    out = _run_fix(report, path, tmp_path)
    assert "rew" in np.load(out).files  # the source's name kept
    rows, env = _rows_of_keyed(out)
    _compare(rows, env, oracle, lost_ok=False)


def _rows_of_keyed(out):
    ds = read(out, Shape(keys={"reward": "rew"}))
    leaves = ds.data.items(True, True)
    return {"/".join(k) if isinstance(k, tuple) else k: v.numpy() for k, v in leaves}, ds.env


def test_sb3_buffer_that_wrapped(runs):
    """A Stable-Baselines3 buffer of 40 steps filled with 64: its oldest
    slot is at pos. Bugs caught: the rows read from slot 0 (a broken chain
    at the cursor, a wrong verdict or wrong rows), the wrap ignored.
    """
    data, _ = runs["gym-next-step"]
    rb = _sb3(data, size=40)
    assert rb.full and rb.pos == T - 40
    tail = {k: a[T - 40 :] for k, a in data.items()}
    want = cleanbuf.clean(_name(tail, "torchrl"), layout="time_first", mode="next_step")
    report = audit(rb)
    assert report.status == 1 and report.rows == 40 * E and report.layout == "time_first"
    got = _run_fix(report, rb, None)
    assert len(got["observations"]) == len(want["observation"])
    for e in range(E):
        a = got["observations"][got["_cleanbuf/env"] == e]
        b = want["observation"][want["_cleanbuf/env"] == e]
        assert np.array_equal(a, b)
    assert audit(got).clean


def test_time_first_is_a_layout_word_of_clean(runs):
    """Bugs caught: clean(dict, layout="time_first") refused (RolloutRepair
    takes the word), and a [T, E] dict read with the env axis as time.
    """
    data, oracle = runs["torchrl-gymenv"]
    told = cleanbuf.clean(dict(data), layout="time_first")
    found = cleanbuf.clean(dict(data))
    for k in told:
        assert np.array_equal(told[k], found[k], equal_nan=told[k].dtype.kind == "f"), k
    _compare({k: v for k, v in told.items()}, told["_cleanbuf/env"], oracle, lost_ok=False)


def test_a_dones_array_that_contradicts_the_ends_is_data(runs, tmp_path):
    """CleanRL's PPO stores in ``dones`` whether a row *starts* an episode
    (its ``next_done``, one step after the end). Bug caught: the audit read
    that array as the done flag, ignored ``terminations`` /
    ``truncations``, diagnosed "same_step, high confidence, lost for good"
    on next-step data, and its printed fix then failed on the disagreement.
    """
    data, oracle = runs["gym-next-step"]
    arrays = _name(data, "cleanrl")
    ends = arrays["terminations"] | arrays["truncations"]
    arrays["dones"] = np.concatenate([np.zeros_like(ends[:1]), ends[:-1]])  # next_done
    path = str(tmp_path / "ppo.npz")
    np.savez(path, **arrays)
    report = audit(path)
    assert report.mode == "next_step" and report.status == 1, str(report)
    assert "dones disagrees with terminations | truncations" in str(report), str(report)
    out = _run_fix(report, path, tmp_path)
    stored = np.load(out)
    assert "dones" in stored.files  # kept, as data, under its own name
    assert audit(out).status == 0
    rows, env = _rows_of(out)
    _compare(rows, env, oracle, lost_ok=False)


def test_a_missing_next_observation_is_named_alone(runs, tmp_path, capsys):
    """A PPO rollout saved without ``next_obs``. Bugs caught: the error
    named ``obs`` missing too (it is there) and listed the arrays under
    TorchRL's names (``observation``), so that ``--key obs=observation``,
    the fix it suggested, then failed.
    """
    data, _ = runs["gym-next-step"]
    arrays = _name(data, "cleanrl")
    del arrays["next_obs"]
    path = str(tmp_path / "ppo.npz")
    np.savez(path, **arrays)
    assert main(["audit", path]) == 2
    err = capsys.readouterr().err
    assert "role(s) next_obs (" in err and "--key next_obs=NAME" in err, err
    assert "obs, rewards" in err and "observation" not in err.split("The arrays are:")[1], err


def test_the_printed_fix_starts_with_the_command_the_user_ran(runs, tmp_path, monkeypatch):
    """Bug caught: the fix printed a bare ``cleanbuf``, which fails
    ("command not found") for a user who ran ``.venv/bin/cleanbuf audit``
    as the README does, with the venv not on PATH; run as ``python -m
    cleanbuf``, the fix must use that interpreter.
    """
    data, _ = runs["gym-next-step"]
    path = str(tmp_path / "raw.npz")
    np.savez(path, **_name(data, "cleanrl"))
    monkeypatch.setattr(sys, "argv", [".venv/bin/cleanbuf", "audit", path])
    assert audit(path).command().startswith(".venv/bin/cleanbuf clean ")
    main_py = os.path.join("site", "cleanbuf", "__main__.py")
    monkeypatch.setattr(sys, "argv", [main_py, "audit", path])
    assert audit(path).command().startswith(f"{sys.executable} -m cleanbuf clean ")
