"""The stateful cleaner: TensorDict in, flat cleaned rows out.

A call (:meth:`Cleaner.clean`) is one step over the producer's
:class:`~cleanbuf.engine._state.Carry`:

1. **read** (:meth:`Cleaner.read`, :mod:`cleanbuf.engine._read`): layout, flags, observation
   keys and stream ends, checked; a batch with nothing to clean passes through as views;
2. **plan** (:func:`plan_call`): the kernel decides, from
   flags only, which rows to drop, hold or emit, where each next observation comes from and
   which held rows are released;
3. **write** (:mod:`cleanbuf.engine._write`): the kept rows moved into fresh tensors, their
   next observations and bookkeeping patched (never the caller's batch);
4. **commit** (:meth:`Cleaner.commit`): the call's carry becomes current, the counters count it.

Everything that raises does so before the commit, so a failed call changes nothing.

**The one undo**: the cleaner keeps its state from before the last call and that call's
fingerprint (each stream's first row, compared by the kernel). That batch again (its write
into the buffer failed) is cleaned as if the last call had not happened; once its rows are
known stored (:meth:`Cleaner.last_call_stored`) it is written twice, a
:class:`~cleanbuf.ContinuityError`; once its write is known failed
(:meth:`Cleaner.undo_last_call`) the cleaner goes back at once. Without trajectory ids a
batch is taken for the last one only when its call fails, so a new batch that merely starts
like the last one is never undone.

:mod:`cleanbuf.engine._routing` picks the carry for batches of several producers;
:meth:`Cleaner.flush` releases the held rows. The whole state (carries and counters) is one
:class:`~cleanbuf.engine._state.State`, ``cleaner.state``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

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
    TerminalObservationLostError,
    key_name,
)
from cleanbuf.engine._kernels import NO_ROWS, RELEASED_LOST, KernelResult, Selection
from cleanbuf.engine._keys import Views, done_flags, observation_keys
from cleanbuf.engine._options import LOST_POLICIES, Options
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

# ------------------------------------------------------------------ the plan
# What the kernel planned for a call (run by the read step): the rows to drop,
# hold or emit, the held rows it releases and the lost-observation policy.
# Numpy arrays and counts; no tensor is touched here.


def bad_reset_row(row: int, stream: int, done: bool, reward_key: tuple) -> ResetRowError:
    """The error for a supposed reset row that is not one (the safety net)."""
    what = "is itself done" if done else f"has a nonzero reward ({key_name(reward_key)})"
    return ResetRowError(
        f"row {row} (stream {stream}) follows a done row, so in next-step mode it "
        f"must be an auto-reset row (reward exactly 0, not done), but it {what}. "
        "The configuration is likely wrong: same-step or already-clean data "
        "(TorchRL GymWrapper over a SAME_STEP or DISABLED env, SB3 VecEnv) needs "
        "mode='same_step' or 'disabled'; TorchRL GymEnv(num_envs=N) needs "
        "joint_reset=True; AutoresetFilter.for_env(env) sets both. If a reward "
        "transform inside the env shifts rewards away from 0, pass "
        "check_reset_rows=False. If the configuration is right, a batch was skipped or "
        "came out of order (the row after a done row is not its reset row), or a raw loop "
        "reset envs itself (envs.reset()) after they ended: build that step's rows with "
        "cleanbuf.step_rows(..., reset=mask), True for the envs reset. Nothing was written."
    )


def lost_policy(
    options: Options, obs_keys: list, leaves: dict, n_lost: int, final_missing: bool
) -> str:
    """The lost-observation policy to apply to ``n_lost`` rows, or raise.

    Args:
        options: the cleaner's options.
        obs_keys: the observation keys.
        leaves: the call's leaves (for the observations' dtypes).
        n_lost: rows whose next observation is lost.
        final_missing: the rows are same-step done rows without a final
            observation, where the default is to raise.

    Returns:
        "nan", "drop" or "keep".

    Raises:
        TerminalObservationLostError: the policy is to raise, or none was
            chosen where NaN cannot mark the rows.
        InputError: "nan" chosen for integer observations.
    """
    policy = options.on_lost_terminal_obs
    if n_lost == 0:
        return policy or "nan"
    ints = [k for k in obs_keys if not leaves[k].is_floating_point()]
    nan = "" if ints else " or 'nan' (mark them NaN)"  # (NaN cannot mark integers)
    choices = (
        "Choose on_lost_terminal_obs='drop' (do not store those rows), 'keep' (store them as "
        f"the producer left them){nan}, where the "
        "options are given (AutoresetFilter(..., on_lost_terminal_obs='drop'), "
        "AutoresetFilter.for_env(env, on_lost_terminal_obs='drop'), clean(...) or "
        "RolloutRepair(...) alike). Nothing was written."
    )
    if policy is None and final_missing:
        raise TerminalObservationLostError(
            f"{n_lost} done row(s) have no final observation (no final-observation "
            "entry such as ('next', 'final_obs'), ('next', 'final_observation') or "
            "('next', 'terminal_observation'), or its mask says it is absent), so "
            "their next observation would be the reset observation. Store the final "
            "observation (cleanbuf.step_rows reads it from the info: pass the step's info), "
            f"name it with final_obs_key=, or: {choices}"
        )
    if policy == "raise" or (policy is None and ints):
        why = (
            f"observation keys {', '.join(key_name(k) for k in ints)} are not floating "
            "point, so NaN cannot mark them"
            if policy is None
            else "on_lost_terminal_obs='raise'"
        )
        keys = ", ".join(key_name(("next", *k)) for k in obs_keys)
        raise TerminalObservationLostError(
            f"{n_lost} next observation(s) ({keys}) are lost (the producer reset every env of "
            "a reset group at once, the final observation is absent, or the row after "
            f"never arrived) and {why}. To lose none, use a producer that keeps terminal "
            "observations (for TorchRL's GymEnv(name, num_envs=N): "
            f"cleanbuf.lossless_gym_env(name, num_envs)). Else: {choices}"
        )
    if policy == "nan" and ints:
        raise InputError(
            f"on_lost_terminal_obs='nan' cannot mark observation keys "
            f"{', '.join(f'{key_name(k)} ({leaves[k].dtype})' for k in ints)}. Choose "
            "'drop' or 'keep'."
        )
    return policy or "nan"


_NO_FLAGS = np.zeros(0, np.bool_)


class Release:
    """The held rows a call releases, in output order (they come first).

    Attributes:
        streams: their streams.
        slots: their slots in the carry's held rows.
        src: per row, the call's row holding its next observation, or
            ``RELEASED_LOST`` (lost: a restart cut it off),
            ``RELEASED_AS_IS`` (complete as stored: its end was only a mark)
            or ``RELEASED_STORED`` (complete as stored: a real end whose
            terminal observation it holds).
        lost_done: per lost row (dropped ones included), whether it is a
            done row.
        n_dropped: lost rows left out (the "drop" policy).
        n: rows released (``len(streams)``).
        n_stitched: released rows whose next observation this call brings.
        n_lost: released rows whose next observation is lost.
        n_terminal_lost: of those, the done rows.
    """

    __slots__ = (
        "streams", "slots", "src", "lost_done", "n_dropped", "n", "n_stitched", "n_lost",
        "n_terminal_lost",
    )  # fmt: skip

    def __init__(self, streams, slots, src, lost_done, n_dropped: int = 0):
        self.streams, self.slots, self.src, self.lost_done = streams, slots, src, lost_done
        self.n_dropped = n_dropped
        self.n = len(streams)
        self.n_stitched = int(np.count_nonzero(src >= 0)) if self.n else 0
        self.n_lost = len(lost_done)
        self.n_terminal_lost = int(np.count_nonzero(lost_done)) if self.n_lost else 0

    @classmethod
    def of(cls, carry: Carry, released_src: np.ndarray, done_key) -> Release:
        """Reads the kernel's per-stream ``released_src`` against the held rows (some held)."""
        slot_of = np.full(len(released_src), -1, np.int64)
        slot_of[carry.held_stream] = np.arange(len(carry.held_stream))
        streams = np.flatnonzero((released_src != -1) & (slot_of >= 0))
        slots, src = slot_of[streams], released_src[streams]
        lost_done = _NO_FLAGS
        if np.count_nonzero(src == RELEASED_LOST):
            held = Views(carry.held, 1, len(carry.held_stream))
            lost_done = done_flags(held, done_key)[slots[src == RELEASED_LOST]]
        return cls(streams, slots, src, lost_done)

    def without_lost(self) -> Release:
        """The same release with the lost rows left out (the "drop" policy)."""
        keep = self.src != RELEASED_LOST
        return Release(
            self.streams[keep],
            self.slots[keep],
            self.src[keep],
            self.lost_done,
            n_dropped=len(self.src) - int(np.count_nonzero(keep)),
        )


NO_RELEASE = Release(NO_ROWS, NO_ROWS, NO_ROWS, _NO_FLAGS)  # no held row: nothing released


class Plan(NamedTuple):
    """What the kernel planned for a call, and what it means for the held rows.

    Attributes:
        sel: the call's rows to emit and to hold, and their patches.
        released_src: per stream, the source of its held row's next
            observation (see :class:`~cleanbuf.engine._kernels.KernelResult`).
        per_stream: the new carry flags, int64[5, S].
        n_drop: reset rows dropped.
        n_lost: done rows of the call whose terminal observation is lost.
        n_next_lost: other rows of the call whose next observation is lost.
        n_done: episode ends completed.
        release: the held rows of earlier calls this call releases.
        policy: the lost-observation policy that applies ("nan", "drop" or
            "keep").
    """

    sel: Selection
    released_src: np.ndarray
    per_stream: np.ndarray
    n_drop: int
    n_lost: int
    n_next_lost: int
    n_done: int
    release: Release
    policy: str


def plan_call(call: Call, options: Options) -> Plan:
    """Reads the kernel's plan of a call (``call.planned``) into a :class:`Plan`.

    Changes nothing: the kernel returned a fresh carry array.

    Args:
        call: a call read (and planned) by the read step.
        options: the cleaner's options.

    Raises:
        ResetRowError: a row that should be a reset row is not one.
        TerminalObservationLostError, InputError: see :func:`lost_policy`.
    """
    layout = call.layout
    sel, *rest = call.planned  # (read and planned in one kernel call)
    k = KernelResult(Selection(*sel), *rest)
    if k.bad_row >= 0:
        stream = int(layout.stream_of(np.array([k.bad_row]))[0])
        bad = k.bad_row
        raise bad_reset_row(bad, stream, bool(call.done[bad]), options.reward_key)
    release = NO_RELEASE
    if len(call.carry.held_stream):
        release = Release.of(call.carry, k.released_src, options.done_key)
    n_lost = k.n_lost + k.n_next_lost + release.n_lost
    policy = options.on_lost_terminal_obs or "nan"
    if n_lost:
        same_step = options.mode == "same_step"
        policy = lost_policy(options, call.obs_keys, call.views.tensors, n_lost, same_step)
    if policy == "drop":
        release = release.without_lost()
    return Plan(
        k.sel, k.released_src, k.carry, k.n_drop, k.n_lost, k.n_next_lost, k.n_done,
        release, policy,
    )  # fmt: skip


# ------------------------------------------------------------ the cleaner
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

    The engine of :class:`cleanbuf.AutoresetFilter` and :func:`cleanbuf.clean` (options
    documented there).

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
        # Set by the filter inside a Ray actor: producers whose trajectory ids may collide.
        self.many_producers = False
        # The one undo (see the module): the state before the last call, its fingerprint,
        # whether its rows are known stored.
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

        A call that fails leaves the cleaner as it was; the last call's batch again is the
        undo (see the module).

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

        Returns the rows and the state to undo them to. Refused, the state left as ``undo``,
        where the last call's rows were stored or the batch fails from there too.
        """
        before = self._before
        if self._stored:
            # First rows alone may match (every stream restarting): same if it cleans from before.
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
            The rows to store. The call's fingerprint (None where it reads no stream ends)
            is left in ``self._reader.fingerprint``, by a failed call too.
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
        call = self._reader.read(td, self.state.carry, before)
        if call.as_is:
            return self._pass_through(call)
        plan = plan_call(call, self.options)
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

        The same kernel call plans it (``call.planned``, read by :func:`plan_call`), unless it
        has nothing to clean and not ``plan``. ``keep_lost`` keeps the rows whose next
        observation is lost; ``before`` is the last call's fingerprint.
        """
        return self._reader.read(td, self.state.carry, before, plan, keep_lost)

    def _pass_through(self, call: Call) -> TensorDictBase:
        """Every row as it came, as views of the batch (disabled mode, or nothing to clean)."""
        carry, layout = call.carry, call.layout
        if carry is not None:
            # A pending is_init fix left here means the rows have no is_init: moot.
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
        for k in call.moved:  # (from the numpy view where there is one: cheaper)
            a = views.get(k)
            rows[k] = views.flat(k) if a is None else torch.from_numpy(a)
        return as_td(rows, layout.n_rows, call.device)

    # ------------------------------------------------------- 3. write: move
    def _move(self, call: Call, plan: Plan) -> tuple[Views, dict]:
        """Gathers the output rows and the rows to hold.

        Released held rows first, then the emitted rows; every key the patches write is a copy.
        """
        opts, sel, release = self.options, plan.sel, plan.release
        patched = set()
        lost = len(sel.lost) or release.n_lost
        if call.rules.stitch and not call.obs_only and (
            len(sel.stitched) or release.n_stitched or len(sel.final)
            or (lost and plan.policy == "nan")
        ):  # fmt: skip
            for k in call.obs_keys:
                patched.add(("next", *k))
        if len(sel.emit_init):
            patched.add(opts.is_init_key)
        if len(sel.emit_shift):  # fix_bookkeeping shifts whichever step counts are present
            patched.update(opts.step_count_keys)
        return move(
            call.moved, call.views, call.carry.held, release.slots, sel.emit, sel.hold,
            call.layout.n_rows, patched, self._pool,
        )  # fmt: skip

    # ------------------------------------------------------ 3. write: patch
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

    # ------------------------------------------------------------ 4. commit
    def commit(self, call: Call, plan: Plan, new_held: dict) -> None:
        """Makes the call's carry state current and counts the call.

        Nothing here raises (the kernel returned a fresh carry array: the old state is
        untouched until here).
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

        For rows whose done row a wrapped buffer overwrote, keeping its reset row: that row
        is dropped and the next episode's bookkeeping fixed. ``layout="stream_key"`` only,
        before the streams' first rows (else a ``CleanbufError``).

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

        The same batch again is then written twice (a :class:`~cleanbuf.ContinuityError`),
        never a retry of a failed write.
        """
        if self._before is not None:
            self._stored = True

    def undo_last_call(self) -> bool:
        """Goes back to before the last call, whose rows never reached the buffer.

        The rows it released are held again, its counters undone. Returns whether there
        was a call to undo.
        """
        if self._before is None or self._stored:
            return False
        self.state, self._before, self._fingerprint = self._before, None, None
        return True

    def _forget_last_call(self) -> None:
        """No call to repeat or undo (a flush, a loaded state)."""
        self._before, self._fingerprint, self._stored = None, None, False

    def flush(self, on_lost_terminal_obs: str | None = None) -> TensorDictBase:
        """Returns the held rows (flat ``[H]``), producer after producer, and forgets them.

        What becomes of each held row: :func:`flush_carry`. A reset row arriving after a
        flush is still recognised and dropped.

        Args:
            on_lost_terminal_obs: the lost-observation policy for this flush; None: the
                option's.

        Raises:
            CleanbufError: an unknown policy (nothing flushed).
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

    The row each one waits for (its reset row, or its successor) will not come. The kernel
    decided what each is when it held it (:meth:`~cleanbuf.engine._state.Carry.held_marks`):
    an undecided batch-end mark whose next observation is stored is returned as it is; any
    other row has lost its next observation and gets the lost-observation policy (counted in
    ``terminal_obs_missing`` for done rows, ``next_obs_missing`` for the others). Updates
    ``carry`` and ``stats`` in place.
    """
    n_held = len(carry.held_stream)
    if n_held == 0:
        return TensorDict({}, batch_size=[0])
    rows = dict(carry.held)  # ours, forgotten below: patched in place
    bookkeeping = {k for k in (options.is_init_key, options.step_count_key) if k}
    obs_keys, obs_only = observation_keys(rows, options.observation_keys, bookkeeping)
    done = done_flags(Views(rows, 1, n_held), options.done_key)
    marked, stored = carry.held_marks()
    missing = ~(marked & stored)  # (an undecided mark not stored: a real end, zero-filled)
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
    stats["episodes_completed"] += int((marked & ~stored & done).sum())  # real ends
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
        "this batch starts where the last call's started (the same first row in every "
        "stream), and that call's rows were stored: either the same batch was written twice, "
        "or, in a raw loop, the step did not move on. Write each batch once (a batch whose "
        "write into the buffer failed may be written again; this one's write succeeded), and "
        "in a raw loop set obs = next_obs after each step. Expected the next batch of each "
        "stream. Nothing was written."
    )
