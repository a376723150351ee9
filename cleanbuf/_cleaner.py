"""The stateful cleaner: TensorDict in, flat cleaned rows out.

It validates a call, plans it with the numba kernels from flags only, moves
the rows, writes next observations and bookkeeping into the fresh copies,
and only then commits its carry state (held rows, per-stream flags,
counters). Anything that raises does so before the commit, so a failed call
changes nothing.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from cleanbuf import _kernels
from cleanbuf._carry import Carry
from cleanbuf._continuity import CallEnds, LastRows
from cleanbuf._errors import (
    CleanbufError,
    InputError,
    LayoutError,
    ResetRowError,
    TerminalObservationLostError,
)
from cleanbuf._kernels import (
    MARKED,
    NEED_INIT,
    NO_ROWS,
    PENDING,
    RELEASED_LOST,
    SHIFT,
    WAITING,
    Selection,
)
from cleanbuf._keys import (
    batch_leaves,
    check_same_layout,
    done_flags,
    final_entries,
    observation_keys,
)
from cleanbuf._keys import (
    row_flags as _flags,
)
from cleanbuf._layout import CallLayout, resolve
from cleanbuf._move import Views
from cleanbuf._options import Options
from cleanbuf._patch import as_td, fill_rows, fix_bookkeeping, move, write_next_obs
from cleanbuf._pool import BufferPool
from cleanbuf._retry import Fingerprint, SameBatchAgain, Undo

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


_NO_FLAGS = np.zeros(0, np.bool_)  # an absent optional per-row array, for the kernel
# What a call without a final-observation entry has of one (see final_entries).
_NO_FINAL = ({}, None, frozenset())


def _fmt(key: tuple) -> str:
    return repr(key[0]) if len(key) == 1 else repr(key)


class Cleaner:
    """Cleans auto-reset data, call after call, keeping the carry state.

    This is the engine behind :class:`cleanbuf.AutoresetFilter` and
    :func:`cleanbuf.clean`; the options are documented there.

    Args:
        options: the validated options.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from cleanbuf._options import Options
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

    def __init__(self, options: Options):
        self.options = options
        self._carry = Carry()
        # With producer_key: one carry per producer (worker); self._carry is
        # the one of the producer of the call in progress.
        self._groups: list[Carry] = []
        self._undo: Undo | None = None  # before the last call (see __call__)
        self._fingerprint: Fingerprint | None = None  # of the call in progress
        self._stats = dict.fromkeys(STAT_NAMES, 0)
        self._pool = BufferPool()
        self._layouts: dict = {}  # (batch size, names) -> CallLayout, for the fixed layouts
        self._obs_keys: dict = {}  # leaf keys -> discovered observation keys

    # ------------------------------------------------------------------ API
    @property
    def stats(self) -> dict:
        """A copy of the counters (see ``STAT_NAMES``), as plain Python ints."""
        return {k: int(v) for k, v in self._stats.items()}

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        """Cleans one call's batch; returns the rows to store, flat ``[M]``.

        A batch that comes again right after its call (its write into the
        buffer failed, :mod:`cleanbuf._retry`) is cleaned as if that call
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
        self._fingerprint = None
        if self.options.producer_key is None:
            return self._clean(td)
        group, last_ids = self._producer_of(td)
        self._carry = self._groups[group] if group < len(self._groups) else Carry()
        out = self._clean(td)  # commits into self._carry, or raises having changed nothing
        self._carry.traj_ids = last_ids
        if group == len(self._groups):
            self._groups.append(self._carry)
        self._groups[group] = self._carry
        self._stats["rows_held"] = sum(len(c.held_stream) for c in self._groups)
        return out

    def _producer_of(self, td: TensorDictBase) -> tuple[int, np.ndarray]:
        """Which producer's streams a batch continues (``producer_key``), and the
        trajectory ids of its last rows.

        A trajectory id belongs to one stream of one producer (TorchRL draws
        them from one pool for all workers), so a batch whose first row of
        any stream carries the id of a producer's last row continues that
        producer. A batch that continues none is a producer's first, or
        every stream of its producer ended (or restarted) at the batch
        boundary: then any producer whose streams all ended, with nothing
        held, pending or open, is as good as a new one.
        """
        key = self.options.producer_key
        if td.batch_dims < 2 or key not in td.keys(include_nested=True):
            raise InputError(
                f"producer_key={key!r} needs [*E, T] batches holding that key (TorchRL's "
                f"trajectory ids); got batch_size={list(td.batch_size)} and keys "
                f"{sorted(td.keys(True, True), key=str)}. Extend the buffer with the "
                "collector's batches as they come."
            )
        ids = td.get(key).reshape(*td.batch_size).reshape(-1, td.batch_size[-1])
        first, last = ids[:, 0].cpu().numpy(), ids[:, -1].cpu().numpy()
        if self._undo is not None and Fingerprint(True, {key: first}).same(self._undo.fingerprint):
            raise SameBatchAgain
        for g, carry in enumerate(self._groups):
            if len(carry.traj_ids) == len(first) and np.any(carry.traj_ids == first):
                return g, last
        for g, carry in enumerate(self._groups):
            if carry.is_blank():
                return g, last
        return len(self._groups), last

    def _clean(self, td: TensorDictBase) -> TensorDictBase:
        """Cleans one batch against ``self._carry``; commits only on success."""
        opts = self.options
        if not isinstance(td, TensorDictBase):
            raise InputError(
                f"expected a TensorDict, got {type(td).__name__}; use cleanbuf.clean() "
                "for dicts of arrays."
            )
        layout = self._layout(td)
        leaves = batch_leaves(td)  # as stored; read as rows through views
        n, bd = layout.n_rows, td.batch_dims
        views = Views(leaves, bd, n)
        done = done_flags(views, opts.done_key)
        if opts.mode == "disabled":
            return self._pass_through(views, leaves, layout, done, td.device)
        obs_keys, obs_only = self._observation_keys(leaves)
        same_step = opts.mode == "same_step"
        stitch = not (obs_only and opts.compact)
        final_of, present, entry_keys = (
            final_entries(leaves, opts.final_obs_key, obs_keys, n, bd) if same_step else _NO_FINAL
        )
        moved = leaves
        if entry_keys and not opts.keep_final_obs:
            moved = {k: v for k, v in leaves.items() if k not in entry_keys}
        if len(self._carry.held_stream):
            self._check_held_schema(moved, bd)
        n_streams = layout.n_streams
        carry = self._carry.grown(n_streams) if n_streams > self._carry.n_streams else self._carry
        restart = self._restart_rows(views, n)
        last = self._continuity(views, obs_keys, obs_only, layout, done, restart)
        if (
            not (obs_only and stitch)
            and not np.count_nonzero(done)
            and self._nothing_pending(carry, leaves)
        ):
            # No episode end, no row waiting, no fix pending: the rows are clean
            # as they are (views of the batch; nothing is copied). A pending
            # is_init fix can only be left here if the rows have no is_init:
            # it is moot, forget it.
            if np.count_nonzero(carry.per_stream[NEED_INIT]):
                carry.per_stream = carry.per_stream.copy()
                carry.per_stream[NEED_INIT] = 0
            carry.last = last
            self._carry = carry
            return self._pass_through(views, moved, layout, done, td.device)
        mark = self._mark_rows(views, layout, done, restart)
        planned = _kernels.plan_rows(
            n,
            layout.steps,
            layout.stream,
            done,
            self._joint(done, mark, layout, n_streams) if opts.joint_reset else _NO_FLAGS,
            _NO_FLAGS if present is None else present,
            bool(final_of),
            self._reward_rows(views, n),
            restart,
            mark,
            carry.per_stream,
            not same_step,
            obs_only and stitch,
            same_step and stitch,
            stitch,
            stitch and (obs_only or not self._in_done_row(layout.kind)),
            opts.on_lost_terminal_obs == "drop",
        )
        rows, ends, released_src, per_stream, n_drop, n_lost, n_next_lost, n_done, bad_row = planned
        if bad_row >= 0:
            self._raise_bad_reset_row(bad_row, done, layout)
        rel = _Release.of(carry, released_src, n_streams, opts.done_key)
        policy = self._lost_policy(
            obs_keys, leaves, n_lost + n_next_lost + rel.n_lost, final_missing=same_step
        )
        if policy == "drop":
            rel = rel.without_lost()
        sel = Selection.unpack(rows, ends)
        emit, hold, stitched, _, lost, final, emit_init, hold_init, emit_shift, hold_shift = sel
        rel_streams, rel_slots = rel.streams, rel.slots
        n_rel = len(rel_streams)
        patched = set()
        if (
            stitch
            and not obs_only
            and (
                len(stitched)
                or rel.n_stitched
                or len(final)
                or ((len(lost) or rel.n_lost) and policy == "nan")
            )
        ):
            patched.update(("next", *k) for k in obs_keys)
        if len(emit_init):
            patched.add(opts.is_init_key)
        if len(emit_shift):  # fix_bookkeeping shifts whichever step counts are present
            patched.update(opts.step_count_keys)
        out, new_held = move(
            moved, views, carry.held, rel_slots, emit, hold, n, patched, self._pool
        )
        if stitch:
            write_next_obs(out, n_rel, views, obs_keys, sel, rel.src, final_of, policy, obs_only)
        fix_bookkeeping(out, n_rel, emit_init, emit_shift, opts.is_init_key, opts.step_count_keys)
        if new_held:
            fix_bookkeeping(
                Views(new_held), 0, hold_init, hold_shift, opts.is_init_key, opts.step_count_keys
            )
        # Commit: nothing below raises. (The kernel returned a fresh carry array,
        # so until here the old state was untouched.)
        carry.per_stream = per_stream
        carry.last = last
        if len(carry.held_stream) or len(hold):
            kept_old = released_src[carry.held_stream] == -1
            carry.held = _cat_held(carry.held, kept_old, new_held)
            carry.held_stream = np.concatenate(
                [carry.held_stream[kept_old], layout.stream_of(hold)]
            )
        self._carry = carry
        self._commit_layout(layout)
        n_out = n_rel + len(emit)
        s = self._stats
        s["rows_in"] += n
        s["rows_out"] += n_out
        s["reset_rows_dropped"] += n_drop
        s["next_obs_restitched"] += (len(stitched) + rel.n_stitched + len(final)) if stitch else 0
        s["terminal_obs_missing"] += n_lost + rel.n_terminal_lost
        s["next_obs_missing"] += n_next_lost + rel.n_lost - rel.n_terminal_lost
        s["lost_rows_dropped"] += (n_lost + n_next_lost + rel.n_dropped) if policy == "drop" else 0
        s["episodes_completed"] += n_done
        s["rows_held"] = len(carry.held_stream)
        return as_td(out.tensors, n_out, td.device)

    def flush(self) -> TensorDictBase:
        """Returns the held rows (flat ``[H]``) and forgets them.

        With ``producer_key``, every producer's held rows, producer after
        producer.

        A held row waits for the row after it: the reset row holding its
        terminal observation (next-step data), or its successor
        (observation-only data). At a flush that row will not come. A done
        row whose producer stores the terminal observation in the row itself
        (``terminal_obs_in_done_row``) is complete; any other held row has
        lost its next observation, and the lost-observation policy applies
        (counted in ``terminal_obs_missing`` for done rows and
        ``next_obs_missing`` for the others). A reset row arriving after a
        flush is still recognised and dropped.
        """
        self._undo = None  # a flush is no call to repeat
        if self.options.producer_key is None:
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
        in_done_row = self._in_done_row(carry.layout_kind)
        missing = np.ones(n_held, np.bool_) if obs_only else ~np.full(n_held, in_done_row)
        # A collector's batch-end mark still undecided: maybe no episode end at
        # all, and maybe one whose terminal observation was zero-filled.
        marked = carry.per_stream[MARKED][carry.held_stream] != 0
        missing |= marked
        done = done & ~marked
        n_terminal = int((missing & done).sum())
        n_next = int((missing & ~done).sum())
        policy = self._lost_policy(obs_keys, rows, n_terminal + n_next, final_missing=False)
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
        self._carry.held, self._carry.held_stream = {}, np.zeros(0, np.int64)
        per_stream = carry.per_stream.copy()
        per_stream[WAITING] = 0
        self._carry.per_stream = per_stream
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
        if self.options.producer_key is not None:
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
        saved = state.get("options")
        if saved is not None:
            mine = self.options.as_dict()
            diff = [
                f"{k}={saved.get(k)!r} (this filter: {v!r})"
                for k, v in mine.items()
                if saved.get(k) != v
            ]
            if diff:
                raise InputError(
                    f"this state was saved by a filter with other options: {', '.join(diff)}. "
                    "Build the filter with the options it was saved with (or the same "
                    "for_env producer) before loading it."
                )
        groups = [Carry.from_state_dict(g) for g in state.get("producers", ())]
        self._carry, self._groups, self._undo = carry, groups, None
        self._stats = dict.fromkeys(STAT_NAMES, 0) | {k: int(v) for k, v in state["stats"].items()}

    # ------------------------------------------------------------ internals
    def _bookkeeping(self) -> set:
        return {k for k in (self.options.is_init_key, self.options.step_count_key) if k}

    def _in_done_row(self, layout_kind: str | None) -> bool:
        """Whether a done row already holds its terminal observation: as
        configured, else True except for time-last (TorchRL collector) batches,
        whose done rows TorchRL zero-fills.
        """
        if self.options.terminal_obs_in_done_row is not None:
            return self.options.terminal_obs_in_done_row
        return layout_kind != "time_last"

    def _nothing_pending(self, carry, leaves: dict) -> bool:
        """True when, in a call without an episode end, there is no reset row
        to drop, no row waiting, and no bookkeeping fix that applies to the
        keys the call has.
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

    def _observation_keys(self, leaves: dict) -> tuple[list, bool]:
        """:func:`observation_keys`, whose key discovery is remembered per key set;
        the shapes and dtypes are checked on every call.
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
        opts = self.options
        stream_ids = None
        if opts.layout == "stream_key":
            if opts.stream_key not in td.keys(include_nested=True):
                raise InputError(
                    f"stream key {_fmt(opts.stream_key)} is missing from the batch; it "
                    "must hold each row's stream (env) id."
                )
            stream_ids = td.get(opts.stream_key)
        names = td.names if td.batch_dims else None
        if stream_ids is None:
            cache_key = (td.batch_size, None if names is None else tuple(names))
            layout = self._layouts.get(cache_key)
            if layout is None:
                layout = resolve(td.batch_size, names, opts.layout, None, None)
                if len(self._layouts) < 64:
                    self._layouts[cache_key] = layout
        else:
            layout = resolve(td.batch_size, names, opts.layout, stream_ids, self._carry.stream_ids)
        c = self._carry
        if c.layout_kind is None or layout.kind == "stream_key":
            return layout
        if layout.kind != c.layout_kind or layout.stream_shape != c.stream_shape:
            raise LayoutError(
                f"the streams changed between calls: earlier calls had {c.layout_kind} "
                f"streams of shape {list(c.stream_shape)}, this call has {layout.kind} "
                f"streams of shape {list(layout.stream_shape)}. Each stream must stay "
                "the same env across calls. Call flush() and use a new filter for a new "
                "env set, or use stream_key= if envs come and go."
            )
        return layout

    def _commit_layout(self, layout: CallLayout) -> None:
        c = self._carry
        if layout.kind == "stream_key":
            old = c.stream_ids if c.stream_ids is not None else np.zeros(0, np.int64)
            c.stream_ids = np.concatenate([old, layout.new_stream_ids])
        c.layout_kind, c.stream_shape = layout.kind, layout.stream_shape

    def _check_held_schema(self, leaves: dict, batch_dims: int) -> None:
        """Raises unless the batch's leaves match the held rows (called while
        rows are held).
        """
        held = self._carry.held
        if set(held) != set(leaves):
            raise InputError(
                f"the batch keys changed while rows are held: held rows have "
                f"{sorted(held, key=str)}, this batch has {sorted(leaves, key=str)}. Keep "
                "the keys stable, or call flush() before changing them."
            )
        for k, v in leaves.items():
            h = held[k]
            if h.dtype != v.dtype or h.shape[1:] != v.shape[batch_dims:]:
                raise InputError(
                    f"key {_fmt(k)} changed while rows are held: held rows have shape "
                    f"{list(h.shape[1:])} and dtype {h.dtype} per row, this batch has "
                    f"{list(v.shape[batch_dims:])} and {v.dtype}. Call flush() before changing it."
                )

    def _joint(
        self, done: np.ndarray, mark: np.ndarray, layout: CallLayout, n_streams: int
    ) -> np.ndarray:
        """Per row, done at a step where its whole reset group is done (with
        ``joint_reset``); a collector's undecided batch-end marks do not count
        (if they hid a real joint reset, the next row is a restart).
        """
        group = self.options.reset_group_size or n_streams
        if n_streams % group:
            raise LayoutError(
                f"reset_group_size={group} does not divide the {n_streams} streams of "
                f"shape {list(layout.stream_shape)}; it must be the number of envs that "
                "reset together (the envs of one TorchRL GymEnv / worker)."
            )
        if len(mark):
            done = done & ~mark
        d = done.reshape(n_streams // group, group, layout.steps)
        return (d & d.all(axis=1, keepdims=True)).reshape(-1)

    def _continuity(
        self,
        views: Views,
        obs_keys: list,
        obs_only: bool,
        layout: CallLayout,
        done: np.ndarray,
        restart: np.ndarray,
    ) -> LastRows:
        """Checks that the call continues the streams of the calls before it
        (:mod:`cleanbuf._continuity`) and is not the last call's batch again
        (:mod:`cleanbuf._retry`); returns the call's last rows, to commit.
        Time-aligned full transitions only: other calls keep what they had.
        """
        if obs_only or layout.kind == "stream_key":
            return self._carry.last
        first = layout.first_rows
        ends = CallEnds.of_call(views, obs_keys, first, layout.last_rows, done, restart)
        self._fingerprint = fingerprint = Fingerprint.of_call(views, first, ends)
        undo = self._undo
        if undo is not None and fingerprint.exact and undo.same_batch(fingerprint):
            raise SameBatchAgain
        if self.options.check_continuity:
            self._carry.last.check(ends)
        return LastRows.of(ends)

    def _restart_rows(self, leaves: Views, n_rows: int) -> np.ndarray:
        """Per row, whether it comes after a real reset of its env: ``is_init``
        where the rows have it, else ``step_count == 0``; empty when neither.
        """
        opts = self.options
        if opts.is_init_key is not None and opts.is_init_key in leaves.tensors:
            return _flags("is_init", opts.is_init_key, leaves)
        if opts.step_count_key is not None and opts.step_count_key in leaves.tensors:
            count = leaves.tensors[opts.step_count_key]
            return (count.reshape(n_rows, -1)[:, 0] == 0).cpu().numpy()
        return _NO_FLAGS

    def _mark_rows(
        self, leaves: Views, layout: CallLayout, done: np.ndarray, restart: np.ndarray
    ) -> np.ndarray:
        """With ``set_truncated``: per row, a done row on the call's last step
        whose only end signal may be the collector's truncation mark (empty
        otherwise).
        """
        if not self.options.set_truncated or not np.count_nonzero(done):
            return _NO_FLAGS
        if not len(restart):
            raise InputError(
                "set_truncated=True needs is_init (InitTracker) or step_count (StepCounter) "
                "in the rows: the row after a batch-end mark tells a real episode end (a "
                "reset) from a mark only through them. Add InitTracker() to the env, or "
                "build the collector without set_truncated."
            )
        mark = np.zeros(layout.n_rows, np.bool_)
        last = np.arange(layout.steps - 1, layout.n_rows, layout.steps)
        truncated = self._flag_or(leaves, ("next", "truncated"), True)
        terminated = self._flag_or(leaves, ("next", "terminated"), False)
        mark[last] = (done & truncated & ~terminated)[last]
        return mark

    @staticmethod
    def _flag_or(leaves: Views, key: tuple, default: bool) -> np.ndarray | bool:
        return _flags(key[-1], key, leaves) if key in leaves.tensors else default

    def _reward_rows(self, leaves: Views, n_rows: int) -> np.ndarray:
        """Per row, nonzero where the reward is not exactly 0 (for the reset-row check)."""
        key = self.options.reward_key
        if not self.options.check_reset_rows or key is None or key not in leaves.tensors:
            return _NO_FLAGS
        a = leaves[key]
        if a is not None and a.size == n_rows and a.dtype.kind != "c":
            return a.reshape(n_rows)
        reward = leaves.tensors[key]
        return (reward != 0).reshape(n_rows, -1).any(1).to(torch.uint8).cpu().numpy()

    def _raise_bad_reset_row(self, row, done, layout) -> None:
        stream = int(layout.stream_of(np.array([row]))[0])
        what = "is itself done" if done[row] else "has a nonzero reward"
        raise ResetRowError(
            f"row {row} (stream {stream}) follows a done row, so in next-step mode it "
            f"must be an auto-reset row (reward exactly 0, not done), but it {what}. "
            "The configuration is likely wrong: same-step or already-clean data "
            "(TorchRL GymWrapper over a SAME_STEP or DISABLED env, SB3 VecEnv) needs "
            "mode='same_step' or 'disabled'; TorchRL GymEnv(num_envs=N) needs "
            "joint_reset=True; AutoresetFilter.for_env(env) sets both. If a reward "
            "transform inside the env shifts rewards away from 0, pass "
            "check_reset_rows=False. Nothing was written."
        )

    def _lost_policy(self, obs_keys: list, leaves: dict, n_lost: int, final_missing: bool) -> str:
        """The lost-observation policy to apply to ``n_lost`` rows, or raise.

        ``final_missing``: the rows are same-step done rows without a final
        observation, where the default is to raise.
        """
        opts = self.options
        policy = opts.on_lost_terminal_obs
        if n_lost == 0:
            return policy or "nan"
        if policy is None and final_missing:
            raise TerminalObservationLostError(
                f"{n_lost} done row(s) have no final observation (no final-observation "
                "entry such as ('next', 'final_obs'), ('next', 'final_observation') or "
                "('next', 'terminal_observation'), or its mask says it is absent), so "
                "their next observation would be the reset observation. Store the final "
                "observation (cleanbuf.step_rows reads it from the info), name it with "
                "final_obs_key=, or choose on_lost_terminal_obs='drop' (do not store those "
                "rows), 'nan' (mark them) or 'keep' (store them as they are). Nothing was "
                "written."
            )
        ints = [k for k in obs_keys if not leaves[k].is_floating_point()]
        if policy == "raise" or (policy is None and ints):
            why = (
                f"observation keys {', '.join(_fmt(k) for k in ints)} are not floating point, "
                "so NaN cannot mark them"
                if policy is None
                else "on_lost_terminal_obs='raise'"
            )
            raise TerminalObservationLostError(
                f"{n_lost} next observation(s) are lost (the producer reset every env of "
                "a reset group at once, the final observation is absent, or the row after "
                f"never arrived) and {why}. Choose on_lost_terminal_obs='drop' (do not "
                "store those rows), 'keep' (store them as the producer left them) or 'nan' "
                "(floating observations only). Nothing was written."
            )
        if policy == "nan" and ints:
            raise InputError(
                f"on_lost_terminal_obs='nan' cannot mark observation keys "
                f"{', '.join(f'{_fmt(k)} ({leaves[k].dtype})' for k in ints)}. Choose 'drop' "
                "or 'keep'."
            )
        return policy or "nan"

    def _pass_through(self, views: Views, keys, layout, done, device) -> TensorDictBase:
        """Every row of ``keys`` as it came (views of the batch): disabled mode,
        or a call with nothing to clean.
        """
        self._commit_layout(layout)
        self._stats["rows_in"] += layout.n_rows
        self._stats["rows_out"] += layout.n_rows
        self._stats["episodes_completed"] += int(np.count_nonzero(done))
        return as_td({k: views.flat(k) for k in keys}, layout.n_rows, device)


@dataclasses.dataclass
class _Release:
    """The held rows from earlier calls that a call releases, in output order.

    Attributes:
        streams: their streams.
        slots: their slots in the held rows.
        src: per row, the call's row holding its next observation, or
            ``RELEASED_LOST`` (lost: a restart cut it off) or
            ``RELEASED_AS_IS`` (complete as stored).
        lost_done: per lost row, whether it is a done row.
    """

    streams: np.ndarray
    slots: np.ndarray
    src: np.ndarray
    lost_done: np.ndarray
    n_dropped: int = 0

    @classmethod
    def of(cls, carry: Carry, released_src: np.ndarray, n_streams: int, done_key) -> _Release:
        """Reads the kernel's ``released_src`` against the carry's held rows."""
        if not len(carry.held_stream):
            return cls(NO_ROWS, NO_ROWS, NO_ROWS, _NO_FLAGS)
        slot_of = np.full(n_streams, -1, np.int64)
        slot_of[carry.held_stream] = np.arange(len(carry.held_stream))
        streams = np.flatnonzero((released_src != -1) & (slot_of >= 0))
        slots, src = slot_of[streams], released_src[streams]
        lost_done = _NO_FLAGS
        if np.count_nonzero(src == RELEASED_LOST):
            held = Views(carry.held, 1, len(carry.held_stream))
            lost_done = done_flags(held, done_key)[slots[src == RELEASED_LOST]]
        return cls(streams, slots, src, lost_done)

    @property
    def n_stitched(self) -> int:
        return int(np.count_nonzero(self.src >= 0))

    @property
    def n_lost(self) -> int:
        return len(self.lost_done)

    @property
    def n_terminal_lost(self) -> int:
        return int(np.count_nonzero(self.lost_done))

    def without_lost(self) -> _Release:
        """The same release with the lost rows left out (the "drop" policy)."""
        keep = self.src != RELEASED_LOST
        return _Release(
            self.streams[keep],
            self.slots[keep],
            self.src[keep],
            self.lost_done,
            n_dropped=len(self.src) - int(np.count_nonzero(keep)),
        )


def _cat_held(held: dict, kept_old: np.ndarray, new_held: dict) -> dict:
    if not kept_old.any():
        return new_held
    idx = torch.from_numpy(np.flatnonzero(kept_old))
    kept = {k: v.index_select(0, idx.to(v.device)) for k, v in held.items()}
    if not new_held:
        return kept
    return {k: torch.cat([kept[k], new_held[k].to(kept[k].device)]) for k in kept}
