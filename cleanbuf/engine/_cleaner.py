"""The stateful cleaner: TensorDict in, flat cleaned rows out.

A call reads like this (:meth:`Cleaner._clean`):

1. **read** the batch (:mod:`cleanbuf.engine._read`): its layout (which rows
   belong to which stream), its done flags and observation keys, the rows
   that restart a stream, its stream ends (one kernel pass), and check them
   all; a batch with nothing to clean passes through as views;
2. **plan** it with the numba kernel, from flags only
   (:mod:`cleanbuf.engine._kernels`): which rows to drop, hold or emit, and where
   each next observation comes from;
3. **release** the rows held by earlier calls that this call completes;
4. **move** the kept rows into fresh tensors;
5. **patch** their next observations and bookkeeping (never the caller's
   batch);
6. **commit** the carry state and the counters.

Everything that raises does so before the commit, so a failed call changes
nothing. Around a call, :meth:`Cleaner.__call__` picks the producer's carry
(``producer_key``, :mod:`cleanbuf.engine._groups`) and goes back to before the last
call when that call's batch comes again (:mod:`cleanbuf.engine._retry`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from cleanbuf.engine import _checks
from cleanbuf.engine._carry import Carry
from cleanbuf.engine._errors import (
    CleanbufError,
    ContinuityError,
    LayoutError,
    ResetRowError,
    StateError,
)
from cleanbuf.engine._flush import flush_carry
from cleanbuf.engine._groups import clean_routed, producer_key
from cleanbuf.engine._kernels import NEED_INIT, PENDING, Selection, plan_rows
from cleanbuf.engine._move import Views
from cleanbuf.engine._options import LOST_POLICIES, Options
from cleanbuf.engine._patch import as_td, fix_bookkeeping, move, write_next_obs
from cleanbuf.engine._pool import BufferPool
from cleanbuf.engine._read import Call, Reader
from cleanbuf.engine._release import Release, kept_held
from cleanbuf.engine._retry import Undo, call_with_retry

STAT_NAMES = (
    "rows_in",
    "rows_out",
    "reset_rows_dropped",
    "next_obs_restitched",
    "terminal_obs_missing",
    "next_obs_missing",
    "lost_rows_dropped",
    "rows_held",
    "episodes_completed",
)


class _Plan(NamedTuple):
    """What the kernel planned for a call, and what it means for the held rows."""

    sel: Selection
    released_src: np.ndarray
    per_stream: np.ndarray
    n_drop: int
    n_lost: int
    n_next_lost: int
    n_done: int
    release: Release
    policy: str


class Cleaner:
    """Cleans auto-reset data, call after call, keeping the carry state.

    This is the engine behind :class:`cleanbuf.AutoresetFilter` and
    :func:`cleanbuf.clean`; the options are documented there.

    Args:
        options: the validated options.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from cleanbuf.engine._options import LOST_POLICIES, Options
        >>> obs = torch.tensor([[0.0], [1.0], [2.0], [10.0], [11.0]])
        >>> data = TensorDict({
        ...     "observation": obs,
        ...     ("next", "observation"): torch.tensor([[1.0], [2.0], [0.0], [11.0], [12.0]]),
        ...     ("next", "reward"): torch.tensor([[1.0], [1.0], [1.0], [0.0], [1.0]]),
        ...     ("next", "done"): torch.tensor([[False], [False], [True], [False], [False]]),
        ... }, batch_size=[5]).refine_names("time")
        >>> out = Cleaner(Options.build("next_step"))(data)
        >>> out["next", "observation"].flatten().tolist()  # terminal obs 10 restored
        [1.0, 2.0, 10.0, 12.0]
    """

    def __init__(self, options: Options, pool: BufferPool | None = None):
        self.options = options
        self._carry = Carry()
        # With producer_key: one carry per producer (worker); self._carry is
        # the one of the producer of the call in progress.
        self._groups: list[Carry] = []
        # Batches may come from several producers whose trajectory ids can
        # collide (Ray collectors, each with its own pool): told apart by
        # their ids and observations, a batch continuing none starts a new
        # producer. Set by the filter inside a Ray actor.
        self.many_producers = False
        self._undo: Undo | None = None  # before the last call (see __call__)
        self._stats = dict.fromkeys(STAT_NAMES, 0)
        self._pool = BufferPool() if pool is None else pool  # where large outputs go
        self._reader = Reader(options)

    @property
    def stats(self) -> dict:
        """A copy of the counters (see ``STAT_NAMES``), as plain Python ints."""
        return {k: int(v) for k, v in self._stats.items()}

    def count(self, name: str) -> int:
        """One counter (see ``STAT_NAMES``), without copying them all."""
        return self._stats[name]

    # ------------------------------------------------------------ a call
    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        """Cleans one call's batch; returns the rows to store, flat ``[M]``.

        A batch that comes again right after its call (its write into the
        buffer failed, :mod:`cleanbuf.engine._retry`) is cleaned as if that
        call had not happened: the rows it released come again.
        """
        if isinstance(td, TensorDictBase) and td.batch_dims and td.batch_size[-1] == 0:
            # No row ([E, 0], or no env of a step): nothing to clean, nothing changes.
            return TensorDict({}, batch_size=[0], device=td.device)
        return call_with_retry(self, td, self._call_once)

    @property
    def _fingerprint(self):
        """The fingerprint of the call read last (:mod:`cleanbuf.engine._retry`)."""
        return self._reader.fingerprint

    def _call_once(self, td: TensorDictBase) -> TensorDictBase:
        """:meth:`_clean` against the carry of the batch's producer (``_groups``)."""
        key = producer_key(self.options, self.many_producers, td)
        try:
            if key is None:
                return self._clean(td)
            return clean_routed(self, td, key, self._clean)
        except (LayoutError, ResetRowError, ContinuityError) as err:
            hint = _checks.time_first_hint(td, self.options)
            if not hint:
                raise
            raise type(err)(f"{hint} {err}") from None

    def _clean(self, td: TensorDictBase) -> TensorDictBase:
        """Cleans one batch against ``self._carry``; commits only on success."""
        call = self._read(td)
        if call.as_is:
            return self._pass_through(call)
        plan = self._plan(call)
        out, new_held = self._move(call, plan)
        self._patch(call, plan, out, new_held)
        self._commit(call, plan, new_held)
        return as_td(out.tensors, len(plan.release) + len(plan.sel.emit), call.device)

    # ------------------------------------------------------ 1. read and check
    def _read(self, td: TensorDictBase) -> Call:
        """Reads and checks a batch (:class:`cleanbuf.engine._read.Reader`); changes nothing."""
        before = self._undo.fingerprint if self._undo is not None else None
        return self._reader.read(td, self._carry, before)

    def _pass_through(self, call: Call) -> TensorDictBase:
        """Every row as it came, as views of the batch.

        Disabled mode, or a call with nothing to clean.
        """
        carry, layout = call.carry, call.layout
        if carry is not None:
            # A pending is_init fix can only be left here if the rows have no
            # is_init: it is moot, forget it.
            if np.count_nonzero(carry.per_stream[NEED_INIT]):
                carry.per_stream = carry.per_stream.copy()
                carry.per_stream[NEED_INIT] = 0
            if call.ends is not None:
                carry.last = call.ends.last
            carry.obs_schema = call.schema
            self._carry = carry
            self._commit_layout(layout)
        self._stats["rows_in"] += layout.n_rows
        self._stats["rows_out"] += layout.n_rows
        self._stats["episodes_completed"] += int(np.count_nonzero(call.done))
        rows = {k: call.views.flat(k) for k in call.moved}
        return as_td(rows, layout.n_rows, call.device)

    # -------------------------------------------------------------- 2. plan
    def _plan(self, call: Call) -> _Plan:
        """Runs the planning kernel; reads what it says of the held rows."""
        opts, layout, rules = self.options, call.layout, call.rules
        sel, released_src, per_stream, n_drop, n_lost, n_next_lost, n_done, bad_row = plan_rows(
            n=layout.n_rows,
            steps=layout.steps,
            stream=layout.stream,
            done=call.done,
            **call.kernel_flags(opts),
            carry=call.carry.per_stream,
            reset_rows=rules.reset_rows,
            successor=rules.successor,
            final=rules.final,
            stitch=rules.stitch,
            hold_done=rules.hold_done,
            drop_lost=rules.drop_lost,
        )
        if bad_row >= 0:
            stream = int(layout.stream_of(np.array([bad_row]))[0])
            raise _checks.bad_reset_row(bad_row, stream, bool(call.done[bad_row]))
        release = Release.of(call.carry, released_src, opts.done_key)
        policy = _checks.lost_policy(
            opts,
            call.obs_keys,
            call.views.tensors,
            n_lost + n_next_lost + release.n_lost,
            final_missing=opts.mode == "same_step",
        )
        if policy == "drop":
            release = release.without_lost()
        return _Plan(
            Selection(*sel), released_src, per_stream, n_drop, n_lost, n_next_lost, n_done,
            release, policy,
        )  # fmt: skip

    # ---------------------------------------------------------- 3-4. move
    def _move(self, call: Call, plan: _Plan) -> tuple[Views, dict]:
        """Gathers the output rows and the rows to hold.

        The output has the released held rows first, then the emitted rows;
        every key the patches write is a copy.
        """
        opts, sel, release = self.options, plan.sel, plan.release
        patched = set()
        lost = len(sel.lost) or release.n_lost
        if call.rules.stitch and not call.obs_only and (
            len(sel.stitched) or release.n_stitched or len(sel.final)
            or (lost and plan.policy == "nan")
        ):  # fmt: skip
            patched.update(("next", *k) for k in call.obs_keys)
        if len(sel.emit_init):
            patched.add(opts.is_init_key)
        if len(sel.emit_shift):  # fix_bookkeeping shifts whichever step counts are present
            patched.update(opts.step_count_keys)
        return move(
            call.moved, call.views, call.carry.held, release.slots, sel.emit, sel.hold,
            call.layout.n_rows, patched, self._pool,
        )  # fmt: skip

    # -------------------------------------------------------------- 5. patch
    def _patch(self, call: Call, plan: _Plan, out: Views, new_held: dict) -> None:
        """Writes next observations, ``is_init`` and step counts into the copies."""
        opts, sel, release = self.options, plan.sel, plan.release
        n_rel = len(release)
        if call.rules.stitch:
            write_next_obs(
                out, n_rel, call.views, call.obs_keys, sel, release.src, call.final_of,
                plan.policy, call.obs_only,
            )  # fmt: skip
        keys = (opts.is_init_key, opts.step_count_keys)
        fix_bookkeeping(out, n_rel, sel.emit_init, sel.emit_shift, *keys)
        if new_held:
            fix_bookkeeping(Views(new_held), 0, sel.hold_init, sel.hold_shift, *keys)

    # ------------------------------------------------------------- 6. commit
    def _commit(self, call: Call, plan: _Plan, new_held: dict) -> None:
        """Makes the call's carry state current and counts the call.

        Nothing here raises. (The kernel returned a fresh carry array, so
        until here the old state was untouched.)
        """
        carry, sel, release = call.carry, plan.sel, plan.release
        carry.per_stream = plan.per_stream
        if call.ends is not None:
            carry.last = call.ends.last
        carry.obs_schema = call.schema
        if len(carry.held_stream) or len(sel.hold):
            kept_old = plan.released_src[carry.held_stream] == -1
            carry.held = kept_held(carry.held, kept_old, new_held)
            new_streams = call.layout.stream_of(sel.hold)
            carry.held_stream = np.concatenate([carry.held_stream[kept_old], new_streams])
        self._carry = carry
        self._commit_layout(call.layout)
        n_lost = plan.n_lost + plan.n_next_lost
        restitched = len(sel.stitched) + release.n_stitched + len(sel.final)
        s = self._stats
        s["rows_in"] += call.layout.n_rows
        s["rows_out"] += len(release) + len(sel.emit)
        s["reset_rows_dropped"] += plan.n_drop
        s["next_obs_restitched"] += restitched if call.rules.stitch else 0
        s["terminal_obs_missing"] += plan.n_lost + release.n_terminal_lost
        s["next_obs_missing"] += plan.n_next_lost + release.n_lost - release.n_terminal_lost
        s["lost_rows_dropped"] += (n_lost + release.n_dropped) if plan.policy == "drop" else 0
        s["episodes_completed"] += plan.n_done
        s["rows_held"] = len(carry.held_stream)

    # ----------------------------------------------------- flush and state
    def expect_reset_rows(self, stream_ids: np.ndarray) -> None:
        """Says that these streams of flat rows start with a reset row.

        For rows that begin after an episode end whose done row is gone (a
        wrapped buffer overwrote it, and kept its reset row): the reset row
        is dropped and the next episode's bookkeeping fixed, as after any
        episode end. ``layout="stream_key"`` only, before the streams'
        first rows.

        Examples:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> cleaner = Cleaner(Options.build("next_step", stream_key="env"))
            >>> cleaner.expect_reset_rows(np.array([7]))
            >>> rows = TensorDict({
            ...     "env": torch.tensor([7, 7]),
            ...     "observation": torch.tensor([[5.0], [0.0]]),
            ...     "step_count": torch.tensor([[0], [1]]),
            ...     ("next", "observation"): torch.tensor([[0.0], [1.0]]),
            ...     ("next", "reward"): torch.tensor([[0.0], [1.0]]),
            ...     ("next", "done"): torch.tensor([[False], [False]]),
            ... }, batch_size=[2])
            >>> out = cleaner(rows)  # the reset row goes, the count restarts at 0
            >>> out["observation"].flatten().tolist(), out["step_count"].flatten().tolist()
            ([0.0], [0])
        """
        carry = self._carry
        known = np.zeros(0, np.int64) if carry.stream_ids is None else carry.stream_ids
        ids = np.asarray(stream_ids, np.int64)
        if self.options.layout != "stream_key" or np.isin(ids, known).any():
            raise CleanbufError(
                "expect_reset_rows() goes with layout='stream_key', before the streams' "
                f"first rows; got layout={self.options.layout!r}, stream ids {ids.tolist()} "
                f"(known: {known.tolist()})."
            )
        carry = carry.grown(len(known) + len(ids))
        carry.per_stream = carry.per_stream.copy()
        carry.per_stream[PENDING, len(known) :] = 1
        carry.stream_ids = np.concatenate([known, ids])
        carry.layout_kind, carry.stream_shape = "stream_key", (len(known) + len(ids),)
        self._carry = carry

    def last_call_stored(self) -> None:
        """Says that the last call's rows were stored.

        The same batch again is then written twice (a
        :class:`~cleanbuf.ContinuityError`), never taken for a retry of a
        failed write.
        """
        if self._undo is not None:
            self._undo.stored = True

    def undo_last_call(self) -> bool:
        """Goes back to before the last call, whose rows never reached the buffer.

        The rows that call released are held again, its counters undone.
        Returns whether there was a call to undo.
        """
        if self._undo is None or self._undo.stored:
            return False
        last, self._undo = self._undo, None
        last.restore(self)
        return True

    def flush(self, on_lost_terminal_obs: str | None = None) -> TensorDictBase:
        """Returns the held rows (flat ``[H]``) and forgets them.

        A held row waits for the row after it: the reset row holding its
        terminal observation (next-step data), or its successor
        (observation-only data). At a flush that row will not come. A held
        done row whose next observation is stored (read from the data: not
        zero-filled, not NaN, as an undecided batch-end mark's) is complete
        and returned as it is; any other held row has
        lost its next observation, and the lost-observation policy applies
        (counted in ``terminal_obs_missing`` for done rows and
        ``next_obs_missing`` for the others). A reset row arriving after a
        flush is still recognised and dropped. With several producers, every
        producer's held rows, producer after producer.
        """
        self._undo = None  # a flush is no call to repeat
        options = self.options
        if on_lost_terminal_obs is not None:
            if on_lost_terminal_obs not in LOST_POLICIES:
                raise CleanbufError(
                    f"on_lost_terminal_obs={on_lost_terminal_obs!r}: expected one of "
                    f"{LOST_POLICIES}. Nothing was flushed."
                )
            options = dataclasses.replace(options, on_lost_terminal_obs=on_lost_terminal_obs)
        carries = self._groups or [self._carry]
        outs = [flush_carry(options, carry, self._stats) for carry in carries]
        outs = [o for o in outs if o.batch_size[0]]
        return torch.cat(outs) if outs else TensorDict({}, batch_size=[0])

    def state_dict(self) -> dict:
        """The carry state, counters and options, as tensors and plain Python values."""
        state = {**self._carry.state_dict(), "stats": self.stats, "options": self.options.as_dict()}
        if self._groups:
            state["producers"] = [c.state_dict() for c in self._groups]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restores what :meth:`state_dict` returned.

        Everything is checked before anything changes.

        Raises:
            StateError: the state is not a cleanbuf state, or a field of it
                is missing or does not agree with the others (named).
            InputError: the state was saved by a cleaner with other options
                (its held rows and flags would be read under other rules).
        """
        carry = Carry.from_state_dict(state)
        options = state.get("options")
        if options is not None and not isinstance(options, dict):
            raise StateError(
                f"state field 'options': expected a dict, got {type(options).__name__}. "
                "Pass what state_dict() returned, unchanged."
            )
        _checks.same_options(options, self.options)
        producers = state.get("producers", ())
        if not isinstance(producers, (list, tuple)):
            raise StateError(
                f"state field 'producers': expected a list of states, got "
                f"{type(producers).__name__}. Pass what state_dict() returned, unchanged."
            )
        groups = [Carry.from_state_dict(g) for g in producers]
        stats = _checked_stats(state.get("stats"), groups or [carry])
        self._carry, self._groups, self._undo = carry, groups, None
        self._stats = dict.fromkeys(STAT_NAMES, 0) | stats

    # ----------------------------------------------------------- helpers
    def _commit_layout(self, layout) -> None:
        c = self._carry
        if layout.kind == "stream_key":
            old = c.stream_ids if c.stream_ids is not None else np.zeros(0, np.int64)
            c.stream_ids = np.concatenate([old, layout.new_stream_ids])
        c.layout_kind, c.stream_shape = layout.kind, layout.stream_shape


def _checked_stats(stats, carries: list) -> dict:
    """The counters of a state, checked: known names, ints, and the held rows counted."""
    fix = "Pass what state_dict() returned, unchanged."
    if not isinstance(stats, dict):
        raise StateError(
            f"state field 'stats': expected a dict of counters, got {type(stats).__name__}. {fix}"
        )
    for name, value in stats.items():
        if name not in STAT_NAMES or isinstance(value, bool) or not isinstance(value, int):
            raise StateError(
                f"state field 'stats': expected int counters named {list(STAT_NAMES)}, got "
                f"{name!r}: {value!r}. {fix}"
            )
    held = sum(len(c.held_stream) for c in carries)
    if stats.get("rows_held", 0) != held:
        raise StateError(
            f"state field 'stats': expected rows_held={held} (the held rows), got "
            f"{stats.get('rows_held')!r}. {fix}"
        )
    return {k: int(v) for k, v in stats.items()}
