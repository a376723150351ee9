"""The stateful cleaner: TensorDict in, flat cleaned rows out.

A call is one step over the producer's :class:`~cleanbuf.engine._state.Carry`
(:meth:`Cleaner.clean`):

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
nothing. Around a call, and apart from it:

- **one undo**: the cleaner keeps its state from before the last call, and
  that call's fingerprint (the first row of each stream, compared with the
  next call's by the kernel). A call whose batch is the last call's again
  (its write into the buffer failed and it is written again) is cleaned as
  if the last call had not happened; once the buffer is known to hold the
  last call's rows (:meth:`Cleaner.last_call_stored`) the same batch again
  is written twice, a :class:`~cleanbuf.ContinuityError`; once the write
  is known to have failed (:meth:`Cleaner.undo_last_call`) the cleaner goes
  back at once. Without trajectory ids, a batch is taken for the last one
  again only when its call fails (a repeated batch does not follow its
  streams), so a new batch that merely starts like the last one is never
  undone;
- :mod:`cleanbuf.engine._routing` picks the producer's carry, for batches
  from several producers in turn (a single producer's call skips it);
- :meth:`Cleaner.flush` releases the held rows at the end of collection.

The whole state (carries and counters) is one
:class:`~cleanbuf.engine._state.State`, ``cleaner.state``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from cleanbuf.engine._errors import (
    CleanbufError,
    ContinuityError,
    LayoutError,
    ResetRowError,
    StateError,
)
from cleanbuf.engine._keys import Views, done_flags, observation_keys
from cleanbuf.engine._options import LOST_POLICIES, Options
from cleanbuf.engine._plan import Plan, lost_policy
from cleanbuf.engine._plan import plan as plan_call
from cleanbuf.engine._read import (
    Call,
    Fingerprint,
    Reader,
    SameBatchAgain,
    time_first_hint,
)
from cleanbuf.engine._routing import producer_key, route
from cleanbuf.engine._state import Carry, State, kept_held, same_options
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
        self.state = State(Carry(), [], dict.fromkeys(STAT_NAMES, 0))
        # Batches may come from several producers whose trajectory ids can
        # collide (Ray collectors, each with its own pool): told apart by
        # their ids and observations, a batch continuing none starts a new
        # producer. Set once by the filter inside a Ray actor.
        self.many_producers = False
        # The one undo (see the module): the state before the last call, that
        # call's fingerprint, and whether its rows are known to be stored.
        self._before: State | None = None
        self._fingerprint: Fingerprint | None = None
        self._stored = False
        self._pool = BufferPool() if pool is None else pool  # where large outputs go
        self._reader = Reader(options)

    @property
    def stats(self) -> dict:
        """A copy of the counters (see ``STAT_NAMES``), as plain Python ints."""
        return {k: int(v) for k, v in self.state.stats.items()}

    def count(self, name: str) -> int:
        """One counter (see ``STAT_NAMES``), without copying them all."""
        return self.state.stats[name]

    # ------------------------------------------------------------ a call
    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        """Cleans one call's batch; returns the rows to store, flat ``[M]``.

        A batch that comes again right after its call (its write into the
        buffer failed) is cleaned as if that call had not happened: the rows
        it released come again (the undo, see the module). A call that
        fails leaves the cleaner as it was.

        Examples:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> batch = TensorDict({  # the done row's terminal observation comes next call
            ...     "observation": torch.tensor([[[0.0], [1.0]]]),
            ...     ("next", "observation"): torch.tensor([[[1.0], [0.0]]]),
            ...     ("next", "reward"): torch.ones(1, 2, 1),
            ...     ("next", "done"): torch.tensor([[[False], [True]]]),
            ... }, batch_size=[1, 2])
            >>> cleaner = Cleaner(Options.build("next_step"))
            >>> len(cleaner(batch)), cleaner.stats["rows_held"]  # the done row waits
            (1, 1)
            >>> cleaner.undo_last_call()  # its rows never reached the buffer
            True
            >>> cleaner.stats["rows_in"], cleaner.stats["rows_held"]
            (0, 0)
        """
        if self.options.layout == "time_first" and isinstance(td, TensorDictBase):
            td = time_last(td)
        if isinstance(td, TensorDictBase) and td.batch_dims and td.batch_size[-1] == 0:
            # No row ([E, 0], or no env of a step): nothing to clean, nothing changes.
            return TensorDict({}, batch_size=[0], device=td.device)
        undo = self.state.snapshot()
        self._reader.fingerprint = None
        try:
            out = self.step(td, self._fingerprint)
        except (SameBatchAgain, CleanbufError) as err:
            read = self._reader.fingerprint
            again = self._before is not None and (
                isinstance(err, SameBatchAgain) or (read is not None and read.again)
            )
            if not again:
                self.state = undo
                raise
            out, undo = self._again(td, undo, err)
        self._before, self._fingerprint, self._stored = undo, self._reader.fingerprint, False
        return out

    def _again(self, td: TensorDictBase, undo: State, err: Exception) -> tuple:
        """The last call's batch again: cleaned from before that call, or refused.

        Returns the rows and the state to undo them to. Refused (the state
        as ``undo``, before this call) where the last call's rows were
        stored, or where the batch fails from there too.
        """
        before = self._before
        if self._stored:
            # The first rows alone may match another batch (a fresh start of
            # every stream looks the same each time): it is the same batch if
            # it cleans from where the last call started.
            self.state = before.snapshot()
            try:
                self.step(td, None)
            except (SameBatchAgain, CleanbufError):
                same = False
            else:
                same = True
            self.state = undo
            if same or isinstance(err, SameBatchAgain):
                raise written_twice() from None
            raise err
        self.state = before
        retry = before.snapshot()
        try:
            out = self.step(td, None)
        except CleanbufError:
            self.state = undo  # as before this call, which changes nothing
            if isinstance(err, SameBatchAgain):
                raise
            raise err from None
        return out, retry

    def step(self, td: TensorDictBase, before: Fingerprint | None) -> TensorDictBase:
        """Cleans one batch against the carry of its producer; raises having changed nothing.

        Args:
            td: the batch.
            before: the last call's fingerprint (a batch written again).

        Returns:
            The rows to store. The call's fingerprint (None where the call
            reads no stream ends) is left in ``self._reader.fingerprint``,
            where a call that fails leaves it too.
        """
        key = None  # one producer: no routing at all
        if self.many_producers or self.options.producer_key is not None:
            key = producer_key(self.options, self.many_producers, td)
        try:
            if key is None:
                return self.clean(td, before)
            return route(self, td, key, before)
        except (LayoutError, ResetRowError, ContinuityError) as err:
            hint = time_first_hint(td, self.options)
            if not hint:
                raise
            raise type(err)(f"{hint} {err}") from None

    def clean(self, td: TensorDictBase, before: Fingerprint | None = None) -> TensorDictBase:
        """Cleans one batch against ``state.carry``; commits only on success.

        Returns what :meth:`step` returns.
        """
        call = self.read(td, before=before)
        if call.as_is:
            return self._pass_through(call)
        plan = self.plan(call)
        out, new_held = self._move(call, plan)
        self._patch(call, plan, out, new_held)
        self.commit(call, plan, new_held)
        n = plan.release.n + len(plan.sel.emit)
        return as_td(out.tensors, n, call.device)

    # ------------------------------------------------------ 1. read and check
    @property
    def carry(self) -> Carry:
        """The carry state of the producer of the last call (read it; never write it)."""
        return self.state.carry

    def read(
        self,
        td: TensorDictBase,
        plan: bool = False,
        keep_lost: bool = False,
        before: Fingerprint | None = None,
    ) -> Call:
        """Reads and checks a batch (:class:`cleanbuf.engine._read.Reader`); changes nothing.

        The call is planned in the same kernel call (``call.planned``,
        which :meth:`plan` then uses), except one with nothing to clean
        unless ``plan``; ``keep_lost`` keeps the rows whose next
        observation is lost.
        ``before`` is the last call's fingerprint (a batch written again).
        """
        return self._reader.read(td, self.state.carry, before, plan, keep_lost)

    def _pass_through(self, call: Call) -> TensorDictBase:
        """Every row as it came, as views of the batch.

        Disabled mode, or a call with nothing to clean.
        """
        carry, layout = call.carry, call.layout
        if carry is not None:
            # A pending is_init fix can only be left here if the rows have no
            # is_init: it is moot, forget it.
            carry.forget_pending_init()
            if call.ends is not None:
                carry.last = call.ends.last
            carry.obs_schema = call.schema
            self.state.carry = carry
            self._commit_layout(layout)
        self.state.stats["rows_in"] += layout.n_rows
        self.state.stats["rows_out"] += layout.n_rows
        self.state.stats["episodes_completed"] += int(np.count_nonzero(call.done))
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
        self.state.carry = carry
        self._commit_layout(call.layout)
        n_lost = plan.n_lost + plan.n_next_lost
        restitched = len(sel.stitched) + release.n_stitched + len(sel.final)
        s = self.state.stats
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
        carry = self.state.carry
        known = np.zeros(0, np.int64) if carry.stream_ids is None else carry.stream_ids
        ids = np.asarray(stream_ids, np.int64)
        if self.options.layout != "stream_key" or np.isin(ids, known).any():
            raise CleanbufError(
                "expect_reset_rows() goes with layout='stream_key', before the streams' "
                f"first rows; got layout={self.options.layout!r}, stream ids {ids.tolist()} "
                f"(known: {known.tolist()})."
            )
        carry = carry.expect_resets(len(ids))
        carry.stream_ids = np.concatenate([known, ids])
        carry.layout_kind, carry.stream_shape = "stream_key", (len(known) + len(ids),)
        self.state.carry = carry

    def last_call_stored(self) -> None:
        """Says that the last call's rows were stored.

        The same batch again is then written twice (a
        :class:`~cleanbuf.ContinuityError`), never taken for a retry of a
        failed write.
        """
        if self._before is not None:
            self._stored = True

    def undo_last_call(self) -> bool:
        """Goes back to before the last call, whose rows never reached the buffer.

        The rows that call released are held again, its counters undone.
        Returns whether there was a call to undo.
        """
        if self._before is None or self._stored:
            return False
        self.state, self._before, self._fingerprint = self._before, None, None
        return True

    def _forget_last_call(self) -> None:
        """No call to repeat or undo (a flush, a loaded state)."""
        self._before, self._fingerprint, self._stored = None, None, False

    def flush(self, on_lost_terminal_obs: str | None = None) -> TensorDictBase:
        """Returns the held rows (flat ``[H]``) and forgets them.

        A held row waits for the row after it: the reset row holding its
        terminal observation (next-step data), or its successor
        (observation-only data). At a flush that row will not come. A held
        done row whose next observation is stored (an undecided batch-end
        mark's, as the kernel found it when it held the row) is complete
        and returned as it is; any other held row has lost its next
        observation, and the lost-observation policy applies
        (counted in ``terminal_obs_missing`` for done rows and
        ``next_obs_missing`` for the others). A reset row arriving after a
        flush is still recognised and dropped. With several producers, every
        producer's held rows, producer after producer.
        """
        self._forget_last_call()  # a flush is no call to repeat
        options = self.options
        if on_lost_terminal_obs is not None:
            if on_lost_terminal_obs not in LOST_POLICIES:
                raise CleanbufError(
                    f"on_lost_terminal_obs={on_lost_terminal_obs!r}: expected one of "
                    f"{LOST_POLICIES}. Nothing was flushed."
                )
            options = dataclasses.replace(options, on_lost_terminal_obs=on_lost_terminal_obs)
        carries = self.state.producers or [self.state.carry]
        outs = [flush_carry(options, carry, self.state.stats) for carry in carries]
        outs = [o for o in outs if o.batch_size[0]]
        return torch.cat(outs) if outs else TensorDict({}, batch_size=[0])

    def state_dict(self) -> dict:
        """The carry state, counters and options, as tensors and plain Python values."""
        carry, producers = self.state.carry, self.state.producers
        state = {**carry.state_dict(), "stats": self.stats, "options": self.options.as_dict()}
        if producers:
            state["producers"] = [c.state_dict() for c in producers]
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
        self.state = State(carry, groups, dict.fromkeys(STAT_NAMES, 0) | stats)
        self._forget_last_call()

    # ----------------------------------------------------------- helpers
    def _commit_layout(self, layout) -> None:
        c = self.state.carry
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


def flush_carry(options: Options, carry: Carry, stats: dict) -> TensorDictBase:
    """Returns ``carry``'s held rows (flat ``[H]``), forgets them, and counts them.

    A held row waits for the row after it: the reset row holding its
    terminal observation (next-step data), or its successor
    (observation-only data). At a flush that row will not come. What each
    held row is was decided by the kernel when it held it, and is in the
    carry's flags (:meth:`~cleanbuf.engine._state.Carry.held_marks`): a
    batch-end mark still undecided whose next observation is stored is
    complete and returned as it is; any other held row (a done row whose
    terminal observation was not stored, an observation-only row) has lost
    its next observation, and the lost-observation policy applies (counted
    in ``terminal_obs_missing`` for done rows and ``next_obs_missing`` for
    the others). ``carry`` and ``stats`` are updated in place.
    """
    n_held = len(carry.held_stream)
    if n_held == 0:
        return TensorDict({}, batch_size=[0])
    rows = dict(carry.held)  # ours, forgotten below: patched in place
    bookkeeping = {k for k in (options.is_init_key, options.step_count_key) if k}
    obs_keys, obs_only = observation_keys(rows, options.observation_keys, bookkeeping)
    done = done_flags(Views(rows, 1, n_held), options.done_key)
    marked, marks_seen, stored = carry.held_marks()
    missing = ~(marked & stored)
    # An undecided mark whose next observation is not stored: where the
    # producer showed that it marks batch ends, maybe no episode end at all
    # (its next observation is missing); else a real end whose terminal
    # observation was zero-filled (lost).
    done = done & ~(marked & marks_seen)
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
    carry.flushed()
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


def written_twice() -> ContinuityError:
    """The error for a batch that comes again after its rows were stored."""
    return ContinuityError(
        "this batch is the one the last call cleaned (the same first row in every stream), "
        "and that call's rows were stored: it was written twice. Expected the next batch of "
        "each stream, got the last one again. Write each batch once (a batch whose write "
        "into the buffer failed may be written again; this one's write succeeded). In a raw "
        "loop, this is also what a step that does not move on looks like: set obs = next_obs "
        "after each step. Nothing was written."
    )
