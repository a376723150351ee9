"""The end of collection: the rows a carry still holds, released with what they lack."""

from __future__ import annotations

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from cleanbuf.engine import _checks
from cleanbuf.engine._carry import Carry
from cleanbuf.engine._flags import stored_rows
from cleanbuf.engine._kernels import JOINT_MARK, MARK, MARKED, MARKS_SEEN, WAITING
from cleanbuf.engine._keys import done_flags, observation_keys
from cleanbuf.engine._move import Views
from cleanbuf.engine._options import Options
from cleanbuf.engine._patch import as_td, fill_rows


def flush_carry(options: Options, carry: Carry, stats: dict) -> TensorDictBase:
    """Returns ``carry``'s held rows (flat ``[H]``), forgets them, and counts them.

    A held row waits for the row after it: the reset row holding its
    terminal observation (next-step data), or its successor
    (observation-only data). At a flush that row will not come. A held done
    row whose next observation is stored (read from the data, as
    :func:`~cleanbuf.engine._flags.stored_rows` reads it: a batch-end mark
    still undecided, whose next observation is real) is complete and
    returned as it is; any other held row has lost its next observation,
    and the lost-observation policy applies (counted in
    ``terminal_obs_missing`` for done rows and ``next_obs_missing`` for the
    others). ``carry`` and ``stats`` are updated in place.
    """
    n_held = len(carry.held_stream)
    if n_held == 0:
        return TensorDict({}, batch_size=[0])
    rows = dict(carry.held)  # ours, forgotten below: patched in place
    bookkeeping = {k for k in (options.is_init_key, options.step_count_key) if k}
    obs_keys, obs_only = observation_keys(rows, options.observation_keys, bookkeeping)
    done = done_flags(Views(rows, 1, n_held), options.done_key)
    if obs_only:
        missing = np.ones(n_held, np.bool_)
    elif options.terminal_obs_in_done_row:
        missing = ~done
    else:
        stored = stored_rows(Views(rows, 1, n_held), obs_keys, done)
        missing = ~stored if len(stored) else np.ones(n_held, np.bool_)
    # A batch-end candidate still undecided, whose next observation is not
    # stored. Where the producer showed that it marks batch ends (a mark of
    # the stream turned out to be one), maybe no episode end at all: its
    # next observation is missing. Else a real end, whose terminal
    # observation was zero-filled: lost.
    flags = carry.per_stream[MARKED][carry.held_stream]
    marked = (flags & (MARK | JOINT_MARK)) != 0
    done = done & ~(marked & ((flags & MARKS_SEEN) != 0))
    n_terminal = int((missing & done).sum())
    n_next = int((missing & ~done).sum())
    policy = _checks.lost_policy(options, obs_keys, rows, n_terminal + n_next, False)
    for k in obs_keys:
        nk = ("next", *k)
        if obs_only:
            rows[nk] = torch.zeros_like(rows[k])
        if policy == "nan" and missing.any():
            fill_rows(Views(rows), nk, np.flatnonzero(missing), float("nan"))
    keep = np.flatnonzero(~missing) if policy == "drop" else np.arange(n_held)
    if len(keep) < n_held:
        idx = torch.from_numpy(keep)
        rows = {k: v.index_select(0, idx.to(v.device)) for k, v in rows.items()}
    per_stream = carry.per_stream.copy()
    per_stream[WAITING] = 0
    carry.held, carry.held_stream, carry.per_stream = {}, np.zeros(0, np.int64), per_stream
    stats["rows_out"] += len(keep)
    stats["terminal_obs_missing"] += n_terminal
    stats["next_obs_missing"] += n_next
    stats["lost_rows_dropped"] += n_held - len(keep)
    stats["episodes_completed"] += int((marked & done).sum())  # taken for real ends
    stats["rows_held"] = 0
    return as_td(rows, len(keep))
