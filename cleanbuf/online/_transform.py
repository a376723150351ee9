"""The TorchRL replay-buffer transform: a thin shell over the cleaner.

Whether the rows a filter's call returned reached the buffer: TorchRL's writer says so.
A replay buffer runs the filter, then writes what the filter returned; if that write fails
(a full disk, a storage that raises) the filter has already moved on. TorchRL's round-robin
writers tell every entity attached to the storage, after each write that succeeded, which
slots it wrote (``storage.attach(entity)``; the writer then calls ``entity.mark_update(index)``,
as it does for a prioritized sampler). The filter attaches a :class:`WriteMarks` counter to its
buffer's storage, and before its next call, its flush, its stats and its state it reads whether
the count moved since its last call returned rows:

- moved: stored; the same batch written again is a duplicate (a
  :class:`~cleanbuf.ContinuityError`), never a retry;
- did not move: the write failed; the cleaner goes back to before that call (the rows it
  released are held again), as if it never came: a retry stores them, and another batch is
  refused as a skipped one;
- unknown (another writer, a consuming buffer, copies of the filter in worker processes or Ray
  actors): the cleaner's own rule stays (the undo of :class:`cleanbuf.engine._cleaner.Cleaner`).

No row of the storage is read.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from tensordict import NestedKey, TensorDictBase
from torchrl.envs.transforms import Transform

from cleanbuf.engine._cleaner import Cleaner
from cleanbuf.engine._errors import (
    CleanbufError,
    CleanbufWarning,
    InputError,
    StateError,
    TerminalObservationLostError,
    user_stacklevel,
)
from cleanbuf.engine._options import Options, keyword_names, options_in, refuse_unknown
from cleanbuf.online import _at_exit, _publish
from cleanbuf.online._base import OnlineCleaner
from cleanbuf.online._compact import (
    STREAM_KEY,
    check_compact_load,
    is_compact,
    with_stream_index,
)
from cleanbuf.online._compat import (
    attached_entities,
    calling_replay_buffer,
    reports_writes,
    rewind_writer,
    writer_position,
)
from cleanbuf.online._copies import CopyStates
from cleanbuf.online._first_write import check_late_attachment, check_orientation
from cleanbuf.online._losses import LOST_KEY, LostObservations
from cleanbuf.online._ray import flush_buffer_actor, in_ray_actor, is_ray_buffer
from cleanbuf.online._storage import check_storage, is_storage_init


def not_a_tensordict(data: Any, layout: str | None = None) -> str:
    """The error for a write of something other than a TensorDict, with a fix that runs.

    A list of TensorDicts (``rb.extend([td, td])``) gets the join that
    fits them and the filter's ``layout``: steps ``[E]`` stacked along
    time (``dim=1``; ``dim=0`` for ``layout="time_first"``), each written
    in turn where the filter reads one step per call (``layout="step"``)
    or flat rows, batches ``[E, T]`` concatenated along time.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> steps = [TensorDict({}, batch_size=[4])] * 3
        >>> "rb.extend(torch.stack(data, dim=1))" in not_a_tensordict(steps)
        True
        >>> "for td in data: rb.extend(td)" in not_a_tensordict(steps, "step")
        True
        >>> done = torch.zeros(4, 16, 1, dtype=torch.bool)
        >>> "TensorDict(data, batch_size=[4, 16])" in not_a_tensordict({"next": {"done": done}})
        True
    """
    end = " Nothing was written."
    if (
        isinstance(data, (list, tuple))
        and data
        and all(isinstance(d, TensorDictBase) for d in data)
    ):
        shapes = {tuple(d.batch_size) for d in data}
        got = f"a {type(data).__name__} of {len(data)} TensorDicts"
        one_step = len(shapes) == 1 and len(next(iter(shapes))) == 1
        if one_step and layout in ("step", "stream_key"):
            return (
                f"AutoresetFilter cleans one TensorDict per write; got {got} of batch size "
                f"{list(next(iter(shapes)))}. Fix: write them in turn, "
                f"for td in data: rb.extend(td) (this filter's layout={layout!r} reads "
                "one TensorDict per call)." + end
            )
        if one_step:
            dim = 0 if layout == "time_first" else 1
            shape = "[T, E] batch, time first" if dim == 0 else "[E, T] batch, time last"
            return (
                f"AutoresetFilter cleans one TensorDict per write; got {got} of batch size "
                f"{list(next(iter(shapes)))} (one step of E envs each). Fix: stack them along "
                f"time, rb.extend(torch.stack(data, dim={dim})) (an {shape}, as this "
                "filter reads)." + end
            )
        if layout == "step":
            return (
                f"AutoresetFilter cleans one TensorDict per write; got {got} (batch sizes "
                f"{sorted(list(s) for s in shapes)}), and this filter's layout='step' reads "
                "one step of E envs per call. Fix: write the steps in turn, "
                "for td in data: [rb.extend(step) for step in td.unbind(1)]." + end
            )
        tdim, shape = (0, "[T, E]") if layout == "time_first" else (-1, "[E, T]")
        return (
            f"AutoresetFilter cleans one TensorDict per write; got {got} (batch sizes "
            f"{sorted(list(s) for s in shapes)}). Fix: write them in turn, "
            f"for td in data: rb.extend(td); or join {shape} batches along time, "
            f"rb.extend(torch.cat(data, dim={tdim}))." + end
        )
    what = "a dict" if isinstance(data, Mapping) else type(data).__name__
    nxt = data.get("next") if isinstance(data, Mapping) else None
    done = nxt.get("done") if isinstance(nxt, Mapping) else None
    shape = list(getattr(done, "shape", ())[:2])
    wrap = f"[{shape[0]}, {shape[1]}]" if len(shape) == 2 else "[E, T]"
    return (
        f"AutoresetFilter cleans TensorDict batches; got {what}. Expected what a TorchRL "
        "collector yields (a TensorDict [E, T]). Fix: for a dict of [E, T] tensors, "
        f"rb.extend(tensordict.TensorDict(data, batch_size={wrap})); for stored arrays, "
        "rows = cleanbuf.clean(data); for on-policy rollouts, RolloutRepair." + end
    )


class WriteMarks:
    """Counts the writes TorchRL's writer reports to a storage's attached entities.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(8))
        >>> marks = marks_of(rb)
        >>> _ = rb.extend(TensorDict({"a": torch.zeros(3)}, [3]))
        >>> marks.writes, marks_of(rb) is marks  # one per storage
        (1, True)
    """

    __slots__ = ("writes",)

    def __init__(self):
        self.writes = 0

    def mark_update(self, index: Any) -> None:
        """Called by the writer after a write that succeeded."""
        self.writes += 1

    def __getstate__(self) -> dict:
        return {"writes": self.writes}

    def __setstate__(self, state: dict) -> None:
        self.writes = state["writes"]


def marks_of(rb: Any) -> WriteMarks | None:
    """The write counter attached to ``rb``'s storage (attached on first use).

    None where the buffer's writer does not report its writes (see
    :func:`~cleanbuf.online._compat.reports_writes`): the filter cannot
    tell a failed write there.
    """
    if rb is None or not reports_writes(rb):
        return None
    entities = attached_entities(rb.storage)
    if entities is None:
        return None
    marks = next((e for e in entities if type(e) is WriteMarks), None)
    if marks is None:
        marks = WriteMarks()
        rb.storage.attach(marks)
    return marks


class AutoresetFilter(OnlineCleaner, Transform):
    """Removes auto-reset artifacts from data as it is written to a replay buffer.

    Use it as ``ReplayBuffer(..., transform=AutoresetFilter(...))`` (also
    inside a ``Compose``), or build it from the producer with
    :meth:`for_env`. ``rb.extend(batch)`` and ``rb.add(row)`` then store
    cleaned rows, flat ``[M]``: each next-step reset row dropped and its
    observation put back as the terminal observation of the done row before
    it, each same-step done row given its final observation, ``is_init`` and
    the step counts fixed. ``rb.sample()`` is untouched and the collector
    does not change. A done row whose terminal observation comes with the
    next call waits for it: call :meth:`flush` at the end of collection (a
    forgotten one is said when the filter is collected, or at interpreter
    exit). Its first write refuses a ``[T, E]`` batch where ``[E, T]`` is
    read, and warns when the buffer already holds rows it did not write
    (and names the call that cleans those). Any error leaves the
    filter and the buffer as they were. The rules, one
    by one (modes, joint resets, observation-only data, streams across
    calls, batch-end marks, processes, Ray, failures), are in the guide
    ``docs/rules.md``; each option in full in :class:`cleanbuf.Options`.

    Args:
        mode: "next_step", "same_step", "disabled" (check and pass
            through), or a ``gymnasium.vector.AutoresetMode``.
        layout: None (infer: ``[*E, T]`` collector batches), "time_last",
            "time_first" (``[T, *E]`` rollouts, as raw loops stack steps),
            "step" (one step of E envs per call) or "stream_key".
        stream_key: the key of each flat row's env id.
        joint_reset: the producer resets all envs of a group together
            when all are done (TorchRL ``GymEnv(num_envs=N)``).
        reset_group_size: envs per reset group (None: all).
        joint_key: flat rows: a per-row flag of joint-reset done rows.
        on_lost_terminal_obs: "nan", "drop", "raise" or "keep" (None:
            "nan" for floating next-step observations, else an error).
        terminal_obs_in_done_row: True declares every done row complete,
            zeros included (rarely needed: the data says it, row by row).
        check_reset_rows: check that reset rows have reward 0, not done.
        observation_keys: the observation keys (None: discovered).
        done_key: the done key (None: ``("next", "done")``, else
            terminated | truncated).
        reward_key: the reward key of the reset-row check.
        is_init_key: the ``InitTracker`` key (None: left alone).
        step_count_key: the ``StepCounter`` key (None: left alone).
        final_obs_key: same-step: the final-observation entry (None: the
            common names).
        keep_final_obs: same-step: store that entry too.
        compact: observation-only data stays observation-only.
        check_continuity: each call must continue the calls before it.
        producer_key: the trajectory-id key that tells apart the
            producers of batches extended in turn (``MultiAsyncCollector``).
        **unknown: nothing: a misspelt option raises, naming the options.

    Raises:
        CleanbufError: an unknown option or a value that does not fit the
            others (named, with the fix).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyTensorStorage, ReplayBuffer
        >>> from cleanbuf import AutoresetFilter
        >>> filt = AutoresetFilter("next_step")
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(100), transform=filt)
        >>> batch = TensorDict({  # [E=1, T=4]: done at t=1, reset row at t=2
        ...     "observation": torch.tensor([[[0.0], [1.0], [2.0], [10.0]]]),
        ...     ("next", "observation"): torch.tensor([[[1.0], [0.0], [10.0], [11.0]]]),
        ...     ("next", "reward"): torch.tensor([[[1.0], [1.0], [0.0], [1.0]]]),
        ...     ("next", "done"): torch.tensor([[[False], [True], [False], [False]]]),
        ... }, batch_size=[1, 4])
        >>> _ = rb.extend(batch)
        >>> len(rb), rb[:]["next", "observation"].flatten().tolist()
        (3, [1.0, 2.0, 11.0])
        >>> filt.stats["reset_rows_dropped"]
        1

    See Also:
        :class:`cleanbuf.RolloutRepair`: the same cleaning for on-policy
        batches, time axis kept. :func:`cleanbuf.clean`: data already
        collected. :func:`cleanbuf.step_rows`: a raw loop's step as rows.
    """

    _held_note = "not stored until flush(rb)"

    def __init__(
        self,
        mode: str | Any = "next_step",
        *,
        layout: str | None = None,
        stream_key: NestedKey | None = None,
        joint_reset: bool = False,
        reset_group_size: int | None = None,
        joint_key: NestedKey | None = None,
        on_lost_terminal_obs: str | None = None,
        terminal_obs_in_done_row: bool | None = None,
        check_reset_rows: bool = True,
        observation_keys: Sequence[NestedKey] | None = None,
        done_key: NestedKey | None = None,
        reward_key: NestedKey | None = ("next", "reward"),
        is_init_key: NestedKey | None = "is_init",
        step_count_key: NestedKey | None = "step_count",
        final_obs_key: NestedKey | None = None,
        keep_final_obs: bool = False,
        compact: bool = False,
        check_continuity: bool = True,
        producer_key: NestedKey | None = None,
        **unknown: Any,
    ):
        deprecated = refuse_unknown(unknown, keyword_names(AutoresetFilter), "AutoresetFilter")
        options = Options.build(**options_in(locals()), **deprecated)
        super().__init__(in_keys=[], out_keys=[])
        self._engine = Cleaner(options)
        self._bypass = False
        self._origin = None
        self._copies: _publish.Copies | None = None  # set once the copies publish
        self._storage_checked = False  # the buffer's storage takes flat rows (checked once)
        self._stream_index = False  # a CompactStorage: rows carry their stream (first write)
        # Rows the buffer held at this filter's first write (attached late), not cleaned:
        # cleanbuf.clean(rb) reads it to say which rows to clean.
        self.rows_before_attach = 0
        self._losses = LostObservations("filter")  # NaN next observations written by default
        self._in_ray_actor: bool | None = None  # whether it runs in a Ray actor (first call)
        # the last call's rows, on their way: the buffer's write counter and its count
        # then, the writer's position before them, and how many rows
        self._last_write: tuple | None = None
        self._marks: WriteMarks | None = None  # the buffer's write counter (first call)
        self._writer = None  # the buffer's round-robin writer, where it reports writes
        _at_exit.watch(self)  # held rows never flushed are said at interpreter exit

    @property
    def stats(self) -> dict:
        """The counters, as plain Python ints.

        ``rows_in == rows_out + reset_rows_dropped + lost_rows_dropped +
        rows_held``:

        - ``rows_in``, ``rows_out``: the rows given, and the rows stored;
        - ``reset_rows_dropped``: bogus reset transitions removed (next-step
          data: the row from an episode's last observation to the reset one);
        - ``next_obs_restitched``: next observations put back (a done row's
          terminal observation, from its reset row or a final-observation entry);
        - ``terminal_obs_missing``: done rows whose terminal observation was
          lost before the filter saw it (NaN by default, see
          ``on_lost_terminal_obs``); ``next_obs_missing``: other rows whose
          next observation never came (a held row at a flush);
        - ``lost_rows_dropped``: rows not stored for a lost next observation
          (``on_lost_terminal_obs="drop"``);
        - ``rows_held``: rows waiting for the row after them (stored by a
          later call or the flush);
        - ``episodes_completed``: the episode ends seen.

        Once the buffer is shared with worker processes (a multi-process
        collector given the buffer, or the filter in Ray actors), the sums
        over every copy of the filter, as each last published its state
        (after each of its calls).

        Warns:
            CleanbufWarning: once per filter, when copies of it in other
                processes stored lost terminal observations as NaN (by
                default), with their summed count.
        """
        if self._copies is None:
            self._settle_write()
            return self._engine.stats
        states = self._copies.load()
        self._losses.after_copies(states)
        return _publish.summed_stats(states)

    def share_memory_(self) -> AutoresetFilter:
        """Called by TorchRL when the buffer is shared with worker processes.

        From then on every copy of the filter (one per worker that extends
        the buffer) publishes its state after each call, so that
        :attr:`stats` sums them and :meth:`flush` stores what every copy
        holds. Returns the filter.
        """
        if self._copies is None:
            self._copies = _publish.shared(CopyStates(), self._state())
        return self

    def _state(self) -> dict:
        """What this copy publishes: its cleaner's state, and what its calls lost."""
        return {**self._engine.state_dict(), LOST_KEY: self._losses.in_calls}

    def _publish(self) -> None:
        self._copies.publish(self._state())

    def __getstate__(self) -> dict:
        # Pickled while Ray runs: for a Ray actor, which publishes its state.
        self._copies = _publish.for_ray(self._copies, self._state())
        state = super().__getstate__()
        # the buffer's counter and writer stay here
        state["_last_write"] = state["_marks"] = state["_writer"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._in_ray_actor = None  # where it runs is read at its first call

    def flush(
        self, rb: Any = None, *, on_lost_terminal_obs: str | None = None
    ) -> TensorDictBase | None:
        """Releases the held rows, at the end of collection.

        ``filt.flush(rb)`` writes them into ``rb`` (bypassing this filter,
        so they are stored exactly once); ``filt.flush()`` returns them.
        A held row whose next observation will not come (its reset row or
        successor never arrived) follows the lost-observation policy;
        ``on_lost_terminal_obs`` chooses it for this flush (integer
        observations, which NaN cannot mark, need "drop" or "keep" here
        when the filter was built without one).

        Args:
            rb: a replay buffer, or None.
            on_lost_terminal_obs: "nan", "drop", "raise" or "keep" for
                this flush; None uses the filter's option.

        Returns:
            The held rows (flat), or None when written to ``rb``.

        Raises:
            TerminalObservationLostError: a held row's next observation is
                lost and the policy is "raise" (or NaN cannot mark it); its
                text says how to choose a policy for this flush alone.
                Nothing was written and nothing changed.

        Warns:
            CleanbufWarning: as :attr:`stats` does, before the flush; and
                when, by default (no ``on_lost_terminal_obs`` chosen,
                next-step data), rows it stored lost their terminal
                observation (done on the last step collected, not stored
                in the row, the reset row that holds it never collected),
                with their count: they are stored with a NaN next
                observation.
        """
        try:
            out = self._flush(rb, on_lost_terminal_obs)
        except TerminalObservationLostError as err:
            # (the unflushed-rows warning says so, with the policies that apply)
            schema = self._engine.carry.obs_schema
            floating = all(dtype.is_floating_point for dtype, _ in schema.values())
            self.__dict__["_flush_raised"] = "floating" if floating else "integer"
            if on_lost_terminal_obs is not None:
                raise
            raise TerminalObservationLostError(
                f"{err} The policy can be given to this flush alone: "
                "filt.flush(rb, on_lost_terminal_obs='keep')."
            ) from None
        self.__dict__["_flush_raised"] = False
        if out is not None and STREAM_KEY in out.keys():  # (read by a CompactStorage only)
            out = out.exclude(STREAM_KEY)
        return out

    def _flush(self, rb: Any, on_lost_terminal_obs: str | None) -> TensorDictBase | None:
        """Flushes; warns when the rows it stored lost next observations by default."""
        before = self._lost_so_far()
        out = self._flush_rows(rb, on_lost_terminal_obs)
        after = self._lost_so_far()
        n_lost, n_next = after[0] - before[0], after[1] - before[1]
        # Said at the next call, if rows come after the flush (it was not the end).
        self.__dict__["_flushed_lost"] = n_lost + n_next
        policy = self.options if on_lost_terminal_obs is None else None
        if policy is not None and self._losses.counting(policy):
            self._losses.after_flush(n_lost, n_next)
        return out

    def _say_rows_after_flush(self) -> None:
        """Warns, once, of rows that come after a flush that stored rows without their next one."""
        n = self.__dict__["_flushed_lost"]
        self.__dict__["_flushed_lost"] = 0
        warnings.warn(
            CleanbufWarning(
                f"rows came after filt.flush(rb), which stored {n} row(s) without their next "
                "observation (NaN, or as the producer left them) or left them out: the rows "
                "written since may hold those next observations, too late for the rows the "
                "flush stored. Flush once, when collection ends; to checkpoint mid-run, save "
                "filt.state_dict() with the buffer's rb.state_dict() instead."
            ),
            stacklevel=user_stacklevel(),
        )

    def _lost_so_far(self) -> tuple[int, int]:
        """``terminal_obs_missing`` and ``next_obs_missing``: this filter's, or its copies' sums."""
        keys = ("terminal_obs_missing", "next_obs_missing")
        if self._copies is None:
            return tuple(self._engine.count(k) for k in keys)
        states = self._copies.load().values()
        return tuple(sum(int(s.get("stats", {}).get(k, 0)) for s in states) for k in keys)

    def _flush_rows(self, rb: Any, on_lost_terminal_obs: str | None) -> TensorDictBase | None:
        self._settle_write()
        if self._copies is not None:  # what the copies lost, before the flush marks more
            self._losses.after_copies(self._copies.load())
        if rb is not None and is_ray_buffer(rb) and flush_buffer_actor(rb, type(self)):
            # The buffer actor's filter stored every copy's held rows there.
            if self._copies is not None:
                self._engine.load_state_dict(self._copies.load()[self._copies.own])
            return None
        if self._copies is not None:
            self._publish()
            write = None if rb is None else lambda rows: self._extend_bypassing(rb, rows)
            rows, state = _publish.flush_copies(self._copies, self.options, write)
            self._engine.load_state_dict(state)
            return None if rb is not None else rows
        if rb is None:
            return self._engine.flush(on_lost_terminal_obs)
        state = self._engine.state_dict()
        rows = self._engine.flush(on_lost_terminal_obs)
        if rows.batch_size[0] == 0:
            return None
        position = writer_position(self._writer) if self._writer is not None else None
        try:
            self._extend_bypassing(rb, rows)
        except BaseException:
            self._engine.load_state_dict(state)
            if position is not None:  # (its rows go to the same slots when flushed again)
                rewind_writer(self._writer, position, rows.batch_size[0])
            raise
        return None

    def _extend_bypassing(self, rb: Any, rows: TensorDictBase) -> None:
        self._bypass = True
        try:
            rb.extend(rows)
        finally:
            self._bypass = False

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase | None:
        if self._bypass:
            return tensordict
        out = self._clean(tensordict, owned=True)  # (inv made the shallow copy)
        # ReplayBuffer.extend / add store nothing for None (their writers
        # reject an empty batch).
        return out if out.batch_size[0] else None

    def _clean(self, tensordict: TensorDictBase, *, owned: bool = False) -> TensorDictBase:
        """One call of the cleaner on ``tensordict``: the flat rows it leaves."""
        if self.parent is not None:
            raise RuntimeError(
                "AutoresetFilter is a replay-buffer transform: put it in "
                "ReplayBuffer(transform=...), not in an environment."
            )
        if not isinstance(tensordict, TensorDictBase):
            raise InputError(not_a_tensordict(tensordict, self.options.layout))
        if not self._storage_checked or self._in_ray_actor is None:
            self._first_write(tensordict)
        if self.__dict__.get("_flushed_lost"):
            self._say_rows_after_flush()
        one_step = tensordict.batch_dims and tensordict.batch_size[-1] == 1  # (spares a call)
        if one_step and is_storage_init(tensordict):
            # Shaped as the filter's rows, so the storage is laid out for them;
            # TorchRL empties the buffer right after: nothing is counted or kept.
            return Cleaner(self.options)(tensordict)
        failed = self._settle_write()
        # One filter in one process tells its calls' writes apart (see the module);
        # copies in workers and Ray actors keep the cleaner's own retry rule.
        tracks = self._copies is None and not self._in_ray_actor
        marks = self.__dict__["_marks"] if tracks else None
        lost = self._engine.state.stats["terminal_obs_missing"]
        if self._stream_index:  # which stored row follows which, for the compact storage
            tensordict = with_stream_index(
                tensordict, self.options.layout, self.options.stream_key, owned=owned
            )
        out = self._run_engine(tensordict, failed)
        if marks is not None and out.batch_size[0]:
            # (per-call fields go into __dict__: nn.Module.__setattr__ costs more)
            n = out.batch_size[0]
            self.__dict__["_last_write"] = (marks, marks.writes, writer_position(self._writer), n)
        elif tracks:
            self._engine.last_call_stored()  # nothing to write, or no buffer: no retry
        lost = self._engine.state.stats["terminal_obs_missing"] - lost
        if lost:
            self._count_lost(lost)
        if self._copies is not None:
            self._publish()
        return out

    def _run_engine(self, tensordict: TensorDictBase, failed: bool) -> TensorDictBase:
        """The cleaner's call; after a failed write, its error says so."""
        try:
            return self._engine(tensordict)
        except CleanbufError as err:
            if not failed:
                raise
            raise type(err)(
                "The write of the previous batch into the buffer failed, so its rows (and "
                "the held rows its call released) are not stored; the filter is back to "
                f"before that batch: write it again before this one. {err}"
            ) from None

    def _first_write(self, tensordict: TensorDictBase) -> None:
        """At the first write: where the filter runs, the buffer, and what it already holds.

        Where it runs is read again after an unpickling. Once per process: refuses a buffer that
        cannot take the filter's rows, a ``[T, E]`` batch where ``[E, T]`` is read, and warns of
        a buffer that already holds rows this filter did not write; attaches the write counter
        (see the module).
        """
        if self._in_ray_actor is None:
            self._in_ray_actor = in_ray_actor()
            self._engine.many_producers = self._in_ray_actor
        if self._storage_checked:
            return
        rb = calling_replay_buffer()
        check_storage(rb)
        check_orientation(tensordict, self.options)
        fresh = self._copies is None and not self._engine.count("rows_in")
        self.rows_before_attach = check_late_attachment(
            rb, fresh and not is_storage_init(tensordict)
        )
        self._marks = marks_of(rb)
        self._writer = rb._writer if self._marks is not None else None
        self._stream_index = rb is not None and is_compact(getattr(rb, "storage", None))
        self._storage_checked = True  # once per process: a frame walk is not free

    def _settle_write(self) -> bool:
        """Reads whether the last call's rows reached the buffer; True if they did not.

        Stored (the writer reported a write since): a batch written again is
        a duplicate. Not stored: the cleaner goes back to before that call,
        and the writer to before its rows (TorchRL moved it past slots the
        failed write left empty, which a sampler would draw).
        """
        last = self._last_write
        if last is None:
            return False
        self.__dict__["_last_write"] = None  # (nn.Module.__setattr__ costs more)
        marks, writes, position, n_rows = last
        if marks.writes > writes:
            self._engine.last_call_stored()
            return False
        rewind_writer(self._writer, position, n_rows)
        return self._engine.undo_last_call()

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Cleans a batch when the filter is a collector's ``postproc``.

        In a replay buffer (``transform=``), the filter works on the write
        path only and this is the identity on sampled rows. On its own
        (``Collector(..., postproc=filt)``, ``RayCollector(...,
        collector_kwargs={"postproc": filt})``) it cleans the batch as
        ``rb.extend`` would and returns the rows: a batch with no row left
        when everything was dropped or held, which a collector can pass on.

        Examples:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> filt = AutoresetFilter("next_step")
            >>> batch = TensorDict({  # [E=1, T=3]: done at t=0, reset row at t=1
            ...     "observation": torch.tensor([[[0.0], [5.0], [10.0]]]),
            ...     ("next", "observation"): torch.tensor([[[0.0], [10.0], [11.0]]]),
            ...     ("next", "reward"): torch.tensor([[[1.0], [0.0], [1.0]]]),
            ...     ("next", "done"): torch.tensor([[[True], [False], [False]]]),
            ... }, batch_size=[1, 3])
            >>> filt(batch)["next", "observation"].flatten().tolist()
            [5.0, 11.0]
        """
        container = self.__dict__.get("_container")
        if container is not None and container() is not None:
            return tensordict  # sampled rows
        return self._clean(tensordict)

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return next_tensordict

    def get_extra_state(self) -> dict:
        self._settle_write()
        state = self._engine.state_dict()
        if self._stream_index or self.__dict__.get("_fed_compact"):
            state["compact_storage"] = True  # its buffer's rows hold no next observations
        if self._copies is not None:  # every other copy's state too
            self._publish()
            state["copies"] = self._copies.others()
        return state

    def set_extra_state(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise StateError(
                f"state: expected the dict AutoresetFilter.state_dict() returned, got "
                f"{type(state).__name__}. Pass what state_dict() returned, unchanged."
            )
        if "cleaner" in state and "held_kind" in state:
            raise StateError(
                "state: this is a RolloutRepair's state (it holds a repaired column); an "
                "AutoresetFilter loads only what AutoresetFilter.state_dict() returned. "
                "Nothing was changed."
            )
        if state.get("compact_storage"):
            check_compact_load(calling_replay_buffer(max_frames=24))
            self.__dict__["_fed_compact"] = True
        others = state.get("copies", [])
        _publish.check_states(others, self.options)
        self._engine.load_state_dict(state)
        self._copies = _publish.add_copies(self._copies, others)
        if self._copies is not None:
            self._publish()

    def _unflushed(self) -> int:
        """Rows held and never stored, not said yet (0 once said, or for copies)."""
        # (Copies in worker processes and Ray actors are flushed by the parent.)
        if self.__dict__.get("_said_unflushed") or self._copies is not None:
            return 0
        return self._engine.count("rows_held")

    def _say_unflushed_at_exit(self) -> None:
        """Warns, at interpreter exit, of held rows a forgotten flush never stored.

        A ``Collector(replay_buffer=rb)`` keeps the buffer, and so the filter,
        alive to the end: the garbage-collection warning never comes then.
        """
        held = self._unflushed()
        if held:
            self.__dict__["_said_unflushed"] = True
            warnings.warn(
                f"an AutoresetFilter still held {held} row(s) at interpreter exit that were "
                f"never stored (each waits for the row after it). {self._flush_advice()} To "
                "resume collection in another process instead, save filt.state_dict() with "
                "the buffer's rb.state_dict(): the restored filter stores them when their next "
                "rows come.",
                CleanbufWarning,
                stacklevel=2,
            )

    def _flush_advice(self) -> str:
        """What to call to store the held rows (with a policy, after a flush that raised)."""
        raised = self.__dict__.get("_flush_raised")
        if raised:
            nan = (
                ", or on_lost_terminal_obs='nan' to store them marked NaN"
                if raised == "floating"
                else ""  # (NaN cannot mark integer observations)
            )
            return (
                "Its flush raised (a held row lost its next observation and the policy is "
                "to raise): call filt.flush(rb, on_lost_terminal_obs='drop') to store none of "
                "them, on_lost_terminal_obs='keep' to store them as the producer left them"
                f"{nan}."
            )
        return (
            "Call filt.flush(rb) at the end of collection (after the collector's loop) to "
            "store them."
        )

    def __del__(self) -> None:
        # A forgotten flush(rb) loses the held rows: say so when the filter goes.
        try:
            held = self._unflushed()
            if held:
                warnings.warn(
                    f"an AutoresetFilter was garbage-collected while holding {held} row(s) "
                    "that were never stored (each waits for the row after it). "
                    f"{self._flush_advice()}",
                    CleanbufWarning,
                    stacklevel=2,
                )
        except Exception:  # interpreter shutdown, a half-built filter: nothing to say
            pass
