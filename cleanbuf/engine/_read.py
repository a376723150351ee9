"""Reading one call's batch: its layout, flags, observation keys and stream ends, checked.

What depends on the batch's layout and key set (the row-to-stream map, the
observation keys, the reset groups, the rules) is worked out once and
cached; per call there remain the flag views, one
:func:`~cleanbuf.engine._continuity.read_ends` kernel pass over the first
and last rows, and the checks that compare them with the carry.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from tensordict import TensorDictBase

from cleanbuf.engine import _checks
from cleanbuf.engine._carry import Carry
from cleanbuf.engine._continuity import CallEnds, check, read_ends
from cleanbuf.engine._errors import InputError, key_name
from cleanbuf.engine._flags import (
    NONE,
    joint_rows,
    restart_rows,
    reward_rows,
    row_flags_or_none,
    stored_rows,
)
from cleanbuf.engine._kernels import (
    ANY_MARKS,
    NEED_INIT,
    NO_MARKS,
    PENDING,
    SHIFT,
    UNSTORED_MARKS,
    WAITING,
)
from cleanbuf.engine._keys import (
    TRAJ_IDS,
    batch_leaves,
    check_same_layout,
    done_flags,
    final_entries,
    observation_keys,
    without_empty_final_entry,
)
from cleanbuf.engine._layout import CallLayout, resolve
from cleanbuf.engine._move import Views
from cleanbuf.engine._options import Options
from cleanbuf.engine._retry import Fingerprint, SameBatchAgain
from cleanbuf.engine._rules import Rules

_CACHE_SIZE = 64


@dataclasses.dataclass
class Call:
    """What :meth:`Reader.read` found in a batch, checked."""

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
    restart: np.ndarray = dataclasses.field(default_factory=lambda: NONE)
    ends: CallEnds | None = None  # time-aligned full transitions only
    rules: Rules | None = None
    schema: dict = dataclasses.field(default_factory=dict)  # obs key -> (dtype, feature shape)
    as_is: bool = True  # nothing to clean: the rows pass through as views

    def kernel_flags(self, options: Options) -> dict:
        """The per-row flags and switches of the planning kernel for this call."""
        views, layout = self.views, self.layout
        marks = NO_MARKS
        if self.rules.marks and (len(self.restart) > 0 or self.ends is not None):
            # A collector writes trajectory ids; rows without them (raw loops)
            # are never marked, so their stored batch-end truncations are ends.
            marks = ANY_MARKS if TRAJ_IDS in views.tensors else UNSTORED_MARKS
        group = 0
        if options.joint_reset and options.joint_key is None:
            group = options.reset_group_size or layout.n_streams
        return dict(
            stored=self.stored(options),
            joint=joint_rows(options, views, self.done),
            group=group,
            final_ok=NONE if self.final_present is None else self.final_present,
            final_default=bool(self.final_of),
            reward=reward_rows(options, views),
            restart=self.restart,
            terminated=row_flags_or_none(views, ("next", "terminated")) if marks else NONE,
            truncated=row_flags_or_none(views, ("next", "truncated")) if marks else NONE,
            marks=marks,
            cont=self.ends.cont if self.ends is not None else np.zeros(0, np.uint8),
        )

    def stored(self, options: Options) -> np.ndarray:
        """Per done row, whether its next observation is stored (next-step full rows).

        Read from the data (:func:`~cleanbuf.engine._flags.stored_rows`);
        every done row where ``terminal_obs_in_done_row=True`` says so.
        """
        if not self.rules.reset_rows or self.obs_only:
            return NONE
        if options.terminal_obs_in_done_row:
            return self.done
        return stored_rows(self.views, self.obs_keys, self.done)


class Reader:
    """Reads batches for one cleaner, with the caches of its layouts and key sets.

    Args:
        options: the cleaner's options.
    """

    def __init__(self, options: Options):
        self.options = options
        self._layouts: dict = {}  # (batch size, names) -> CallLayout, for the fixed layouts
        self._obs_keys: dict = {}  # leaf keys -> discovered observation keys
        self.fingerprint: Fingerprint | None = None  # of the call read last

    def read(self, td: TensorDictBase, carry: Carry, before: Fingerprint | None) -> Call:
        """Reads and checks a batch against ``carry``; changes nothing.

        Args:
            td: the batch.
            carry: the producer's carry state.
            before: the last call's fingerprint (a batch written again).

        Raises:
            InputError, LayoutError, ContinuityError: bad or discontinuous input.
            SameBatchAgain: the batch is the last call's again (trajectory ids).
        """
        opts = self.options
        if not isinstance(td, TensorDictBase):
            raise InputError(
                f"expected a TensorDict, got {type(td).__name__}; use cleanbuf.clean() "
                "for dicts of arrays."
            )
        self.fingerprint = None
        layout = self._layout(td, carry)
        leaves = batch_leaves(td)  # as stored; read as rows through views
        views = Views(leaves, td.batch_dims, layout.n_rows)
        call = Call(td.device, layout, views, done_flags(views, opts.done_key), moved=leaves)
        if opts.mode != "same_step":
            call.moved = without_empty_final_entry(leaves, opts.final_obs_key)
        if opts.mode == "disabled":
            return call
        call.obs_keys, call.obs_only = self._observation_keys(leaves)
        dims = td.batch_dims
        call.schema = {k: (leaves[k].dtype, leaves[k].shape[dims:]) for k in call.obs_keys}
        if carry.obs_schema and not carry.is_blank():
            _checks.same_observations(carry.obs_schema, call.schema)
        if opts.mode == "same_step":
            call.final_of, call.final_present, entry_keys = final_entries(
                leaves, opts.final_obs_key, call.obs_keys, layout.n_rows, td.batch_dims
            )
            if entry_keys and not opts.keep_final_obs:
                call.moved = {k: v for k, v in leaves.items() if k not in entry_keys}
        if len(carry.held_stream):
            _checks.same_schema_as_held(carry.held, call.moved, td.batch_dims)
        grow = layout.n_streams > carry.n_streams
        call.carry = carry.grown(layout.n_streams) if grow else carry
        call.restart = restart_rows(opts, views)
        call.rules = Rules.of(opts, call.obs_only, layout.kind)
        self._read_ends(call, carry, before)
        call.as_is = (
            not call.rules.successor
            and not np.count_nonzero(call.done)
            and self._nothing_pending(call.carry, leaves)
        )
        return call

    def _read_ends(self, call: Call, carry: Carry, before: Fingerprint | None) -> None:
        """Reads the stream ends, checks continuity, recognises a batch again.

        Time-aligned full transitions only: other calls keep what they had.
        """
        layout = call.layout
        if call.obs_only or layout.kind == "stream_key":
            return
        exact = TRAJ_IDS in call.views.tensors
        ends = read_ends(
            call.views,
            call.obs_keys,
            layout.steps,
            call.done,
            carry.last,
            None if before is None else before.rows,
            (TRAJ_IDS,) if exact else (),
        )
        self.fingerprint = Fingerprint(exact, ends.first, ends.repeats)
        if exact and ends.repeats:
            raise SameBatchAgain
        if self.options.check_continuity:
            first_restart = call.restart[:: layout.steps] if len(call.restart) else NONE
            check(carry.last, ends, first_restart, call.obs_keys)
        call.ends = ends

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

    def _observation_keys(self, leaves: dict) -> tuple[list, bool]:
        """The observation keys, discovered once per key set.

        :func:`observation_keys`; each key's pairing with its next
        observation (shape and dtype) is checked on every call, the first
        included.
        """
        key = tuple(leaves)
        found = self._obs_keys.get(key)
        if found is None:
            opts = self.options
            bookkeeping = {k for k in (opts.is_init_key, opts.step_count_key) if k}
            found = observation_keys(leaves, opts.observation_keys, bookkeeping)
            if len(self._obs_keys) < _CACHE_SIZE:
                self._obs_keys[key] = found
        if not found[1]:
            for k in found[0]:
                check_same_layout(leaves, k, ("next", *k))
        return found

    def _layout(self, td: TensorDictBase, carry: Carry) -> CallLayout:
        """The call's layout, checked against the streams of the calls before.

        Cached per batch shape for the fixed layouts.
        """
        opts = self.options
        names = td.names if td.batch_dims else None
        if opts.layout == "stream_key":
            for key, what in (
                (opts.stream_key, "it must hold each row's stream (env) id"),
                (opts.joint_key, "it must hold, per row, True on a done row whose whole "
                 "reset group was done on that step"),
            ):  # fmt: skip
                if key is not None and key not in td.keys(include_nested=True):
                    name = "stream" if key == opts.stream_key else "joint"
                    raise InputError(
                        f"{name} key {key_name(key)} is missing from the batch; {what}."
                    )
            ids = td.get(opts.stream_key)
            return resolve(td.batch_size, names, opts.layout, ids, carry.stream_ids)
        cache_key = (td.batch_size, None if names is None else tuple(names))
        layout = self._layouts.get(cache_key)
        if layout is None:
            layout = resolve(td.batch_size, names, opts.layout, None, None)
            if opts.joint_reset and opts.joint_key is None and layout.kind != "stream_key":
                group = opts.reset_group_size or layout.n_streams
                _checks.reset_groups(group, layout.n_streams, layout.stream_shape)
            if len(self._layouts) < _CACHE_SIZE:
                self._layouts[cache_key] = layout
        _checks.same_streams(carry, layout)
        return layout
