"""A readable, row-by-row reference cleaner, and a generator of synthetic streams.

The reference implements DESIGN.md's next-step rules one stream at a time,
with no batching, no arrays and no cleverness: it is what the kernels are
checked against. The generator simulates next-step producers (plain, or with
TorchRL's joint reset) and also returns the ground truth, the stream an
explicit-reset run would have produced.

Observations encode their position (DESIGN.md, "Style"): the observation of
stream e at step t is ``1000 * e + t``, a terminal observation is
``100_000 + 1000 * e + t``, so a wrong stitch shows in the number itself.
"""

from __future__ import annotations

import math

import numpy as np

FIELDS = ("obs", "next_obs", "reward", "done", "is_init", "step_count", "next_step_count", "payload")


def reference_clean(rows, *, flush_lost):
    """Cleans one stream of next-step rows, row by row.

    Args:
        rows: the stream's rows in time order, dicts with the keys of
            ``FIELDS`` plus ``joint`` (a done row whose whole reset group was
            done at that step: no reset row follows it).
        flush_lost: whether a done row still waiting for its reset row at the
            end has lost its terminal observation (TorchRL zero-fills it) or
            already holds it (raw loops).

    Returns:
        The cleaned rows (dicts with the keys of ``FIELDS``).
    """
    out = []
    waiting = None  # the done row whose reset row comes next
    is_init_next = False
    step_shift = 0
    for row in rows:
        if waiting is not None:
            # A reset row: it carries the terminal observation; drop it.
            assert row["reward"] == 0 and not row["done"], "not a reset row"
            waiting["next_obs"] = row["obs"]
            out.append(waiting)
            waiting = None
            is_init_next = True  # the next row starts the new episode
            step_shift = 1  # the reset row consumed one step of StepCounter
            continue
        row = {k: row[k] for k in FIELDS} | {"joint": row["joint"]}
        if is_init_next:
            row["is_init"] = True
            is_init_next = False
        row["step_count"] -= step_shift
        row["next_step_count"] -= step_shift
        joint = row.pop("joint")
        if row["done"]:
            step_shift = 0
            if joint:
                row["next_obs"] = math.nan  # lost for good
                out.append(row)
            else:
                waiting = row
            continue
        out.append(row)
    if waiting is not None:
        if flush_lost:
            waiting["next_obs"] = math.nan
        out.append(waiting)
    return out


def simulate(rng, n_streams, steps, *, group=None, zero_fill=True, max_len=6):
    """Simulates a next-step producer.

    Args:
        rng: a numpy Generator.
        n_streams: number of streams (envs).
        steps: time steps to simulate.
        group: reset-group size for TorchRL's joint reset (None: plain
            next-step, a reset row after every done row).
        zero_fill: the done row's next observation is zero (TorchRL) rather
            than the terminal observation (raw Gymnasium / EnvPool loops).
        max_len: longest episode.

    Returns:
        ``(raw, truth)``: per stream, the produced rows (with ``joint``) and
        the rows an explicit-reset run gives (terminal observations that a
        joint reset lost are NaN; an episode still waiting for its reset row
        at the end keeps what the producer put in its done row, NaN when
        zero-filled).
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
        rows_now = []
        for e in range(n_streams):
            obs = float(1000 * e + t)
            if reset_due[e]:
                prev = raw[e][-1]
                row = dict(obs=prev["terminal"], next_obs=float(1000 * e + t + 1), reward=0.0,
                           done=False, is_init=True, step_count=0, next_step_count=1,
                           payload=float(-obs), joint=False)
                reset_due[e] = False
                fresh[e] = True
                count[e] = 1
                raw[e].append(row)
                rows_now.append(None)
                continue
            if fresh[e]:
                true_count[e] = 0
            remaining[e] -= 1
            done = remaining[e] == 0
            terminal = float(100_000 + 1000 * e + t)
            next_obs = terminal if done else float(1000 * e + t + 1)
            stored_next = 0.0 if (done and zero_fill) else next_obs
            is_init = bool(fresh[e] and count[e] == 0)
            row = dict(obs=obs, next_obs=stored_next, reward=1.0, done=bool(done),
                       is_init=is_init, step_count=int(count[e]),
                       next_step_count=int(count[e] + 1), payload=float(-obs),
                       joint=False, terminal=terminal)
            true_row = dict(obs=obs, next_obs=next_obs, reward=1.0, done=bool(done),
                            is_init=bool(fresh[e]), step_count=int(true_count[e]),
                            next_step_count=int(true_count[e] + 1), payload=float(-obs))
            fresh[e] = False
            count[e] += 1
            true_count[e] += 1
            raw[e].append(row)
            truth[e].append(true_row)
            rows_now.append(true_row)
            done_now[e] = done
            if done:
                remaining[e] = rng.integers(1, max_len + 1)
        for e in range(n_streams):
            if not done_now[e]:
                continue
            joint = group is not None and done_now[(e // group) * group:(e // group + 1) * group].all()
            if joint:
                raw[e][-1]["joint"] = True
                rows_now[e]["next_obs"] = math.nan
                fresh[e] = True
                count[e] = 0
            else:
                reset_due[e] = True
    for e in range(n_streams):
        if reset_due[e] and zero_fill:
            truth[e][-1]["next_obs"] = math.nan  # never arrived: lost at flush
    return raw, truth
