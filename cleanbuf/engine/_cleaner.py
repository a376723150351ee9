"""The stateful cleaner: TensorDict in, flat cleaned rows out.

A call reads like this (:meth:`Cleaner._clean`):

1. **read** the batch: its layout (which rows belong to which stream), its
   done flags and observation keys, the rows that restart a stream, and
   check them all (:mod:`cleanbuf.engine._checks`, :mod:`cleanbuf.engine._continuity`);
   a batch with nothing to clean passes through as views;
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

from cleanbuf.engine import _checks, _flags
from cleanbuf.engine._carry import Carry
from cleanbuf.engine._continuity import CallEnds, LastRows
from cleanbuf.engine._errors import CleanbufError, ContinuityError, InputError, key_name
from cleanbuf.engine._groups import candidates, first_restarts, trajectory_ends
from cleanbuf.engine._kernels import (
    MARKED,
    NEED_INIT,
    PENDING,
    SHIFT,
    WAITING,
    Selection,
    plan_rows,
)
from cleanbuf.engine._keys import (
    TRAJ_IDS,
    batch_leaves,
    check_same_layout,
    done_flags,
    final_entries,
    observation_keys,
)
from cleanbuf.engine._layout import CallLayout, resolve
from cleanbuf.engine._move import Views
from cleanbuf.engine._options import Options
from cleanbuf.engine._patch import as_td, fill_rows, fix_bookkeeping, move, write_next_obs
from cleanbuf.engine._pool import BufferPool
from cleanbuf.engine._release import Release, kept_held
from cleanbuf.engine._retry import Fingerprint, SameBatchAgain, Undo
from cleanbuf.engine._rules import Rules, terminal_obs_in_done_row

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
# What a call without a final-observation entry has of one (see final_entries).
_NO_FINAL = ({}, None, frozenset())


@dataclasses.dataclass
class _Call:
    """What :meth:`Cleaner._read` found in a batch, checked."""

    device: torch.device | None
    layout: CallLayout
    views: Views  # every leaf, read as rows
    done: np.ndarray
    moved: dict  # the leaves to store (without a same-step final entry)
    carry: Carry | None = None  # None in disabled mode
    obs_keys: list = dataclasses.field(default_factory=list)
    obs_only: bool = False
    final_of: dict = dataclasses.field(default_factory=dict)
    final_present: np.ndarray | None = None
    restart: np.ndarray = dataclasses.field(default_factory=lambda: _flags.NONE)
    last: LastRows | None = None
    rules: Rules | None = None
    as_is: bool = True  # nothing to clean: the rows pass through as views


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
        >>> from cleanbuf.engine._options import Options
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
        self._fingerprint: Fingerprint | None = None  # of the call in progress
        self._stats = dict.fromkeys(STAT_NAMES, 0)
        self._pool = BufferPool() if pool is None else pool  # where large outputs go
        self._layouts: dict = {}  # (batch size, names) -> CallLayout, for the fixed layouts
        self._obs_keys: dict = {}  # leaf keys -> discovered observation keys

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
        buffer failed, :mod:`cleanbuf.engine._retry`) is cleaned as if that call
        had not happened: the rows it released come again.
        """
        undo = Undo.of(self)
        try:
            out = self._call_once(td)
        except (SameBatchAgain, CleanbufError) as err:
            # The last call's batch again (recognised by its trajectory ids, or
            # by its observations once it fails to follow the streams).
            again = self._undo is not None and (
                isinstance(err, SameBatchAgain) or self._undo.same_batch(self._fingerprint)
            )
            if not again:
                raise
            last, self._undo = self._undo, None
            last.restore(self)
            retry = Undo.of(self)
            try:
                out = self._call_once(td)
            except CleanbufError:
                undo.restore(self)  # as before this call, which changes nothing
                self._undo = last
                if isinstance(err, SameBatchAgain):
                    raise
                raise err from None
            undo = retry
        undo.fingerprint = self._fingerprint
        self._undo = undo
        return out

    def _call_once(self, td: TensorDictBase) -> TensorDictBase:
        """:meth:`_clean` against the carry of the batch's producer.

        With several producers, the batch goes to the first producer it
        continues (:func:`cleanbuf.engine._groups.candidates`); ``_clean`` changes
        nothing when it refuses one. When the producers draw trajectory ids
        from one pool (``producer_key``), a batch sharing ids with producers
        it does not continue is refused (a skipped or repeated batch); when
        they may share ids (:attr:`many_producers`), it starts a new one.
        """
        self._fingerprint = None
        key = self._producer_key(td)
        if key is None:
            return self._clean(td)
        first, last = trajectory_ends(td, key)
        restarts = None
        if self.many_producers and self.options.producer_key is None:
            # pools of their own: an id may be shared by chance
            restarts = first_restarts(td, self.options)
        matching, others = candidates(self._groups, first, restarts)
        refused = None
        for group in matching:
            try:
                out = self._clean_as(group, td)
                break
            except ContinuityError as err:
                refused = refused or err
        else:
            if refused is not None and not self.many_producers:
                raise refused
            for group in others:  # the last, a new producer, refuses nothing
                try:
                    out = self._clean_as(group, td)
                    break
                except ContinuityError:
                    continue  # an id it shares by chance: its open streams say no
        self._carry.traj_ids = last
        if group == len(self._groups):
            self._groups.append(self._carry)
        self._groups[group] = self._carry
        self._stats["rows_held"] = sum(len(c.held_stream) for c in self._groups)
        return out

    def _clean_as(self, group: int, td: TensorDictBase) -> TensorDictBase:
        """:meth:`_clean` against producer ``group``'s carry (a new one past the last)."""
        self._carry = self._groups[group] if group < len(self._groups) else Carry()
        return self._clean(td)  # commits into self._carry, or raises having changed nothing

    def _producer_key(self, td: TensorDictBase) -> tuple | None:
        """The key that tells the batch's producer, or None for one producer."""
        key = self.options.producer_key
        if key is not None or not self.many_producers:
            return key
        if self.options.layout in (None, "time_last") and td.batch_dims >= 2:
            # get, not keys(): a LazyStackedTensorDict (a batch Ray carried)
            # does not list its nested keys as containing them.
            if td.get(TRAJ_IDS, None) is not None:
                return TRAJ_IDS
        return None

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
    def _read(self, td: TensorDictBase) -> _Call:
        """Reads and checks a batch; decides whether it has anything to clean."""
        opts = self.options
        if not isinstance(td, TensorDictBase):
            raise InputError(
                f"expected a TensorDict, got {type(td).__name__}; use cleanbuf.clean() "
                "for dicts of arrays."
            )
        layout = self._layout(td)
        leaves = batch_leaves(td)  # as stored; read as rows through views
        views = Views(leaves, td.batch_dims, layout.n_rows)
        done = done_flags(views, opts.done_key)
        call = _Call(td.device, layout, views, done, moved=leaves)
        if opts.mode == "disabled":
            return call
        call.obs_keys, call.obs_only = self._observation_keys(leaves)
        if opts.mode == "same_step":
            call.final_of, call.final_present, entry_keys = final_entries(
                leaves, opts.final_obs_key, call.obs_keys, layout.n_rows, td.batch_dims
            )
            if entry_keys and not opts.keep_final_obs:
                call.moved = {k: v for k, v in leaves.items() if k not in entry_keys}
        if len(self._carry.held_stream):
            _checks.same_schema_as_held(self._carry.held, call.moved, td.batch_dims)
        n_streams = layout.n_streams
        grow = n_streams > self._carry.n_streams
        call.carry = self._carry.grown(n_streams) if grow else self._carry
        call.restart = _flags.restart_rows(opts, views)
        call.last = self._continuity(call)
        call.rules = Rules.of(opts, call.obs_only, layout.kind)
        call.as_is = (
            not call.rules.successor
            and not np.count_nonzero(done)
            and self._nothing_pending(call.carry, leaves)
        )
        return call

    def _continuity(self, call: _Call) -> LastRows:
        """Checks the call's continuity and fingerprint; returns its last rows.

        The call must continue the streams of the calls before it
        (:mod:`cleanbuf.engine._continuity`); a call that brings the last call's
        batch again raises :class:`SameBatchAgain` (:mod:`cleanbuf.engine._retry`).
        Time-aligned full transitions only: other calls keep what they had.
        """
        layout = call.layout
        if call.obs_only or layout.kind == "stream_key":
            return self._carry.last
        first = layout.first_rows
        ends = CallEnds.of_call(
            call.views, call.obs_keys, first, layout.last_rows, call.done, call.restart
        )
        self._fingerprint = fingerprint = Fingerprint.of_call(call.views, first, ends)
        if self._undo is not None and fingerprint.exact and self._undo.same_batch(fingerprint):
            raise SameBatchAgain
        if self.options.check_continuity:
            self._carry.last.check(ends)
        return LastRows.of(ends)

    def _nothing_pending(self, carry: Carry, leaves: dict) -> bool:
        """Whether a call without an episode end has nothing to fix.

        Nothing to fix: no reset row to drop, no row waiting, and no
        bookkeeping fix that applies to the keys the call has.
        """
        # (count_nonzero: a third of what any() costs on these small arrays)
        nonzero, per_stream = np.count_nonzero, carry.per_stream
        if nonzero(per_stream[PENDING]) or nonzero(per_stream[WAITING]):
            return False
        if nonzero(per_stream[NEED_INIT]) and self.options.is_init_key in leaves:
            return False
        if not nonzero(per_stream[SHIFT]):
            return True
        return not any(k in leaves for k in self.options.step_count_keys)

    def _pass_through(self, call: _Call) -> TensorDictBase:
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
            carry.last = call.last
            self._carry = carry
        self._commit_layout(layout)
        self._stats["rows_in"] += layout.n_rows
        self._stats["rows_out"] += layout.n_rows
        self._stats["episodes_completed"] += int(np.count_nonzero(call.done))
        rows = {k: call.views.flat(k) for k in call.moved}
        return as_td(rows, layout.n_rows, call.device)

    # -------------------------------------------------------------- 2. plan
    def _plan(self, call: _Call) -> _Plan:
        """Runs the planning kernel; reads what it says of the held rows."""
        opts, layout, rules, views = self.options, call.layout, call.rules, call.views
        mark = _flags.mark_rows(opts, views, layout, call.done, call.restart)
        sel, released_src, per_stream, n_drop, n_lost, n_next_lost, n_done, bad_row = plan_rows(
            n=layout.n_rows,
            steps=layout.steps,
            stream=layout.stream,
            done=call.done,
            joint=_flags.joint_rows(opts, views, call.done, mark, layout),
            final_ok=_flags.NONE if call.final_present is None else call.final_present,
            final_default=bool(call.final_of),
            reward=_flags.reward_rows(opts, views),
            restart=call.restart,
            mark=mark,
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
    def _move(self, call: _Call, plan: _Plan) -> tuple[Views, dict]:
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
    def _patch(self, call: _Call, plan: _Plan, out: Views, new_held: dict) -> None:
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
    def _commit(self, call: _Call, plan: _Plan, new_held: dict) -> None:
        """Makes the call's carry state current and counts the call.

        Nothing here raises. (The kernel returned a fresh carry array, so
        until here the old state was untouched.)
        """
        carry, sel, release = call.carry, plan.sel, plan.release
        carry.per_stream = plan.per_stream
        carry.last = call.last
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

    def flush(self) -> TensorDictBase:
        """Returns the held rows (flat ``[H]``) and forgets them.

        A held row waits for the row after it: the reset row holding its
        terminal observation (next-step data), or its successor
        (observation-only data). At a flush that row will not come. A done
        row whose producer stores the terminal observation in the row itself
        (``terminal_obs_in_done_row``) is complete; any other held row has
        lost its next observation, and the lost-observation policy applies
        (counted in ``terminal_obs_missing`` for done rows and
        ``next_obs_missing`` for the others). A reset row arriving after a
        flush is still recognised and dropped. With several producers, every
        producer's held rows, producer after producer.
        """
        self._undo = None  # a flush is no call to repeat
        if not self._groups:
            return self._flush_carry()
        outs = []
        for g, carry in enumerate(self._groups):
            self._carry = carry
            outs.append(self._flush_carry())
            self._groups[g] = self._carry
        outs = [o for o in outs if o.batch_size[0]]
        return torch.cat(outs) if outs else TensorDict({}, batch_size=[0])

    def _flush_carry(self) -> TensorDictBase:
        """:meth:`flush` of ``self._carry``."""
        opts, carry = self.options, self._carry
        n_held = len(carry.held_stream)
        if n_held == 0:
            return TensorDict({}, batch_size=[0])
        rows = dict(carry.held)  # ours, forgotten below: patched in place
        obs_keys, obs_only = observation_keys(rows, opts.observation_keys, self._bookkeeping())
        done = done_flags(Views(rows, 1, n_held), opts.done_key)
        in_done_row = terminal_obs_in_done_row(opts, carry.layout_kind)
        missing = np.ones(n_held, np.bool_) if obs_only else ~np.full(n_held, in_done_row)
        # A collector's batch-end mark still undecided: maybe no episode end at
        # all, and maybe one whose terminal observation was zero-filled.
        marked = carry.per_stream[MARKED][carry.held_stream] != 0
        missing |= marked
        done = done & ~marked
        n_terminal = int((missing & done).sum())
        n_next = int((missing & ~done).sum())
        policy = _checks.lost_policy(opts, obs_keys, rows, n_terminal + n_next, False)
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
        s = self._stats
        s["rows_out"] += len(keep)
        s["terminal_obs_missing"] += n_terminal
        s["next_obs_missing"] += n_next
        s["lost_rows_dropped"] += n_held - len(keep)
        s["rows_held"] = 0
        return as_td(rows, len(keep))

    def state_dict(self) -> dict:
        """The carry state, counters and options, as tensors and plain Python values."""
        state = {**self._carry.state_dict(), "stats": self.stats, "options": self.options.as_dict()}
        if self._groups:
            state["producers"] = [c.state_dict() for c in self._groups]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restores what :meth:`state_dict` returned.

        Raises:
            InputError: the state is not a cleanbuf state, or was saved by a
                cleaner with other options (its held rows and flags would be
                read under other rules).
        """
        carry = Carry.from_state_dict(state)
        _checks.same_options(state.get("options"), self.options)
        groups = [Carry.from_state_dict(g) for g in state.get("producers", ())]
        self._carry, self._groups, self._undo = carry, groups, None
        self._stats = dict.fromkeys(STAT_NAMES, 0) | {k: int(v) for k, v in state["stats"].items()}

    # ----------------------------------------------------------- helpers
    def _bookkeeping(self) -> set:
        return {k for k in (self.options.is_init_key, self.options.step_count_key) if k}

    def _observation_keys(self, leaves: dict) -> tuple[list, bool]:
        """The observation keys, discovered once per key set.

        :func:`observation_keys`; the shapes and dtypes are checked on every
        call.
        """
        key = tuple(leaves)
        found = self._obs_keys.get(key)
        if found is None:
            found = observation_keys(leaves, self.options.observation_keys, self._bookkeeping())
            if len(self._obs_keys) < 64:
                self._obs_keys[key] = found
        elif not found[1]:
            for k in found[0]:
                check_same_layout(leaves, k, ("next", *k))
        return found

    def _layout(self, td: TensorDictBase) -> CallLayout:
        """The call's layout, checked against the streams of the calls before.

        Cached per batch shape for the fixed layouts.
        """
        opts = self.options
        names = td.names if td.batch_dims else None
        if opts.layout == "stream_key":
            if opts.stream_key not in td.keys(include_nested=True):
                raise InputError(
                    f"stream key {key_name(opts.stream_key)} is missing from the "
                    "batch; it must hold each row's stream (env) id."
                )
            if opts.joint_key is not None and opts.joint_key not in td.keys(include_nested=True):
                raise InputError(
                    f"joint key {key_name(opts.joint_key)} is missing from the batch; it "
                    "must hold, per row, True on a done row whose whole reset group was "
                    "done on that step."
                )
            ids = td.get(opts.stream_key)
            return resolve(td.batch_size, names, opts.layout, ids, self._carry.stream_ids)
        cache_key = (td.batch_size, None if names is None else tuple(names))
        layout = self._layouts.get(cache_key)
        if layout is None:
            layout = resolve(td.batch_size, names, opts.layout, None, None)
            if len(self._layouts) < 64:
                self._layouts[cache_key] = layout
        _checks.same_streams(self._carry, layout)
        return layout

    def _commit_layout(self, layout: CallLayout) -> None:
        c = self._carry
        if layout.kind == "stream_key":
            old = c.stream_ids if c.stream_ids is not None else np.zeros(0, np.int64)
            c.stream_ids = np.concatenate([old, layout.new_stream_ids])
        c.layout_kind, c.stream_shape = layout.kind, layout.stream_shape
