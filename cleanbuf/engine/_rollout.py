"""Rollouts kept whole: the cleaner's plan written into the batch, time axis kept.

The second writer of the step (read -> plan -> **write**): it reads, plans and commits through
:class:`~cleanbuf.engine._cleaner.Cleaner`'s public ``read``, ``plan`` and ``commit``, and
writes the plan into a copy of every row instead of :mod:`cleanbuf.engine._write`'s flat rows.
What the batch becomes: docs/rules.md, "The repair's core rule" and "The repair's shape".

Nothing here knows TorchRL: :class:`cleanbuf.RolloutRepair` is the shell.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from tensordict import TensorDictBase

from cleanbuf.engine._cleaner import Cleaner, lost_policy, plan_call
from cleanbuf.engine._compat import new_tensordict
from cleanbuf.engine._errors import LayoutError, StateError
from cleanbuf.engine._kernels import RELEASED_AS_IS, RELEASED_LOST
from cleanbuf.engine._keys import DONE_KEYS, Views, done_flags, observation_keys
from cleanbuf.engine._options import Options
from cleanbuf.engine._write import fill_rows, fix_bookkeeping, set_rows, take_rows

# What each returned row is (int8 per row).
VALID, RESET, LOST = 0, 1, 2
ROLLOUT_STATS = (
    "rows_in",
    "rows_out",
    "reset_rows_masked",
    "lost_rows_masked",
    "rows_held",
    "next_obs_restitched",
    "terminal_obs_missing",
    "next_obs_missing",
    "episodes_completed",
)
MASK_KEY = ("collector", "mask")


class _Rows:
    """Flat rows of a batch (copies, patched in place) and what each row is."""

    def __init__(self, tensors: dict, kind: np.ndarray):
        self.views = Views(tensors, 1, len(kind))
        self.kind = kind

    @property
    def tensors(self) -> dict:
        return self.views.tensors


class Rollouts:
    """The cleaner's second output form: batches ``[*E, T]`` repaired, time axis kept.

    The engine of :class:`cleanbuf.RolloutRepair` (documented there). Each call takes a
    time-last batch ``[*E, T]`` (a 1-D batch named ``["time"]`` is one stream) and returns
    one of the same streams, every row marked in ``mask_key`` (True: a transition of the
    explicit-reset run).

    Args:
        options: the cleaner's options (time-last layout).
        mask_key: where the validity mask goes.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> rep = Rollouts(Options.build("next_step"))
        >>> batch = TensorDict({  # [E=1, T=4]: done at t=1, reset row at t=2
        ...     "observation": torch.tensor([[[0.0], [1.0], [2.0], [10.0]]]),
        ...     ("next", "observation"): torch.tensor([[[1.0], [0.0], [10.0], [11.0]]]),
        ...     ("next", "reward"): torch.tensor([[[1.0], [1.0], [0.0], [1.0]]]),
        ...     ("next", "done"): torch.tensor([[[False], [True], [False], [False]]]),
        ... }, batch_size=[1, 4])
        >>> out = rep(batch)  # the last column waits for the next call
        >>> out["next", "observation"].flatten().tolist()  # terminal obs 2 restored
        [1.0, 2.0, 10.0]
        >>> out["collector", "mask"].tolist(), out["next", "done"].flatten().tolist()
        ([[True, True, False]], [False, True, True])
        >>> rep.flush()["observation"].flatten().tolist()
        [10.0]
    """

    def __init__(self, options: Options, mask_key: tuple = MASK_KEY):
        self.cleaner = Cleaner(options)
        self.mask_key = mask_key
        self._held: _Rows | None = None  # the waiting last column, patched
        self._shape: tuple | None = None  # the streams' shape [*E]
        self._stats = dict.fromkeys(ROLLOUT_STATS, 0)
        self._names = None

    @property
    def stats(self) -> dict:
        """The counters (plain ints).

        ``rows_in == rows_out + reset_rows_masked + lost_rows_masked + rows_held``.
        """
        return dict(self._stats)

    @property
    def options(self) -> Options:
        return self.cleaner.options

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        """Repairs one batch ``[*E, T]``; returns ``[*E, T']``.

        See docs/rules.md, "The repair's shape". A batch without steps (``[*E, 0]``) changes
        nothing and comes back as it is, with an empty mask.
        """
        self._check_shape(td)
        if isinstance(td, TensorDictBase) and td.batch_dims and td.batch_size[-1] == 0:
            out = td.clone()
            out.set(self.mask_key, torch.zeros(td.batch_size, dtype=torch.bool, device=td.device))
            return out
        cleaner = self.cleaner
        call = cleaner.read(td, plan=True, keep_lost=True)  # lost rows are masked, not gone
        n = call.layout.n_rows
        rows = _copies(call.views, call.moved, n)
        if call.carry is None:  # disabled mode: nothing to repair
            return self._emit(td, rows, hold=False, counts={})
        plan = plan_call(call, cleaner.options)
        counts = self._patch(call, plan, rows)
        held = self._release(call, plan, counts)
        hold = plan.sel.hold
        new_held = take_rows(call.views, call.moved, hold) if len(hold) else {}
        cleaner.commit(call, plan, new_held)  # nothing raises from here on
        self._held = held
        return self._emit(td, rows, call.rules.hold_done, counts, call.structure.done)

    # ----------------------------------------------------------- the patches
    def _patch(self, call, plan, rows: _Rows) -> dict:
        """Writes the plan into the copies of the call's rows; returns the counts."""
        opts, sel, views = self.options, plan.sel, call.views
        emit = sel.emit
        kind = rows.kind
        kind[:] = RESET
        kind[emit] = VALID
        kind[sel.hold] = VALID
        stitched, lost, final = emit[sel.stitched], emit[sel.lost], emit[sel.final]
        if call.obs_only:
            for k in call.obs_keys:
                rows.tensors[("next", *k)] = torch.zeros_like(rows.tensors[k])
        for k in call.obs_keys:
            nk = ("next", *k)
            if len(stitched):
                set_rows(rows.views, nk, stitched, views, k, sel.stitched_src)
            if len(final):
                set_rows(rows.views, nk, final, views, call.final_of[k], final)
        self._lost(rows, lost, call.obs_keys, plan.policy)
        init = np.concatenate([emit[sel.emit_init], sel.hold[sel.hold_init]])
        shift = np.zeros(call.layout.n_rows, np.int64)
        if len(sel.emit_shift):
            shift[emit] = sel.emit_shift
        if len(sel.hold_shift):
            shift[sel.hold] = sel.hold_shift
        keys = (opts.is_init_key, opts.step_count_keys)
        fix_bookkeeping(rows.views, 0, init, shift if shift.any() else shift[:0], *keys)
        self._make_inert(rows, np.flatnonzero(kind == RESET))
        return {
            "next_obs_restitched": len(stitched) + len(final),
            "terminal_obs_missing": plan.n_lost,
            "next_obs_missing": plan.n_next_lost,
        }

    def _lost(self, rows: _Rows, lost: np.ndarray, obs_keys: list, policy: str) -> None:
        """Applies the lost-observation policy to ``lost`` rows.

        See docs/rules.md, "Lost terminal observations in a repaired batch".
        """
        if not len(lost) or policy == "keep":
            return
        for k in obs_keys:
            if policy == "nan":
                fill_rows(rows.views, ("next", *k), lost, math.nan)
            else:  # "drop": masked, bootstrapped from its own observation
                set_rows(rows.views, ("next", *k), lost, rows.views, k, lost)
        if policy == "drop":
            rows.kind[lost] = LOST

    def _make_inert(self, rows: _Rows, reset: np.ndarray) -> None:
        """Reset rows: done and terminated, not truncated, reward 0 (masked)."""
        if not len(reset):
            return
        t = rows.tensors
        opts = self.options
        done_keys = {*DONE_KEYS[:2], *((opts.done_key,) if opts.done_key else ())}
        for key in done_keys:
            if key in t:
                fill_rows(rows.views, key, reset, True)
        if DONE_KEYS[2] in t:
            fill_rows(rows.views, DONE_KEYS[2], reset, False)
        if opts.reward_key in t:
            fill_rows(rows.views, opts.reward_key, reset, 0)

    def _release(self, call, plan, counts: dict) -> _Rows | None:
        """The held column, its waiting rows completed from this call (a copy)."""
        held, streams = self._held, call.carry.held_stream
        if held is None or not len(streams):
            return held
        src = plan.released_src[streams]
        held = _Rows({k: v.clone() for k, v in held.tensors.items()}, held.kind.copy())
        got, lost = src >= 0, streams[src == RELEASED_LOST]
        for k in call.obs_keys:
            if got.any():
                set_rows(held.views, ("next", *k), streams[got], call.views, k, src[got])
        self._lost(held, lost, call.obs_keys, plan.policy)
        self._unmark(held, streams[src == RELEASED_AS_IS])
        counts["next_obs_restitched"] += int(got.sum())
        counts["terminal_obs_missing"] += plan.release.n_terminal_lost
        counts["next_obs_missing"] += plan.release.n_lost - plan.release.n_terminal_lost
        return held

    def _unmark(self, rows: _Rows, marks: np.ndarray) -> None:
        """Batch-end marks that were no episode end: not done, so the estimators chain through."""
        if not len(marks):
            return
        for key in (DONE_KEYS[0], DONE_KEYS[2], self.options.done_key):
            if key is not None and key in rows.tensors:
                fill_rows(rows.views, key, marks, False)

    # ---------------------------------------------------------- the output
    def _emit(self, td: TensorDictBase, rows: _Rows, hold: bool, counts: dict, done=None):
        """Commits the counts; returns held column + rows, the last column held."""
        self._shape = shape = tuple(td.batch_size[:-1])
        steps = td.batch_size[-1]
        n_streams = int(np.prod(shape, dtype=np.int64))
        out, new_held = _columns(self._held, rows, n_streams, steps, hold)
        steps += int(self._held is not None) - int(hold)  # a column in front, one held
        self._held = new_held
        s = self._stats
        s["rows_in"] += n_streams * td.batch_size[-1]
        for k, v in counts.items():
            s[k] += int(v)
        self._count_out(out, done)
        s["rows_held"] = 0 if new_held is None else len(new_held.kind)
        return self._as_batch(out, td.device, steps)

    def _count_out(self, rows: _Rows, done=None) -> None:
        """Counts the rows returned, by kind, and the episode ends among them.

        An episode end is a returned done row that is no reset row (a batch-end mark counts
        once it is returned done), as the filter counts it.
        """
        s, kind = self._stats, rows.kind
        # done: the call's DoneSource (its rows were read and checked), or None
        flags = (
            done_flags(rows.views, self.options.done_key)
            if done is None
            else done.flags(rows.views)
        )
        ends = flags & (kind != RESET)
        s["episodes_completed"] += int(np.count_nonzero(ends))
        s["rows_out"] += int(np.count_nonzero(kind == VALID))
        s["reset_rows_masked"] += int(np.count_nonzero(kind == RESET))
        s["lost_rows_masked"] += int(np.count_nonzero(kind == LOST))

    def _as_batch(self, rows: _Rows, device, steps: int) -> TensorDictBase:
        batch = torch.Size([*self._shape, steps])
        nested: dict = {}
        leaves = dict(rows.tensors)
        mask = torch.from_numpy(rows.kind == VALID)
        # on the rows' device (a collector's batch may have none, its leaves on a GPU)
        leaves[self.mask_key] = mask.to(device or next(iter(leaves.values()), mask).device)
        for k, v in leaves.items():
            node = nested
            for part in k[:-1]:
                node = node.setdefault(part, {})
            v = v.reshape(*batch, *v.shape[1:])
            # (moved only where it is elsewhere: to() costs even when it moves nothing)
            node[k[-1]] = v if device is None or v.device == device else v.to(device)
        return new_tensordict(nested, batch, device)

    def _check_shape(self, td: TensorDictBase) -> None:
        if not isinstance(td, TensorDictBase) or td.batch_dims == 0:
            return  # the cleaner's read says what is wrong
        shape = tuple(td.batch_size[:-1])
        if self._shape is not None and shape != self._shape:
            raise LayoutError(
                f"the streams changed: earlier batches had {list(self._shape)} streams "
                f"before the time dimension, this one has batch_size={list(td.batch_size)}. "
                "Repair each producer's batches with its own RolloutRepair, or flush() "
                "and build a new one. Nothing was changed."
            )

    # ------------------------------------------------------ flush and state
    def flush(self) -> TensorDictBase | None:
        """Returns the held column ``[*E, 1]`` (None when nothing is held).

        Its waiting rows get the lost-observation policy (counted), except undecided
        batch-end marks whose next observation is stored (returned as they are).
        """
        if self._held is None:
            return None
        carry = self.cleaner.carry
        streams = carry.held_stream  # the held column's waiting rows
        if len(streams):
            held, opts = self._held, self.options
            bookkeeping = {k for k in (opts.is_init_key, opts.step_count_key) if k}
            keys = observation_keys(held.tensors, opts.observation_keys, bookkeeping)[0]
            marked, stored = carry.held_marks()  # (as the kernel found them)
            lost = streams[~(marked & stored)]
            policy = lost_policy(opts, keys, held.tensors, len(lost), False)
            self.cleaner.flush()  # forgets its held rows (ours are the ones returned)
            self._lost(held, lost, keys, policy)
            self._stats["terminal_obs_missing"] += len(lost)
        held, self._held = self._held, None
        self._count_out(held)
        self._stats["rows_held"] = 0
        return self._as_batch(held, None, 1)

    def state_dict(self) -> dict:
        """The cleaner's state, the held column and the counters (picklable)."""
        held = self._held
        return {
            "cleaner": self.cleaner.state_dict(),
            "held": None if held is None else {k: v.clone() for k, v in held.tensors.items()},
            "held_kind": None if held is None else torch.from_numpy(held.kind.copy()),
            "shape": None if self._shape is None else list(self._shape),
            "stats": dict(self._stats),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores what :meth:`state_dict` returned.

        Raises:
            StateError: a field missing or of the wrong kind (named), checked before
                anything changes.
        """
        check_rollout_state(state)
        self.cleaner.load_state_dict(state["cleaner"])
        held = state["held"]
        self._held = (
            None
            if held is None
            else _Rows({tuple(k): v.clone() for k, v in held.items()}, state["held_kind"].numpy())
        )
        self._shape = None if state["shape"] is None else tuple(state["shape"])
        self._stats = dict.fromkeys(ROLLOUT_STATS, 0) | dict(state["stats"])


ROLLOUT_FIELDS = {
    "cleaner": "the cleaner's state (a dict)",
    "held": "None or the held column (a dict of tensors)",
    "held_kind": "None or a tensor (each held row's kind), with 'held'",
    "shape": "None or the batch shape (a list of sizes)",
    "stats": "the counters (a dict of numbers)",
}


def check_rollout_state(state: dict) -> None:
    """Raises a :class:`~cleanbuf.StateError` naming the first field that is wrong.

    Examples:
        >>> check_rollout_state({"cleaner": {}, "held": None, "held_kind": None, "shape": None})
        Traceback (most recent call last):
        ...
        cleanbuf.engine._errors.StateError: state field 'stats' is missing: expected the ...
    """
    for field, expected in ROLLOUT_FIELDS.items():
        if field not in state:
            raise _field_error(field, expected, "it is missing")
    held, kind, shape = state["held"], state["held_kind"], state["shape"]
    good = {
        "cleaner": isinstance(state["cleaner"], dict),
        "held": held is None
        or (isinstance(held, dict) and all(isinstance(v, torch.Tensor) for v in held.values())),
        "held_kind": (kind is None) == (held is None)
        and (kind is None or (isinstance(kind, torch.Tensor) and kind.dim() == 1)),
        "shape": shape is None
        or (isinstance(shape, (list, tuple)) and all(isinstance(d, int) for d in shape)),
        "stats": isinstance(state["stats"], dict)
        and all(isinstance(v, (int, float)) for v in state["stats"].values()),
    }
    for field, ok in good.items():
        if not ok:
            got = type(state[field]).__name__
            raise _field_error(field, ROLLOUT_FIELDS[field], f"got {got} {state[field]!r:.80}")


def _field_error(field: str, expected: str, got: str) -> StateError:
    if got == "it is missing":
        head = f"state field {field!r} is missing: expected {expected}"
    else:
        head = f"state field {field!r}: expected {expected}, {got}"
    return StateError(
        f"{head}. The state is damaged or not one RolloutRepair.state_dict() returned: pass "
        "what state_dict() returned, unchanged. Nothing was changed."
    )


def _copies(views: Views, keys, n: int) -> _Rows:
    """Copies of the call's rows (``keys``), to patch.

    numpy copies (cheaper per leaf) where the rows have numpy views, kept as the copies'
    views; torch's clone elsewhere.
    """
    tensors, arrays = {}, {}
    for k in keys:
        a = views[k]
        if a is None:
            tensors[k] = views.flat(k).clone()
        else:
            arrays[k] = a = a.copy()
            tensors[k] = torch.from_numpy(a)
    rows = _Rows(tensors, np.zeros(n, np.int8))
    rows.views.update(arrays)
    return rows


def _columns(head: _Rows | None, body: _Rows, n_streams: int, steps: int, hold: bool):
    """Per stream, the head's row (if any), then the body's rows but its last if ``hold``.

    Returns ``(out, held)``: the held rows are each stream's last (None unless ``hold``).
    Each leaf is written once, into one new tensor.
    """
    if head is None and not hold:
        return body, None
    n_head, keep = int(head is not None), steps - 1 if hold else steps
    tensors, held, arrays, held_arrays = {}, {}, {}, {}
    for k, v in body.tensors.items():
        a = body.views[k]
        h = head.views[k] if n_head and a is not None else None
        if h is not None and (h.dtype != a.dtype or h.shape[1:] != a.shape[1:]):
            h = None  # (torch below says what differs)
        if a is not None and (h is not None or not n_head):
            # CPU rows: numpy (cheaper per call than torch), arrays kept as the rows' views
            feature = a.shape[1:]
            by_stream = a.reshape(n_streams, steps, *feature)
            out = np.empty((n_streams, n_head + keep, *feature), a.dtype)
            if n_head:
                out[:, 0] = h.reshape(n_streams, *feature)
            out[:, n_head:] = by_stream[:, :keep]
            arrays[k] = out = out.reshape(-1, *feature)
            tensors[k] = torch.from_numpy(out)
            if hold:
                held_arrays[k] = last = by_stream[:, steps - 1].copy()
                held[k] = torch.from_numpy(last)
            continue
        feature = v.shape[1:]
        by_stream = v.reshape(n_streams, steps, *feature)
        kept = by_stream.narrow(1, 0, keep)  # (narrow, select, cat: no __setitem__, dearer)
        if n_head:
            h = head.tensors[k].to(v.device).reshape(n_streams, 1, *feature)
            out = torch.cat([h, kept], dim=1)
        else:
            out = kept.clone(memory_format=torch.contiguous_format)
        tensors[k] = out.reshape(n_streams * (n_head + keep), *feature)
        if hold:
            last = by_stream.select(1, steps - 1)
            held[k] = last.clone(memory_format=torch.contiguous_format)
    kind = body.kind.reshape(n_streams, steps)
    out_kind = kind[:, :keep]
    if n_head:
        out_kind = np.concatenate([head.kind.reshape(n_streams, 1), out_kind], axis=1)
    new_held = None
    if hold:
        new_held = _Rows(held, kind[:, steps - 1].copy())
        new_held.views.update(held_arrays)
    out = _Rows(tensors, out_kind.reshape(-1))
    out.views.update(arrays)
    return out, new_held
