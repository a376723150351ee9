"""The TorchRL replay-buffer transform: a thin shell over the cleaner."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Mapping
from typing import Any

from tensordict import TensorDictBase
from torchrl.envs.transforms import Transform

from cleanbuf.engine._cleaner import Cleaner
from cleanbuf.engine._errors import CleanbufError, CleanbufWarning, InputError, StateError
from cleanbuf.engine._options import Options
from cleanbuf.online import _publish, _writes
from cleanbuf.online._compat import calling_replay_buffer
from cleanbuf.online._copies import CopyStates
from cleanbuf.online._losses import LOST_KEY, LostObservations
from cleanbuf.online._producers import options_for_env
from cleanbuf.online._ray import flush_buffer_actor, in_ray_actor, is_ray_buffer
from cleanbuf.online._storage import check_storage, is_storage_init


class AutoresetFilter(Transform):
    """Removes auto-reset artifacts from data as it is written to a replay buffer.

    Use it as ``ReplayBuffer(..., transform=AutoresetFilter(...))`` (also
    inside a ``Compose``). ``rb.extend(batch)`` and ``rb.add(row)`` store
    cleaned rows; ``rb.sample()`` is untouched. The collector does not change.

    **Core rule (next-step mode).** A vector env in next-step auto-reset mode
    (Gymnasium >= 1.0 default, EnvPool, TorchRL ``GymEnv(name, num_envs=N)``)
    emits, after each done row, a reset row: observation = the terminal
    observation, reward 0, not done, next observation = the first observation
    of the new episode. For each stream the filter drops that reset row,
    writes its observation into the done row's ``("next", obs)`` (the
    terminal observation, which TorchRL zero-fills), sets ``is_init`` on the
    new episode's first row, subtracts the step the reset row consumed from
    ``step_count`` / ``("next", "step_count")``, and passes every other key
    through. A done row whose reset row is not in the same call is held and
    emitted by the call that brings it (or by :meth:`flush`); where the done
    row already holds its terminal observation (raw Gymnasium and EnvPool
    loops: read from the data, row by row, a next observation that is
    neither zero-filled nor NaN), it is emitted at once, never replaced or
    counted lost, and only its reset row is dropped when it comes. The
    output is
    flat rows ``[M]``: a 1-D storage stores rows. A call that drops, holds
    and fixes nothing returns views of the batch (what a plain extend would
    store); otherwise the rows are copies. The output declares the device
    its rows are on, even when the batch has none (TorchRL's collectors
    yield ``device=None``), so a storage writes it without a ``to()`` over
    every leaf first. A call that leaves no row
    returns None, which the buffer stores as nothing. Inside a ``Compose``
    the write path runs the transforms from last to first; a transform that
    runs after this filter there receives that None and must accept it.

    **Joint resets.** TorchRL's ``GymEnv(num_envs=N)`` performs a real reset
    when all N envs are done at the same step. No reset row follows then, and
    the terminal observations of those done rows are gone. With
    ``joint_reset=True`` the filter knows this, does not hold those rows, and
    applies ``on_lost_terminal_obs`` to them. :meth:`for_env` sets it.

    **Same-step mode.** Producers that reset on the same step (Gymnasium
    ``SAME_STEP``, Stable-Baselines3 ``VecEnv``, gym 0.26, ManiSkill, Isaac
    Lab) return the reset observation as the done row's next observation and
    the terminal one in an info entry. No row is dropped; the done row's
    ``("next", obs)`` is taken from the final-observation entry
    (``("next", "final_obs")``, ``("next", "final_observation")`` or
    ``("next", "terminal_observation")``, or ``final_obs_key``; one tensor,
    or a sub-TensorDict with the observation keys), whose per-row mask
    ``("next", "_final_obs")`` says where it is present. The entry is not
    stored unless ``keep_final_obs=True``. A done row without it raises by
    default (``on_lost_terminal_obs`` chooses otherwise).

    **Observation-only data.** When the observation keys have no
    ``("next", k)`` (TorchRL ``Collector(compact_obs=True)``, loops that
    store each observation once), every row gets ``("next", k)`` from the
    next row of its stream (a next-step done row: from its reset row, the
    terminal observation; a same-step done row: from its final entry). The
    last row of each stream in a call is held until that row arrives. With
    ``compact=True`` the layout stays observation-only: only the artifacts
    go, nothing is held, half the memory, and the terminal observations of
    done rows are not stored (a next-step reset row that is dropped took its
    terminal observation with it).

    **Streams across calls.** Each call must continue the streams of the
    calls before it: a stream's first row in a call has, as its observation,
    the stored next observation of its last row in the previous call, unless
    that row ended an episode or the new row restarts the stream
    (``is_init``, or ``step_count`` 0: a collector reset between batches,
    which ends the interrupted episode there). Another producer's batch, a
    skipped batch or an unnoticed reset raises
    :class:`~cleanbuf.ContinuityError`. Before each call the filter reads
    from the buffer whether the last call's rows arrived: a batch written
    again after its write failed is a retry (its rows, and the held rows
    its call released, are delivered again), one written again after its
    write succeeded is a duplicate (``ContinuityError``).

    **Batch-end marks.** ``Collector(set_truncated=True)`` marks every
    batch's last step done and truncated. Such a row (done, truncated, not
    terminated, on a time-last call's last step, where TorchRL zero-fills
    real terminal observations) may be a real end or only a mark; no option
    says which. It is held, and its stream's next row decides: a restart
    (``is_init``, else a first row whose observation differs from the held
    row's next observation) means a real end, any other row a mark, stored
    as it was. One still undecided at :meth:`flush` is stored as it is when
    its next observation is stored (not zero-filled: a mark's is real); a
    zero-filled one is a real end (its terminal observation lost). Rows
    without the collector's ``("collector", "traj_ids")`` come from no
    collector and carry no marks: there a stored batch-end truncation (a
    raw loop stacked ``[E, T]``) is a real end.

    **Many processes.** Given to a multi-process TorchRL collector
    (``replay_buffer=rb``), the buffer and this filter are pickled into each
    worker; TorchRL calls :meth:`share_memory_` first, and from then on every
    copy publishes its state, so that :attr:`stats` and :meth:`flush` in the
    parent cover them all.

    **A collector's postproc.** Called on its own rather than by a buffer
    (``Collector(..., postproc=filt)``), the filter cleans each batch the
    collector yields or writes (:meth:`forward`).

    **Ray.** Pickled while Ray is running (``RayReplayBuffer(...,
    transform=filt)``, or ``RayCollector(..., collector_kwargs={"postproc":
    filt})``), the filter does the same through a small Ray actor, on any
    node. Inside a Ray actor the filter takes batches from several
    producers (each ``RayCollector`` worker extending the buffer): each
    batch goes to the producer whose streams it continues, by trajectory
    ids and observations, and a batch that continues none starts a new
    producer.

    **Honest failure modes.** A supposed reset row with a nonzero reward or
    a done flag raises :class:`~cleanbuf.ResetRowError` (wrong mode or
    flavour, or a reward transform that moves 0: ``check_reset_rows=False``).
    A lost terminal observation is NaN by default (floating observations),
    counted in ``stats["terminal_obs_missing"]``; integer observations need an
    explicit ``on_lost_terminal_obs`` (at the end, also
    ``flush(rb, on_lost_terminal_obs=...)``). Any error leaves the filter's
    state and the buffer unchanged. A filter collected while it holds rows
    (a forgotten :meth:`flush`) warns, and its repr shows them.

    Args:
        mode: "next_step", "same_step", "disabled" (validate and pass
            through), or a ``gymnasium.vector.AutoresetMode``.

    Keyword Args:
        layout: None to infer (``[*E, T]`` time-last collector batches, a
            1-D batch named ``["time"]`` or of length one as one stream),
            "time_last" (``[*E, T]``, declared), "step" (each call is one
            step of E envs, batch ``[E]``), or "stream_key" with
            ``stream_key``. (Time-first ``[T, E]`` rollouts: transpose them,
            or use :class:`~cleanbuf.RolloutRepair` / :func:`cleanbuf.clean`
            with ``layout="time_first"``.)
        stream_key: key of a per-row stream id, for flat rows.
        joint_reset: the producer resets a whole reset group when all its
            envs are done at once (TorchRL ``GymEnv(num_envs=N)``).
        reset_group_size: streams per reset group (consecutive in C order);
            None means all streams of a call.
        joint_key: with ``layout="stream_key"``: a key holding, per row,
            True on a done row whose whole reset group was done on that
            step (a joint reset: no reset row follows, the terminal
            observation is lost). Implies ``joint_reset``; flat rows do not
            show which rows share a step, so the flag comes with them.
        on_lost_terminal_obs: "nan", "drop", "raise" or "keep". None (the
            default) is, in next-step mode, "nan" for floating observations
            and an error for integer ones; in same-step mode an error.
        terminal_obs_in_done_row: rarely needed: whether a done row holds
            its terminal observation is read from the data, row by row
            (zero-filled or NaN: not held). True declares every done row
            complete, zeros included, for the one case the data cannot
            tell: a terminal observation that is truly 0 in every element
            with no reset row after it. False is deprecated (ignored).
        check_reset_rows: check that each reset row has reward 0 and is not
            done.
        observation_keys: list of observation keys; None discovers every key
            present at the root and under "next" (done, reward and
            bookkeeping keys excluded). Observation-only data needs them.
        done_key: the done key; None uses ``("next", "done")``, else
            ``("next", "terminated") | ("next", "truncated")``.
        reward_key: the reward key for the reset-row check.
        is_init_key: the ``InitTracker`` key (None to leave it alone).
        step_count_key: the ``StepCounter`` key (None to leave it alone).
        final_obs_key: same-step mode: the final-observation entry; None
            looks for the common names.
        keep_final_obs: same-step mode: store the final-observation entry too.
        compact: observation-only data: keep it observation-only (see above).
        check_continuity: check that each call continues the streams of the
            calls before it (see above).
        producer_key: batches come from several producers in turn (a
            ``MultiAsyncCollector`` extended from the parent); this key's
            trajectory ids tell which producer's streams a batch continues.

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
    """

    def __init__(self, mode: Any = "next_step", **options: Any):
        super().__init__(in_keys=[], out_keys=[])
        self._cleaner = Cleaner(Options.build(mode, **options))
        self._bypass = False
        self._origin = None
        self._copies: _publish.Copies | None = None  # set once the copies publish
        self._storage_checked = False  # the buffer's storage takes flat rows (checked once)
        self._losses = LostObservations()  # NaN next observations written by default
        self._in_ray_actor: bool | None = None  # whether it runs in a Ray actor (first call)
        self._buffer = None  # weak reference to the buffer whose extend calls it (first call)
        self._last_write: _writes.LastWrite | None = None  # the last call's rows, on their way

    @classmethod
    def for_env(cls, env: Any, **overrides: Any) -> AutoresetFilter:
        """Builds a filter configured for the producer ``env``.

        Reads the auto-reset behaviour from TorchRL ``GymEnv`` /
        ``GymWrapper`` (also inside ``TransformedEnv``, and ``ParallelEnv`` /
        ``SerialEnv`` of them, where each worker is its own reset group), a
        TorchRL collector (``compact_obs=True`` makes the data
        observation-only), a
        ``MultiSyncCollector`` or ``MultiAsyncCollector`` (each worker its
        own reset group; an async collector's batches told apart by
        trajectory ids), a ``RayCollector`` (read in its first remote
        collector; a sync one's stacked batches, each collector its own
        reset group), a Gymnasium ``VectorEnv``, a Stable-Baselines3
        ``VecEnv`` or an EnvPool env.

        Args:
            env: the producer.
            **overrides: options that replace what was read from ``env``.

        Returns:
            The filter. Its repr says how it was configured.

        Raises:
            CleanbufError: the producer is unknown; pass an explicit mode.

        A ``GymEnv(name, num_envs=N)`` loses the terminal observations of
        envs that end on the same step (TorchRL resets them together): the
        repr says so when its sub-envs have a time limit, and the first
        call that loses one warns (by default).
        """
        reading = options_for_env(env)
        options = {**reading.options, **overrides}
        filt = cls(**options)
        filt._origin = reading.why
        return filt

    @property
    def options(self) -> Options:
        """The filter's options."""
        return self._cleaner.options

    @property
    def stats(self) -> dict:
        """The counters, as plain Python ints.

        ``rows_in``, ``rows_out``, ``reset_rows_dropped``,
        ``next_obs_restitched``, ``terminal_obs_missing``,
        ``next_obs_missing``, ``lost_rows_dropped``, ``rows_held``,
        ``episodes_completed``.

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
            return self._cleaner.stats
        states = self._copies.load()
        self._losses.after_copies(states, stacklevel=2)
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
        return {**self._cleaner.state_dict(), LOST_KEY: self._losses.in_calls}

    def _publish(self) -> None:
        self._copies.publish(self._state())

    def __getstate__(self) -> dict:
        # Pickled while Ray runs: for a Ray actor, which publishes its state.
        self._copies = _publish.for_ray(self._copies, self._state())
        state = super().__getstate__()
        state["_buffer"] = state["_last_write"] = None  # weak references stay here
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

        Warns:
            CleanbufWarning: as :attr:`stats` does, before the flush.
        """
        self._settle_write()
        if self._copies is not None:  # what the copies lost, before the flush marks more
            self._losses.after_copies(self._copies.load(), stacklevel=2)
        if rb is not None and is_ray_buffer(rb) and flush_buffer_actor(rb, type(self)):
            # The buffer actor's filter stored every copy's held rows there.
            if self._copies is not None:
                self._cleaner.load_state_dict(self._copies.load()[self._copies.own])
            return None
        if self._copies is not None:
            self._publish()
            write = None if rb is None else lambda rows: self._extend_bypassing(rb, rows)
            rows, self._cleaner = _publish.flush_copies(self._copies, self.options, write)
            return None if rb is not None else rows
        if rb is None:
            return self._cleaner.flush(on_lost_terminal_obs)
        state = self._cleaner.state_dict()
        rows = self._cleaner.flush(on_lost_terminal_obs)
        if rows.batch_size[0] == 0:
            return None
        try:
            self._extend_bypassing(rb, rows)
        except BaseException:
            self._cleaner.load_state_dict(state)
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
        out = self._clean(tensordict)
        # ReplayBuffer.extend / add store nothing for None (their writers
        # reject an empty batch).
        return out if out.batch_size[0] else None

    def _clean(self, tensordict: TensorDictBase) -> TensorDictBase:
        """One call of the cleaner on ``tensordict``: the flat rows it leaves."""
        if self.parent is not None:
            raise RuntimeError(
                "AutoresetFilter is a replay-buffer transform: put it in "
                "ReplayBuffer(transform=...), not in an environment."
            )
        if not isinstance(tensordict, TensorDictBase):
            what = "a dict" if isinstance(tensordict, Mapping) else type(tensordict).__name__
            raise InputError(
                f"AutoresetFilter cleans TensorDict batches; got {what}. Expected what a "
                "TorchRL collector yields (a TensorDict [E, T]). Fix: wrap it "
                "(tensordict.TensorDict(data, batch_size=[E, T])), or use "
                "cleanbuf.clean(data) for dicts of arrays and RolloutRepair for on-policy "
                "rollouts. Nothing was written."
            )
        if not self._storage_checked:
            rb = calling_replay_buffer()
            check_storage(rb)
            self._buffer = None if rb is None else weakref.ref(rb)
            self._storage_checked = True  # once per process: a frame walk is not free
        if self._in_ray_actor is None:
            self._in_ray_actor = in_ray_actor()
        self._cleaner.many_producers = self._in_ray_actor  # also a cleaner a flush replaced
        if is_storage_init(tensordict):
            # Shaped as the filter's rows, so the storage is laid out for them;
            # TorchRL empties the buffer right after: nothing is counted or kept.
            return Cleaner(self.options)(tensordict)
        failed = self._settle_write()
        rb = None if self._buffer is None else self._buffer()
        slot = _writes.slot_before(rb) if self._tracks_writes() else None
        counting = self._losses.counting(self.options)
        lost = self._cleaner.count("terminal_obs_missing") if counting else 0
        try:
            out = self._cleaner(tensordict)
        except CleanbufError as err:
            if not failed:
                raise
            raise type(err)(
                "The write of the previous batch into the buffer failed, so its rows (and "
                "the held rows its call released) are not stored; the filter is back to "
                f"before that batch: write it again before this one. {err}"
            ) from None
        if slot is not None:
            self._last_write = _writes.record(rb, slot, out)
        if self._tracks_writes() and self._last_write is None:
            self._cleaner.last_call_stored()  # nothing to write, or no buffer: no retry
        if counting:
            self._losses.after_call(self._cleaner.count("terminal_obs_missing") - lost)
        if self._copies is not None:
            self._publish()
        return out

    def _tracks_writes(self) -> bool:
        """Whether this filter tells its calls' writes apart (:mod:`cleanbuf.online._writes`).

        One filter in one process; copies in workers and Ray actors keep
        the cleaner's own retry rule.
        """
        return self._copies is None and not self._in_ray_actor

    def _settle_write(self) -> bool:
        """Reads whether the last call's rows reached the buffer; True if they did not.

        Stored: a batch written again is a duplicate. Not stored: the
        cleaner goes back to before that call.
        """
        last, self._last_write = self._last_write, None
        if last is None:
            return False
        stored = last.stored()
        if stored:
            self._cleaner.last_call_stored()
        elif stored is False:
            return self._cleaner.undo_last_call()
        return False

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
        state = self._cleaner.state_dict()
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
        others = state.get("copies", [])
        _publish.check_states(others, self.options)
        self._cleaner.load_state_dict(state)
        self._copies = _publish.add_copies(self._copies, others)
        if self._copies is not None:
            self._publish()

    def __repr__(self) -> str:
        o = self.options
        parts = [f"mode={o.mode!r}"]
        if o.layout is not None:
            parts.append(f"layout={o.layout!r}")
        if o.joint_key is not None:
            parts.append(f"joint_key={o.joint_key!r}")
        elif o.joint_reset:
            parts.append(f"joint_reset=True, reset_group_size={o.reset_group_size}")
        if o.on_lost_terminal_obs is not None:
            parts.append(f"on_lost_terminal_obs={o.on_lost_terminal_obs!r}")
        origin = getattr(self, "_origin", None)
        if origin:
            parts.append(f"from={origin!r}")
        held = self._cleaner.count("rows_held")
        if held:
            parts.append(f"rows_held={held} (not stored until flush(rb))")
        return f"{type(self).__name__}({', '.join(parts)})"

    def __del__(self) -> None:
        # A forgotten flush(rb) loses the held rows: say so when the filter goes.
        # (Copies in worker processes and Ray actors are flushed by the parent.)
        try:
            held = self._cleaner.count("rows_held") if self._copies is None else 0
            if held:
                warnings.warn(
                    f"an AutoresetFilter was garbage-collected while holding {held} row(s) "
                    "that were never stored (each waits for the row after it). Call "
                    "filt.flush(rb) at the end of collection to store them.",
                    CleanbufWarning,
                    stacklevel=2,
                )
        except Exception:  # interpreter shutdown, a half-built filter: nothing to say
            pass
