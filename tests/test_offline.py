"""Standalone: audit and clean data already on disk, made by real collectors and loops.

Each dataset is written without the filter, by a real TorchRL collector or
a raw Gymnasium loop, dumped with ``rb.dumps``; the same batches also go
through the filter at write time. The audit must find the artifacts the
filter found, and ``cleanbuf clean`` must store, env by env, what the
filter stored.
"""

from __future__ import annotations

import os
import subprocess
import sys

import gymnasium as gym
import h5py
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer

import cleanbuf
from cleanbuf import AutoresetFilter, InputError
from cleanbuf.check.cli import main
from cleanbuf.offline import _clean_files, audit, clean_dataset
from cleanbuf.offline._formats import read
from cleanbuf.offline._joint import joint_rows
from tests.batches import assert_same_rows
from tests.loops import ENVS, run_loop
from tests.oracle import STREAM, collect, make_env, streams_from_rows

E, T, BATCHES = 4, 16, 12
BOOKKEEPING = ("is_init", "step_count")


def _policy(td):
    """Deterministic, and different per env so that episodes end at different
    steps (no joint reset): push right when (step + env) % 3 == 0. Tags each
    row with its env.
    """
    batch = td.batch_size
    env = torch.arange(batch[-1]).expand(batch)
    right = ((td["step_count"].squeeze(-1) + env) % 3 == 0).long()
    td.set("action", torch.nn.functional.one_hot(right, 2))
    td.set(STREAM, env.clone())
    return td


def _env_0_falls(td):
    """:func:`_policy`, except that env 0 always pushes left: it falls within
    about ten steps, alone, while a short time limit ends the others together.
    """
    td = _policy(td)
    env = torch.arange(td.batch_size[-1]).expand(td.batch_size)
    td["action"][env == 0] = torch.tensor([1, 0])
    return td


def _run(replay_buffer, max_episode_steps, policy=_policy):
    env = make_env("CartPole-v1", E, max_episode_steps)
    try:
        return collect(env, E * T, E * T * BATCHES, replay_buffer, policy=policy)
    finally:
        env.close()


def _collect(storage=None, max_episode_steps=None, policy=_policy):
    """12 [4, 16] CartPole batches of GymEnv(num_envs=4), seeded: returned,
    and written by the collector itself into a buffer on ``storage`` (as
    [T]-step chunks) when given, from a second, identical run.
    """
    rb = None if storage is None else ReplayBuffer(storage=storage)
    if rb is not None:
        _run(rb, max_episode_steps, policy)
    return rb, _run(None, max_episode_steps, policy)


def _filtered(batches, mode="next_step", **options):
    """What the filter stores at write time from the same batches."""
    filt = AutoresetFilter(mode, **options)
    rb = ReplayBuffer(storage=LazyTensorStorage(100_000), transform=filt)
    for b in batches:
        rb.extend(b)
    filt.flush(rb)
    return rb[: len(rb)], filt.stats


def _dump(rb, tmp_path, name="src"):
    path = str(tmp_path / name)
    rb.dumps(path)
    return path


def _tuple(key):
    return key if isinstance(key, tuple) else (key,)


def _name(key):
    """A TensorDict key as a .npz array name: nested keys joined by '/'."""
    return "/".join(key) if isinstance(key, tuple) else key


def _assert_streams(got, want, suffix=False):
    """Per env, the cleaned rows equal the filter's (or, for a wrapped buffer,
    its last rows: the buffer lost the first ones).
    """
    got, want = streams_from_rows(got), streams_from_rows(want)
    assert set(got) == set(want)
    for e in want:
        g = got[e]
        w = want[e][len(want[e]) - len(g) :] if suffix else want[e]
        if suffix and "is_init" in w.keys() and not bool(g["is_init"][0]):
            # The env's rows start inside an episode whose start (and the
            # reset row that told how to shift its step counts) the buffer
            # overwrote: that episode's bookkeeping stays as stored (a
            # documented limit). A start the rows show (a reset row kept at
            # the front) is fixed, and checked like any other.
            end = int(w["next", "done"].reshape(-1).nonzero()[0]) + 1
            keys = [k for k in w.keys(True, True) if _tuple(k)[-1] not in BOOKKEEPING]
            assert_same_rows(g[:end].select(*keys), w[:end].select(*keys), f"env {e}")
            g, w = g[end:], w[end:]
        assert_same_rows(g, w, f"env {e}")


@pytest.mark.parametrize("storage", [LazyTensorStorage, LazyMemmapStorage])
def test_collector_chunks(storage, tmp_path):
    """Collector(replay_buffer=rb) on a plain storage stores [T]-step chunks,
    one env each. Bugs caught: chunks read as flat rows of one stream (reset
    rows of one env glued to another's episodes), the env order of the
    chunks not recovered, reset rows or zero-filled terminal observations
    left, counts that differ from what the filter finds, is_init and step
    counts of the episodes after reset rows not reported.
    """
    rb, batches = _collect(storage(1000))
    want, stats = _filtered(batches)
    assert stats["reset_rows_dropped"] > 10 and stats["terminal_obs_missing"] == 0
    src = _dump(rb, tmp_path)
    report = audit(src)
    assert (report.envs, report.steps, report.mode, report.joint_reset) == (
        E,
        T,
        "next_step",
        False,
    )
    assert report.reset_rows == stats["reset_rows_dropped"]
    assert report.recoverable == report.next_obs_zero == stats["next_obs_restitched"]
    # Each episode after a reset row starts without is_init, at step count 1.
    assert report.is_init_wrong == report.step_count_wrong == report.reset_rows
    assert not report.clean and report.confidence == "high"
    done = clean_dataset(src, str(tmp_path / "dst"))
    out = ReplayBuffer(storage=storage(1000))  # built as SRC's: the cleaned rows fit
    out.loads(str(tmp_path / "dst"))
    _assert_streams(out[: len(out)], want)
    assert {k: done.stats[k] for k in stats} == stats
    assert audit(str(tmp_path / "dst")).clean


def _datasets(f):
    """The names of every dataset in an HDF5 file, groups joined by '/'."""
    names = []
    f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    return names


def test_flat_rows_and_npz_and_memmap(tmp_path):
    """rb.extend(batch.reshape(-1)): runs of T rows, env by env; the same
    rows as a .npz file, a TensorDict memmap directory and an HDF5 file. Bugs caught:
    the run length or env count not recovered from flat rows, a format
    written back in another format, a cleaned dump that rb.loads cannot read.
    """
    _, batches = _collect()
    want, stats = _filtered(batches)
    rows = torch.cat([b.reshape(-1) for b in batches])
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000))
    rb.extend(rows)
    src = _dump(rb, tmp_path)
    npz = str(tmp_path / "src.npz")
    np.savez(npz, **{_name(k): v.numpy() for k, v in rows.items(True, True)})
    mm = str(tmp_path / "src_memmap")
    rows.memmap(mm)
    h5 = str(tmp_path / "src.h5")
    with h5py.File(h5, "w") as f:
        for k, v in rows.items(True, True):
            f.create_dataset(_name(k), data=v.numpy())
    sources = ((src, "dst"), (npz, "dst.npz"), (mm, "dst_memmap"), (h5, "dst.h5"))
    for path, dst in sources:
        report = audit(path)
        assert (report.envs, report.steps, report.reset_rows) == (
            E,
            T,
            stats["reset_rows_dropped"],
        ), path
        clean_dataset(path, str(tmp_path / dst))
    out = ReplayBuffer(storage=LazyTensorStorage(10_000))
    out.loads(str(tmp_path / "dst"))
    _assert_streams(out[: len(out)], want)
    arrays = dict(np.load(str(tmp_path / "dst.npz")))
    # Each row's env index, which cleanbuf clean stores for the audit, is the
    # env the rows came from (the policy wrote it as env_id).
    np.testing.assert_array_equal(arrays.pop("_cleanbuf/env"), arrays[STREAM])
    from_npz = TensorDict(
        {tuple(k.split("/")): torch.from_numpy(v) for k, v in arrays.items()},
        batch_size=[len(arrays["done"])],
    )
    _assert_streams(from_npz, want)
    _assert_streams(TensorDict.load_memmap(str(tmp_path / "dst_memmap")), want)
    with h5py.File(str(tmp_path / "dst.h5"), "r") as f:
        from_h5 = {tuple(k.split("/")): torch.from_numpy(f[k][()]) for k in _datasets(f)}
    np.testing.assert_array_equal(from_h5.pop(("_cleanbuf", "env")), from_h5[(STREAM,)])
    _assert_streams(TensorDict(from_h5, batch_size=[len(from_npz)]), want)
    for dst in ("dst", "dst.npz", "dst_memmap", "dst.h5"):
        report = audit(str(tmp_path / dst))
        assert report.clean and report.env_stored and report.envs == E, dst


@pytest.mark.parametrize("chunks", [True, False], ids=["chunks", "flat rows"])
def test_wrapped_buffer(chunks, tmp_path):
    """A full circular buffer whose capacity is not a whole number of
    batches: it starts at the writer's cursor, inside a batch. Bugs caught:
    rows read in slot order (the oldest after the newest), the head (the
    rest of an overwritten batch) given to the wrong envs, a reset row at
    the start of an env's rows (its done row overwritten) kept.
    """
    capacity = 30 if chunks else 700  # 30 slots of 16 steps; 700 rows: 700 % 64 = 60
    rb, batches = _collect(LazyTensorStorage(capacity) if chunks else None)
    if not chunks:
        rb = ReplayBuffer(storage=LazyTensorStorage(capacity))
        for b in batches:
            rb.extend(b.reshape(-1))
    want, stats = _filtered(batches)
    src = _dump(rb, tmp_path)
    report = audit(src)
    assert report.wrapped and report.head == (capacity * (T if chunks else 1)) % (E * T)
    assert (report.envs, report.steps) == (E, T)
    done = clean_dataset(src, None)
    _assert_streams(done.rows, want, suffix=True)
    s = done.stats
    assert s["rows_in"] == s["rows_out"] + s["reset_rows_dropped"]
    assert s["orphan_reset_rows"] <= s["reset_rows_dropped"]


def test_joint_resets_are_found_and_marked(tmp_path):
    """A 6-step time limit: every episode ends by truncation, all envs on
    the same step, so TorchRL resets them together and stores zeros as
    their terminal observations. Bugs caught: zeros taken for states (an
    audit that calls the data clean), the next episode's first row dropped
    as a reset row.
    """
    _, batches = _collect(max_episode_steps=6)
    want, stats = _filtered(batches, joint_reset=True)
    assert stats["terminal_obs_missing"] > 0
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000))
    for b in batches:
        rb.extend(b.reshape(-1))
    report = audit(rb)
    assert report.joint_reset and report.lost == stats["terminal_obs_missing"]
    rows, got = cleanbuf.clean(rb, return_stats=True)
    _assert_streams(rows, want)
    assert got["terminal_obs_missing"] == stats["terminal_obs_missing"]


def _wrapped_joint_dump(chunks, tmp_path):
    """A wrapped buffer of joint-reset data with ends of both kinds.

    Env 0 falls alone (a reset row follows); a 12-step (chunks) or 9-step
    (flat rows) limit sometimes ends every env on one step (a joint reset).
    The oldest write is partly overwritten, and in it some steps have every
    remaining env done: joint or not shows only in the rows after them. In
    the chunks, two envs' rows start with a reset row whose done row was
    overwritten.
    """
    capacity = 30 if chunks else 700  # heads of 32 and 60 rows
    rb, batches = _collect(
        LazyTensorStorage(capacity) if chunks else None, 12 if chunks else 9, _env_0_falls
    )
    if not chunks:
        rb = ReplayBuffer(storage=LazyTensorStorage(capacity))
        for b in batches:
            rb.extend(b.reshape(-1))
    want, stats = _filtered(batches, joint_reset=True)
    assert stats["terminal_obs_missing"] > 0 and stats["reset_rows_dropped"] > 0
    return _dump(rb, tmp_path), want


@pytest.mark.parametrize("chunks", [True, False], ids=["chunks", "flat rows"])
def test_wrapped_joint_reset_buffer(chunks, tmp_path, monkeypatch):
    """Joint-reset data whose oldest write is partly overwritten is cleaned
    whole: each env's rows equal the filter's last rows. Bugs caught: the
    rest of the overwritten write stored as it was (zeros kept as terminal
    observations, reset rows kept), its joint ends taken for plain ones (the
    next episode's first row dropped, or ResetRowError) or the reverse, the
    env or step of a head row miscounted, a reset row at an env's front
    kept or dropped without restarting the next episode's step counts.
    """
    undecided = []

    def spy(*args):
        joint, maybe = joint_rows(*args)
        undecided.append(int(maybe.sum()))
        return joint, maybe

    monkeypatch.setattr(_clean_files, "joint_rows", spy)
    src, want = _wrapped_joint_dump(chunks, tmp_path)
    report = audit(src)
    if chunks:  # the kept rows show no whole step that ended and restarted (they
        # were overwritten); done rows at the very end, with no row after them,
        # are no evidence of joint resets. The user who knows the producer says so.
        assert not report.joint_reset and report.joint_steps == 0 and report.trailing > 0
    else:
        assert report.joint_reset and report.joint_steps > 0
    assert report.wrapped and report.confidence == "high"
    done = clean_dataset(src, None, joint_reset=True)
    assert undecided[0] > 0  # the head had steps only the rows after them decide
    s = done.stats
    assert s["rows_not_cleaned"] == 0 and s["terminal_obs_missing"] > 0
    assert s["orphan_reset_rows"] == (2 if chunks else 0)
    _assert_streams(done.rows, want, suffix=True)
    assert s["rows_in"] == s["rows_out"] + s["reset_rows_dropped"] + s["rows_held"]


def test_wrapped_joint_reset_buffer_when_the_audit_is_unsure(tmp_path, monkeypatch):
    """When the audit doubts that reward 0 marks a reset row, the head's
    all-done steps cannot be decided: the head is stored as it was and
    counted, and the whole writes are still cleaned. Bugs caught: the reward
    signature trusted anyway, the head dropped (data lost) or counted wrong.
    """
    src, want = _wrapped_joint_dump(True, tmp_path)
    analyse = _clean_files.analyse

    def unsure(ds):
        report, streams = analyse(ds)
        report.confidence = "medium"
        return report, streams

    monkeypatch.setattr(_clean_files, "analyse", unsure)
    done = clean_dataset(src, None, joint_reset=True)
    head = audit(src).head
    s = done.stats
    assert s["rows_not_cleaned"] == head > 0
    assert s["rows_in"] == s["rows_out"] + s["reset_rows_dropped"] + s["rows_held"]
    assert_same_rows(done.rows[:head], read(src).rows(np.arange(head)))
    assert s["rows_out"] == len(done.rows) and s["reset_rows_dropped"] > 0  # the rest cleaned


@pytest.mark.parametrize(
    "capacity", [10_000, 250, 232], ids=["whole", "wrapped", "wrapped at reset rows"]
)
def test_raw_gymnasium_next_step_loop(capacity):
    """A raw next-step loop whose rows ([E] per step) were extended into a
    plain buffer: runs of one row; 250 slots wrap in the middle of a step.
    Bugs caught: T = 1 data taken as one stream, the raw loop's terminal
    observation (stored twice) taken for a same-step artifact, the rows of
    a wrapped buffer given to the wrong envs, and (232 slots: three envs'
    oldest rows are reset rows whose done rows were overwritten) an audit
    that counts fewer reset rows than the clean drops.
    """
    name, kwargs, policy = ENVS["CartPole-terminates"]
    rb = ReplayBuffer(storage=LazyTensorStorage(capacity))
    venv, steps = run_loop(name, kwargs, policy, E, 120, gym.vector.AutoresetMode.NEXT_STEP, rb)
    venv.close()
    want, stats = _filtered(steps, layout="step")
    report = audit(rb)
    assert (report.envs, report.steps, report.mode) == (E, 1, "next_step")
    assert report.next_obs_zero == 0 and report.next_obs_is_reset == 0
    wrapped = capacity < E * len(steps)
    assert report.wrapped == wrapped and report.head == (capacity % E if wrapped else 0)
    if not wrapped:
        assert report.reset_rows == stats["reset_rows_dropped"] > 0
    rows, cleaned = cleanbuf.clean(rb, return_stats=True)
    # the audit counts every reset row the clean drops, those at a wrapped env's oldest row too
    assert report.reset_rows + report.orphan_reset_rows == cleaned["reset_rows_dropped"]
    assert report.orphan_reset_rows == cleaned["orphan_reset_rows"] == (3 if capacity == 232 else 0)
    _assert_streams(rows, want, suffix=wrapped)


def test_clean_data_audits_clean(tmp_path):
    """The explicit-reset producer. Bug caught: an audit that finds reset
    rows in clean data (a real first row with reward 0 would be one; CartPole
    has none), or exits 1 on it.
    """
    env = make_env("CartPole-v1", E, disabled=True)
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000))
    for b in collect(env, E * T, E * T * 6, policy=_policy):
        rb.extend(b.reshape(-1))
    env.close()
    src = _dump(rb, tmp_path)
    report = audit(src)
    assert report.clean and report.episodes > 5 and report.mode == "disabled"
    assert main(["audit", src]) == 0


def test_cli_lost_observation_error_names_the_flag_not_the_filter(tmp_path, capsys):
    """One stream whose last row ended an episode, its terminal observation
    zero-filled, cleaned with ``--on-lost-terminal-obs raise``: the row
    waits for a reset row that never comes. Bug caught: the error told a
    command-line user to call ``filt.flush(rb, ...)``, a filter they do not
    have; it must name the flag and the observation key, and the exit
    code must be 2 with nothing written.
    """
    rows = TensorDict(
        {
            "observation": torch.tensor([[1.0], [2.0], [3.0]]),
            ("next", "observation"): torch.tensor([[2.0], [3.0], [0.0]]),
            ("next", "reward"): torch.ones(3, 1),
            ("next", "done"): torch.tensor([[False], [False], [True]]),
        },
        batch_size=[3],
    )
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    rb.extend(rows)
    src, dst = _dump(rb, tmp_path), tmp_path / "dst"
    args = ["clean", src, str(dst), "--mode", "next_step", "--on-lost-terminal-obs", "raise"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "next observation(s) (('next', 'observation')) are lost" in err  # the key named
    assert "--on-lost-terminal-obs" in err
    assert "filt." not in err
    assert not dst.exists()
    filt = AutoresetFilter("next_step", on_lost_terminal_obs="raise")
    filt.inv(rows.unsqueeze(0))
    with pytest.raises(cleanbuf.TerminalObservationLostError, match=r"filt\.flush\(rb"):
        filt.flush()  # (the filter's own flush does name itself)


def test_cli(tmp_path, capsys):
    """Bugs caught: wrong exit codes (a pipeline guard that passes dirty
    data), an existing DST overwritten, SRC == DST accepted, an error
    without its message, SRC written to, --plot writing no image (or,
    into a missing directory, failing after the whole audit with a bare
    "No such file"), a missing SRC blamed on DST's name.
    """
    rb, _ = _collect(LazyTensorStorage(1000))
    src = _dump(rb, tmp_path)
    before = _digest(src)
    assert main(["audit", src]) == 1
    assert "cleanbuf clean" in capsys.readouterr().out
    assert main(["audit", src, "--json"]) == 1
    assert '"reset_rows"' in capsys.readouterr().out
    png = tmp_path / "audit.png"
    assert main(["audit", src, "--plot", str(png)]) == 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert main(["audit", src, "--plot", str(tmp_path / "nodir" / "audit.png")]) == 2
    out, err = capsys.readouterr()
    assert "nodir does not exist" in err and not out  # refused before the audit runs
    dst = str(tmp_path / "dst")
    assert main(["clean", src, dst, "--no-progress"]) == 0
    assert "reset_rows_dropped" in capsys.readouterr().out
    assert main(["clean", src, dst, "--no-progress"]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["clean", src, src]) == 2
    assert "same path" in capsys.readouterr().err
    assert main(["audit", str(tmp_path / "nope")]) == 2
    assert main(["clean", str(tmp_path / "nope"), str(tmp_path / "x")]) == 2
    assert "nope does not exist" in capsys.readouterr().err  # (not: DST names no format)
    assert main(["clean", src, dst, "--force", "--no-progress"]) == 0
    assert _digest(src) == before  # SRC is never written


def _digest(folder):
    """Every file's bytes under ``folder``, by relative path."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def test_bad_input_leaves_nothing(tmp_path, monkeypatch):
    """Bugs caught: a partial DST (or a temporary directory) left after a
    failure, an unknown format or missing keys without a message that names
    them, arrays of different lengths zipped together, a truncated memmap
    read as data (tensordict pads it with zeros, writing into the source).
    """
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(InputError, match="no format cleanbuf reads"):
        audit(str(tmp_path / "notes.txt"))
    rows = TensorDict({"observation": torch.zeros(8, 2)}, batch_size=[8])
    np.savez(str(tmp_path / "nodone.npz"), observation=rows["observation"].numpy())
    with pytest.raises(InputError, match=r"'next', 'done'"):
        audit(str(tmp_path / "nodone.npz"))
    np.savez(str(tmp_path / "ragged.npz"), observation=np.zeros((8, 2)), reward=np.zeros(7))
    with pytest.raises(InputError, match="different numbers of rows.*'reward': 7"):
        audit(str(tmp_path / "ragged.npz"))
    rb, _ = _collect(LazyTensorStorage(1000))
    src = _dump(rb, tmp_path)
    broken = tmp_path / "broken"
    rb.dumps(str(broken))
    os.truncate(broken / "storage" / "observation.memmap", 10)
    with pytest.raises(InputError, match="observation.*truncated or partly copied"):
        audit(str(broken))
    assert os.path.getsize(broken / "storage" / "observation.memmap") == 10

    from cleanbuf.engine import _cleaner

    monkeypatch.setattr(_clean_files, "PIECE_BYTES", 1)  # one write a call: several calls
    calls = []

    def interrupted(self, td):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(self, td)

    original = _cleaner.Cleaner.__call__
    monkeypatch.setattr(_cleaner.Cleaner, "__call__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        clean_dataset(src, str(tmp_path / "dst"))
    assert not (tmp_path / "dst").exists()
    assert not [p for p in os.listdir(tmp_path) if "cleanbuf-tmp" in p]


_UNDER_A_LIMIT = """
import resource, sys
import cleanbuf
from cleanbuf.check.cli import main

def vm_data():  # what RLIMIT_DATA counts: private writable memory, not file maps
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData"):
                return int(line.split()[1]) * 1024

src, small, dst = sys.argv[1:4]
# numba's compiler and torchrl's storage code take their memory once per process
assert main(["clean", small, dst + "-warm", "--no-progress"]) == 0
resource.setrlimit(resource.RLIMIT_DATA, (vm_data() + (64 << 20), resource.RLIM_INFINITY))
print("on disk:", main(["clean", src, dst, "--no-progress"]))
try:
    cleanbuf.clean(src)  # the cleaned rows in memory: needs about the dataset's size
    print("in memory: cleaned")
except Exception as err:
    print("in memory:", type(err).__name__, str(err).splitlines()[0][:200])
"""


@pytest.mark.slow  # writes and cleans a dataset larger than its memory limit
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
def test_cleans_a_dataset_larger_than_its_memory_limit(tmp_path):
    """A 217 MB dataset of Atari-sized rows, cleaned by the command line in
    a fresh process that may allocate only 64 MB more than it holds after a
    warm-up (``RLIMIT_DATA``). The same process then fails to clean the
    dataset into memory, which shows the limit binds. Bug caught: reading
    a whole column (or the whole dataset) into memory, or holding every
    cleaned piece until the end: the allocation fails, the command exits 2.
    """
    from bench.offline_data import write_memmap

    src, small, dst = (str(tmp_path / name) for name in ("src", "small", "dst"))
    size_mb = write_memmap(src, batches=60) / 1e6
    write_memmap(small, batches=2)
    out = subprocess.run(
        [sys.executable, "-c", _UNDER_A_LIMIT, src, small, dst],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith(("on disk", "in memory"))]
    assert size_mb > 3 * 64
    assert lines[0] == "on disk: 0", (out.stdout[-2000:], out.stderr[-2000:])
    assert "alloc" in lines[1] or "MemoryError" in lines[1], lines
    assert audit(dst).rows < audit(src).rows  # reset rows were dropped


@pytest.mark.parametrize("with_info", [True, False], ids=["final obs stored", "final obs not"])
def test_raw_gymnasium_same_step_loop(with_info):
    """A SAME_STEP loop (Stable-Baselines3 behaves the same): each done row's
    next observation is the next episode's first. With the final
    observations stored (step_rows with the info), the clean puts them
    back, as the filter does; without them they are lost, and said so.
    Bugs caught: same-step data taken for next-step (first rows dropped as
    reset rows), the replaced observations not counted, the stored final
    observations not used, and an audit that calls the stored final
    observations "lost for good" (or prints a fix that marks them NaN).
    """
    name, kwargs, policy = ENVS["CartPole-terminates"]
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000))
    mode = gym.vector.AutoresetMode.SAME_STEP
    venv, steps = run_loop(name, kwargs, policy, E, 120, mode, rb, with_info=with_info)
    venv.close()
    report = audit(rb)
    assert (report.envs, report.steps, report.mode, report.reset_rows) == (E, 1, "same_step", 0)
    ends = torch.stack(steps)["next", "done"][:-1]  # done rows with a row after them
    assert report.next_obs_is_reset == int(ends.sum()) > 0
    stored = report.next_obs_is_reset if with_info else 0
    assert report.final_stored == stored
    assert report.lost_for_good == report.next_obs_is_reset - stored
    assert ("nan" in report.command()) is not with_info
    if with_info:
        want, stats = _filtered(steps, mode="same_step", layout="step")
        _assert_streams(cleanbuf.clean(rb), want)
        assert stats["next_obs_restitched"] == report.episodes  # the last one's too
    else:
        with pytest.raises(cleanbuf.TerminalObservationLostError):
            cleanbuf.clean(rb)
        rows, stats = cleanbuf.clean(rb, on_lost_terminal_obs="drop", return_stats=True)
        assert stats["lost_rows_dropped"] == report.episodes


def test_stable_baselines3_loop_saved_to_disk(tmp_path):
    """A Stable-Baselines3 DummyVecEnv loop (same-step, the terminal
    observation in infos[i]["terminal_observation"]) whose rows were
    extended into a plain buffer and dumped. Bug caught: SB3's rows (done
    flags without truncation, the terminal observation under SB3's name)
    not read as same-step, or cleaned otherwise than the filter does.
    """
    from stable_baselines3.common.vec_env import DummyVecEnv

    name, _, policy = ENVS["CartPole-terminates"]
    venv = DummyVecEnv([lambda: gym.make(name)] * E)
    venv.seed(0)
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000))
    steps, obs = [], venv.reset()
    for _ in range(100):
        action = policy(obs)
        next_obs, reward, dones, infos = venv.step(action)
        rows = cleanbuf.step_rows(obs, action, next_obs, reward, dones, None, infos, env_ids=True)
        rb.extend(rows)
        steps.append(rows)
        obs = next_obs
    venv.close()
    src = _dump(rb, tmp_path)
    report = audit(src)
    assert (report.envs, report.steps, report.mode) == (E, 1, "same_step")
    assert report.next_obs_is_reset > 0 and report.reset_rows == 0
    want, stats = _filtered(steps, mode="same_step", layout="step")
    done = clean_dataset(src, str(tmp_path / "dst"))
    out = ReplayBuffer(storage=LazyTensorStorage(10_000))
    out.loads(str(tmp_path / "dst"))
    _assert_streams(out[: len(out)], want)
    assert done.stats["next_obs_restitched"] == stats["next_obs_restitched"] == report.episodes


def test_large_rows_are_gathered_into_the_output(tmp_path, monkeypatch):
    """Rows of 14 KB (Atari-sized), 3.6 MB a write: the cleaner gathers them
    straight into the output's files, two writes a call. Bugs caught: a
    piece gathered into the wrong rows of the output (overwriting the last
    piece's, or past the end), a patch (restored terminal observation)
    lost because it went to a copy, rows that differ from cleaning the
    same data in memory one write a call (rows lost or doubled where a
    piece ends, an episode cut there).
    """
    from bench.offline_data import write_memmap

    src = str(tmp_path / "src")
    write_memmap(src, batches=6)
    monkeypatch.setattr(_clean_files, "PIECE_BYTES", 1)  # one write a call
    in_memory = clean_dataset(src, None)
    assert in_memory.stats["next_obs_restitched"] > 0
    monkeypatch.setattr(_clean_files, "PIECE_BYTES", 8 << 20)  # two writes a call
    on_disk = clean_dataset(src, str(tmp_path / "dst"))
    assert on_disk.stats == in_memory.stats
    assert_same_rows(TensorDict.load_memmap(str(tmp_path / "dst")), in_memory.rows)
