"""``cleanbuf clean SRC DST``: clean transitions on disk into a new dataset.

The rows are read in write order, one write (one collector batch) at a
time, and go through the same cleaner as the replay-buffer filter, each
tagged with the env the audit recovered (``layout="stream_key"``); the
cleaned rows are written to a new dataset of SRC's format in a temporary
directory, renamed to DST at the end. Memory stays that of a few batches
plus a few index arrays of 8 bytes a row, whatever the size of the rows.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from cleanbuf._cleaner import STAT_NAMES, Cleaner
from cleanbuf._errors import InputError
from cleanbuf._options import Options
from cleanbuf._pool import BufferPool
from cleanbuf.offline._audit import Report, analyse, stream_positions
from cleanbuf.offline._formats import Collect, Dataset, Writer, read

ENV_KEY = "_cleanbuf_env"


class OutputPool(BufferPool):
    """The cleaner's large outputs, gathered straight into the output's files.

    Where the writer has laid out a key, the cleaner's buffer for it is the
    output's next rows, so the rows are copied once (from SRC into DST);
    the writer's copy of them is then a copy onto itself, which torch
    skips. Measured on 2 GB of Atari-like rows: see ``bench/README.md``.
    """

    def __init__(self, writer: Writer):
        super().__init__()
        self.writer = writer

    def take(self, key, shape: tuple, dtype: torch.dtype, device: torch.device):
        """The output's next rows of ``key`` when they fit, else a pooled buffer."""
        dest = self.writer.slot(key, shape[0])
        if dest is not None and dest.dtype == dtype and tuple(dest.shape) == tuple(shape):
            return dest
        return super().take(key, shape, dtype, device)


@dataclasses.dataclass
class Cleaned:
    """What :func:`clean_dataset` did.

    Attributes:
        stats: the cleaner's counters, plus ``orphan_reset_rows`` (reset rows
            at the start of a wrapped buffer whose done row was overwritten:
            dropped) and ``rows_not_cleaned`` (rows of a partly overwritten
            batch of joint-reset data: stored as they were).
        report: the audit of the source.
        rows: the cleaned rows when no destination was given, else None.
    """

    stats: dict
    report: Report
    rows: TensorDictBase | None = None


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="rows", file=sys.stderr, desc="cleanbuf clean")


def clean_dataset(
    src: str | Dataset,
    dst: str | None,
    *,
    force: bool = False,
    progress: bool = False,
    **options: Any,
) -> Cleaned:
    """Cleans the dataset at ``src`` into a new one at ``dst``, same format.

    Args:
        src: a TorchRL ``rb.dumps`` directory, a TensorDict memmap directory or
            a ``.npz`` file, or a :class:`Dataset`.
        dst: where to write the cleaned dataset (refused if it exists, unless
            ``force``); None keeps the cleaned rows in memory.
        force: replace an existing ``dst``.
        progress: show a progress bar on stderr (needs ``tqdm``).
        **options: :class:`cleanbuf.AutoresetFilter` options; by default those
            the audit found (``report.options()``).

    Returns:
        The stats, the audit of ``src``, and the rows if ``dst`` is None.

    Raises:
        InputError: unreadable ``src``, ``dst`` exists, ``dst`` is ``src``.
        CleanbufError: the data does not fit the options. Nothing is left at
            ``dst``.
    """
    ds = src if isinstance(src, Dataset) else read(src)
    if dst is not None and os.path.abspath(ds.path) == os.path.abspath(dst):
        raise InputError(f"SRC and DST are the same path ({dst}); cleanbuf never modifies SRC.")
    report, streams = analyse(ds)
    if not streams.found:
        raise InputError(
            f"{src}: cannot tell which env each row came from (the rows do not chain into "
            "runs of a fixed length in a fixed env order, as a collector or a vector-env "
            "loop writes them), so they cannot be cleaned per env. Already cleaned data "
            "reads like this. Clean such rows with cleanbuf.clean(data, stream_key=KEY) "
            "and a key holding each row's env index."
        )
    opts = {**report.options(), **options}
    joint = opts.pop("joint_reset", False)
    n = report.rows
    # The source's capacity in rows: rb.loads reads the cleaned dump into a
    # buffer of rows built with it.
    capacity = max(ds.capacity * ds.chunk, n)
    writer = Collect() if dst is None else Writer(ds.format, dst, capacity, force=force)
    pool = OutputPool(writer) if isinstance(writer, Writer) else None
    bar = _progress(n, progress)
    stats = dict.fromkeys((*STAT_NAMES, "orphan_reset_rows", "rows_not_cleaned"), 0)
    try:
        positions = stream_positions(streams, n)
        env_of = np.empty(n, np.int64)
        for env, pos in enumerate(positions):
            env_of[pos] = env
        skip = _orphans(ds, report, positions) if ds.wrapped and not joint else np.zeros(0, int)
        stats["orphan_reset_rows"] = len(skip)
        if joint:
            cleaner = Cleaner(Options.build(**opts, joint_reset=True, layout="time_last"), pool)
            pieces = [(s, e, True) for s, e in streams.batches(n)]
            loose = np.r_[0 : streams.head, n - streams.tail : n]
        else:
            cleaner = Cleaner(Options.build(**opts, stream_key=ENV_KEY), pool)
            size = streams.steps * streams.envs
            pieces = [(s, min(s + size, n), False) for s in range(0, n, size)]
            loose = np.zeros(0, np.int64)
        if len(loose):  # joint resets need whole batches: the rest is stored as it was
            rows = ds.rows(loose)
            writer.write(rows)
            stats["rows_in"] += len(loose)
            stats["rows_out"] += len(loose)
            stats["rows_not_cleaned"] += len(loose)
        for start, stop, aligned in pieces:
            pos = np.arange(start, stop)
            if aligned:
                batch = ds.rows(pos).reshape(streams.envs, streams.steps)
            else:
                pos = pos[~np.isin(pos, skip)] if len(skip) else pos
                batch = ds.rows(pos)
                batch.set(ENV_KEY, torch.as_tensor(env_of[pos]))
            out = cleaner(batch)
            writer.write(out.exclude(ENV_KEY))
            if bar is not None:
                bar.update(stop - start)
        rest = cleaner.flush()
        writer.write(rest.exclude(ENV_KEY))
        for k, v in cleaner.stats.items():
            stats[k] += v
        stats["rows_in"] += len(skip)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    return Cleaned(stats, report, writer.rows if dst is None else None)


def _orphans(ds: Dataset, report: Report, positions: list) -> np.ndarray:
    """Reset rows that start a wrapped buffer's stream: their done row was overwritten.

    The first row of an env's rows, next-step data, reward 0 and not done,
    when other rows rarely have reward 0 (the audit's confidence is high).
    """
    out: list[int] = []
    if report.mode != "next_step" or report.confidence != "high":
        return np.asarray(out, np.int64)
    for pos in positions:
        if not len(pos):
            continue
        row = ds.rows(pos[:1])
        done = row.get(("next", "done"), row.get(("next", "terminated"), None))
        if float(row["next", "reward"].reshape(-1)[0]) == 0 and not bool(done.any()):
            out.append(int(pos[0]))
    return np.asarray(out, np.int64)
