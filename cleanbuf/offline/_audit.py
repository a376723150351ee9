"""``cleanbuf.audit``: what auto-reset artifacts stored transitions hold.

The audit reads the rows in write order, recovers which env each came
from (:mod:`cleanbuf.offline._streams`; data written by ``cleanbuf clean``
stores it, :mod:`cleanbuf.offline._marker`), and then looks at every
episode end of every env: the done row and the row after it.

* **next-step** data: the row after a done row is a *reset row*, from the
  terminal state to the next episode's first state, with reward 0 and not
  done. Its observation is the terminal state the done row lacks (TorchRL
  zero-fills it; a raw Gymnasium loop has it in both).
* **joint resets** (TorchRL's ``GymEnv(num_envs=N)`` when all envs end on
  one step): no reset row, and the done rows' next observations are zeros.
  Lost for good.
* **same-step** data: the done row's next observation is the next
  episode's first observation (the next row's observation). Lost unless
  the final observations were stored.
* **clean** data: none of those.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Any

import numpy as np

from cleanbuf.engine._errors import InputError
from cleanbuf.offline._formats import Dataset, from_buffer, read
from cleanbuf.offline._marker import DONE_KEYS, env_if_fresh
from cleanbuf.offline._streams import Rows, Streams, recover, same_per_row, stored

IN_MEMORY = "torchrl buffer in memory"  # the format of a buffer audited in memory
BLOCK_BYTES = 2 << 20  # observations read at a time when scanning every row
_NOT_OBS = {"done", "terminated", "truncated", "reward", "is_init", "step_count", "traj_ids"}


def _tuple(key) -> tuple:
    return key if isinstance(key, tuple) else (key,)


def observation_key(data) -> tuple:
    """The observation key: the first key ``k`` stored with ``("next", *k)``.

    Raises:
        InputError: no such pair of keys.
    """
    keys = [_tuple(k) for k in data.keys(True, True)]
    present = set(keys)
    for k in keys:
        if k[0] != "next" and k[-1] not in _NOT_OBS and ("next", *k) in present:
            return k
    raise InputError(
        f"no observation key stored with its ('next', ...) twin among {sorted(keys, key=str)}; "
        "an audit needs each row's observation and next observation."
    )


@dataclasses.dataclass
class Report:
    """What :func:`audit` found.

    Attributes:
        source: the path audited, or for a buffer in memory its name
            (``"ReplayBuffer(LazyTensorStorage(1000))"``); format: its format.
        rows: valid rows; envs, steps: the recovered layout (E envs, T steps
            per env per write); head: rows of a partly overwritten batch.
        wrapped: the buffer wrapped around.
        env_stored: each row's env was read from the data (``cleanbuf
            clean`` stores it with its output), not recovered; ``steps`` is
            then 0.
        layout_found: the env layout was recovered (else the rows were read
            as one stream).
        mode: the producer's auto-reset mode as the data shows it
            (``"next_step"``, ``"same_step"``, ``"disabled"`` for clean data).
        joint_reset: episode ends without a reset row and with lost next
            observations (TorchRL's joint reset).
        confidence: ``"high"``, ``"medium"`` or ``"low"``, with ``why``.
        episodes: done rows. reset_rows: reset rows (next-step).
        next_obs_zero, next_obs_nan: done rows whose next observation is all
            zeros / has NaN. next_obs_is_reset: done rows whose next
            observation is the next episode's first one (same-step).
        recoverable: done rows whose terminal observation a clean restores
            (from the reset row after them).
        is_init_wrong, step_count_wrong: episodes whose first row (after
            the reset row, if any) lacks ``is_init`` or has a step count
            other than 0; None when the rows have no such key.
        in_memory: the source is a TorchRL buffer or storage in memory (the
            fix is then a Python call, not a command).
    """

    source: str
    format: str
    rows: int
    envs: int
    steps: int
    head: int
    wrapped: bool
    layout_found: bool
    mode: str
    joint_reset: bool
    confidence: str
    why: str
    episodes: int
    reset_rows: int
    next_obs_zero: int
    next_obs_nan: int
    next_obs_is_reset: int
    recoverable: int
    is_init_wrong: int | None = None
    step_count_wrong: int | None = None
    in_memory: bool = False
    env_stored: bool = False
    details: list = dataclasses.field(default_factory=list, repr=False)

    @property
    def artifacts(self) -> int:
        """Rows that are wrong without saying so.

        Reset rows, done rows whose next observation is zeros (restorable
        or not), and same-step done rows holding the next episode's first
        observation. NaN next observations are marked lost already (what
        ``cleanbuf clean`` leaves), so they do not count.
        """
        return self.reset_rows + self.next_obs_zero + self.next_obs_is_reset

    @property
    def lost(self) -> int:
        """Done rows whose terminal observation is gone for good (marked or not)."""
        return max(self.next_obs_zero + self.next_obs_nan - self.recoverable, 0)

    @property
    def clean(self) -> bool:
        """No artifact found."""
        return self.artifacts == 0

    def options(self) -> dict:
        """The :class:`cleanbuf.AutoresetFilter` options that clean this data."""
        opts: dict[str, Any] = {"mode": self.mode}
        if self.joint_reset:
            opts["joint_reset"] = True
        return opts

    def command(self, dst: str = "CLEANED") -> str:
        """The ``cleanbuf clean`` command that fixes the data.

        For a buffer in memory, the Python call that returns its cleaned
        rows (``rb`` stands for the buffer audited).
        """
        if self.in_memory:
            joint = ", joint_reset=True" if self.joint_reset else ""
            return f'rows = cleanbuf.clean(rb, mode="{self.mode}"{joint})'
        flags = f" --mode {self.mode}" + (" --joint-reset" if self.joint_reset else "")
        return f"cleanbuf clean {self.source} {dst}{flags}"

    def to_dict(self) -> dict:
        """The report as plain values (what ``--json`` prints)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del out["details"]
        out.update(
            artifacts=self.artifacts, lost=self.lost, clean=self.clean, command=self.command()
        )
        return out

    def __str__(self) -> str:
        lines = [
            f"cleanbuf audit: {self.source} ({self.format})",
            f"  rows              {self.rows}"
            + (f" (wrapped; {self.head} from a partly overwritten write)" if self.wrapped else ""),
            f"  streams           {self.envs} envs (each row's env stored by cleanbuf clean)"
            if self.env_stored
            else f"  streams           {self.envs} envs, {self.steps} steps per env per write"
            if self.layout_found
            else "  streams           not recovered (rows of several envs in no order found); "
            "read as one stream",
            f"  producer          {self.mode}"
            + (", joint resets" if self.joint_reset else "")
            + f" ({self.confidence} confidence: {self.why})",
            f"  episode ends      {self.episodes}",
            f"  reset rows        {self.reset_rows}",
            f"  next obs zeros    {self.next_obs_zero}",
            f"  next obs NaN      {self.next_obs_nan}",
            f"  next obs = reset  {self.next_obs_is_reset}",
            f"  recoverable       {self.recoverable} terminal observations (from reset rows)",
            f"  lost for good     {self.lost + self.next_obs_is_reset}",
        ]
        for name, value in (("is_init", self.is_init_wrong), ("step_count", self.step_count_wrong)):
            if value is not None:
                lines.append(f"  {name + ' wrong':18s}{value} episode first rows")
        if self.clean:
            lines.append("  clean: no auto-reset artifact found")
            if self.next_obs_nan:
                lines.append(f"  ({self.next_obs_nan} terminal observations marked lost: NaN)")
        else:
            lines.append(f"  fix: {self.command()}")
            if self.in_memory:
                lines.append(f"  (rb: this {self.source}; rows: its rows cleaned, flat)")
            if self.lost:
                drop = (
                    'on_lost_terminal_obs="drop"'
                    if self.in_memory
                    else "--on-lost-terminal-obs drop"
                )
                lines.append(
                    f"  ({self.lost} terminal observations cannot be restored: the fix marks "
                    f"them NaN; add {drop} to store no such row)"
                )
        return "\n".join(lines)

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON."""
        return json.dumps(self.to_dict(), indent=1)

    def plot(self, path: str) -> None:
        """Draws the artifacts, and what cleaning changes, into an image file.

        Left: per env, where the reset rows and the lost terminal
        observations are (write order). Right: the rows of each kind of
        artifact as stored and once cleaned (see
        :mod:`cleanbuf.offline._plot`). Needs matplotlib.
        """
        import matplotlib.pyplot as plt

        from cleanbuf.offline._plot import figure

        fig = figure(self)
        fig.savefig(path, dpi=90)
        plt.close(fig)


def stream_positions(streams: Streams, n: int) -> list[np.ndarray]:
    """Per env, its rows' positions in write order, in time order.

    Examples:
        >>> s = Streams(steps=2, envs=2, head=1, head_runs=((1, 0, 1),), tail=0)
        >>> [p.tolist() for p in stream_positions(s, 9)]
        [[1, 2, 5, 6], [0, 3, 4, 7, 8]]
    """
    if streams.env is not None:  # stored with the rows
        return [np.flatnonzero(streams.env == env) for env in range(streams.envs)]
    parts: list[list[np.ndarray]] = [[] for _ in range(streams.envs)]
    for env, start, stop in streams.head_runs:
        parts[env % streams.envs].append(np.arange(start, stop))
    t = streams.steps
    for start, _ in streams.batches(n):
        for env in range(streams.envs):
            parts[env].append(np.arange(start + env * t, start + (env + 1) * t))
    if streams.tail:
        start = n - streams.tail
        for env in range(streams.envs):
            lo = start + env * t
            if lo < n:
                parts[env].append(np.arange(lo, min(lo + t, n)))
    return [np.concatenate(p) if p else np.zeros(0, np.int64) for p in parts]


def _ends(rows: Rows, reward: np.ndarray, positions: np.ndarray, details: list, book: dict) -> dict:
    """Counts over the episode ends of one env's rows (time order).

    Every done row's next observation is read (zeros, NaN); those with a
    row after them are also compared with it (reset row, same-step).
    Appends ``(done rows, followed by a reset row, lost)`` to ``details``.
    ``book`` holds the ``is_init`` / ``step_count`` columns present: the
    first row of each next episode (after its reset row) is checked.
    """
    done = rows.done
    d = positions[done[positions]]
    flat_next = _flat(rows.next_obs(d))
    nan = np.isnan(flat_next).any(1) if flat_next.dtype.kind == "f" else np.zeros(len(d), bool)
    zero = ~nan & (flat_next == 0).all(1)
    has_next = np.zeros(len(d), np.bool_)  # the last row of the env has none
    has_next[: len(d) - int(len(positions) and done[positions[-1]])] = True
    after = positions[np.flatnonzero(done[positions[:-1]]) + 1]  # the rows after them
    same = np.zeros(len(d), np.bool_)
    reset = np.zeros(len(d), np.bool_)
    same[has_next] = same_per_row(flat_next[has_next], rows.obs(after))
    reset[has_next] = (reward[after] == 0) & ~done[after]
    # A raw next-step loop stores the terminal state twice (done row's next
    # observation and reset row's observation): 'same' and 'reset' at once.
    details.append((d, reset, (zero | nan) & ~reset))
    at = np.flatnonzero(done[positions[:-1]]) + 1 + reset[has_next]  # episode first rows
    first = positions[at[at < len(positions)]]
    wrong = {}
    if "is_init" in book:
        wrong["is_init_wrong"] = int((~book["is_init"][first]).sum())
    if "step_count" in book:
        wrong["step_count_wrong"] = int((book["step_count"][first] != 0).sum())
    return {
        **wrong,
        "ends": int(has_next.sum()),
        "reset": int(reset.sum()),
        "zero": int(zero.sum()),
        "nan": int(nan.sum()),
        "same_not_reset": int((same & ~reset).sum()),
        "recoverable": int(((zero | nan) & reset).sum()),
        "lost_no_reset": int(((zero | nan) & ~reset).sum()),
    }


def _flat(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(len(x), -1)


def audit(source: Any) -> Report:
    """Audits stored transitions for auto-reset artifacts.

    Args:
        source: a path (a TorchRL ``rb.dumps`` directory, a TensorDict memmap
            directory or a ``.npz`` file), a TorchRL ``ReplayBuffer`` or
            storage (dumped to a temporary directory first; the report
            names the buffer, and its fix is the ``cleanbuf.clean`` call),
            or a :class:`Dataset`.

    Returns:
        The report: ``print(report)``, ``report.to_dict()``, ``report.clean``.

    Raises:
        InputError: an unreadable source, or rows without done flags,
            reward or observations.
    """
    if isinstance(source, Dataset):
        return analyse(source)[0]
    if isinstance(source, (str, os.PathLike)):
        return analyse(read(os.fspath(source)))[0]
    with tempfile.TemporaryDirectory(prefix="cleanbuf-") as tmp:
        report = analyse(from_buffer(source, os.path.join(tmp, "dump")))[0]
    # The dump was a means: the report names the buffer, and its fix is a call.
    return dataclasses.replace(report, source=buffer_name(source), format=IN_MEMORY, in_memory=True)


def buffer_name(source: Any) -> str:
    """A TorchRL buffer or storage as its class and its storage's size.

    Examples:
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> buffer_name(ReplayBuffer(storage=LazyTensorStorage(1000)))
        'ReplayBuffer(LazyTensorStorage(1000))'
        >>> buffer_name(LazyTensorStorage(10))
        'LazyTensorStorage(10)'
    """
    storage = getattr(source, "storage", None)
    if storage is None:
        return f"{type(source).__name__}({getattr(source, 'max_size', '')})"
    return f"{type(source).__name__}({buffer_name(storage)})"


def analyse(ds: Dataset) -> tuple[Report, Streams]:
    """:func:`audit`, and the recovered layout (for cleaning)."""
    data = ds.data
    done_key = next((k for k in DONE_KEYS if k in data.keys(True, True)), None)
    if done_key is None or ("next", "reward") not in data.keys(True, True):
        raise InputError(
            f"{ds.path}: an audit needs ('next', 'done') (or 'terminated') and "
            f"('next', 'reward'); the keys are {sorted(data.keys(True, True), key=str)}."
        )
    n = ds.n_rows
    every = np.arange(n)
    done = ds.column(done_key, every).reshape(n, -1).any(1)
    reward = ds.column(("next", "reward"), every).reshape(n, -1)[:, 0]
    rows = _rows(ds, observation_key(data), done)
    env = env_if_fresh(ds.env, ds.mark, done)
    streams = recover(rows, ds.chunk, ds.wrapped) if env is None else stored(env)
    totals: dict[str, int] = {}
    first_of_episode = np.zeros(n, np.bool_)  # the rows after a done row
    details: list = []
    book = _book(ds)
    per_env = stream_positions(streams, n)
    for positions in per_env:
        first_of_episode[positions[1:][done[positions[:-1]]]] = True
        for k, v in _ends(rows, reward, positions, details, book).items():
            totals[k] = totals.get(k, 0) + v
    others = ~done & ~first_of_episode
    totals["zero_reward_rate"] = float(np.mean(reward[others] == 0)) if others.any() else 1.0
    mode, joint, confidence, why = _verdict(totals)
    if not streams.found:
        confidence, why = "low", why + "; env layout not recovered"
    reset_rows = totals.get("reset", 0) if mode == "next_step" else 0
    report = Report(
        source=ds.path,
        format=ds.format,
        rows=n,
        envs=streams.envs,
        steps=0 if env is not None else streams.steps,
        head=streams.head,
        wrapped=ds.wrapped,
        layout_found=streams.found,
        env_stored=env is not None,
        mode=mode,
        joint_reset=joint,
        confidence=confidence,
        why=why,
        episodes=int(done.sum()),
        reset_rows=reset_rows,
        next_obs_zero=totals.get("zero", 0),
        next_obs_nan=totals.get("nan", 0),
        next_obs_is_reset=totals.get("same_not_reset", 0) if mode == "same_step" else 0,
        recoverable=totals.get("recoverable", 0) if mode == "next_step" else 0,
        # (read as one stream, rows of several envs would look wrong)
        is_init_wrong=totals.get("is_init_wrong") if streams.found else None,
        step_count_wrong=totals.get("step_count_wrong") if streams.found else None,
    )
    report.details = [(positions, *detail) for positions, detail in zip(per_env, details)]
    return report, streams


def _rows(ds: Dataset, key: tuple, done: np.ndarray) -> Rows:
    """The observations of ``key`` and their next ones, read a block at a time."""
    leaf = ds.data.get(key)
    row_bytes = leaf[0].numel() * leaf.element_size() if ds.chunk == 1 else leaf[0, 0].nbytes
    return Rows(
        ds.n_rows,
        done,
        lambda p: ds.column(key, p),
        lambda p: ds.column(("next", *key), p),
        block=max(64, BLOCK_BYTES // max(row_bytes, 1)),
    )


def _book(ds: Dataset) -> dict:
    """The ``is_init`` and ``step_count`` columns present, one value a row."""
    n, every = ds.n_rows, np.arange(ds.n_rows)
    keys = set(_tuple(k) for k in ds.data.keys(True, True))
    book = {
        name: ds.column((name,), every).reshape(n, -1)[:, 0]
        for name in ("is_init", "step_count")
        if (name,) in keys
    }
    if "is_init" in book:
        book["is_init"] = book["is_init"].astype(bool)
    return book


def _verdict(t: dict) -> tuple[str, bool, str, str]:
    """The producer's mode from the episode-end counts, and how sure it is.

    A reset row is told by its reward of 0: the verdict is sure only when
    the other rows (not done, not after a done row) rarely have reward 0.
    """
    ends = t.get("ends", 0)
    if not ends:
        return "disabled", False, "low", "no episode end with a row after it"
    zero_rate = t["zero_reward_rate"]
    reset, same = t["reset"], t["same_not_reset"]
    lost_alone = t["lost_no_reset"] if t["zero"] else 0  # NaN alone: marked already
    if reset >= same and reset > 0:
        mode, share = "next_step", reset / ends
        why = f"{reset} of {ends} episode ends followed by a reward-0 row"
    elif same > 0:
        mode, share = "same_step", same / ends
        why = f"{same} of {ends} done rows whose next observation starts the next row"
    elif lost_alone:
        mode, share = "next_step", lost_alone / ends
        why = f"{lost_alone} of {ends} done rows with zero/NaN next observations, no reset row"
    else:
        return "disabled", False, "high" if ends >= 3 else "low", f"{ends} clean episode ends"
    joint = mode == "next_step" and lost_alone > 0
    if joint and reset:  # the ends a joint reset explains count for the verdict too
        share = (reset + lost_alone) / ends
        why += f", {lost_alone} without one (joint resets)"
    if share >= 0.9 and ends >= 3 and zero_rate < 0.05:
        confidence = "high"
    elif share >= 0.6:
        confidence = "medium"
    else:
        confidence = "low"
    if zero_rate >= 0.05:
        why += f"; {zero_rate:.0%} of other rows also have reward 0"
    return mode, joint, confidence, why
