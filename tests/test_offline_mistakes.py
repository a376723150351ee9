"""The mistakes users make with stored data, each said in one clear line.

A real Gymnasium next-step loop (CartPole, 4 envs) saved as ``[T, E]``
and ``[E, T]`` arrays, audited and cleaned with a layout that the data
contradicts, and with the command-line flags that the errors name.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import gymnasium as gym
import numpy as np
import pytest

import cleanbuf
from cleanbuf.offline import read
from cleanbuf.offline.cli import main
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
