"""What ``cleanbuf check`` counts and compares, and its report.

A producer's rows are aligned with the truth env by env: its ``k``-th real
row (reset rows aside) is the truth's row ``k``. Everything it stores
wrong is counted on that alignment (:func:`count_stored`); its cleaned
rows are compared with the truth's, row for row within each env
(:func:`compare_cleaned`). :class:`CheckReport` holds one
:class:`ProducerResult` per producer and prints the table.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

STREAM = "env_id"
OBS = ("observation",)
NEXT_OBS = ("next", "observation")
# The keys compared with the truth, when the rows hold them.
COMPARED = (
    "observation",
    "action",
    ("next", "observation"),
    ("next", "reward"),
    ("next", "terminated"),
    ("next", "truncated"),
    ("next", "done"),
    "is_init",
    "step_count",
)
WHY_LOST = {
    "joint": "all envs done on the same step: TorchRL reset them together",
    "end": "done on the last step: the row that holds it was never collected",
    "filled": (
        "the env resets inside its step, and TorchRL's AutoResetTransform fills the done "
        "step's next observation with NaN, keeping only the reset one"
    ),
}
# Stable-Baselines3 sets infos[i]["TimeLimit.truncated"] only when the step did not
# also terminate: a step that did both comes back terminated, not truncated.
SB3_BOTH = "sb3-dummy"


@dataclasses.dataclass
class ProducerResult:
    """One producer's line of the table.

    Attributes:
        producer: its name.
        description: what it is, in words.
        rows: rows it stored.
        reset_rows: bogus reset rows among them (a reset step's row).
        done_rows: real rows that end an episode.
        terminal_zero: done rows whose next observation is zero-filled.
        terminal_nan: done rows whose next observation is NaN.
        terminal_reset_obs: done rows whose next observation is the next
            episode's first observation.
        terminal_other: done rows whose next observation is wrong otherwise.
        truncation_as_termination: truncations the producer flags as
            terminations.
        wrong_init_or_step: real rows whose ``is_init`` or ``step_count``
            differs from the truth (None: the rows hold neither).
        cleaned_rows: rows after cleaning.
        differ: cleaned rows unlike the truth's (rows missing or extra
            count one each).
        lost: terminal observations lost for good (NaN after cleaning).
        lost_why: the count of lost ones by reason (a key of ``WHY_LOST``).
        truncation_flags_lost: steps that both terminated and truncated
            whose truncation the producer does not report (Stable-Baselines3);
            not a difference of the cleaning.
        clean_seconds: the time the cleaning took.
        collect_seconds: the time the collection took.
        options: how the cleaning was configured (the filter's repr).
        repair: for ``[E, T]`` batches (TorchRL), what ``RolloutRepair``
            gave: ``rows``, ``masked``, ``differ``, ``lost``,
            ``differences`` (its valid rows against the truth); else None.
        differences: the first differing rows (env, row, key, want, got).
    """

    producer: str
    description: str
    rows: int
    reset_rows: int
    done_rows: int
    terminal_zero: int
    terminal_nan: int
    terminal_reset_obs: int
    terminal_other: int
    truncation_as_termination: int
    wrong_init_or_step: int | None
    cleaned_rows: int
    differ: int
    lost: int
    lost_why: dict
    clean_seconds: float
    collect_seconds: float
    truncation_flags_lost: int = 0
    repair: dict | None = None
    options: str = ""
    differences: list = dataclasses.field(default_factory=list)

    @property
    def differs(self) -> bool:
        """Whether the cleaned rows, or the repaired ones, differ from the truth."""
        return bool(self.differ or (self.repair and self.repair["differ"]))

    @property
    def stored_wrong(self) -> int:
        """Rows stored wrong in any way the table counts."""
        return (
            self.reset_rows
            + self.terminal_zero
            + self.terminal_nan
            + self.terminal_reset_obs
            + self.terminal_other
            + self.truncation_as_termination
            + (self.wrong_init_or_step or 0)
        )


def _flat(td: TensorDict, key: Any, n: int) -> np.ndarray:
    """A key's values, one row each: ``[n, width]`` as float64 (NaN kept); n may be 0."""
    x = td[key]
    return x.reshape(n, math.prod(x.shape[1:])).to(torch.float64).numpy()


def _obs_leaves(td: TensorDict, root: tuple) -> list:
    """The observation leaves under ``root`` (``("observation",)`` or a nested key)."""
    value = td.get(root if len(root) > 1 else root[0])
    if isinstance(value, torch.Tensor):
        return [root]
    return [(*root, *(k if isinstance(k, tuple) else (k,))) for k in value.keys(True, True)]


def obs_columns(td: TensorDict, root: tuple) -> np.ndarray:
    """Every observation leaf, concatenated per row, float64 ``[n, -1]``."""
    n = td.batch_size[0]
    return np.concatenate([_flat(td, k, n) for k in _obs_leaves(td, root)], axis=1)


def count_stored(run: Any, truth: TensorDict) -> dict:
    """Counts what ``run`` stores wrong, against ``truth`` (``[E, steps]``).

    Returns:
        The stored-side fields of :class:`ProducerResult`.
    """
    n_envs = truth.batch_size[0]
    out = {
        "rows": int(run.real.size),
        "reset_rows": int((~run.real).sum()),
        "done_rows": 0,
        "terminal_zero": 0,
        "terminal_nan": 0,
        "terminal_reset_obs": 0,
        "terminal_other": 0,
        "truncation_as_termination": 0,
    }
    keys = set(run.rows.keys(True, True))
    bookkeeping = "is_init" in keys and "step_count" in keys
    wrong_book = 0
    for e in range(n_envs):
        idx = np.flatnonzero(run.real[e])
        got, want = run.rows[e][idx], truth[e][: len(idx)]
        n = len(idx)
        done = want["next", "done"].reshape(n).numpy()
        trunc = (want["next", "truncated"] & ~want["next", "terminated"]).reshape(n).numpy()
        stored_term = run.stored_terminated[e][idx]
        out["truncation_as_termination"] += int((trunc & stored_term).sum())
        next_got, next_want = obs_columns(got, NEXT_OBS), obs_columns(want, NEXT_OBS)
        first_after = obs_columns(
            truth[e], OBS
        )  # row k + 1's observation: the next episode's first
        for k in np.flatnonzero(done):
            s, x = next_got[k], next_want[k]
            out["done_rows"] += 1
            if np.array_equal(s, x):
                continue
            if np.isnan(s).any():
                out["terminal_nan"] += 1
            elif not s.any():
                out["terminal_zero"] += 1
            elif k + 1 < len(first_after) and np.array_equal(s, first_after[k + 1]):
                out["terminal_reset_obs"] += 1
            else:
                out["terminal_other"] += 1
        if bookkeeping:
            bad = np.zeros(n, bool)
            for key in ("is_init", "step_count"):
                bad |= (_flat(got, key, n) != _flat(want, key, n)).any(1)
            wrong_book += int(bad.sum())
    out["wrong_init_or_step"] = wrong_book if bookkeeping else None
    return out


def _lost_reason(run: Any, e: int, k: int) -> str | None:
    """Why env ``e``'s real row ``k`` may have lost its terminal observation, or None."""
    if getattr(run, "filled", False):  # every done row, the last step's included
        return "filled"
    idx = np.flatnonzero(run.real[e])
    t = int(idx[k])
    if run.joint[t]:
        return "joint"
    if t == run.real.shape[1] - 1:
        return "end"
    return None


def compare_cleaned(run: Any, cleaned: TensorDict, truth: TensorDict, limit: int = 20) -> dict:
    """Compares the cleaned rows with the truth, row for row within each env.

    A cleaned row equals the truth's when every key of :data:`COMPARED`
    it holds does (values compared as float64; trajectory ids are not
    compared). A NaN next observation on a done row is a lost terminal
    observation when the producer lost it for good (a joint reset, a done
    row on the last step, or a producer that fills every done row:
    TorchRL's ``AutoResetTransform``); anywhere else it is a difference. Each
    row missing or extra in an env counts as one differing row.

    Returns:
        The cleaned-side fields of :class:`ProducerResult`.
    """
    n_envs = truth.batch_size[0]
    ids = cleaned[STREAM].reshape(-1)
    differ, lost, why, diffs, flags_lost = 0, 0, {}, [], 0
    for e in range(n_envs):
        got = cleaned[ids == e]
        expected = int(run.real[e].sum())
        n = min(len(got), expected)
        if len(got) != expected:
            differ += abs(len(got) - expected)
            diffs.append({"env": e, "row": n, "key": "rows", "want": expected, "got": len(got)})
        got, want = got[:n], truth[e][:n]
        bad = np.zeros(n, bool)
        keys = set(got.keys(True, True))
        for key in COMPARED:
            if key not in keys and not (isinstance(key, tuple) and key in keys):
                continue
            if key in ("observation", ("next", "observation")):
                root = (key,) if isinstance(key, str) else key
                x, y = obs_columns(got, root), obs_columns(want, root)
            else:
                x, y = _flat(got, key, n), _flat(want, key, n)
            if key == ("next", "observation"):
                nan = np.isnan(x).any(1)
                for k in np.flatnonzero(nan):
                    reason = _lost_reason(run, e, int(k))
                    done = bool(want["next", "done"][k].all())
                    if done and reason is not None:
                        lost += 1
                        why[reason] = why.get(reason, 0) + 1
                        x[k] = y[k]  # lost, not different
            if key == ("next", "truncated") and run.producer == SB3_BOTH:
                both = (_flat(want, ("next", "terminated"), n) > 0).all(1) & (y > 0).all(1)
                hidden = both & (x == 0).all(1)
                flags_lost += int(hidden.sum())
                x[hidden] = y[hidden]  # the producer never said it
            unlike = ~((x == y) | (np.isnan(x) & np.isnan(y))).all(1)
            for k in np.flatnonzero(unlike & ~bad)[: max(0, limit - len(diffs))]:
                name = key if isinstance(key, str) else "/".join(key)
                diffs.append(
                    {
                        "env": e,
                        "row": int(k),
                        "key": name,
                        "want": y[k].tolist(),
                        "got": x[k].tolist(),
                    }
                )
            bad |= unlike
        differ += int(bad.sum())
    return {
        "cleaned_rows": int(len(cleaned)),
        "differ": differ,
        "lost": lost,
        "lost_why": why,
        "differences": diffs[:limit],
        "truncation_flags_lost": flags_lost,
    }


def first_truth_difference(a: TensorDict, b: TensorDict) -> str | None:
    """Where two truth runs differ first (env, row, key), or None when they are equal."""
    n_envs, steps = a.batch_size
    for e in range(n_envs):
        for key in COMPARED:
            x, y = _flat(a[e], key, steps), _flat(b[e], key, steps)
            unlike = np.flatnonzero(~((x == y) | (np.isnan(x) & np.isnan(y))).all(1))
            if len(unlike):
                name = key if isinstance(key, str) else "/".join(key)
                return f"env {e}, step {int(unlike[0])}, {name}"
    return None


@dataclasses.dataclass
class CheckReport:
    """What :func:`check` found: one :class:`ProducerResult` per producer, and the verdict.

    ``str(report)`` is the table ``cleanbuf check`` prints; :attr:`status`
    its exit status.

    Attributes:
        env: the env checked (a Gymnasium id or ``module:function``).
        num_envs: sub-envs per producer.
        steps: steps per producer (and of the truth).
        seed: sub-env ``e`` started from ``reset(seed=seed + e)``.
        max_episode_steps: the time limit put on each sub-env, or None.
        truth_episode_ends: episode ends in the truth.
        truth_truncations: of which truncations.
        producers: one result per producer run, in order.
        not_run: producers not run, with why.
        not_reproducible: where two truth runs differ (None: they are equal).
        cleaning: the cleaning checked.
        reproducer: the reproducer file written (status 1), else None.
        replay: the command that replays it, else None.
        steps_asked: the steps asked for (``steps`` is more where the
            truth was run longer until every env ended an episode).
        time_limit: the sub-envs' time limit (the env's own or
            ``max_episode_steps``), None without one.
        unseen: what the truth did not show (an env that ended no
            episode), with the settings that would show it; then nothing
            was compared (status 3). None: every env ended an episode.
    """

    env: str
    num_envs: int
    steps: int
    seed: int
    max_episode_steps: int | None
    truth_episode_ends: int
    truth_truncations: int
    producers: list
    not_run: dict
    not_reproducible: str | None
    cleaning: str
    reproducer: str | None = None
    replay: str | None = None
    steps_asked: int | None = None
    time_limit: int | None = None
    unseen: str | None = None
    timelines: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def status(self) -> int:
        """The exit status: 0 equal, 1 a difference, 3 not reproducible or nothing seen."""
        if self.not_reproducible is not None or self.unseen is not None:
            return 3
        return 1 if any(p.differs for p in self.producers) else 0

    def to_dict(self) -> dict:
        """The report as plain values (``cleanbuf check --json``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del out["timelines"]
        out["producers"] = [dataclasses.asdict(p) for p in self.producers]
        out["status"] = self.status
        return out

    def __str__(self) -> str:
        return "\n".join(line.rstrip() for line in _render(self))

    def plot(self, path: str) -> None:
        """Draws env 0's rows as each producer stored them, against the truth (matplotlib)."""
        from cleanbuf.check.plot import figure

        fig = figure(self)
        fig.savefig(path, dpi=110)
        import matplotlib.pyplot as plt

        plt.close(fig)


# The table: (header, width, value).
_COLUMNS = (
    ("rows", 6, lambda p: p.rows),
    ("reset", 6, lambda p: p.reset_rows),
    ("zeroed", 7, lambda p: p.terminal_zero),
    ("NaN", 5, lambda p: p.terminal_nan),
    ("=reset", 7, lambda p: p.terminal_reset_obs + p.terminal_other),
    ("trunc>term", 11, lambda p: p.truncation_as_termination),
    ("init/step", 10, lambda p: "-" if p.wrong_init_or_step is None else p.wrong_init_or_step),
)
_CLEANED = (
    ("rows", 6, lambda p: p.cleaned_rows),
    ("differ", 7, lambda p: p.differ),
    ("lost", 5, lambda p: p.lost),
    ("time", 8, lambda p: f"{p.clean_seconds * 1e3:.0f} ms"),
)
LEGEND = (
    "reset: bogus reset rows; zeroed / NaN / =reset: terminal observations stored as zeros, NaN "
    "or the next episode's first; trunc>term: truncations flagged as terminations; init/step: "
    "wrong is_init or step_count (-: not stored); differ: cleaned rows unlike the truth; lost: "
    "terminal observations lost for good (NaN); time: the cleaning's."
)


def _table(report: CheckReport) -> list[str]:
    width = max([len("producer"), *(len(p.producer) for p in report.producers)]) + 1
    left = sum(w for _, w, _ in _COLUMNS)
    right = sum(w for _, w, _ in _CLEANED)
    lines = [
        " " * width
        + " as stored ".center(left, "-")
        + " | "
        + " cleaned by cleanbuf ".center(right, "-")
    ]
    head = "producer".ljust(width) + "".join(c[0].rjust(c[1]) for c in _COLUMNS)
    lines.append(head + " | " + "".join(c[0].rjust(c[1]) for c in _CLEANED))
    for p in report.producers:
        line = p.producer.ljust(width) + "".join(str(c[2](p)).rjust(c[1]) for c in _COLUMNS)
        lines.append(line + " | " + "".join(str(c[2](p)).rjust(c[1]) for c in _CLEANED))
    return lines


def _repair_lines(report: CheckReport) -> list[str]:
    """The on-policy check: RolloutRepair's valid rows against the truth."""
    with_repair = [p for p in report.producers if p.repair]
    if not with_repair:
        return []
    lines = ["", "on-policy, [E, T] batches through RolloutRepair.for_env(env), time axis kept:"]
    for p in with_repair:
        r = p.repair
        lines.append(
            f"  {p.producer}: {r['rows']} rows, {r['masked']} masked, {r['rows'] - r['masked']} "
            f"valid: {r['differ']} differ from the truth, {r['lost']} lost"
        )
    return lines


def _advice(report: CheckReport) -> list[str]:
    """Plain words: which producer to prefer, and what to pass."""
    ps = report.producers
    # (a producer whose cleaned rows differ from the truth is never preferred)
    clean = [p.producer for p in ps if p.stored_wrong == 0 and p.lost == 0 and not p.differs]
    whole = [p.producer for p in ps if p.lost == 0 and not p.differs]
    out = []
    if clean:
        out.append(f"Prefer {', '.join(clean)}: nothing stored wrong, nothing to clean.")
    elif whole:
        out.append(f"Prefer {', '.join(whole)}: cleaned, nothing is lost.")
    needs = [p for p in ps if p.stored_wrong and p.lost == 0 and not p.differs]
    if needs:
        names = ", ".join(p.producer for p in needs)
        out.append(
            f"{names}: pass transform=AutoresetFilter.for_env(env) to the buffer "
            "(on-policy: RolloutRepair.for_env(env)); it gives back the truth's rows."
        )
    for p in ps:
        if p.lost_why.get("joint"):
            out.append(
                f"{p.producer}: {p.lost_why['joint']} terminal observation(s) lost for good "
                f"({WHY_LOST['joint']}; fixed-horizon tasks: every episode). Use "
                f"cleanbuf.lossless_gym_env(name, num_envs={report.num_envs}) instead, or "
                'AutoresetFilter.for_env(env, on_lost_terminal_obs="drop") to leave those '
                "rows out."
            )
        if p.lost_why.get("filled"):
            out.append(
                f"{p.producer}: every terminal observation ({p.lost_why['filled']}) lost for "
                f"good: {WHY_LOST['filled']}. No option of cleanbuf gives them back: "
                "AutoresetFilter.for_env(env) keeps those rows NaN and counts them, "
                'on_lost_terminal_obs="drop" leaves them out (RolloutRepair: masked). To keep '
                "them, do not reset inside the step: a SerialEnv / ParallelEnv of single envs "
                "that TorchRL resets (torchrl-serial), or "
                f"cleanbuf.lossless_gym_env(name, num_envs={report.num_envs})."
            )
        if p.lost_why.get("end"):
            out.append(
                f"{p.producer}: {p.lost_why['end']} done row(s) on the last step: "
                f"{WHY_LOST['end']} (a longer run keeps them)."
            )
        if p.truncation_flags_lost:
            out.append(
                f"{p.producer}: {p.truncation_flags_lost} step(s) ended both ways (terminated "
                "and truncated); its infos[i]['TimeLimit.truncated'] is set only when not "
                "terminated, so those rows stay terminated, not truncated (harmless for "
                "bootstrapping: a termination wins)."
            )
        if p.truncation_as_termination:
            out.append(
                f"{p.producer}: its dones flag {p.truncation_as_termination} truncation(s) as "
                "terminations; the truncation is in infos[i]['TimeLimit.truncated']: "
                "step_rows(obs, action, next_obs, rewards, dones, None, infos) reads it."
            )
    return out


def _verdict(report: CheckReport) -> list[str]:
    if report.unseen is not None:
        return [f"NO VERDICT: {report.unseen}"]
    if report.status == 3:
        return [
            f"NOT REPRODUCIBLE: {report.env} is not reproducible under seeds: two runs with "
            f"explicit resets, the same seeds and the same actions differ (first at "
            f"{report.not_reproducible}). Nothing was compared. Check that the env's reset(seed=) "
            "seeds every source of randomness it uses (self.np_random, not the random module, "
            "np.random or torch's global generator), and that nothing else (the time, a file, "
            "a counter kept across instances) changes its steps."
        ]
    lost = sum(p.lost for p in report.producers)
    if report.status == 0:
        note = f" ({lost} lost terminal observation(s) marked NaN, counted above)" if lost else ""
        skipped = ", ".join(report.not_run)
        skipped = f"; not compared: {skipped} (why above)" if skipped else ""
        return [
            f"Verdict: every producer's cleaned rows equal the explicit-reset run, row for "
            f"row within each env{note}{skipped}. Exit 0."
        ]
    lines = []
    for p in report.producers:
        for what, n, diffs in (
            ("cleaned", p.differ, p.differences),
            (
                "RolloutRepair's valid",
                p.repair["differ"] if p.repair else 0,
                p.repair["differences"] if p.repair else [],
            ),
        ):
            if not n:
                continue
            lines.append(
                f"DIFFERENCE: {p.producer}: {n} {what} row(s) unlike the explicit-reset run"
            )
            for d in diffs[:3]:
                if d["key"] == "rows":
                    lines.append(f"  env {d['env']}: {d['got']} rows, the truth {d['want']}")
                    continue
                lines.append(
                    f"  env {d['env']}, row {d['row']}, {d['key']}: "
                    f"want {_short(d['want'])}, got {_short(d['got'])}"
                )
    if report.reproducer:
        lines.append(f"Reproducer written: {report.reproducer}")
        lines.append(f"Replay it: {report.replay}")
    return lines


def _short(value: Any) -> str:
    if isinstance(value, list):
        return (
            "[" + ", ".join(f"{v:.4g}" for v in value[:4]) + (", ...]" if len(value) > 4 else "]")
        )
    return str(value)


def _render(report: CheckReport) -> list[str]:
    limit = "" if report.max_episode_steps is None else f", time limit {report.max_episode_steps}"
    longer = ""
    if report.steps_asked is not None and report.steps != report.steps_asked:
        longer = f" ({report.steps_asked} asked: run until every env ended an episode)"
    trunc = f"{report.truth_truncations} truncations"
    if report.time_limit is not None and not report.truth_truncations:
        trunc += f": time limit {report.time_limit} never reached"
    lines = [
        f"cleanbuf check {report.env}: {report.num_envs} envs x {report.steps} steps{longer}, "
        f"seed {report.seed}{limit}, seeded random actions",
        f"truth (explicit resets, same seeds and actions): "
        f"{report.num_envs * report.steps} rows, {report.truth_episode_ends} episode ends "
        f"({trunc})",
    ]
    if report.status == 3:
        return _wrap([*lines, "", *_verdict(report)])
    lines += ["", *_table(report), *_repair_lines(report), "", LEGEND]
    if report.cleaning != "AutoresetFilter.for_env(producer)":
        lines.append(f"cleaned by {report.cleaning}")
    named = "; ".join(f"{p.producer}: {p.description}" for p in report.producers)
    lines += ["", f"{named}."]
    for name, why in report.not_run.items():
        lines.append(f"{name}: not compared: {why}")
    lines.append("")
    lines += _advice(report)
    return _wrap([*lines, "", *_verdict(report)])


def _wrap(lines: list[str], width: int = 100) -> list[str]:
    """Wraps the prose lines (not the table's) at ``width``."""
    import textwrap

    out = []
    for line in lines:
        if len(line) <= width or "|" in line or line.startswith(("Replay it: ", "Reproducer")):
            out.append(line)
        else:
            indent = "  " if line.startswith("  ") else ""
            out += textwrap.wrap(
                line, width, subsequent_indent=indent + "  ", break_on_hyphens=False
            )
    return out
