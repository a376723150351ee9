"""What ``cleanbuf check`` counts, compares and prints.

A producer's rows are aligned with the truth env by env: its ``k``-th real
row (reset rows aside) is the truth's row ``k``. Everything it stores
wrong is counted on that alignment (:func:`count_stored`); its cleaned
rows are compared with the truth's, row for row within each env
(:func:`compare_cleaned`).
"""

from __future__ import annotations

import dataclasses
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
    """A key's values, one row each: ``[n, -1]`` as float64 (NaN kept)."""
    return td[key].reshape(n, -1).to(torch.float64).numpy()


def _obs_leaves(td: TensorDict, root: tuple) -> list:
    """The observation leaves under ``root`` (``("observation",)`` or a nested key)."""
    value = td.get(root if len(root) > 1 else root[0])
    if isinstance(value, torch.Tensor):
        return [root]
    return [(*root, *(k if isinstance(k, tuple) else (k,))) for k in value.keys(True, True)]


def _obs(td: TensorDict, root: tuple) -> np.ndarray:
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
        next_got, next_want = _obs(got, NEXT_OBS), _obs(want, NEXT_OBS)
        first_after = _obs(truth[e], OBS)  # row k + 1's observation: the next episode's first
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
    observation when the producer lost it for good (a joint reset, or a
    done row on the last step); anywhere else it is a difference. Each
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
                x, y = _obs(got, root), _obs(want, root)
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
