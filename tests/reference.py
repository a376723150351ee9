"""A readable, row-by-row reference cleaner, and a generator of synthetic streams.

The reference implements the cleaning rules (the
rules of each mode in ``AutoresetFilter``'s docstring) one stream at a
time, with no batching, no arrays and no cleverness: it is what the kernels are checked
against. The generator simulates next-step producers (plain, or with
TorchRL's joint reset) and same-step producers, and also returns the ground
truth, the stream an explicit-reset run would have produced.

Observations encode their position: the observation of
stream e at step t is ``1000 * e + t``, a terminal observation is
``100_000 + 1000 * e + t``, so a wrong stitch shows in the number itself.
"""

from __future__ import annotations

import math

import numpy as np

FIELDS = (
    "obs",
    "next_obs",
    "reward",
    "done",
    "is_init",
    "step_count",
    "next_step_count",
    "payload",
)
NAN = math.nan


def stored(row):
    """Whether a done row's stored next observation is its terminal one: read
    from the data, neither zero-filled nor NaN (observations here are never 0
    otherwise).
    """
    nxt = row["next_obs"]
    return bool(row["done"]) and nxt != 0 and not math.isnan(nxt)


def reference_clean(rows, *, mode="next_step", obs_only=False, compact=False):
    """Cleans one stream, row by row.

    Args:
        rows: the stream's rows in time order: dicts with the keys of
            ``FIELDS`` plus ``joint`` (a next-step done row whose whole reset
            group was done: no reset row follows), ``mark`` (optional: the
            row's done flag may be only a collector's batch-end truncation
            mark) and, for same-step data, ``final`` / ``final_ok`` (the
            final-observation entry and whether it is there). A row with
            ``is_init`` that is not the expected reset row restarts the
            stream (a collector reset).
        mode: "next_step" or "same_step".
        obs_only: the rows' ``next_obs`` is not stored; it comes from the
            next row (or a done row's final entry).
        compact: observation-only output: no ``next_obs`` is written at all.

    A next-step done row whose next observation is :func:`stored` is
    complete: emitted at once, never lost (at a restart, a joint reset or
    the end); only its reset row is dropped.

    Returns:
        The cleaned rows (dicts with the keys of ``FIELDS``; without
        ``next_obs`` when ``compact``). Lost next observations are NaN.
    """
    out = []
    waiting = None  # the row whose next observation is the next row's observation
    reset_row_next = False
    is_init_next = False
    step_shift = 0
    marked = None  # a row whose done flag may be only a mark: the next row decides
    for row in rows:
        ends = row["done"] and not row.get("mark")
        is_reset_row = reset_row_next and row["reward"] == 0 and not ends
        if marked is not None:
            if row["is_init"] and not is_reset_row and not stored(marked):
                # A restart after a mark: the row may have ended (its terminal
                # observation zero-filled) or not; its next observation is unknown.
                marked["next_obs"] = NAN
            out.append(marked)
            marked = None
        if row["is_init"] and not is_reset_row:
            # A restart: the row waiting for this one lost its next observation.
            if waiting is not None:
                waiting["next_obs"] = NAN
                out.append(waiting)
                waiting = None
            reset_row_next = is_init_next = False
            step_shift = 0
        if waiting is not None:
            waiting["next_obs"] = row["obs"]
            out.append(waiting)
            waiting = None
        if reset_row_next:
            # A next-step reset row: it carried the terminal observation; drop it.
            assert is_reset_row, "not a reset row"
            reset_row_next = False
            is_init_next = True  # the next row starts the new episode
            step_shift = 1  # the reset row consumed one step of StepCounter
            continue
        row = {k: row[k] for k in FIELDS} | {k: row.get(k) for k in ("joint", "final", "final_ok")}
        if is_init_next:
            row["is_init"] = True
            is_init_next = False
        row["step_count"] -= step_shift
        row["next_step_count"] -= step_shift
        joint, final, final_ok = row.pop("joint"), row.pop("final"), row.pop("final_ok")
        if ends:
            step_shift = 0
        if row["done"] and not ends:
            marked = row  # kept as stored unless a restart comes next
            continue
        if compact:
            del row["next_obs"]
            reset_row_next = mode == "next_step" and row["done"] and not joint
            out.append(row)
            continue
        if row["done"]:
            if mode == "same_step":
                row["next_obs"] = final if final_ok else NAN
                out.append(row)
            elif joint:
                if obs_only or not stored(row):
                    row["next_obs"] = NAN  # the joint reset lost it for good
                out.append(row)
            elif not obs_only and stored(row):
                reset_row_next = True
                out.append(row)  # complete: only its reset row goes
            else:
                reset_row_next = True
                waiting = row  # its reset row holds the terminal observation
            continue
        if obs_only:
            waiting = row
            continue
        out.append(row)
    if waiting is not None:  # its next observation never came
        waiting["next_obs"] = NAN
        out.append(waiting)
    if marked is not None:  # still undecided at the flush: kept if stored
        if obs_only or not stored(marked):
            marked["next_obs"] = NAN
        out.append(marked)
    return out


def simulate(
    rng,
    n_streams,
    steps,
    *,
    mode="next_step",
    group=None,
    zero_fill=True,
    max_len=6,
    final_missing=0.0,
    restart_at=(),
    mark_every=0,
):
    """Simulates an auto-resetting producer.

    Args:
        rng: a numpy Generator.
        n_streams: number of streams (envs).
        steps: time steps to simulate.
        mode: "next_step" (a reset row after each done row) or "same_step"
            (the done row's next observation is the reset observation; the
            terminal one is in ``final``).
        group: next-step only: reset-group size for TorchRL's joint reset
            (None: a reset row after every done row).
        zero_fill: next-step only: the done row's next observation is zero
            (TorchRL) rather than the terminal observation (raw loops); a
            float: the chance of that, per done row (read per row).
        max_len: longest episode.
        final_missing: same-step only: chance that a done row has no final
            observation.
        restart_at: steps at which every env is reset by the collector (a
            restart: a fresh observation ``50_000 + 1000 * e + t``, is_init,
            step count 0); a reset row due then is discarded with it.
        mark_every: next-step only: a collector's batch-end mark on every
            ``mark_every``-th step (done and truncated set on top of what the
            env said; ``terminated`` keeps the env's own end).

    Returns:
        ``(raw, truth)``: per stream, the produced rows and the rows an
        explicit-reset run gives (terminal observations that the producer
        lost are NaN: zero-filled with no reset row after them; a stored
        one is never lost).
    """
    raw = [[] for _ in range(n_streams)]
    truth = [[] for _ in range(n_streams)]
    remaining = rng.integers(1, max_len + 1, n_streams)
    reset_due = np.zeros(n_streams, bool)
    fresh = np.ones(n_streams, bool)  # next real row starts an episode
    count = np.zeros(n_streams, np.int64)  # the producer's StepCounter
    true_count = np.zeros(n_streams, np.int64)
    for t in range(steps):
        done_now = np.zeros(n_streams, bool)
        truth_now = [None] * n_streams
        mark = bool(mark_every) and t % mark_every == mark_every - 1
        if t in restart_at:
            for e in range(n_streams):
                if reset_due[e] and raw[e][-1]["zeroed"]:
                    truth[e][-1]["next_obs"] = NAN  # the reset discarded its reset row
            reset_due[:] = False
            fresh[:] = True
            count[:] = 0
            remaining = rng.integers(1, max_len + 1, n_streams)
        for e in range(n_streams):
            obs = float(1000 * e + t) + (50_000 if t in restart_at else 0)
            if reset_due[e]:
                row = dict(
                    obs=raw[e][-1]["terminal"],
                    next_obs=float(1000 * e + t + 1),
                    reward=0.0,
                    done=mark,
                    is_init=True,
                    step_count=0,
                    next_step_count=1,
                    payload=float(-obs),
                )
                raw[e].append(_with_flags(row, mark=mark))
                reset_due[e] = False
                fresh[e] = True
                count[e] = 1
                continue
            if fresh[e]:
                true_count[e] = 0
            remaining[e] -= 1
            done = bool(remaining[e] == 0)
            terminal = float(100_000 + 1000 * e + t)
            true_next = terminal if done else float(1000 * e + t + 1)
            zeroed = False
            if not done:
                stored_next = true_next
            elif mode == "same_step":
                stored_next = float(1000 * e + t + 1)  # the reset observation
            else:
                zeroed = bool(zero_fill is True or (zero_fill and rng.random() < zero_fill))
                stored_next = 0.0 if zeroed else terminal
            final_ok = mode == "same_step" and done and rng.random() >= final_missing
            row = dict(
                obs=obs,
                next_obs=stored_next,
                reward=1.0,
                done=done or mark,
                is_init=bool(fresh[e] and count[e] == 0),
                step_count=int(count[e]),
                next_step_count=int(count[e] + 1),
                payload=float(-obs),
            )
            raw[e].append(
                _with_flags(
                    row,
                    terminal=terminal,
                    final=terminal if final_ok else 0.0,
                    final_ok=final_ok,
                    mark=mark and not done,
                    zeroed=zeroed,
                )
            )
            true_row = dict(
                obs=obs,
                next_obs=true_next,
                reward=1.0,
                done=done or mark,
                is_init=bool(fresh[e]),
                step_count=int(true_count[e]),
                next_step_count=int(true_count[e] + 1),
                payload=float(-obs),
            )
            if mode == "same_step" and done and not final_ok:
                true_row["next_obs"] = NAN
            truth[e].append(true_row)
            truth_now[e] = true_row
            fresh[e] = False
            count[e] += 1
            true_count[e] += 1
            done_now[e] = done
            if done:
                remaining[e] = rng.integers(1, max_len + 1)
        for e in np.flatnonzero(done_now):
            if mode == "same_step":
                fresh[e] = True
                count[e] = 0
                continue
            lo = (e // group) * group if group else e
            if group is not None and done_now[lo : lo + group].all():
                raw[e][-1]["joint"] = True
                if raw[e][-1]["zeroed"]:
                    truth_now[e]["next_obs"] = NAN
                fresh[e] = True
                count[e] = 0
            else:
                reset_due[e] = True
    for e in range(n_streams):
        if reset_due[e] and raw[e][-1]["zeroed"]:
            truth[e][-1]["next_obs"] = NAN  # its reset row never arrived: lost at flush
    return raw, truth


def _with_flags(row, terminal=None, final=0.0, final_ok=False, mark=False, zeroed=False):
    return row | dict(
        joint=False, terminal=terminal, final=final, final_ok=final_ok, mark=mark, zeroed=zeroed
    )
