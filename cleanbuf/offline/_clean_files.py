"""``cleanbuf clean SRC DST``: clean transitions on disk into a new dataset.

The rows are read in write order, a few whole writes (collector batches)
at a time, and go through the same cleaner as the replay-buffer filter,
each tagged with the env the audit recovered (``layout="stream_key"``);
the cleaned rows are written to a new dataset, in the format DST names,
in a temporary directory; read back and checked there (its rows, done
flags and env index against what was cleaned), it is renamed to DST.
Memory stays that of a piece of ``PIECE_BYTES`` plus a few index arrays
of 8 bytes a row, whatever the size of the dataset (for the directory
formats; a ``.npz`` or HDF5 file is read and written whole).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase

from cleanbuf.engine._cleaner import STAT_NAMES, Cleaner
from cleanbuf.engine._errors import InputError
from cleanbuf.engine._keys import DONE_KEYS, Views, done_flags
from cleanbuf.engine._options import Options, normalize_mode
from cleanbuf.engine._write import BufferPool
from cleanbuf.offline._audit import Report, analyse, stream_positions
from cleanbuf.offline._compat import quiet_torchrl_log
from cleanbuf.offline._formats import (
    DUMP,
    NPZ,
    Collect,
    Dataset,
    Shape,
    Writer,
    output_format,
    read,
)
from cleanbuf.offline._joint import joint_rows

ENV_KEY = "_cleanbuf_env"  # each row's env, as the audit recovered it
JOINT_KEY = "_cleanbuf_joint"  # each row's joint-reset flag (see _joint.py)
# Rows cleaned per cleaner call: whole writes, up to this many bytes (at
# least one write). Each call costs about a millisecond however few rows
# it gets; the large rows themselves go straight to the output's files.
PIECE_BYTES = 16 << 20


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
        stats: the cleaner's counters, plus ``orphan_reset_rows`` (of the
            reset rows dropped, those at the start of a wrapped buffer, whose
            done row was overwritten) and ``rows_not_cleaned`` (rows of a
            partly overwritten write of joint-reset data whose joint resets
            the audit could not tell: stored as they were, and counted in
            ``rows_in`` and ``rows_out``).
        report: the audit of the source.
        rows: the cleaned rows when no destination was given, else None.
        capacity: for a dump, the rows its storage holds: ``rb.loads(DST)``
            needs a buffer of exactly this size (SRC's, when the rows fit).
        env: with ``rows``, each row's env.
    """

    stats: dict
    report: Report
    rows: TensorDictBase | None = None
    capacity: int | None = None
    env: np.ndarray | None = None


def _progress(total: int, enabled: bool):
    """A progress bar on stderr, or None (not asked, no tqdm, or stderr no terminal).

    Redirected to a file or a pipe, a bar's redraws would pile up as lines.
    """
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="rows", file=sys.stderr, desc="cleanbuf clean", disable=None)


def clean_dataset(
    src: str | Dataset,
    dst: str | None,
    *,
    force: bool = False,
    progress: bool = False,
    say: Callable[[str], None] | None = None,
    command_line: bool = False,
    **options: Any,
) -> Cleaned:
    """Cleans the dataset at ``src`` into a new one at ``dst``, in the format ``dst`` names.

    Before anything is moved to ``dst``, the output is read back as a
    reader reads it: its rows must be the ``rows_out`` cleaned, with the
    done flags and env index written; else nothing is moved and an
    ``OutputCheckError`` says so.

    Args:
        src: a TorchRL ``rb.dumps`` directory, a TensorDict memmap directory,
            a ``.npz`` or HDF5 file, or a :class:`Dataset`.
        dst: where to write the cleaned dataset (refused if it exists, unless
            ``force``); None keeps the cleaned rows in memory. A name
            ending ``.npz`` is written as a ``.npz`` file, ``.h5`` /
            ``.hdf5`` as an HDF5 file, one ending with a slash (or any
            name, where SRC is a directory) as a directory: a memmap
            directory from one, else a TorchRL dump that ``rb.loads``
            reads into a buffer of ``Cleaned.capacity`` rows. A name of
            another file format (``.pt``, ``.pkl``, ...), or of no format
            where SRC is a file, is refused before anything is read.
        force: replace an existing ``dst``.
        progress: show a progress bar on stderr (needs ``tqdm``).
        say: where a note goes before anything is written (the command line
            prints it on stderr): when a dump's cleaned rows will not fit a
            buffer built as SRC's, the storage to build to load DST; the
            temporary directory a killed run for the same ``dst`` left,
            removed (or, when it cannot be, named). None: a
            :class:`cleanbuf.CleanbufWarning`, for the latter notes.
        command_line: errors name command-line flags (``cleanbuf clean``)
            rather than Python options.
        **options: :class:`cleanbuf.AutoresetFilter` options; by default those
            the audit found (``report.options()``); ``joint_reset`` also
            takes ``"yes"``, ``"no"`` and ``"auto"`` (the audit's).
            ``layout``, ``envs`` and ``keys`` say how SRC's arrays are laid
            out and named (as :func:`cleanbuf.offline.audit` takes them).

    Returns:
        The stats, the audit of ``src``, and the rows if ``dst`` is None.

    Raises:
        InputError: unreadable ``src``, ``dst`` exists, ``dst`` is ``src``,
            lies inside it or holds it; checked before anything is written.
        CleanbufError: the data does not fit the options, or the output
            did not read back as written (``OutputCheckError``). Nothing is
            left at ``dst``.
        OSError: writing failed; a full disk is a ``NoSpaceError`` (an
            ``OSError`` with ``errno.ENOSPC``) naming ``dst`` and the bytes
            needed. Nothing is left at ``dst``, nor a temporary directory.
    """
    shape = Shape(*(options.pop(k, None) for k in ("layout", "envs", "keys")))
    if not isinstance(src, Dataset) and not os.path.exists(src):  # (said before DST's name)
        raise InputError(f"{src} does not exist.")
    if dst is not None:  # a DST naming no format written: refused before SRC is read
        source_kind = src.format if isinstance(src, Dataset) else None
        output_format(dst, source_kind or (DUMP if os.path.isdir(src) else NPZ))
    ds = src if isinstance(src, Dataset) else read(src, shape)
    if dst is not None:
        _check_apart(ds.path, dst)
    report, streams = _layout(ds, command_line)
    options = _joint_option(options)
    check_declared(report, options)
    opts = {**report.options(), **options}
    writer = Collect(ds.names, ds.casts)
    if dst is not None:
        capacity = _capacity(ds, report, say)
        writer = Writer(
            output_format(dst, ds.format),
            dst,
            capacity,
            force=force,
            fit=ds.capacity if ds.format == DUMP else None,
            names=ds.names,
            casts=ds.casts,
            say=say,
            keys=ds.shape.keys,
        )
    bar = _progress(report.rows, progress)
    try:
        with quiet_torchrl_log():  # the writer's storage is a means: no INFO line for it
            stats = _clean(ds, report, streams, opts, writer, bar)
            writer.commit(_mark(ds, opts, stats), rows=stats["rows_out"])
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    if dst is None:
        return Cleaned(stats, report, writer.rows, env=writer.env_rows)
    return Cleaned(stats, report, capacity=writer.capacity)


def _joint_option(options: dict) -> dict:
    """``joint_reset`` as ``True`` / ``False`` / ``"auto"`` (what the audit found).

    Examples:
        >>> _joint_option({"joint_reset": "auto", "mode": "next_step"})
        {'mode': 'next_step'}
        >>> _joint_option({"joint_reset": "no"})
        {'joint_reset': False}
    """
    options = dict(options)
    joint = options.pop("joint_reset", "auto")
    words = {"yes": True, "no": False, True: True, False: False}
    if joint in (None, "auto"):
        return options
    if joint not in words:
        raise InputError(
            f"joint_reset={joint!r}: pass True / 'yes' (TorchRL GymEnv's joint resets), "
            "False / 'no', or 'auto' / None (what the audit found)."
        )
    return {**options, "joint_reset": words[joint]}


def _said(option: str, value: Any) -> str:
    """An option as both callers say it: its flag and its Python keyword.

    Examples:
        >>> _said("mode", "disabled")
        "--mode disabled (mode='disabled')"
        >>> _said("joint_reset", True)
        '--joint-reset yes (joint_reset=True)'
    """
    flag = {True: "yes", False: "no"}.get(value, value)
    return f"--{option.replace('_', '-')} {flag} ({option}={value!r})"


def check_declared(report: Report, options: dict) -> None:
    """Refuses a declared mode or joint-reset setting that the data contradicts.

    Checked against the evidence the audit read, as a declared layout is:
    where the audit is sure (high confidence) of another mode, or saw the
    opposite of the joint-reset setting (a step where every env ended and
    was reset with it, or one by one with a reset row each), the clean
    would store wrong rows, so it is refused, naming what the evidence
    points to. Where the evidence cannot tell, the declared value wins.

    Args:
        report: the audit of the data.
        options: the options given (``mode``, ``joint_reset`` as a bool).

    Raises:
        InputError: one line: what was declared, what the data shows, and
            the setting it points to (as a flag and as a Python option).

    Examples:
        >>> from types import SimpleNamespace
        >>> seen = SimpleNamespace(source="d.npz", mode="next_step", confidence="high",
        ...     why="9 of 9 episode ends followed by a reward-0 row", joint_reset=False,
        ...     joint_steps=0, separate_steps=0)
        >>> check_declared(seen, {"mode": "next_step"})
        >>> check_declared(seen, {"mode": "disabled"})
        Traceback (most recent call last):
        ...
        cleanbuf.engine._errors.InputError: d.npz: --mode disabled (mode='disabled') ...
    """
    mode = options.get("mode")
    mode = None if mode is None else normalize_mode(mode)
    sure = report.confidence == "high" and report.mode in ("next_step", "same_step", "disabled")
    if mode is not None and sure and mode != report.mode:
        raise InputError(
            f"{report.source}: {_said('mode', mode)} says the producer's mode is {mode}, but "
            f"the data contradicts it: it reads as {report.mode} (high confidence: "
            f"{report.why}). Pass {_said('mode', report.mode)}, or leave the mode out to read "
            "it from the data; nothing was written."
        )
    joint = options.get("joint_reset")
    if joint is None or not sure or report.mode != "next_step":
        return
    if joint and report.separate_steps:
        seen = (
            f"{report.separate_steps} done row(s) of steps where every env ended are each "
            "followed by a reset row (reward 0, not done): the envs were reset one by one"
        )
    elif not joint and report.joint_steps:
        seen = (
            f"{report.joint_steps} done row(s) of steps where every env ended are followed by "
            "the next episode's first row, with no reset row: the envs were reset together"
        )
    else:
        return
    raise InputError(
        f"{report.source}: {_said('joint_reset', joint)} contradicts the data: {seen}. Pass "
        f"{_said('joint_reset', not joint)}, or leave it out to read it from the data; "
        "nothing was written."
    )


def _layout(ds: Dataset, command_line: bool = False) -> tuple[Report, Any]:
    """The audit and the env layout; an error when the envs cannot be told apart.

    The error names the options in the caller's terms: flags on the
    command line, keywords in Python.
    """
    report, streams = analyse(ds)
    if report.undecided is not None:
        if command_line:
            say = (
                "--layout time_first ([T, E] arrays), --layout time_last ([E, T]) or --layout "
                "flat --envs N (N envs' rows one env after the other)"
            )
        else:
            say = (
                'layout="time_first" ([T, E] arrays), layout="time_last" ([E, T]), or '
                'layout="flat", envs=N (N envs\' rows one env after the other)'
            )
        raise InputError(
            f"{ds.path}: cannot tell {report.undecided}; so it cannot be cleaned per env. Say "
            f"how the rows are laid out: {say}."
        )
    if not streams.found:
        how = (
            "store each row's env index under a key and clean with "
            "cleanbuf.clean(data, stream_key=KEY) in Python"
            if command_line
            else "clean them with cleanbuf.clean(data, stream_key=KEY), KEY a key holding each "
            "row's env index"
        )
        raise InputError(
            f"{ds.path}: cannot tell which env each row came from (the rows do not chain "
            "into runs of a fixed length in a fixed env order, as a collector or a "
            "vector-env loop writes them), so they cannot be cleaned per env. Data cleaned "
            "by another tool reads like this (cleanbuf clean stores each row's env with its "
            "output), and so does a buffer holding rows written before and after a filter "
            f"was attached (clean the rows written before it alone). To clean such rows, {how}."
        )
    return report, streams


def _capacity(ds: Dataset, report: Report, say: Callable[[str], None] | None) -> int:
    """The rows DST is laid out for; says so before writing when SRC's buffer is too small.

    A dump loads (``rb.loads``) only into a buffer of exactly its capacity:
    DST keeps SRC's capacity (its storage's slots, now one row each) when
    the rows fit it. A ``Collector(replay_buffer=rb)`` stores ``[T]``-step
    chunks, one slot each, so SRC may hold more rows than slots: DST is
    then laid out for all of them and cut to SRC's capacity at the end if
    the cleaned rows fit after all (``Writer``).
    """
    n = report.rows
    if n <= ds.capacity:
        return ds.capacity
    expected = n - report.reset_rows  # the rows left once the reset rows are dropped
    if ds.format == DUMP and expected > ds.capacity and say is not None:
        say(
            f"note: {ds.path} holds {n} rows in {ds.capacity} slots of {ds.chunk} steps; "
            f"about {expected} remain once cleaned, more than a buffer built as the source's "
            f"holds ({ds.capacity} rows). DST is a buffer of {n} rows: load it into "
            f"ReplayBuffer(storage=LazyMemmapStorage({n})) (or LazyTensorStorage({n})) "
            "with rb.loads(DST)."
        )
    return n


def _clean(ds: Dataset, report: Report, streams, opts: dict, writer, bar) -> dict:
    """Feeds the rows through the cleaner into ``writer``, a few writes at a time."""
    opts = dict(opts)
    joint = opts.pop("joint_reset", False)
    n = report.rows
    pool = OutputPool(writer) if isinstance(writer, Writer) else None
    stats = dict.fromkeys((*STAT_NAMES, "orphan_reset_rows", "rows_not_cleaned"), 0)
    positions = stream_positions(streams, n)
    env_of = np.empty(n, np.int64)
    for env, pos in enumerate(positions):
        env_of[pos] = env
    columns = {ENV_KEY: env_of}
    key_opts = {"joint_key": JOINT_KEY} if joint else {}
    cleaner = Cleaner(Options.build(**opts, stream_key=ENV_KEY, **key_opts), pool)
    lo, hi = 0, n  # the rows cleaned; the others are stored as they were
    if joint:
        flags = _joint_flags(ds, cleaner.options, streams, positions)
        columns[JOINT_KEY], undecided = flags
        if undecided.any() and report.confidence != "high":
            # A step of a partial write whose rows are all done: joint or not
            # shows only in the reward signature, which the audit doubts.
            lo, hi = streams.head, n - streams.tail
    if ds.wrapped and (lo, hi) == (0, n):
        orphans = report.orphan_rows
        cleaner.expect_reset_rows(env_of[orphans])
        stats["orphan_reset_rows"] = len(orphans)
    size = streams.steps * streams.envs
    size *= max(1, PIECE_BYTES // max(size * _row_bytes(ds), 1))
    _as_stored(ds, np.arange(0, lo), env_of, writer, stats)
    for start in range(lo, hi, size):
        pos = np.arange(start, min(start + size, hi))
        batch = ds.rows(pos)
        for key, column in columns.items():
            batch.set(key, torch.as_tensor(column[pos]))
        _write(cleaner(batch), columns, writer)
        if bar is not None:
            bar.update(len(pos))
    _write(cleaner.flush(), columns, writer)
    _as_stored(ds, np.arange(hi, n), env_of, writer, stats)
    for k, v in cleaner.stats.items():
        stats[k] += v
    return stats


def _write(out: TensorDictBase, columns: dict, writer) -> None:
    """Writes cleaned rows without cleanbuf's columns, with each row's env."""
    if out.batch_size[0]:
        writer.write(out.exclude(*columns), out.get(ENV_KEY).numpy())


def _mark(ds: Dataset, opts: dict, stats: dict) -> dict:
    """What DST's marker says: who wrote it, from what, how (see ``_marker``)."""
    from cleanbuf._version import __version__

    return {
        "written_by": f"cleanbuf clean {__version__}",
        "source": os.path.abspath(ds.path),
        "options": {
            k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in opts.items()
        },
        "stats": stats,
    }


def _check_apart(src: str, dst: str) -> None:
    """Refuses a DST that is SRC, lies inside it, or holds it (paths resolved).

    Writing into SRC would change the data being read; replacing a DST that
    holds SRC (``--force``) would delete it.

    Examples:
        >>> _check_apart("runs/rb", "runs/rb_clean")
        >>> _check_apart("runs/rb", "runs/rb/storage/x")
        Traceback (most recent call last):
        ...
        cleanbuf.engine._errors.InputError: DST runs/rb/storage/x is inside SRC runs/rb ...
    """
    a, b = os.path.realpath(src), os.path.realpath(dst)
    if a == b:
        raise InputError(f"SRC and DST are the same path ({dst}); cleanbuf never modifies SRC.")
    fix = "cleanbuf never writes into SRC nor replaces it: pick a DST outside it (a sibling)."
    if os.path.commonpath([a, b]) == a:
        raise InputError(f"DST {dst} is inside SRC {src} (resolved: {b} in {a}); {fix}")
    if os.path.commonpath([a, b]) == b:
        raise InputError(f"SRC {src} is inside DST {dst} (resolved: {a} in {b}); {fix}")


def _as_stored(ds: Dataset, positions: np.ndarray, env_of, writer, stats: dict) -> None:
    """Writes rows as they were, counted in ``rows_not_cleaned``."""
    if len(positions):
        writer.write(ds.rows(positions), env_of[positions])
        for name in ("rows_in", "rows_out", "rows_not_cleaned"):
            stats[name] += len(positions)


def _joint_flags(
    ds: Dataset, options: Options, streams, positions: list
) -> tuple[np.ndarray, np.ndarray]:
    """Per row, a done row of a joint reset, and whether that was undecided."""
    n = ds.n_rows
    every = np.arange(n)
    names = {_tuple(k) for k in ds.data.keys(True, True)}
    reward_key = options.reward_key or ("next", "reward")  # (the audit needs this one)
    keys = [k for k in (options.done_key, *DONE_KEYS, reward_key) if k in names]
    leaves = {k: torch.as_tensor(ds.column(k, every)) for k in dict.fromkeys(keys)}
    done = done_flags(Views(leaves, 1, n), options.done_key)
    reward = leaves[reward_key].reshape(n, -1)
    return joint_rows(done, (reward == 0).all(1).numpy(), streams, positions)


def _row_bytes(ds: Dataset) -> int:
    """The bytes of one row, every key."""
    leaves = ds.data.values(True, True)
    return sum(leaf[(0,) * ds.data.batch_dims].nbytes for leaf in leaves)


def _tuple(key: Any) -> tuple:
    return key if isinstance(key, tuple) else (key,)
