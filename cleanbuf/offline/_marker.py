"""What ``cleanbuf clean`` writes about its output: each row's env.

A cleaned dataset's rows no longer fall into runs of ``T`` steps (the
reset rows are gone), so the audit could not recover which env each row
came from, and would read a clean dataset as one stream of unknown
producer. ``cleanbuf clean`` therefore stores each row's env index with
the rows, and the audit reads it instead of guessing:

* a dump or a memmap directory: ``cleanbuf_env.npy`` (one ``int32`` a
  row, in write order) and ``cleanbuf.json`` (who wrote it, the row count,
  a digest of the done flags, the options and the stats), next to the
  files TorchRL and tensordict read (they ignore both);
* a ``.npz`` or HDF5 file: an array ``_cleanbuf/env``, one entry a row
  like every other array.

A directory whose rows changed since (another ``rb.dumps`` into it) no
longer matches its row count or done digest: the audit then ignores the
file and recovers the layout from the rows.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

MARK_FILE = "cleanbuf.json"
ENV_FILE = "cleanbuf_env.npy"
ENV_ARRAY = "_cleanbuf/env"  # in a .npz or HDF5 file


def done_digest(done: np.ndarray) -> str:
    """A digest of the per-row done flags (tells a stale marker from a fresh one).

    Examples:
        >>> done_digest(np.array([False, True])) == done_digest(np.array([0, 1]))
        True
        >>> done_digest(np.array([False, True])) == done_digest(np.array([True, False]))
        False
    """
    flags = np.asarray(done).astype(bool).reshape(-1)
    return f"{len(flags)}:" + hashlib.sha256(np.packbits(flags).tobytes()).hexdigest()


def write_dir(folder: str, env: np.ndarray, mark: dict) -> None:
    """Writes the env index and the marker into a dump or memmap directory."""
    np.save(os.path.join(folder, ENV_FILE), np.asarray(env, np.int32))
    with open(os.path.join(folder, MARK_FILE), "w") as f:
        json.dump(mark, f, indent=1)


def read_dir(folder: str) -> tuple[np.ndarray | None, dict | None]:
    """The env index and the marker of a directory cleanbuf wrote; Nones if absent.

    An unreadable or damaged marker is treated as absent: the audit then
    recovers the layout from the rows, as for any other data.
    """
    env_path, mark_path = os.path.join(folder, ENV_FILE), os.path.join(folder, MARK_FILE)
    if not (os.path.exists(env_path) and os.path.exists(mark_path)):
        return None, None
    try:
        with open(mark_path) as f:
            mark = json.load(f)
        env = np.load(env_path, allow_pickle=False)
    except (OSError, ValueError):
        return None, None
    return (env, mark) if isinstance(mark, dict) and env.ndim == 1 else (None, None)


def env_if_fresh(env: np.ndarray | None, mark: dict | None, done: np.ndarray) -> np.ndarray | None:
    """The stored env index if it still describes these rows, else None.

    It must have one entry a row, and a directory's marker must hold the
    digest of these rows' done flags (a file's array is rewritten with it).

    Examples:
        >>> done = np.array([False, True, False])
        >>> env = np.array([0, 1, 0])
        >>> env_if_fresh(env, {"done": done_digest(done)}, done).tolist()
        [0, 1, 0]
        >>> env_if_fresh(env, {"done": done_digest(done)}, ~done) is None
        True
    """
    if env is None or len(env) != len(done) or (len(env) and env.min() < 0):
        return None
    if mark is not None and mark.get("done") != done_digest(done):
        return None
    return env.astype(np.int64)
