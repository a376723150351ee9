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
import shlex
import sys
import tempfile
from typing import Any

import numpy as np

from cleanbuf.engine._errors import InputError
from cleanbuf.engine._keys import DONE_KEYS, FINAL_KEYS, may_be_observation
from cleanbuf.engine._orientation import same_per_row
from cleanbuf.engine._read import fill_marks
from cleanbuf.offline._formats import Dataset, Shape, done_of, read
from cleanbuf.offline._joint import joint_rows
from cleanbuf.offline._marker import env_if_fresh
from cleanbuf.offline._sources import dataset
from cleanbuf.offline._streams import Rows, Streams, recover, stored

IN_MEMORY = "torchrl buffer in memory"  # the format of a buffer audited in memory
BLOCK_BYTES = 2 << 20  # observations read at a time when scanning every row


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
        if may_be_observation(k) and ("next", *k) in present:
            return k
    raise InputError(
        f"no observation key stored with its ('next', ...) twin among {sorted(keys, key=str)}; "
        "an audit needs each row's observation and next observation."
    )


def program() -> str:
    """The command this process was run as, so that a printed fix runs as printed.

    The script as typed (``.venv/bin/cleanbuf``, a venv not on ``PATH``),
    this interpreter with ``-m cleanbuf``, or plain ``cleanbuf`` (from
    Python, where the fix is shown, not run).
    """
    argv0 = sys.argv[0] if sys.argv else ""
    if os.path.basename(argv0) == "cleanbuf":
        return shlex.quote(argv0)
    if argv0.endswith(os.path.join("cleanbuf", "__main__.py")):
        return f"{shlex.quote(sys.executable)} -m cleanbuf"
    return "cleanbuf"


# Where NaN marks lost terminal observations (TorchRL's auto-reset fill, or a
# clean that marked them), what keeps them at the source.
_KEEP_FINAL_OBS = (
    "  (producers that keep them: Isaac Lab compute_final_obs=True, mjlab "
    "capture_terminal_observations=True or cleanbuf.LosslessMjlabEnv, ManiSkill3 "
    "and Gymnasium SAME_STEP, each read by cleanbuf.step_rows: docs/simulators.md)"
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
            then 0 (a ``[T, E]`` array's is ``T``).
        layout_found: the env layout was recovered (else the rows were read
            as one stream).
        mode: the producer's auto-reset mode as the data shows it
            (``"next_step"``, ``"same_step"``, ``"disabled"`` for clean data).
        joint_reset: episode ends without a reset row and with lost next
            observations (TorchRL's joint reset).
        confidence: ``"high"``, ``"medium"`` or ``"low"``, with ``why``.
        episodes: done rows. reset_rows: reset rows (next-step).
        orphan_rows: the positions of the reset rows at the oldest row of
            an env of a buffer that wrapped, whose done row was overwritten
            (next-step data read with high confidence: reward 0, not done);
            ``cleanbuf clean`` drops them. ``orphan_reset_rows`` counts them.
        next_obs_zero, next_obs_nan: done rows whose next observation is all
            zeros / is marked missing (a NaN, or -1 in every element of
            signed integers, as TorchRL fills it). next_obs_is_reset: done rows whose next
            observation is the next episode's first one (same-step).
        recoverable: done rows whose terminal observation a clean restores
            (from the reset row after them).
        final_stored: same-step done rows whose terminal observation is in
            a final-observation entry (``("next", "final_obs")``, as
            ``cleanbuf.step_rows`` stores Gymnasium's): a clean restores it.
        is_init_wrong, step_count_wrong: episodes whose first row (after
            the reset row, if any) lacks ``is_init`` or has a step count
            other than 0; None when the rows have no such key.
        in_memory: the source is a TorchRL buffer or storage in memory (the
            fix is then a Python call, not a command).
        undecided: why the audit cannot tell whether the data is clean
            (the time axis, the envs, or no two rows of one env to
            compare); None when it could. ``clean`` is then False and the
            command line exits 3.
        layout: the source's leading dims (``"flat"``, ``"time_first"``,
            ``"time_last"``), with the evidence in ``layout_why``;
            name_set: the names its arrays use; shape: what the user said
            (the fix repeats it).
        linked: the rows come in no env order (a filter's output): each
            done row's next observation was looked up among every row's
            observation, which shows a clean buffer clean; artifacts found
            so leave the audit undecided (cleaning needs each row's env).
        joint_steps: done rows of steps where every env ended and the
            next step restarted every env (the evidence of joint resets).
        separate_steps: done rows of steps where every env ended and each
            env's next row is a reset row (the evidence against joint
            resets: those envs were not reset together).
        trailing: done rows with no row after them in their env (the end
            of collection): undecided, they are no evidence of anything.
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
    final_stored: int = 0
    is_init_wrong: int | None = None
    step_count_wrong: int | None = None
    in_memory: bool = False
    env_stored: bool = False
    undecided: str | None = None
    layout: str | None = "flat"
    layout_why: str = ""
    name_set: str = "torchrl"
    shape: Shape = dataclasses.field(default_factory=Shape)
    joint_steps: int = 0
    separate_steps: int = 0
    trailing: int = 0
    orphan_rows: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros(0, np.int64), repr=False
    )
    linked: bool = False
    python: str | None = None
    details: list = dataclasses.field(default_factory=list, repr=False)

    @property
    def orphan_reset_rows(self) -> int:
        """Reset rows at a wrapped buffer's oldest rows (see ``orphan_rows``)."""
        return len(self.orphan_rows)

    @property
    def artifacts(self) -> int:
        """Rows that are wrong without saying so.

        Reset rows, done rows whose next observation is zeros (restorable
        or not), and same-step done rows holding the next episode's first
        observation. NaN next observations are marked lost already (what
        ``cleanbuf clean`` leaves), so they do not count.
        """
        return (
            self.reset_rows + self.orphan_reset_rows + self.next_obs_zero + self.next_obs_is_reset
        )

    @property
    def lost(self) -> int:
        """Done rows whose next observation is zeros or NaN and no reset row restores."""
        return max(self.next_obs_zero + self.next_obs_nan - self.recoverable, 0)

    @property
    def lost_for_good(self) -> int:
        """Done rows whose terminal observation no clean can restore.

        Those of :attr:`lost`, and the same-step done rows holding the next
        episode's first observation whose final observation was not stored.
        """
        return self.lost + max(self.next_obs_is_reset - self.final_stored, 0)

    @property
    def clean(self) -> bool:
        """No artifact found, and the audit could tell."""
        return self.artifacts == 0 and self.undecided is None

    @property
    def status(self) -> int:
        """The command line's exit status: 0 clean, 1 artifacts, 3 cannot tell."""
        return 3 if self.undecided is not None else 0 if self.clean else 1

    def options(self) -> dict:
        """The :class:`cleanbuf.AutoresetFilter` options that clean this data."""
        opts: dict[str, Any] = {"mode": self.mode}
        if self.joint_reset:
            opts["joint_reset"] = True
        return opts

    def _lost_policy(self) -> str | None:
        """``"nan"`` where same-step done rows hold no terminal observation.

        Without it the clean raises (the cleaner's default for same-step
        data), so the fix printed would not run; the report says how many
        are lost, and the NaN marks them in the cleaned copy.
        """
        lost = self.next_obs_is_reset > self.final_stored
        return "nan" if self.mode == "same_step" and lost else None

    def command(self, dst: str | None = None) -> str:
        """The ``cleanbuf clean`` command that fixes the data, runnable as printed.

        ``dst`` defaults to a sibling of the source in its format
        (``data.npz`` -> ``data.clean.npz``, ``runs/rb`` ->
        ``runs/rb.clean``). For data in memory, the Python call that
        returns its cleaned rows (``rb`` stands for a buffer audited,
        ``data`` for a dict or TensorDict).
        """
        joint = "yes" if self.joint_reset else "no"
        lost = self._lost_policy()
        if self.in_memory or self.python is not None:
            name = self.python or "rb"
            extra = f", joint_reset={self.joint_reset}" + self.shape.kwargs()
            extra += f', on_lost_terminal_obs="{lost}"' if lost else ""
            return f'rows = cleanbuf.clean({name}, mode="{self.mode}"{extra})'
        flags = f" --mode {self.mode} --joint-reset {joint}" + self.shape.flags()
        flags += f" --on-lost-terminal-obs {lost}" if lost else ""
        dst = shlex.quote(dst or clean_name(self.source))
        return f"{program()} clean {shlex.quote(self.source)} {dst}{flags}"

    def to_dict(self) -> dict:
        """The report as plain values (what ``--json`` prints)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del out["details"], out["orphan_rows"]
        out["shape"] = dataclasses.asdict(self.shape)
        out.update(
            orphan_reset_rows=self.orphan_reset_rows,
            artifacts=self.artifacts,
            lost=self.lost,
            lost_for_good=self.lost_for_good,
            clean=self.clean,
            status=self.status,
            # (rows linked by content have no env order to clean by)
            command=None if self.undecided or self.linked else self.command(),
        )
        return out

    def __str__(self) -> str:
        if self.undecided is not None:
            return self._cannot_tell()
        lines = [
            f"cleanbuf audit: {self.source} ({self.format})",
            f"  rows              {self.rows}"
            + (
                f" (wrapped; {self.head} from a partly overwritten write)"
                if self.wrapped and self.head
                else " (wrapped: read from the oldest row on)"
                if self.wrapped
                else ""
            ),
            f"  streams           {self.envs} envs (each row's env stored by cleanbuf clean)"
            if self.env_stored
            else "  streams           linked by content (rows in no env order: each done row's "
            "next observation looked up among every row's observation)"
            if self.linked
            else f"  streams           {self.envs} envs (from the layout)"
            if self.layout != "flat" or self.shape.envs is not None
            else f"  streams           {self.envs} envs, {self.steps} "
            f"{'step' if self.steps == 1 else 'steps'} per env per write"
            if self.layout_found
            else "  streams           not recovered (rows of several envs in no order found); "
            "read as one stream",
            f"  layout            {self._layout_line()}",
            f"  producer          {self.mode}"
            + (", joint resets" if self.joint_reset else "")
            + f" ({self.confidence} confidence: {self.why})",
            f"  episode ends      {self.episodes}",
            f"  reset rows        {self.reset_rows}"
            + (
                f" (and {self.orphan_reset_rows} at an env's oldest row, whose done row the "
                "wrapped buffer overwrote)"
                if self.orphan_reset_rows
                else ""
            ),
            f"  next obs zeros    {self.next_obs_zero}",
            f"  next obs NaN      {self.next_obs_nan}",
            f"  next obs = reset  {self.next_obs_is_reset}",
            f"  recoverable       {self.recoverable + self.final_stored} terminal observations "
            + ("(from final-observation entries)" if self.final_stored else "(from reset rows)"),
            f"  lost for good     {self.lost_for_good}",
        ]
        if self.trailing:
            lines.append(
                f"  end of collection {self.trailing} done rows with no row after them "
                "(undecided: no evidence of joint resets)"
            )
        for name, value in (("is_init", self.is_init_wrong), ("step_count", self.step_count_wrong)):
            if value is not None:
                lines.append(f"  {name + ' wrong':18s}{value} episode first rows")
        if self.clean:
            lines.append("  clean: no auto-reset artifact found")
            if self.next_obs_nan:
                lines.append(
                    f"  ({self.next_obs_nan} terminal observations marked lost: NaN, or -1 "
                    "in every element of integer observations)"
                )
                lines.append(_KEEP_FINAL_OBS)
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

    def _layout_line(self) -> str:
        names = "" if self.name_set == "torchrl" else f", {self.name_set} names"
        why = f": {self.layout_why}" if self.layout_why else ""
        return f"{self.layout or 'unknown'}{names}{why}"

    def _cannot_tell(self) -> str:
        """The report of an audit that cannot tell (exit 3), with what to say."""
        if self.in_memory or self.python is not None:
            how = (
                "cleanbuf.audit(data, layout=...) with layout 'time_first' ([T, E]), "
                "'time_last' ([E, T]) or 'flat' (with envs=N: N envs' rows one after the other)"
            )
        else:
            how = (
                f"cleanbuf audit {shlex.quote(self.source)} --layout flat --envs N (rows of N "
                "envs, one env after the other), or --layout time_first|time_last (arrays "
                "[T, E, ...] or [E, T, ...])"
            )
        return "\n".join(
            [
                f"cleanbuf audit: {self.source} ({self.format})",
                f"  rows              {self.rows}",
                f"  layout            {self._layout_line()}",
                f"  cannot tell: {self.undecided}",
                f"  say how the rows are laid out: {how}",
            ]
        )

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


def clean_name(source: str) -> str:
    """Where the fix writes by default: a sibling of ``source``, same format.

    Examples:
        >>> clean_name("runs/data.npz"), clean_name("d4rl.hdf5"), clean_name("runs/rb/")
        ('runs/data.clean.npz', 'd4rl.clean.hdf5', 'runs/rb.clean')
    """
    source = source.rstrip("/")
    root, ext = os.path.splitext(source)
    if ext in (".npz", ".h5", ".hdf5"):
        return f"{root}.clean{ext}"
    return f"{source}.clean"


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

    Every done row's next observation is read (zeros, NaN or -1 fills); those with a
    row after them are also compared with it (reset row, same-step).
    Appends ``(done rows, followed by a reset row, lost)`` to ``details``.
    ``book`` holds the ``is_init`` / ``step_count`` columns present: the
    first row of each next episode (after its reset row) is checked.
    """
    done = rows.done
    d = positions[done[positions]]
    flat_next = _flat(rows.next_obs(d))
    zero, nan = fill_marks(flat_next)  # (nan: marked missing, NaN or TorchRL's -1 fill)
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
        "final_stored": int((same & ~reset & book["final"][d]).sum()) if "final" in book else 0,
        "recoverable": int(((zero | nan) & reset).sum()),
        # a done row with no row after it (end of collection) is no evidence
        "lost_no_reset": int(((zero | nan) & ~reset & has_next).sum()),
        "trailing": int((~has_next).sum()),
    }


def _flat(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(len(x), int(np.prod(x.shape[1:])))


def audit(
    source: Any,
    *,
    layout: str | None = None,
    envs: int | None = None,
    keys: dict | None = None,
) -> Report:
    """Audits stored transitions for auto-reset artifacts.

    Args:
        source: whatever :func:`cleanbuf.clean` takes: a path (a TorchRL
            ``rb.dumps`` directory, a TensorDict memmap directory, a
            ``.npz`` or HDF5 file), a TorchRL ``ReplayBuffer`` or storage
            (dumped to a temporary directory first; the report names the
            buffer, and its fix is the ``cleanbuf.clean`` call), a dict of
            arrays or a TensorDict (``[N]``, ``[T, E]`` or ``[E, T]``
            leading dims), a Stable-Baselines3 ``ReplayBuffer``, or a
            :class:`Dataset`.
        layout: ``"time_first"`` (``[T, E, ...]``), ``"time_last"``
            (``[E, T, ...]``) or ``"flat"``; None decides from the data.
        envs: with ``layout="flat"``: the rows are this many envs' rows,
            one env after the other.
        keys: ``{role: name}`` for arrays named otherwise than TorchRL,
            CleanRL, offline-RL (D4RL) or Stable-Baselines3 do (roles:
            obs, next_obs, action, reward, done, terminated, truncated).

    Returns:
        The report (a :class:`cleanbuf.offline.Report`): ``print(report)``,
        ``report.to_dict()``, ``report.command()`` (the fix), ``report.clean``
        (False when it found artifacts or cannot tell: ``report.undecided``).

    Raises:
        InputError: an unreadable source, or rows without done flags,
            reward or observations.

    Examples:
        >>> import numpy as np
        >>> t = np.arange(6.0)[:, None] + 100 * np.arange(2.0)  # [T=6, E=2], no episode end
        >>> data = {"obs": t, "next_obs": t + 1, "rewards": np.ones((6, 2)),
        ...         "dones": np.zeros((6, 2), bool)}
        >>> r = audit(data)
        >>> r.layout, r.envs, r.clean
        ('time_first', 2, True)
    """
    shape = Shape(layout, envs, keys)
    if isinstance(source, Dataset):
        return analyse(source)[0]
    if isinstance(source, (str, os.PathLike)):
        return analyse(read(os.fspath(source), shape))[0]
    with tempfile.TemporaryDirectory(prefix="cleanbuf-") as tmp:
        ds, name, python = dataset(source, shape, os.path.join(tmp, "dump"))
        report = analyse(ds)[0]
    # The dump was a means: the report names the buffer, and its fix is a call.
    if python is None:
        return dataclasses.replace(report, source=name, format=IN_MEMORY, in_memory=True)
    return dataclasses.replace(report, source=name, python=python)


def analyse(ds: Dataset) -> tuple[Report, Streams]:
    """:func:`audit`, and the recovered layout (for cleaning)."""
    data = ds.data
    keys = {_tuple(k) for k in data.keys(True, True)}
    if not any(k in keys for k in DONE_KEYS) or ("next", "reward") not in keys:
        raise InputError(
            f"{ds.path}: an audit needs ('next', 'done') (or 'terminated' / 'truncated') and "
            f"('next', 'reward') (the reward tells a reset row); the keys are "
            f"{sorted(keys, key=str)}. Name other arrays with --key ROLE=NAME."
        )
    n = ds.n_rows
    every = np.arange(n)
    base = _base(ds, n)
    if ds.undecided is not None:
        return Report(**base, undecided=ds.undecided), Streams(n, 1, 0, (), 0, found=False)
    done = done_of(keys, lambda k: ds.column(k, every), n)
    reward = ds.column(("next", "reward"), every).reshape(n, -1)[:, 0]
    rows = _rows(ds, observation_key(data), done)
    env = env_if_fresh(ds.env, ds.mark, done)
    streams = recover(rows, ds.chunk, ds.wrapped) if env is None else stored(env)
    if not streams.found:
        why = (
            "which env each row came from: the rows chain neither as one env's nor as "
            "several envs' rows step after step (rows of N envs one env after the "
            "other are N runs, which the data cannot tell from one env's broken run)"
        )
        linked = _linked(rows, reward, done)
        if linked is not None and not linked.get("artifacts"):
            return Report(**{**base, **linked["found"]}), streams
        return Report(**base, undecided=why), streams
    per_env = stream_positions(streams, n)
    if all(len(p) < 2 for p in per_env):
        why = "no env has two rows to compare (one row per env, no chain)"
        return Report(**base, undecided=why), streams
    totals, details = _totals(rows, reward, done, per_env, _book(ds))
    aligned = env is None or ds.layout != "flat"  # a step's rows together (a rectangle's)
    steps_all_done = _joint_steps(done, reward, streams, per_env) if aligned else (0, 0)
    joint_steps, separate_steps = steps_all_done
    mode, joint, confidence, why = _verdict(totals, joint_steps)
    reset_rows = totals.get("reset", 0) if mode == "next_step" else 0
    orphans = np.zeros(0, np.int64)
    if ds.wrapped and mode == "next_step" and confidence == "high":
        firsts = np.array([p[0] for p in per_env if len(p)], np.int64)
        orphans = firsts[(reward[firsts] == 0) & ~done[firsts]]
    found = dict(
        envs=streams.envs,
        # (a rectangle's steps from its shape; env ids read from flat rows tell none)
        steps=streams.steps if env is None else n // streams.envs if aligned else 0,
        head=streams.head,
        layout_found=True,
        env_stored=env is not None and ds.layout == "flat" and ds.shape.envs is None,
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
        final_stored=totals.get("final_stored", 0) if mode == "same_step" else 0,
        is_init_wrong=totals.get("is_init_wrong"),
        step_count_wrong=totals.get("step_count_wrong"),
        joint_steps=joint_steps,
        separate_steps=separate_steps,
        trailing=totals.get("trailing", 0),
        orphan_rows=orphans,
    )
    report = Report(**{**base, **found})
    report.details = [(positions, *detail) for positions, detail in zip(per_env, details)]
    return report, streams


MAX_LINKED = 4_000_000  # rows linked by content at most (a dict of their observations' bytes)


def _linked(rows: Rows, reward: np.ndarray, done: np.ndarray) -> dict | None:
    """The episode ends checked by content, for rows in no env order found (None: too many).

    Rows that the filter stored come in no fixed env order (its reset rows
    dropped, its held rows written a call later), so no layout is found;
    each done row's next observation is looked up among every row's
    observation instead. Clean data stores the terminal state nowhere as
    an observation; next-step data stores it as the reset row's (reward 0,
    not done); same-step data's next observation is the next episode's
    first one, another row's observation. Zero or NaN next observations
    are read as everywhere else.

    Returns:
        ``{"found": report fields, "artifacts": count}``: the counts of the
        episode ends; clean only where every end was checked and none is
        an artifact (else the audit cannot tell: cleaning needs each
        row's env).
    """
    n = rows.n
    if n > MAX_LINKED or not n:
        return None
    index: dict[bytes, int] = {}
    for lo in range(0, n, rows.block):
        block = _flat(rows.obs(np.arange(lo, min(lo + rows.block, n))))
        for i, row in enumerate(block):
            index.setdefault(row.tobytes(), lo + i)
    ends = np.flatnonzero(done)
    nxt = _flat(rows.next_obs(ends))
    nan = np.isnan(nxt).any(1) if nxt.dtype.kind == "f" else np.zeros(len(ends), bool)
    zero = ~nan & (nxt == 0).all(1)
    after = np.array([index.get(row.tobytes(), -1) for row in nxt], np.int64)
    found = after >= 0
    reset = np.zeros(len(ends), bool)
    reset[found] = (reward[after[found]] == 0) & ~done[after[found]]
    same = found & ~reset
    others = ~done
    others[after[reset]] = False
    zero_rate = float(np.mean(reward[others] == 0)) if others.any() else 1.0
    checked = int((~zero & ~nan).sum())
    artifacts = int(reset.sum() + same.sum() + zero.sum())
    confidence = "high" if checked >= 3 and zero_rate < 0.05 else "low"
    why = (
        f"{checked} episode ends checked by content: no done row's next observation is "
        "stored as another row's observation (no reset row, no next episode's first one)"
    )
    return {
        "artifacts": artifacts or (0 if checked else 1),
        "found": dict(
            layout_found=False,
            linked=True,
            mode="disabled",
            confidence=confidence,
            why=why,
            episodes=len(ends),
            next_obs_nan=int(nan.sum()),
        ),
    }


def _base(ds: Dataset, n: int) -> dict:
    """The report's fields known before the rows are read (an undecided report's)."""
    return dict(
        source=ds.path,
        format=ds.format,
        rows=n,
        envs=0,
        steps=0,
        head=0,
        wrapped=ds.wrapped,
        layout_found=False,
        mode="unknown",
        joint_reset=False,
        confidence="low",
        why="",
        episodes=0,
        reset_rows=0,
        next_obs_zero=0,
        next_obs_nan=0,
        next_obs_is_reset=0,
        recoverable=0,
        layout=ds.layout,
        layout_why=ds.layout_why,
        name_set=ds.name_set,
        shape=ds.shape,
    )


def _totals(rows: Rows, reward, done, per_env: list, book: dict) -> tuple[dict, list]:
    """The episode-end counts over every env (:func:`_ends`), and their details."""
    totals: dict[str, Any] = {}
    first_of_episode = np.zeros(rows.n, np.bool_)  # the rows after a done row
    details: list = []
    for positions in per_env:
        first_of_episode[positions[1:][done[positions[:-1]]]] = True
        for k, v in _ends(rows, reward, positions, details, book).items():
            totals[k] = totals.get(k, 0) + v
    others = ~done & ~first_of_episode
    totals["zero_reward_rate"] = float(np.mean(reward[others] == 0)) if others.any() else 1.0
    return totals, details


def _joint_steps(done, reward, streams: Streams, per_env: list) -> tuple[int, int]:
    """Done rows of steps where every env ended: ``(restarted together, reset one by one)``.

    A joint reset is told only by such a step: every env done, every env
    with a row after it, and none of those rows a reset row. The same step
    with a reset row after each done row shows the envs reset one by one
    (no joint reset). Done rows at the end of the data have no row after
    them: no evidence either way.
    """
    if streams.envs < 1:
        return 0, 0
    joint, _ = joint_rows(done, reward == 0, streams, per_env)
    restarted = np.zeros(len(done), np.bool_)  # a row after it, and not a reset row
    reset_after = np.zeros(len(done), np.bool_)  # a row after it, a reset row
    for pos in per_env:
        after = pos[1:]
        restarted[pos[:-1]] = (reward[after] != 0) | done[after]
        reset_after[pos[:-1]] = (reward[after] == 0) & ~done[after]
    return int((joint & restarted).sum()), int((joint & reset_after).sum())


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
    """The ``is_init`` and ``step_count`` columns present, one value a row.

    With them, ``"final"``: per row, whether a same-step final-observation
    entry (``("next", "final_obs")`` and the names in ``FINAL_KEYS``) holds
    its terminal observation: its mask (``("next", "_final_obs")``) where
    stored, else every leaf of the entry neither all zeros nor NaN.
    """
    n, every = ds.n_rows, np.arange(ds.n_rows)
    keys = set(_tuple(k) for k in ds.data.keys(True, True))
    book = {
        name: ds.column((name,), every).reshape(n, -1)[:, 0]
        for name in ("is_init", "step_count")
        if (name,) in keys
    }
    if "is_init" in book:
        book["is_init"] = book["is_init"].astype(bool)
    for prefix in FINAL_KEYS:
        entry = [k for k in keys if k[: len(prefix)] == prefix]
        if not entry:
            continue
        mask = (*prefix[:-1], "_" + prefix[-1])
        if mask in keys:
            book["final"] = ds.column(mask, every).reshape(n, -1).astype(bool).all(1)
        else:
            present = np.ones(n, np.bool_)
            for k in entry:
                x = _flat(ds.column(k, every))
                nan = np.isnan(x).any(1) if x.dtype.kind == "f" else False
                present &= ~nan & (x != 0).any(1)
            book["final"] = present
        break
    return book


def _verdict(t: dict, joint_steps: int = 0) -> tuple[str, bool, str, str]:
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
    joint = mode == "next_step" and lost_alone > 0 and joint_steps > 0
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
