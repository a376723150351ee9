"""Faults of ``cleanbuf clean`` / ``cleanbuf audit`` on disk end cleanly.

A full disk, a run killed with ``kill -9``, and files that cannot be read:
each ends in one message naming the path and what is wrong, exit status 2,
nothing at DST and no temporary directory left; a later run that has room
stores what the filter stores from the same batches. The data is a real
``GymEnv("CartPole-v1", num_envs=4)`` collector's (next-step auto-reset),
extended into a buffer as flat rows and dumped with ``rb.dumps``.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, ReplayBuffer

import cleanbuf
from cleanbuf import CleanbufWarning, InputError
from cleanbuf.check.cli import main
from cleanbuf.offline import _formats, audit, clean_dataset
from tests.batches import assert_same_rows
from tests.test_offline import _assert_streams, _collect, _digest, _filtered, _name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = ".cleanbuf-tmp-"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The collector's rows as a dump, a ``.npz`` and an HDF5 file, and the
    filter's rows from the same batches (what a clean must store).
    """
    _, batches = _collect()
    want, _ = _filtered(batches)
    rows = torch.cat([b.reshape(-1) for b in batches])
    folder = tmp_path_factory.mktemp("faults")
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000))
    rb.extend(rows)
    rb.dumps(str(folder / "src"))
    arrays = {_name(k): v.numpy() for k, v in rows.items(True, True)}
    np.savez(str(folder / "src.npz"), **arrays)
    with h5py.File(str(folder / "src.h5"), "w") as f:
        for name, a in arrays.items():
            f.create_dataset(name, data=a)
    return {
        "dump": str(folder / "src"),
        "npz": str(folder / "src.npz"),
        "h5": str(folder / "src.h5"),
        "want": want,
    }


def _leftovers(folder):
    return sorted(p for p in os.listdir(folder) if TAG in p)


def _rows(path):
    """The rows of a cleaned dump, as a buffer loads them."""
    rb = ReplayBuffer(storage=LazyTensorStorage(10_000))
    rb.loads(path)
    return rb[: len(rb)]


def _run(*args, **kwargs):
    """``python -c`` with this checkout's cleanbuf, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=300, **kwargs
    )


# --- disk full -------------------------------------------------------------------


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


_disk_usage = shutil.disk_usage


def _little_free(path):
    return _disk_usage(path)._replace(free=4096)


@pytest.mark.parametrize(
    "fault, fmt",
    [
        ("free space too small", "dump"),
        ("allocation fails", "dump"),
        ("allocation fails", "h5"),
        ("file write fails", "npz"),
        ("file write fails", "h5"),
    ],
)
def test_a_full_disk_is_an_error_naming_dst_and_the_space_needed(
    data, tmp_path, monkeypatch, capsys, fault, fmt
):
    """The disk fills up while ``cleanbuf clean`` writes (simulated: the
    free space reported, the allocation of the output's files or the
    ``.npz``/HDF5 file write fail with ``ENOSPC``). Bugs caught: the rows
    written through sparse memory maps whose blocks the disk cannot give
    (a bus error kills the process, no message; this test runs everywhere,
    the real disk is in the tmpfs test below), a bare "[Errno 28] No space
    left on device" that names neither DST nor the space needed, a
    temporary directory or a partial DST left behind, a retry with room that
    does not store what the filter stores.
    """
    src = data[fmt]
    dst = str(tmp_path / ("dst" if fmt == "dump" else f"dst.{fmt}"))
    if fault == "free space too small":
        monkeypatch.setattr(shutil, "disk_usage", _little_free)
    elif fault == "allocation fails":
        monkeypatch.setattr(os, "posix_fallocate", _enospc)
    elif fmt == "npz":
        monkeypatch.setattr(np, "savez", _enospc)
    else:
        monkeypatch.setattr(h5py.Group, "create_dataset", _enospc)
    with pytest.raises(OSError) as caught:
        clean_dataset(src, dst)
    assert caught.value.errno == errno.ENOSPC
    message = str(caught.value)
    assert message.startswith(f"no space left to write {dst}: "), message
    assert f"on {tmp_path}" in message and " bytes) " in message, message
    need = int(message.split(" bytes)")[0].rsplit("(", 1)[1])
    assert need > 1000, message  # the bytes the output takes, not a placeholder
    assert "\n" not in message
    assert not os.path.exists(dst) and _leftovers(tmp_path) == []
    assert main(["clean", src, dst, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"cleanbuf clean: no space left to write {dst}: ") and err.count("\n") == 1
    )
    assert f"({need} bytes)" in err, err
    monkeypatch.undo()  # room again: the same command succeeds
    assert main(["clean", src, dst, "--no-progress"]) == 0
    if fmt == "dump":
        _assert_streams(_rows(dst), data["want"])
    assert audit(dst).clean and _leftovers(tmp_path) == []


_CLEAN = """
import shutil, sys
from cleanbuf.check.cli import main
if sys.argv[3] == "lie":  # the free space seen before a write, not what is left when writing
    real = shutil.disk_usage
    shutil.disk_usage = lambda p: real(p)._replace(free=1 << 40)
sys.exit(main(["clean", sys.argv[1], sys.argv[2], "--no-progress"]))
"""


def _mount_tmpfs(folder, size):
    os.makedirs(folder)
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", folder],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({out.stderr.strip()}): needs root")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mounts a tmpfs (Linux)")
def test_a_real_full_disk_ends_with_exit_2_and_nothing_left(tmp_path):
    """A 16 MB tmpfs with 2 MB left, DST on it, SRC 7.2 MB of Atari-sized
    rows (``bench.offline_data``, as the large-data test). The disk's free
    space read right (the check before anything is laid out), and read
    while another process still had room to fill (the allocation of the
    output's files fails). Bugs caught: a bus error inside the gather into
    the memory-mapped output (exit 135, no message) and its temporary
    directory left filling the disk; an exit status or message that does
    not say which path needs how much space; once there is room, an output
    other than the clean's in memory.
    """
    from bench.offline_data import write_memmap

    src = str(tmp_path / "src")
    size = write_memmap(src, batches=2)
    disk = str(tmp_path / "disk")
    _mount_tmpfs(disk, "16m")
    try:
        filler = os.path.join(disk, "filler")
        fd = os.open(filler, os.O_CREAT | os.O_WRONLY)
        os.posix_fallocate(fd, 0, shutil.disk_usage(disk).free - (2 << 20))
        os.close(fd)
        for how in ("check", "lie"):
            dst = os.path.join(disk, f"dst-{how}")
            out = _run("-c", _CLEAN, src, dst, how)
            assert out.returncode == 2, (how, out.returncode, out.stderr[-2000:])
            lines = [line for line in out.stderr.splitlines() if "cleanbuf clean" in line]
            assert len(lines) == 1 and lines[0].startswith(
                f"cleanbuf clean: no space left to write {dst}: it needs "
            ), (how, out.stderr[-2000:])
            assert f"({size} bytes) on {disk}, " in lines[0] and "free there" in lines[0], lines
            assert sorted(os.listdir(disk)) == ["filler"], os.listdir(disk)
        os.remove(filler)  # room again: the same command succeeds
        dst = os.path.join(disk, "dst")
        out = _run("-c", _CLEAN, src, dst, "check")
        assert out.returncode == 0, out.stderr[-2000:]
        assert_same_rows(TensorDict.load_memmap(dst), clean_dataset(src, None).rows)
    finally:
        subprocess.run(["umount", disk], check=False)


# --- a run killed earlier ----------------------------------------------------------


_KILLED = """
import sys, time
from cleanbuf.offline import _formats
from cleanbuf.check.cli import main

write = _formats.Writer.write

def slow_write(self, rows, env=None):  # the first rows written, then a long write
    write(self, rows, env)
    print("written", flush=True)
    time.sleep(600)

_formats.Writer.write = slow_write
main(["clean", sys.argv[1], sys.argv[2], "--no-progress"])
"""


@pytest.mark.slow
def test_the_next_run_removes_what_a_killed_run_left(data, tmp_path):
    """``cleanbuf clean`` run A held in its first write of DST (a real
    process); run B for the same DST meanwhile; then A killed with SIGKILL,
    and run C with ``--force``. Bugs caught: a living run's temporary
    directory deleted under it (B), or not named; the killed run's hidden
    directory left next to DST for good, neither removed nor named by the
    next run (C); a half-written DST; an output not what the filter stores.
    """
    dst = str(tmp_path / "dst")
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED, data["dump"], dst],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        lines = iter(proc.stdout.readline, "")  # torchrl logs to stdout too
        assert "written\n" in lines
        (left,) = _leftovers(tmp_path)
        left = str(tmp_path / left)
        assert any(files for _, _, files in os.walk(left))  # rows were written
        out = _run("-m", "cleanbuf", "clean", data["dump"], dst, "--no-progress")
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"cleanbuf clean: {left} (" in out.stderr and "still running" in out.stderr
        assert _leftovers(tmp_path) == [os.path.basename(left)]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    _assert_streams(_rows(dst), data["want"])  # B's, which A never touched
    out = _run("-m", "cleanbuf", "clean", data["dump"], dst, "--no-progress", "--force")
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"cleanbuf clean: removed {left} (" in out.stderr, out.stderr
    assert "stopped before it finished" in out.stderr
    assert _leftovers(tmp_path) == []
    _assert_streams(_rows(dst), data["want"])


def test_leftovers_are_removed_unless_they_hold_the_old_dst(data, tmp_path, capsys):
    """Temporary directories named as a run names them, next to DST: one
    of a run killed while writing, one holding the previous DST that a
    ``--force`` run killed between its two renames moved aside, and one of
    another DST. Bugs caught: a killed run's directory kept and never
    mentioned; the previous DST deleted with its directory (data the user
    had); another DST's directory touched; the Python call silent about it.
    """
    dst = str(tmp_path / "dst.npz")
    prefix = f".dst.npz{TAG}"
    killed = tempfile.mkdtemp(prefix=prefix, dir=tmp_path)
    with open(os.path.join(killed, "rows"), "wb") as f:
        f.write(b"\0" * 100_000)
    moved = tempfile.mkdtemp(prefix=prefix, dir=tmp_path)
    shutil.copy(data["npz"], os.path.join(moved, "old"))
    other = tempfile.mkdtemp(prefix=f".dst{TAG}", dir=tmp_path)  # DST "dst", not "dst.npz"
    assert main(["clean", data["npz"], dst, "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert f"cleanbuf clean: removed {killed} (1" in err, err  # 100 kB or so
    assert f"cleanbuf clean: {moved} (" in err and f"previous {dst}" in err, err
    assert f"Move {os.path.join(moved, 'old')} back" in err, err
    assert other not in err
    assert not os.path.exists(killed)
    assert os.path.exists(os.path.join(moved, "old")) and os.path.isdir(other)
    # From Python, without a place to say it: a warning.
    with pytest.warns(CleanbufWarning, match="holds the previous"):
        clean_dataset(data["npz"], dst, force=True)
    assert audit(dst).clean


def test_a_failed_start_leaves_no_temporary_directory(data, tmp_path, monkeypatch):
    """Bug caught: a temporary directory made before the writer's storage
    could be built, and left when building it failed.
    """
    import torchrl.data

    def broken(*args, **kwargs):
        raise OSError(errno.EACCES, "cannot lay out the storage")

    monkeypatch.setattr(torchrl.data, "LazyMemmapStorage", broken)
    with pytest.raises(OSError, match="cannot lay out"):
        _formats.Writer(_formats.DUMP, str(tmp_path / "dst"), 10)
    assert _leftovers(tmp_path) == []


# --- files that cannot be read --------------------------------------------------------


def _truncated(src, path):
    with open(src, "rb") as f:
        blob = f.read()
    with open(path, "wb") as f:
        f.write(blob[: len(blob) // 2])


def _random(src, path):
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).bytes(4096))


def _empty(src, path):
    open(path, "wb").close()


def _npy(src, path):
    with open(path, "wb") as f:
        np.save(f, np.load(src)["observation"])


def _objects(src, path):
    arrays = dict(np.load(src))
    arrays["observation"] = np.array([{"x": 1}] * len(arrays["observation"]), dtype=object)
    np.savez(path, **arrays)


def _bad_crc(src, path):
    shutil.copy(src, path)
    with open(path, "r+b") as f:  # flip a byte of the first array's data (past its header)
        at = f.read().index(b"\x93NUMPY") + 200
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def _no_rows(src, path):
    if src.endswith(".npz"):
        np.savez(path, **{k: a[:0] for k, a in np.load(src).items()})
        return
    with h5py.File(src, "r") as f, h5py.File(path, "w") as g:
        f.visititems(
            lambda k, v: g.create_dataset(k, data=v[:0]) if isinstance(v, h5py.Dataset) else None
        )


def _dump_with(relpath, text=None, remove=False):
    def make(src, path):
        shutil.copytree(src, path)
        target = os.path.join(path, relpath)
        if remove:
            os.remove(target)
        else:
            with open(target, "w") as f:
                f.write(text)

    return make


UNREADABLE = {
    "truncated npz": ("npz", ".npz", _truncated, "is a damaged .npz file, truncated or corrupted"),
    "random bytes npz": ("npz", ".npz", _random, "is not a .npz file (not a zip archive;"),
    "empty npz": ("npz", ".npz", _empty, "is empty (0 bytes), not a .npz archive"),
    "npy named npz": ("npz", ".npz", _npy, "is not a .npz file (a single .npy array;"),
    "object arrays npz": ("npz", ".npz", _objects, ": array 'observation' holds Python objects"),
    "bad CRC npz": ("npz", ".npz", _bad_crc, "is a damaged .npz file, truncated or corrupted (Bad"),
    "0-row npz": ("npz", ".npz", _no_rows, " holds 0 rows (every array is empty: ["),
    "0-row HDF5": ("h5", ".h5", _no_rows, " holds 0 rows (every array is empty: ["),
    "empty HDF5": ("h5", ".h5", _empty, "is empty (0 bytes), not an HDF5 file"),
    "random bytes HDF5": ("h5", ".h5", _random, "is not an HDF5 file (no HDF5 signature)"),
    "truncated HDF5": ("h5", ".h5", _truncated, "is a damaged HDF5 file, truncated or corrupted"),
    "corrupt writer cursor": (
        "dump",
        "",
        _dump_with("writer/metadata.json", '{"cursor": "x7", "write_count": 768}'),
        "writer/metadata.json: 'cursor' is 'x7', not an integer >= 0",
    ),
    "writer metadata a list": (
        "dump",
        "",
        _dump_with("writer/metadata.json", "[768]"),
        "writer/metadata.json holds a JSON list, not the object (dict) it should",
    ),
    "corrupt storage length": (
        "dump",
        "",
        _dump_with("storage/storage_metadata.json", '{"len": null}'),
        "storage/storage_metadata.json: 'len' is None, not an integer >= 0",
    ),
    "memmap file missing": (
        "dump",
        "",
        _dump_with("storage/observation.memmap", remove=True),
        "storage/observation.memmap is missing: ",
    ),
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_an_unreadable_file_is_one_line_naming_it(data, tmp_path, capsys, case):
    """Damaged inputs, each made from the collector's dump, ``.npz`` or
    HDF5 file. Bugs caught: ``BadZipFile``, ``EOFError``, ``invalid literal
    for int()``, ``AttributeError`` or ``TypeError`` from deep inside a
    reader (no file named, not a cleanbuf error); numpy's advice to load
    the file with ``allow_pickle`` (unsafe, and the wrong cause); an HDF5
    error that does not say the file is empty or not HDF5; a missing
    memmap file read as a missing key; a message of several lines; a
    temporary directory or DST left behind.
    """
    source, suffix, make, says = UNREADABLE[case]
    path = str(tmp_path / f"bad{suffix}")
    make(data[source], path)
    for call in (audit, cleanbuf.clean):
        with pytest.raises(InputError) as caught:
            call(path)
        message = str(caught.value)
        assert message.startswith(path) and says in message, message
        assert "\n" not in message and "allow_pickle" not in message, message
    before = _digest(path) if os.path.isdir(path) else Path(path).read_bytes()
    dst = str(tmp_path / f"dst{suffix}")
    for argv in (["audit", path], ["clean", path, dst, "--no-progress"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == f"cleanbuf {argv[0]}: {message}\n", err
    assert not os.path.exists(dst) and _leftovers(tmp_path) == []
    after = _digest(path) if os.path.isdir(path) else Path(path).read_bytes()
    assert after == before  # the source is never written


# --- what is no data, or no row, in memory ---------------------------------------------


def test_zero_rows_in_memory_keep_their_keys():
    """Bug caught: ``clean(dict)`` of 0 rows returned an empty dict (the
    keys gone) or ended in numpy's "cannot reshape array of size 0"; now
    the result is empty with the source's keys, and stats of zeros.
    """
    nested = {
        "observation": np.zeros((0, 4), np.float32),
        "next": {
            "observation": np.zeros((0, 4), np.float32),
            "reward": np.zeros(0, np.float32),
            "done": np.zeros(0, bool),
        },
    }
    for layout in (None, "time_last", "flat"):
        out, stats = cleanbuf.clean(nested, layout=layout, return_stats=True)
        assert set(out) == {"observation", "next"} and set(out["next"]) == set(nested["next"])
        assert out["next"]["observation"].shape == (0, 4) and stats["rows_out"] == 0
    slash = {"obs": np.zeros((0, 3)), "next_obs": np.zeros((0, 3)), "rewards": np.zeros(0),
             "dones": np.zeros(0, bool)}  # fmt: skip
    assert set(cleanbuf.clean(slash)) == set(slash)
    td = TensorDict({"observation": torch.zeros(4, 0, 2), ("next", "done"): torch.zeros(4, 0, 1)},
                    [4, 0])  # fmt: skip
    out = cleanbuf.clean(td)
    assert out.batch_size == (0,) and set(out.keys(True, True)) == set(td.keys(True, True))


NOT_DATA = {"an int": 42, "a string list": ["a", "b"], "None": None}


@pytest.mark.parametrize("what", list(NOT_DATA))
def test_what_is_no_data_is_one_line_naming_what_is(what):
    """Bug caught: ``audit(42)`` ended in TorchRL's "storage must be either
    a Storage or a callable", ``clean(42)`` in "use cleanbuf.clean() for
    dicts of arrays" (said by clean itself). Now one line naming the kinds
    of data cleanbuf reads.
    """
    for call in (audit, cleanbuf.clean):
        with pytest.raises(InputError) as caught:
            call(NOT_DATA[what])
        message = str(caught.value)
        assert message.startswith(f"got {type(NOT_DATA[what]).__name__}, which is no data")
        assert "a TorchRL ReplayBuffer or storage" in message and "\n" not in message


def test_an_empty_buffer_is_one_line():
    """Bug caught: ``clean(ReplayBuffer(...))`` and ``audit`` of a buffer
    that holds nothing ended in TorchRL's "Cannot save a non-initialized
    storage".
    """
    for source in (ReplayBuffer(storage=LazyTensorStorage(10)), LazyTensorStorage(10)):
        for call in (audit, cleanbuf.clean):
            with pytest.raises(InputError, match=r"holds no rows \(len 0\): nothing to audit"):
                call(source)


def test_a_storage_of_two_dims_is_read_as_time_first():
    """A real ``GymEnv("CartPole-v1", num_envs=4)`` collector's ``[E, T]``
    batches extended into ``LazyTensorStorage(N, ndim=2)`` (TorchRL keeps
    them as ``[time, env]`` slots), small enough to wrap. Bug caught: the
    audit and the clean failed with "'len' is 64, more than the 16 slots
    of the storage: the file does not belong to this storage". Now it is
    read oldest step first, as ``time_first``, and cleans to what the
    filter stores from the same steps.
    """
    _, batches = _collect()
    data = torch.cat(batches, 1)  # [E, T]
    steps = data.shape[1]
    keep = steps - 16 - 4  # the storage's time slots: it wraps
    rb = ReplayBuffer(storage=LazyTensorStorage(keep * 4, ndim=2))
    for t in range(0, steps, 16):
        rb.extend(data[:, t : t + 16])
    assert rb.storage._storage.batch_size == (keep, 4)
    report = audit(rb)
    assert report.wrapped and report.layout == "time_first" and report.envs == 4, str(report)
    assert report.rows == keep * 4 and report.status == 1, str(report)
    rows = cleanbuf.clean(rb, mode="next_step", joint_reset=True)
    want = cleanbuf.clean(data[:, steps - keep :].clone(), joint_reset=True)
    assert len(rows) == len(want)
    assert torch.equal(rows["observation"].sort(0).values, want["observation"].sort(0).values)


def test_a_corrupt_repair_state_names_the_field():
    """Bug caught: a ``RolloutRepair`` state with a field missing or of the
    wrong kind ended in ``KeyError: 'held_kind'``, with the repair half
    restored. Now a StateError names the field, and nothing changes.
    """
    state = cleanbuf.RolloutRepair("next_step").state_dict()
    inner = state["_extra_state"]
    broken = [(k, {kk: v for kk, v in inner.items() if kk != k}) for k in inner]
    broken += [("held", {**inner, "held": [1, 2]}), ("stats", {**inner, "stats": "x"})]
    broken += [("held_kind", {**inner, "held": {}})]  # a held column without its kinds
    for field, bad in broken:
        repair = cleanbuf.RolloutRepair("next_step")
        before = repair.state_dict()
        with pytest.raises(cleanbuf.StateError, match=f"state field '{field}'"):
            repair.load_state_dict({"_extra_state": bad})
        assert str(repair.state_dict()) == str(before), field
