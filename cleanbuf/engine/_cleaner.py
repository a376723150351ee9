"""The stateful cleaner: TensorDict in, flat cleaned rows out.

A call is one step over the producer's :class:`~cleanbuf.engine._state.Carry`
(:meth:`Cleaner._clean`):

1. **read** the batch (:meth:`Cleaner.read`, :mod:`cleanbuf.engine._read`):
   its layout, flags, observation keys, stream ends, all checked; a batch
   with nothing to clean passes through as views;
2. **plan** it (:meth:`Cleaner.plan`, :mod:`cleanbuf.engine._plan`): the
   numba kernel decides from flags only which rows to drop, hold or emit,
   where each next observation comes from, and which held rows this call
   releases;
3. **write** the rows (:mod:`cleanbuf.engine._write`): move the kept rows
   into fresh tensors, patch their next observations and bookkeeping
   (never the caller's batch);
4. **commit** (:meth:`Cleaner.commit`): the call's carry becomes current and
   the counters count it.

Everything that raises does so before the commit, so a failed call changes
nothing. Around a call, :meth:`Cleaner.__call__` picks the producer's carry
(batches from several producers in turn, :meth:`Cleaner._clean_routed`)
and goes back to before the last call when that call's batch comes again
(a write into the buffer failed and the batch is written again,
:meth:`Cleaner._call_with_retry`). :meth:`Cleaner.flush` releases the held
rows at the end of collection.

Several producers. With ``producer_key`` (TorchRL's trajectory ids), or inside a Ray actor,
the cleaner keeps one carry per producer: each worker of a
``MultiAsyncCollector`` whose batches are extended from the parent, one
worker's ``[E, T]`` batch at a time, or each Ray collector extending one
Ray replay buffer.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from cleanbuf.engine._errors import (
    CleanbufError,
    ContinuityError,
    InputError,
    LayoutError,
    ResetRowError,
    StateError,
)
from cleanbuf.engine._kernels import (
    JOINT_MARK,
    MARK,
    MARKED,
    MARKS_SEEN,
    NEED_INIT,
    PENDING,
    WAITING,
)
from cleanbuf.engine._keys import TRAJ_IDS, Views, done_flags, observation_keys
from cleanbuf.engine._options import LOST_POLICIES, Options
from cleanbuf.engine._plan import Plan, lost_policy
from cleanbuf.engine._plan import plan as plan_call
from cleanbuf.engine._read import (
    Call,
    Fingerprint,
    Reader,
    SameBatchAgain,
    restart_rows,
    stored_rows,
    time_first_hint,
)
from cleanbuf.engine._state import Carry, kept_held, same_options
from cleanbuf.engine._write import (
    BufferPool,
    as_td,
    fill_rows,
    fix_bookkeeping,
    move,
    write_next_obs,
)

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
        buffer failed, :meth:`_call_with_retry`) is cleaned as if that
        call had not happened: the rows it released come again.
        """
        if self.options.layout == "time_first" and isinstance(td, TensorDictBase):
            td = time_last(td)
        if isinstance(td, TensorDictBase) and td.batch_dims and td.batch_size[-1] == 0:
            # No row ([E, 0], or no env of a step): nothing to clean, nothing changes.
            return TensorDict({}, batch_size=[0], device=td.device)
        return self._call_with_retry(td)

    @property
    def _fingerprint(self):
        """The fingerprint of the call read last (see :meth:`_call_with_retry`)."""
        return self._reader.fingerprint

    def _call_once(self, td: TensorDictBase) -> TensorDictBase:
        """:meth:`_clean` against the carry of the batch's producer (``_groups``)."""
        key = producer_key(self.options, self.many_producers, td)
        try:
            if key is None:
                return self._clean(td)
            return self._clean_routed(td, key)
        except (LayoutError, ResetRowError, ContinuityError) as err:
            hint = time_first_hint(td, self.options)
            if not hint:
                raise
            raise type(err)(f"{hint} {err}") from None

    def _clean(self, td: TensorDictBase) -> TensorDictBase:
        """Cleans one batch against ``self._carry``; commits only on success."""
        call = self.read(td, plan=True)
        if call.as_is:
            return self._pass_through(call)
        plan = self.plan(call)
        out, new_held = self._move(call, plan)
        self._patch(call, plan, out, new_held)
        self.commit(call, plan, new_held)
        return as_td(out.tensors, plan.release.n + len(plan.sel.emit), call.device)

    # ------------------------------------------------------ 1. read and check
    @property
    def carry(self) -> Carry:
        """The carry state of the producer of the last call (read it; never write it)."""
        return self._carry

    def read(self, td: TensorDictBase, plan: bool = False, keep_lost: bool = False) -> Call:
        """Reads and checks a batch (:class:`cleanbuf.engine._read.Reader`); changes nothing.

        With ``plan``, a call whose structure allows it is planned in the
        same kernel call (``call.planned``, which :meth:`plan` then uses),
        with ``keep_lost`` keeping the rows whose next observation is lost.
        """
        before = self._undo.fingerprint if self._undo is not None else None
        return self._reader.read(td, self._carry, before, plan, keep_lost)

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
        views = call.views
        if views.batch_dims == 1:  # already rows: the batch's own leaves
            return as_td(call.moved, layout.n_rows, call.device)
        rows = {}
        for k in call.moved:  # (as_tensor of the numpy view where there is one: 3x cheaper)
            a = views.get(k)
            rows[k] = views.flat(k) if a is None else torch.from_numpy(a)
        return as_td(rows, layout.n_rows, call.device)

    # -------------------------------------------------------------- 2. plan
    def plan(self, call: Call) -> Plan:
        """Plans a call that :meth:`read` returned (:func:`cleanbuf.engine._plan.plan`).

        Changes nothing.
        """
        return plan_call(call, self.options)

    # ---------------------------------------------------------- 3-4. move
    def _move(self, call: Call, plan: Plan) -> tuple[Views, dict]:
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
    def _patch(self, call: Call, plan: Plan, out: Views, new_held: dict) -> None:
        """Writes next observations, ``is_init`` and step counts into the copies."""
        opts, sel, release = self.options, plan.sel, plan.release
        n_rel = release.n
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
    def commit(self, call: Call, plan: Plan, new_held: dict) -> None:
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
            carry.held_schema = call.structure  # (read checked the old ones against it)
            new_streams = call.layout.stream_of(sel.hold)
            carry.held_stream = np.concatenate([carry.held_stream[kept_old], new_streams])
        self._carry = carry
        self._commit_layout(call.layout)
        n_lost = plan.n_lost + plan.n_next_lost
        restitched = len(sel.stitched) + release.n_stitched + len(sel.final)
        s = self._stats
        s["rows_in"] += call.layout.n_rows
        s["rows_out"] += release.n + len(sel.emit)
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
        self._restore(last)
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
        same_options(options, self.options)
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

    # ------------------------------------------------ a batch written again
    def _snapshot(self) -> Undo:
        """What this cleaner is now (to go back to it).

        A call replaces its carries or their fields and never writes into
        them, so shallow copies do.
        """
        return Undo(self._carry.snapshot(), [g.snapshot() for g in self._groups], dict(self._stats))

    def _restore(self, undo: Undo) -> None:
        """Puts this cleaner back as it was at :meth:`_snapshot`."""
        self._carry, self._groups, self._stats = undo.carry, undo.groups, undo.stats

    def _call_with_retry(self, td: TensorDictBase) -> TensorDictBase:
        """:meth:`_call_once`, going back first if ``td`` is the last call's batch.

        A replay buffer runs the filter, then writes what the filter
        returned. If that write fails, the held rows the call released and
        its flags belong to rows that never reached the buffer: a user who
        writes the same batch again gets those rows again. The read step
        raises :class:`~cleanbuf.engine._read.SameBatchAgain` when the rows'
        fingerprint (with trajectory ids) says so; a call that fails
        otherwise is retried from before the last call when its fingerprint
        matches that call's. A call that fails leaves the cleaner as it was.
        """
        undo = self._snapshot()
        try:
            out = self._call_once(td)
        except (SameBatchAgain, CleanbufError) as err:
            fingerprint = self._fingerprint
            again = self._undo is not None and (
                isinstance(err, SameBatchAgain) or (fingerprint is not None and fingerprint.again)
            )
            if not again:
                raise
            if self._undo.stored:
                self._refuse_stored_again(td, undo, err)
            last, self._undo = self._undo, None
            self._restore(last)
            retry = self._snapshot()
            try:
                out = self._call_once(td)
            except CleanbufError:
                self._restore(undo)  # as before this call, which changes nothing
                self._undo = last
                if isinstance(err, SameBatchAgain):
                    raise
                raise err from None
            undo = retry
        undo.fingerprint = self._fingerprint
        self._undo = undo
        return out

    def _refuse_stored_again(self, td: TensorDictBase, undo: Undo, err: Exception) -> None:
        """Raises for a call that looks like the last one again, whose rows were stored.

        The first rows alone may match another batch (a fresh start of every
        stream looks the same each time): it is the same batch if it cleans
        from where the last call started. Either way the cleaner is left as
        it was.
        """
        last, self._undo = self._undo, None
        self._restore(last)
        try:
            self._call_once(td)
        except (SameBatchAgain, CleanbufError):
            same = False
        else:
            same = True
        self._restore(undo)
        self._undo = last
        if same:
            raise written_twice() from None
        if isinstance(err, SameBatchAgain):
            raise written_twice() from None
        raise err

    # ------------------------------------------------- several producers
    def _clean_routed(self, td: TensorDictBase, key: tuple) -> TensorDictBase:
        """:meth:`_clean` against the carry of the batch's producer.

        With several producers, the batch goes to the first producer it
        continues (:func:`candidates`); :meth:`_clean` changes nothing when
        it refuses one. When the producers draw trajectory ids from one pool
        (``producer_key``), a batch sharing ids with producers it does not
        continue is refused (a skipped or repeated batch); when they may
        share ids (``many_producers``), it starts a new one.
        """
        groups = self._groups
        first, last = trajectory_ends(td, key)
        restarts = None
        if self.many_producers and self.options.producer_key is None:
            restarts = first_restarts(td, self.options)  # pools of their own: ids shared by chance
        matching, others = candidates(groups, first, restarts)
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
        if group == len(groups):
            groups.append(self._carry)
        groups[group] = self._carry
        self._stats["rows_held"] = sum(len(c.held_stream) for c in groups)
        return out

    def _clean_as(self, group: int, td: TensorDictBase) -> TensorDictBase:
        """:meth:`_clean` against producer ``group``'s carry (a new one past the last)."""
        groups = self._groups
        self._carry = groups[group] if group < len(groups) else Carry()
        return self._clean(td)  # commits into self._carry, or raises having changed nothing

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


@dataclasses.dataclass
class Undo:
    """What a cleaner was before a call, and that call's fingerprint."""

    carry: object
    groups: list
    stats: dict
    fingerprint: Fingerprint | None = None
    stored: bool = False  # the call's rows reached the buffer: the batch again is a duplicate


def written_twice() -> ContinuityError:
    """The error for a batch that comes again after its rows were stored."""
    return ContinuityError(
        "this batch is the one the last call cleaned (the same first row in every stream), "
        "and that call's rows were stored: it was written twice. Expected the next batch of "
        "each stream, got the last one again. Write each batch once (a batch whose write "
        "into the buffer failed may be written again; this one's write succeeded). Nothing "
        "was written."
    )


def trajectory_ends(td: TensorDictBase, key: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The trajectory ids of the first and of the last row of each stream.

    Raises:
        InputError: the batch is not ``[*E, T]`` or has no such key.
    """
    ids = td.get(key, None) if td.batch_dims >= 2 else None  # get: see Cleaner._producer_key
    if ids is None:
        raise InputError(
            f"producer_key={key!r} needs [*E, T] batches holding that key (TorchRL's "
            f"trajectory ids); got batch_size={list(td.batch_size)} and keys "
            f"{sorted(td.keys(True, True), key=str)}. Extend the buffer with the "
            "collector's batches as they come."
        )
    ids = ids.reshape(*td.batch_size).reshape(-1, td.batch_size[-1])
    return ids[:, 0].cpu().numpy(), ids[:, -1].cpu().numpy()


def first_restarts(td: TensorDictBase, options: Options) -> np.ndarray | None:
    """Per stream, whether the batch's first row starts an episode after a real reset.

    :func:`cleanbuf.engine._read.restart_rows` of each stream's first row; None
    when the batch says nothing of resets. ``td`` is ``[*E, T]``.
    """
    dim = td.batch_dims - 1  # time
    first = {}
    for key in (options.is_init_key, options.step_count_key):
        value = td.get(key, None) if key is not None else None  # (a lazy stack: get, not keys)
        if value is not None:
            first[key] = value.select(dim, 0)
    restart = restart_rows(options, Views(first, dim, int(np.prod(td.batch_size[:-1]))))
    return restart if len(restart) else None


def candidates(
    groups: list[Carry], first_ids: np.ndarray, restarts: np.ndarray | None = None
) -> tuple[list[int], list[int]]:
    """The producers a batch may continue, most likely first.

    Within a producer, a stream keeps its trajectory id until its episode
    ends, and a new episode takes an id above every id the producer gave
    before. A producer's batch therefore has, on each stream, the id of the
    stream's last row, or (the stream ended at the batch boundary) a larger
    id than any of its last rows. When the producers draw ids from one pool
    (a multi-process collector's workers do), a shared id names the
    producer; producers with pools of their own (each Ray collector has one)
    can share ids, so the observations decide among the candidates (the
    cleaner's continuity check). A batch whose every stream ended at the
    boundary shares no id: the producers it is consistent with come next,
    the one whose ids are closest below the batch's first, then any
    producer with nothing held, pending or open, and a new one.

    ``restarts`` (producers with pools of their own) says which streams
    start an episode after a real reset in the batch's first row. Such an
    episode has a new id, so a producer whose last id it repeats shares it
    by chance: it comes after the producers the batch is consistent with
    (its continuity check would pass, a restart continuing anything).

    An episode's end changes its id too (a collector's batch-end mark
    aside), so a producer sharing the batch's ids only on streams that
    ended comes after one sharing them on open streams.

    Returns:
        ``(matching, others)``: the consistent producers sharing an id with
        the batch on an open stream, then those sharing one only on ended
        streams; then the other consistent ones, those sharing an id by
        chance, the blank ones and ``len(groups)`` (a new producer).

    Examples:
        >>> a, b = Carry(traj_ids=np.array([3, 4])), Carry(traj_ids=np.array([5, 6]))
        >>> candidates([a, b], np.array([7, 6]))  # stream 1 continues trajectory 6
        ([1], [0, 2])
        >>> candidates([a, b], np.array([3, 6]))  # 6 > 4, but 3 < 6: a (b, blank, as new)
        ([0], [1, 2])
        >>> candidates([a, b], np.array([8, 9]))  # every stream restarted: closest first
        ([], [1, 0, 2])
        >>> candidates([], np.array([8, 9]))  # the first producer
        ([], [0])
        >>> candidates([a, b], np.array([5, 6]), restarts=np.array([True, True]))
        ([], [0, 1, 2])
    """
    matching, ended, restarted, by_chance = [], [], [], []
    for g, carry in enumerate(groups):
        last = carry.traj_ids
        if len(last) != len(first_ids):
            continue
        same = last == first_ids
        if not np.all(same | (first_ids > last.max())):
            continue
        open_ = carry.last.open
        if len(open_) != len(same):
            open_ = np.zeros(len(same), np.bool_)
        if np.any(open_ & ~same):
            continue  # an open stream keeps its id
        if restarts is not None and np.any(same & restarts):
            by_chance.append(g)
        elif np.any(same & open_):
            matching.append(g)
        elif same.any():  # only on ended streams (continuity cannot refuse those)
            ended.append(g)
        else:
            restarted.append((int(first_ids.min() - last.max()), g))
    matching += ended
    blank = [g for g, carry in enumerate(groups) if carry.is_blank()]
    others = [g for _, g in sorted(restarted)] + by_chance
    others += [g for g in blank if g not in others and g not in matching]
    return matching, [*others, len(groups)]


def producer_key(options: Options, many_producers: bool, td: TensorDictBase) -> tuple | None:
    """The key that tells the batch's producer, or None for one producer."""
    key = options.producer_key
    if key is not None or not many_producers:
        return key
    if options.layout in (None, "time_last") and td.batch_dims >= 2:
        # get, not keys(): a LazyStackedTensorDict (a batch Ray carried)
        # does not list its nested keys as containing them.
        if td.get(TRAJ_IDS, None) is not None:
            return TRAJ_IDS
    return None


def flush_carry(options: Options, carry: Carry, stats: dict) -> TensorDictBase:
    """Returns ``carry``'s held rows (flat ``[H]``), forgets them, and counts them.

    A held row waits for the row after it: the reset row holding its
    terminal observation (next-step data), or its successor
    (observation-only data). At a flush that row will not come. A held done
    row whose next observation is stored (read from the data, as
    :func:`~cleanbuf.engine._read.stored_rows` reads it: a batch-end mark
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
    policy = lost_policy(options, obs_keys, rows, n_terminal + n_next, False)
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


def time_last(td: TensorDictBase) -> TensorDictBase:
    """A ``[T, *E]`` batch as ``[*E, T]`` (a view); a 1-D batch ``[T]`` as one stream ``[1, T]``.

    Examples:
        >>> td = TensorDict({"x": torch.arange(6).reshape(3, 2)}, batch_size=[3, 2])
        >>> time_last(td)["x"].tolist()  # 3 steps of 2 envs: each env's 3 steps
        [[0, 2, 4], [1, 3, 5]]
        >>> time_last(TensorDict({"x": torch.arange(3)}, batch_size=[3])).batch_size
        torch.Size([1, 3])
    """
    if td.batch_dims == 1:
        return td.unsqueeze(0)
    if td.batch_dims > 1:
        return td.permute(*range(1, td.batch_dims), 0)
    return td
