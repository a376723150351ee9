"""``cleanbuf clean`` at the sizes users have: several pieces, every output format.

A raw Gymnasium next-step loop of 8 CartPole envs, its observations padded
to 804 floats (3.2 KB a row, as a small image or a wide state would be),
is saved the ways people save it: a ``.npz`` of ``[T, E]`` arrays, an HDF5
file, a TorchRL dump of rows step after step, a dump of a collector's
``[E, 16]`` chunks, and a TensorDict memmap directory. Each is cleaned in
several pieces (``PIECE_BYTES`` small, so that the cleaner gathers rows
straight into the output's files, as it does for a dataset of several
hundred MB) into every output format, then loaded back as a user loads it
(``rb.loads``, ``np.load``, ``h5py``, ``TensorDict.load_memmap``) and
compared, env by env and row for row, with the explicit-reset run of the
same envs, and its row count with the count taken from the raw data.
"""

from __future__ import annotations

import json
import os

import gymnasium as gym
import h5py
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ReplayBuffer

from cleanbuf import InputError
from cleanbuf.check.cli import main
from cleanbuf.engine import _write
from cleanbuf.offline import _clean_files, _formats, audit, clean_dataset
from tests.loops import ENVS, run_loop

E = 8
PAD = 201  # observation tiled 201 times: 804 floats a row
KEYS = ["observation", "action", "next/observation", "next/reward", "next/terminated"]
KEYS += ["next/truncated", "next/done", "env_id"]


def _arrays(mode, steps: int) -> dict:
    """A raw loop's [T, E] arrays, observations padded (a function of the observation)."""
    name, kwargs, policy = ENVS["CartPole-terminates"]
    venv, rows = run_loop(name, kwargs, policy, E, steps, mode)
    venv.close()
    out = {}
    for k in KEYS:
        a = torch.stack([r.get(tuple(k.split("/"))) for r in rows]).numpy()
        if k.endswith("observation"):
            a = np.tile(a, PAD)
        out[k] = a
    return out


def _expected_rows(arrays: dict) -> np.ndarray:
    """Per env, the rows a clean keeps, counted from the raw flags alone.

    In next-step data every row after a done row is a reset row; the rest
    are kept (a done row at the very end is flushed).
    """
    done = arrays["next/done"].reshape(len(arrays["next/done"]), E)
    return len(done) - done[:-1].sum(0)


def _td(arrays: dict, lead: int) -> TensorDict:
    shape = next(iter(arrays.values())).shape[:lead]
    return TensorDict({tuple(k.split("/")): torch.as_tensor(a) for k, a in arrays.items()}, shape)


def _save(kind: str, arrays: dict, tmp) -> str:
    """The loop's rows saved as ``kind``; returns the path."""
    steps = len(arrays["observation"])
    if kind == "npz":
        path = str(tmp / "src.npz")
        np.savez(path, **arrays)
    elif kind == "hdf5":
        path = str(tmp / "src.h5")
        with h5py.File(path, "w") as f:
            for k, a in arrays.items():
                f.create_dataset(k, data=a)
    elif kind == "memmap":
        path = str(tmp / "src_memmap")
        flat = {k: a.reshape(steps * E, *a.shape[2:]) for k, a in arrays.items()}
        _td(flat, 1).memmap(path)
    elif kind == "dump-rows":  # rb.extend of each step's [E] rows
        path = str(tmp / "src_rows")
        rb = ReplayBuffer(storage=LazyMemmapStorage(steps * E))
        rb.extend(_td({k: a.reshape(steps * E, *a.shape[2:]) for k, a in arrays.items()}, 1))
        rb.dumps(path)
    else:  # a collector's writes: [E, 16] batches, one slot of 16 steps per env
        path = str(tmp / "src_chunks")
        rb = ReplayBuffer(storage=LazyTensorStorage(steps * E // 16))
        td = _td({k: np.swapaxes(a, 0, 1) for k, a in arrays.items()}, 2)  # [E, T]
        for t in range(0, steps, 16):
            rb.extend(td[:, t : t + 16])
        rb.dumps(path)
    return path


def _load(path: str, capacity: int | None) -> dict:
    """The output loaded as a user loads it: flat "/"-named arrays."""
    if path.endswith(".npz"):
        return dict(np.load(path))
    if path.endswith(".h5"):
        out = {}

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                out[name] = obj[()]

        with h5py.File(path, "r") as f:
            f.visititems(visit)
        return out
    if os.path.isdir(os.path.join(path, "storage")):  # a dump
        rb = ReplayBuffer(storage=LazyMemmapStorage(capacity))
        rb.loads(path)
        rows = rb[: len(rb)]
    else:
        rows = TensorDict.load_memmap(path)
    return {
        "/".join(k) if isinstance(k, tuple) else k: v.numpy() for k, v in rows.items(True, True)
    }


def _compare(rows: dict, oracle: dict, want: np.ndarray) -> None:
    """Each env's rows: exactly ``want[e]`` of them, equal to the explicit-reset run's."""
    env = rows["env_id"].reshape(-1)
    assert len(env) == want.sum(), f"{len(env)} rows read back, {want.sum()} expected"
    for e in range(E):
        got = {k: rows[k][env == e] for k in KEYS}
        n = len(got["observation"])
        assert n == want[e], f"env {e}: {n} rows, {want[e]} expected"
        for k in KEYS:
            x = got[k].reshape(n, -1)
            y = oracle[k][:n, e].reshape(n, -1)
            assert np.array_equal(x, y), f"env {e}: {k} differs from the explicit-reset run"


@pytest.fixture(scope="module")
def loop():
    """The next-step loop and its explicit-reset run, 256 steps of 8 envs (6.6 MB)."""
    modes = gym.vector.AutoresetMode
    return _arrays(modes.NEXT_STEP, 256), _arrays(modes.DISABLED, 256)


SOURCES = ["npz", "hdf5", "memmap", "dump-rows", "dump-chunks"]
OUTPUTS = {"npz": "dst.npz", "hdf5": "dst.h5", "dir": "dst/"}


@pytest.mark.parametrize("out", list(OUTPUTS))
@pytest.mark.parametrize("src", SOURCES)
def test_several_pieces_read_back_whole(loop, src, out, tmp_path, monkeypatch):
    """Bugs caught: an output of several pieces that holds the first piece's
    rows plus one a piece (the storage's count of a slice write taken as the
    rows written: 2,499 of 22,949 rows in a user's .npz, 2,459 rows loaded
    by rb.loads of a dump), an output written in SRC's format under a name
    that says another (an .npz named .h5), a cleaned copy that re-audits as
    "cannot tell", rows out of order or given to the wrong env.
    """
    data, oracle = loop
    monkeypatch.setattr(_clean_files, "PIECE_BYTES", 1 << 20)  # 1 MB: several pieces
    source = _save(src, data, tmp_path)
    dst = os.path.join(tmp_path, OUTPUTS[out])  # (pathlib would drop dst/'s slash)
    done = clean_dataset(source, dst)
    want = _expected_rows(data)
    s = done.stats
    assert s["rows_out"] == want.sum()
    assert s["rows_in"] == s["rows_out"] + s["reset_rows_dropped"] + s["lost_rows_dropped"]
    assert s["rows_held"] == 0  # flushed: every row accounted for
    _compare(_load(dst, done.capacity), oracle, want)
    again = audit(dst)
    assert again.clean and again.status == 0 and again.rows == want.sum(), str(again)
    if out != "dir":
        head = open(dst, "rb").read(4)
        assert head == (b"PK\x03\x04" if out == "npz" else b"\x89HDF"), head


def test_the_output_is_checked_before_it_is_moved(loop, tmp_path, monkeypatch):
    """Bug caught: a clean whose output holds fewer rows than it cleaned
    exits 0 (here the dump's row count is left as TorchRL counted it, one
    row a piece after the first); it must fail with exit 2 and leave
    nothing at DST.
    """
    data, _ = loop
    monkeypatch.setattr(_clean_files, "PIECE_BYTES", 1 << 20)
    source = _save("npz", data, tmp_path)
    wrong = []

    def set_len(path, n):  # the count off by a piece: what TorchRL's bookkeeping gave
        wrong.append(n)
        with open(path) as f:
            meta = json.load(f)
        meta["len"] = n - 1
        with open(path, "w") as f:
            json.dump(meta, f)

    monkeypatch.setattr(_formats, "_set_len", set_len)
    dst = os.path.join(tmp_path, "dst/")
    assert main(["clean", source, dst, "--no-progress"]) == 2
    assert wrong and not os.path.exists(tmp_path / "dst")
    assert not [p for p in os.listdir(tmp_path) if "cleanbuf-tmp" in p]


def test_a_dump_from_a_file_loads_into_a_buffer_of_its_rows(loop, tmp_path, capsys):
    """Bug caught: a .npz cleaned into a dump directory laid out for the
    source's rows, so that rb.loads refused a buffer of the rows cleaned
    (with a raw torch error) and nothing said which size it needed.
    """
    data, oracle = loop
    source = _save("npz", data, tmp_path)
    assert main(["clean", source, os.path.join(tmp_path, "dst/"), "--no-progress"]) == 0
    want = _expected_rows(data)
    assert f"capacity              {want.sum()} (load it" in capsys.readouterr().out
    _compare(_load(str(tmp_path / "dst"), int(want.sum())), oracle, want)


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("dst.pkl", r"names a format cleanbuf does not write.*\.npz"),
        ("dst.pt", r"names a format cleanbuf does not write.*\.npz"),
        ("cleaned", r"names no format: name it .*cleaned\.npz"),
        ("out.v2", r"names no format: name it .*out\.v2\.npz"),
    ],
)
def test_a_dst_naming_no_format_written_is_refused(loop, tmp_path, name, said):
    """Bugs caught: a DST named .pkl (or .pt, ...) written as whatever SRC
    is, a file whose content contradicts its name; a .npz source cleaned to
    a name without a suffix written as a file that cleanbuf itself then
    cannot read (it reads files by their suffix), after a check that read
    it under another name; a missing SRC blamed on DST's name.
    """
    data, _ = loop
    source = _save("npz", data, tmp_path)
    with pytest.raises(InputError, match=said):
        clean_dataset(source, str(tmp_path / name))
    assert not os.path.exists(tmp_path / name)
    # A missing SRC is said first: whether a DST without a suffix names a
    # format depends on SRC's kind (a directory source writes a directory).
    with pytest.raises(InputError, match=r"missing\.npz does not exist"):
        clean_dataset(str(tmp_path / "missing.npz"), str(tmp_path / name))


def test_a_refused_dst_is_one_line_from_the_command(loop, tmp_path, capsys):
    """Bug caught: a refused DST ending in a traceback or a second line of noise."""
    source = _save("npz", loop[0], tmp_path)
    assert main(["clean", source, str(tmp_path / "dst.parquet"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "names a format cleanbuf does not write" in err and err.count("\n") == 1


@pytest.mark.slow  # 40 MB: three pieces of the default size
@pytest.mark.parametrize("out", list(OUTPUTS))
def test_a_dataset_of_several_default_pieces(out, tmp_path, capsys):
    """The same at the default piece size (16 MB), on 40 MB of rows, as a
    user's dataset is cleaned. Bug caught: rows lost where a piece ends,
    at the size where that first happened (more than one 16 MB piece).
    """
    modes = gym.vector.AutoresetMode
    data, oracle = _arrays(modes.NEXT_STEP, 1600), _arrays(modes.DISABLED, 1600)
    assert sum(a.nbytes for a in data.values()) > 2.5 * _clean_files.PIECE_BYTES
    source = _save("dump-chunks", data, tmp_path)
    dst = os.path.join(tmp_path, OUTPUTS[out])
    assert main(["clean", source, dst, "--no-progress", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    want = _expected_rows(data)
    assert printed["stats"]["rows_out"] == want.sum()
    _compare(_load(dst, printed["capacity"]), oracle, want)
    assert audit(dst).clean


def test_small_pieces_gathered_into_the_output(loop, tmp_path, monkeypatch):
    """Every leaf gathered straight into the output's files (the pool's
    threshold at 0), one write a piece. Bug caught: a small key (reward,
    done) counted or placed otherwise than a large one.
    """
    data, oracle = loop
    monkeypatch.setattr(_clean_files, "PIECE_BYTES", 1)
    monkeypatch.setattr(_write, "MIN_POOLED_BYTES", 0)
    source = _save("dump-rows", data, tmp_path)
    done = clean_dataset(source, str(tmp_path / "dst"))
    _compare(_load(str(tmp_path / "dst"), done.capacity), oracle, _expected_rows(data))


def test_without_the_storage_tensors_every_row_still_reaches_the_file(loop, tmp_path, monkeypatch):
    """The fallback where TorchRL's private ``storage._storage`` is gone: no
    row is copied straight into the output, the storage counts each write,
    and a ``.npz`` of several pieces holds every row. Bug caught: the file
    read from the storage's tensors unconditionally (a crash) or up to a
    count that missed rows.
    """
    data, oracle = loop
    monkeypatch.setattr(_clean_files, "PIECE_BYTES", 1 << 20)
    monkeypatch.setattr(_formats, "storage_tensors", lambda storage: None)
    source = _save("hdf5", data, tmp_path)
    clean_dataset(source, str(tmp_path / "dst.npz"))
    _compare(_load(str(tmp_path / "dst.npz"), None), oracle, _expected_rows(data))
