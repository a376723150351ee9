"""The mistakes users make with stored data, each said in one clear line.

A real Gymnasium next-step loop (CartPole, 4 envs) saved as ``[T, E]``
and ``[E, T]`` arrays, audited and cleaned with a layout that the data
contradicts, and with the command-line flags that the errors name.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest

import cleanbuf
from cleanbuf.check.cli import main
from cleanbuf.offline import read
from tests.rollout_helpers import raw_loop

E, T = 4, 48


@pytest.fixture(scope="module")
def arrays():
    """The loop's ``[T, E]`` arrays (TorchRL names), and its explicit-reset twin's."""
    modes = gym.vector.AutoresetMode
    out = []
    for mode in (modes.NEXT_STEP, modes.DISABLED):
        td = raw_loop(mode, E, T, 12, False)
        out.append(
            {
                "observation": td["observation"].numpy(),
                "action": td["action"].numpy(),
                "next/observation": td["next", "observation"].numpy(),
                "next/reward": td["next", "reward"].numpy(),
                "next/done": td["next", "done"].numpy(),
                "next/terminated": td["next", "terminated"].numpy(),
                "next/truncated": td["next", "truncated"].numpy(),
            }
        )
    return out


def _save(tmp_path, name, arrays, time_last=False):
    path = str(tmp_path / name)
    np.savez(path, **{k: np.swapaxes(a, 0, 1) if time_last else a for k, a in arrays.items()})
    return path


WRONG = [
    ("[T, E]", False, "flat", "time_first"),
    ("[T, E]", False, "time_last", "time_first"),
    ("[E, T]", True, "flat", "time_last"),
    ("[E, T]", True, "time_first", "time_last"),
]


@pytest.mark.parametrize(
    "what, time_last, told, right", WRONG, ids=[f"{w[0]}-{w[2]}" for w in WRONG]
)
def test_a_declared_layout_the_data_contradicts_is_said(
    arrays, tmp_path, capsys, what, time_last, told, right
):
    """Bug caught: ``cleanbuf audit data --layout flat`` on ``[T, E]`` arrays
    obeyed the layout into a wrong verdict ("same_step (medium confidence)",
    "lost for good 119") and printed a fix that failed with an option the
    command line does not have; a wrong ``time_first`` / ``time_last`` read
    the env axis as time. Now: exit 2, one line naming the layout the data
    points to; that layout's printed fix runs as printed and cleans.
    """
    path = _save(tmp_path, "data.npz", arrays[0], time_last)
    assert main(["audit", path, "--layout", told]) == 2
    err = capsys.readouterr().err
    assert f"--layout {told}" in err and "contradicts" in err, err
    assert f"--layout {right}" in err, err
    assert len(err.strip().splitlines()) == 1, err
    with pytest.raises(cleanbuf.InputError, match=f"layout='{right}'"):
        cleanbuf.audit(path, layout=told)
    with pytest.raises(cleanbuf.InputError, match=f"layout='{right}'"):
        cleanbuf.clean(path, layout=told)
    report = cleanbuf.audit(path, layout=right)
    assert report.status == 1 and report.mode == "next_step", str(report)
    argv = shlex.split(report.command())
    assert main([*argv[1:], "--no-progress"]) == 0, report.command()
    ds = read(argv[3])
    obs = ds.data["observation"].numpy()
    oracle = arrays[1]
    for e in range(E):
        got = obs[ds.env == e]
        assert np.array_equal(got, oracle["observation"][: len(got), e]), f"env {e}"
    assert cleanbuf.audit(argv[3]).clean


def test_the_done_key_an_error_names_is_a_flag(arrays, tmp_path, capsys):
    """A file whose ``next/done`` is the real episode end and whose
    ``next/terminated`` means something else. Bug caught: the error's fix
    named ``done_key=``, an option the command line did not have; now
    ``--done-key`` is one, and the clean it names runs.
    """
    data = dict(arrays[0])
    data["next/terminated"] = np.zeros_like(data["next/terminated"])  # a column of another meaning
    data["next/truncated"] = np.zeros_like(data["next/truncated"])
    path = _save(tmp_path, "data.npz", data)
    dst = str(tmp_path / "out.npz")
    assert main(["clean", path, dst, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--done-key next/done" in err, err
    assert main(["clean", path, dst, "--no-progress", "--done-key", "next/done"]) == 0
    assert cleanbuf.audit(dst, keys={"done": "next/done"}).clean


def test_an_engine_error_names_its_command_line_flag(tmp_path, capsys):
    """Bug caught: an error of the cleaner named a Python option
    (``check_reset_rows=False``) that ``cleanbuf clean`` users could not
    pass; now the line names the flag, which exists and runs.
    """
    t = np.arange(12.0)[:, None] + 100 * np.arange(2.0)  # [T, E], one end at row 4 ...
    obs, nxt = t.copy(), t + 1
    done = np.zeros((12, 2), bool)
    done[4] = True
    rewards = np.full((12, 2), 0.5, np.float32)  # ... and no reward-0 reset row after it
    obs[5:] += 50
    nxt[5:] += 50
    data = {"obs": obs, "next_obs": nxt, "rewards": rewards, "dones": done}
    path = str(tmp_path / "shifted.npz")
    np.savez(path, **data)
    dst = str(tmp_path / "out.npz")
    status = main(["clean", path, dst, "--no-progress", "--mode", "next_step"])
    err = capsys.readouterr().err
    assert status == 2 and "check_reset_rows=False is --no-check-reset-rows" in err, err
    args = ["clean", path, dst, "--no-progress", "--mode", "next_step", "--no-check-reset-rows"]
    assert main(args) == 0
    assert len(np.load(dst)["rewards"]) == 22  # each env's row after its end dropped


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".npz", ".hdf5"])
def test_cleaning_a_file_prints_no_torchrl_log_line(arrays, tmp_path, suffix):
    """Bug caught: ``cleanbuf clean`` of a ``.npz`` / HDF5 file printed
    TorchRL's "Initialized LazyMemmapStorage" INFO line among its stats.
    """
    import h5py

    path = str(tmp_path / f"data{suffix}")
    if suffix == ".npz":
        np.savez(path, **arrays[0])
    else:
        with h5py.File(path, "w") as f:
            for k, a in arrays[0].items():
                f.create_dataset(k, data=a)
    argv = [sys.executable, "-m", "cleanbuf", "clean", path, str(tmp_path / f"out{suffix}")]
    done = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    assert "cleaned" in done.stdout
    said = done.stdout + done.stderr
    assert "INFO" not in said and "Initialized" not in said, said


def _env() -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {**os.environ, "PYTHONPATH": root}


def _filled_through_the_filter(shuffle_dirty: bool = False):
    """A raw next-step loop (CartPole, 4 envs) into a buffer through the filter."""
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    from tests.loops import ENVS, run_loop

    name, kwargs, policy = ENVS["CartPole-terminates"]
    filt = cleanbuf.AutoresetFilter("next_step", layout="step")
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000), transform=filt)
    venv, rows = run_loop(name, kwargs, policy, E, 100, gym.vector.AutoresetMode.NEXT_STEP, rb=rb)
    venv.close()
    filt.flush(rb)
    return rb, rows


def test_a_buffer_filled_through_the_filter_audits_clean():
    """Bug caught: a buffer filled through the filter could not be audited
    ("cannot tell" which env each row came from: the filter's rows come in
    no fixed env order), so users could not check the filter's own output.
    Now each done row's next observation is looked up among the rows'
    observations: clean, with the ends counted. The same loop's raw rows,
    shuffled into no env order, are never called clean.
    """
    import torch

    rb, rows = _filled_through_the_filter()
    report = cleanbuf.audit(rb)
    assert report.clean and report.status == 0, str(report)
    assert report.linked and report.episodes > 10 and report.confidence == "high", str(report)
    assert "linked by content" in str(report)
    assert report.to_dict()["command"] is None  # no env order to clean by: no fix offered
    raw = torch.cat(rows)
    shuffled = raw[torch.randperm(len(raw), generator=torch.Generator().manual_seed(0))]
    dirty = cleanbuf.audit(shuffled.exclude("env_id"))
    assert not dirty.clean and dirty.status == 3, str(dirty)


@pytest.mark.parametrize("told", ["time_first", "time_last"])
def test_a_rectangle_layout_on_flat_rows_is_said(arrays, tmp_path, capsys, told):
    """Flat rows (the loop's steps appended one after the other) audited as
    a rectangle. Bug caught: the error said only that the arrays' leading
    dims differ, not that the data is flat rows nor which layout to give.
    """
    flat = {k: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]) for k, a in arrays[0].items()}
    flat["next/done"] = flat["next/done"].reshape(-1)
    path = _save(tmp_path, "rows.npz", flat)
    assert main(["audit", path, "--layout", told]) == 2
    err = capsys.readouterr().err
    assert "the data is flat rows" in err and "--layout flat" in err, err
    assert main(["audit", path]) == 1  # read from the data, it is audited


def _printed_fix(err: str) -> tuple[list, dict]:
    """The fix a refusal prints, as flags and as Python options: ``Pass --F V (k=v)``."""
    found = re.search(r"Pass (--[\w-]+) (\S+) \((\w+=[^)]+)\)", err)
    assert found, err
    return [found[1], found[2]], eval(f"dict({found[3]})")


def _reset_rows_data(raw_mode, limit: int, with_info: bool) -> dict:
    """A raw CartPole loop (4 envs, 48 steps), saved as ``[T, E]`` arrays."""
    td = raw_loop(raw_mode, E, T, limit, with_info)
    keys = [k for k in td.keys(True, True) if k != "env_id"]
    return {_name(k): td[k].numpy() for k in keys}


def _name(key) -> str:
    return "/".join(key) if isinstance(key, tuple) else key


DECLARED = [
    ("next-step data", "NEXT_STEP", False, "disabled", "next_step"),
    ("next-step data", "NEXT_STEP", False, "same_step", "next_step"),
    ("same-step data", "SAME_STEP", True, "next_step", "same_step"),
    ("same-step data", "SAME_STEP", True, "disabled", "same_step"),
]


@pytest.mark.parametrize(
    "what, raw_mode, with_info, told, right", DECLARED, ids=[f"{d[1]}-{d[3]}" for d in DECLARED]
)
def test_a_declared_mode_the_data_contradicts_is_refused(
    tmp_path, capsys, what, raw_mode, with_info, told, right
):
    """Bug caught: ``cleanbuf clean rollout.npz out.npz --mode disabled`` on
    data the audit reads as next-step with high confidence printed
    ``cleaned``, ``reset_rows_dropped 0``, exit 0, with every bogus reward-0
    row in the output (and ``mode=`` in Python the same). Now: exit 2, one
    line naming the mode the evidence points to, nothing written; the
    printed fix runs as printed (flags on the command line, the Python
    option from Python) and cleans to the explicit-reset run's rows.
    """
    data = _reset_rows_data(getattr(gym.vector.AutoresetMode, raw_mode), 12, with_info)
    report = cleanbuf.audit(data)
    assert (report.mode, report.confidence) == (right, "high"), str(report)
    path, dst = _save(tmp_path, "data.npz", data), str(tmp_path / "out.npz")
    assert main(["clean", path, dst, "--no-progress", "--mode", told]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert f"--mode {told}" in err and "contradicts" in err and f"reads as {right}" in err, err
    assert not os.path.exists(dst)
    flags, kwargs = _printed_fix(err)
    assert flags == ["--mode", right] and kwargs == {"mode": right}
    assert main(["clean", path, dst, "--no-progress", *flags]) == 0
    with pytest.raises(cleanbuf.InputError, match=f"reads as {right}"):
        cleanbuf.clean(data, mode=told)
    rows = cleanbuf.clean(data, **kwargs)
    truth = _reset_rows_data(gym.vector.AutoresetMode.DISABLED, 12, False)
    for e in range(E):  # each env's cleaned rows: the explicit-reset run's first ones
        got = rows["next/observation"][rows["_cleanbuf/env"] == e]
        assert len(got) > T // 2
        np.testing.assert_array_equal(got, truth["next/observation"][: len(got), e])
    np.testing.assert_array_equal(np.load(dst)["next/observation"], rows["next/observation"])


def test_a_declared_mode_wins_where_the_evidence_cannot_tell(arrays):
    """Bug caught (the other way): a declared mode refused on thin evidence.
    Two episode ends are not enough for a high-confidence verdict: the mode
    the user declares is obeyed, as a declared layout is.
    """
    few = {k: a[:13, :2] for k, a in arrays[0].items()}
    report = cleanbuf.audit(few)
    assert report.mode == "next_step" and report.confidence != "high", str(report)
    _, stats = cleanbuf.clean(few, mode="disabled", return_stats=True)
    assert stats["reset_rows_dropped"] == 0 and stats["rows_out"] == 26


def test_joint_reset_declared_on_envs_reset_one_by_one_is_refused(tmp_path, capsys):
    """A raw next-step loop whose 6-step limit ends every env on the same
    step: a reset row follows each done row (a raw loop never resets envs
    together). Bug caught: ``--joint-reset yes`` was obeyed unchecked; it
    would keep those reset rows as transitions. Now refused in one line
    naming ``--joint-reset no``, which runs as printed.
    """
    data = _reset_rows_data(gym.vector.AutoresetMode.NEXT_STEP, 6, False)
    report = cleanbuf.audit(data)
    assert report.separate_steps > 0 and not report.joint_reset, str(report)
    path, dst = _save(tmp_path, "data.npz", data), str(tmp_path / "out.npz")
    assert main(["clean", path, dst, "--no-progress", "--joint-reset", "yes"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "reset one by one" in err, err
    flags, kwargs = _printed_fix(err)
    assert flags == ["--joint-reset", "no"] and kwargs == {"joint_reset": False}
    assert main(["clean", path, dst, "--no-progress", *flags]) == 0
    with pytest.raises(cleanbuf.InputError, match="reset one by one"):
        cleanbuf.clean(data, joint_reset=True)
    _, stats = cleanbuf.clean(data, return_stats=True, **kwargs)
    assert stats["reset_rows_dropped"] == report.reset_rows > 0


def test_no_joint_reset_declared_on_envs_reset_together_is_refused():
    """TorchRL's ``GymEnv(num_envs=4)`` with a 6-step limit: every env ends
    on the same step and TorchRL resets them together (no reset row).
    Bug caught: ``joint_reset=False`` was obeyed unchecked, and the next
    episode's first rows were dropped as reset rows. Now refused, naming
    ``joint_reset=True``, which runs as printed and equals the filter's rows.
    """
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    from tests.test_offline import _assert_streams, _collect, _filtered

    _, batches = _collect(max_episode_steps=6)
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000))
    for b in batches:
        rb.extend(b.reshape(-1))
    report = cleanbuf.audit(rb)
    assert report.joint_reset and report.joint_steps > 0 and report.confidence == "high"
    with pytest.raises(cleanbuf.InputError, match="reset together") as err:
        cleanbuf.clean(rb, joint_reset=False)
    assert "\n" not in str(err.value)
    _, kwargs = _printed_fix(str(err.value))
    assert kwargs == {"joint_reset": True}
    _assert_streams(cleanbuf.clean(rb, **kwargs), _filtered(batches, joint_reset=True)[0])
