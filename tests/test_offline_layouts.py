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
import shlex

import gymnasium as gym
import h5py
import numpy as np
import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

import cleanbuf
from cleanbuf.offline import audit, read
from cleanbuf.offline._formats import from_arrays
from cleanbuf.offline.cli import main
from tests.loops import ENVS, run_loop
from tests.oracle import collect, make_env

E, T = 4, 64
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
    """producer -> (auto-reset run [T, E], explicit-reset run [T, E]), each run once."""
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
    ds = read(out) if isinstance(out, str) else from_arrays("out", out)
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


@pytest.mark.parametrize("fmt, layout, names, producer", CASES, ids=["-".join(c) for c in CASES])
def test_matrix(runs, fmt, layout, names, producer, tmp_path):
    """Bugs caught: a [T, E] or [E, T] rectangle read with the env axis as
    time (a false all-clear, or a wrong mode), CleanRL / offline-RL / SB3
    names not read, a suggested fix that fails or does not clean, cleaned
    rows that differ from the explicit-reset run (a wrong stitch, a stored
    terminal observation turned NaN, a real row dropped), the source's
    names lost in the copy, and a cleaned copy that does not re-audit clean.
    """
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
    print("\nfmt    layout      names       producer        mode       verdict NaN re-audit")
    for r in RESULTS:
        print(f"{r[0]:6s} {r[1]:11s} {r[2]:11s} {r[3]:15s} {r[4]:10s} {r[5]:7s} {r[6]!s:3s} {r[7]}")
