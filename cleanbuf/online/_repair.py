"""``RolloutRepair``: auto-reset rollouts repaired with their time axis, for on-policy learners."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tensordict import NestedKey, TensorDictBase, unravel_key

from cleanbuf.engine._dicts import to_dict, to_tensordict
from cleanbuf.engine._errors import (
    CleanbufError,
    ContinuityError,
    InputError,
    LayoutError,
    ResetRowError,
    StateError,
)
from cleanbuf.engine._options import Options, keyword_names, options_in, refuse_unknown
from cleanbuf.engine._orientation import batch_time_axis
from cleanbuf.engine._rollout import MASK_KEY, ROLLOUT_FIELDS, Rollouts
from cleanbuf.online._base import OnlineCleaner
from cleanbuf.online._losses import LostObservations
from cleanbuf.online._producers import Reading

LAYOUTS = (None, "time_last", "time_first")
# Filter options that describe other streams than one producer's [*E, T] batches.
_NOT_HERE = ("stream_key", "joint_key", "producer_key", "compact")


class RolloutRepair(OnlineCleaner):
    """Repairs auto-reset rollouts, keeping their time axis, for on-policy losses.

    Value estimators (GAE, TD(0), TD(lambda), V-trace) walk a batch's time
    axis, so the rows :class:`cleanbuf.AutoresetFilter` drops must stay: the
    repair writes the filter's plan into a copy of the batch instead (the
    batch passed in is not changed: use what the call returns). On the rows its
    mask marks valid (``("collector", "mask")``), every TorchRL value
    estimator gives what it gives on the explicit-reset run of the same env,
    and those rows are that run's rows: each done row gets its terminal
    observation, each reset row stays in place, masked and made inert (done,
    terminated, reward 0), ``is_init`` and the step counts are fixed. Where
    a done row's terminal observation comes with the next batch (TorchRL
    collectors), the batch's last column waits for it: call ``k`` returns
    ``[*E, T]`` made of the column call ``k - 1`` held and its own first
    ``T - 1`` steps, and :meth:`flush` returns the last one. The rules in
    full (shape, lost observations, advantage normalisation) are in the
    guide ``docs/rules.md``; each option in :class:`cleanbuf.Options`.

    Args:
        mode: as for :class:`cleanbuf.AutoresetFilter`.
        layout: None or "time_last" for TorchRL's ``[*E, T]`` batches (a
            1-D batch named ``["time"]`` is one stream); "time_first" for
            ``[T, *E]`` rollouts as CleanRL and Stable-Baselines3 store
            them (TensorDicts, or dicts of numpy arrays or tensors keyed as
            TorchRL's). "time_first" reads every done row's next
            observation as stored (``terminal_obs_in_done_row=True``).
        mask_key: where the validity mask goes.
        joint_reset: as for the filter.
        reset_group_size: as for the filter.
        on_lost_terminal_obs: as for the filter; "drop" masks the row.
        terminal_obs_in_done_row: as for the filter.
        check_reset_rows: as for the filter.
        observation_keys: as for the filter.
        done_key: as for the filter.
        reward_key: as for the filter.
        is_init_key: as for the filter.
        step_count_key: as for the filter.
        final_obs_key: as for the filter.
        keep_final_obs: as for the filter.
        check_continuity: as for the filter.
        **unknown: nothing: a misspelt option raises, naming the options;
            the filter's flat-row options (``stream_key``, ``joint_key``,
            ``producer_key``, ``compact``) raise, naming the filter.

    Raises:
        CleanbufError: an unknown option, or one that does not go with
            ``[*E, T]`` batches of one producer.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from cleanbuf import RolloutRepair
        >>> repair = RolloutRepair("next_step")
        >>> batch = TensorDict({  # [E=1, T=4]: done at t=1, reset row at t=2
        ...     "observation": torch.tensor([[[0.0], [1.0], [2.0], [10.0]]]),
        ...     ("next", "observation"): torch.tensor([[[1.0], [0.0], [10.0], [11.0]]]),
        ...     ("next", "reward"): torch.tensor([[[1.0], [1.0], [0.0], [1.0]]]),
        ...     ("next", "done"): torch.tensor([[[False], [True], [False], [False]]]),
        ... }, batch_size=[1, 4])
        >>> out = repair(batch)
        >>> out["next", "observation"].flatten().tolist()  # terminal observation 2.0
        [1.0, 2.0, 10.0]
        >>> out["collector", "mask"].tolist()  # the reset row is masked
        [[True, True, False]]
        >>> repair.flush().batch_size  # the last column, held for the next batch
        torch.Size([1, 1])
        >>> s = repair.stats
        >>> s["rows_in"] == s["rows_out"] + s["reset_rows_masked"] + s["lost_rows_masked"]
        True

    See Also:
        :class:`cleanbuf.AutoresetFilter`: flat rows for replay buffers.
        :func:`cleanbuf.lossless_gym_env`: a TorchRL env that loses no
        terminal observation.
    """

    def __init__(
        self,
        mode: str | Any = "next_step",
        *,
        layout: str | None = None,
        mask_key: NestedKey = MASK_KEY,
        joint_reset: bool = False,
        reset_group_size: int | None = None,
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
        check_continuity: bool = True,
        **unknown: Any,
    ):
        if layout not in LAYOUTS:
            raise CleanbufError(
                f"layout={layout!r} does not go with RolloutRepair, which keeps a time axis: "
                "pass None or 'time_last' for TorchRL [*E, T] batches, or 'time_first' for "
                "[T, *E] rollouts. For one step of E envs per call, or flat rows, use "
                "AutoresetFilter."
            )
        bad = sorted(k for k in _NOT_HERE if unknown.get(k) not in (None, False))
        if bad:
            raise CleanbufError(
                f"option(s) {bad} do not go with RolloutRepair, which repairs the [*E, T] "
                "batches of one producer; use AutoresetFilter for flat rows and "
                "several producers."
            )
        options = options_in(locals())
        del options["layout"]  # the repair's own words; the engine reads [*E, T]
        if layout == "time_first" and terminal_obs_in_done_row is None:
            options["terminal_obs_in_done_row"] = True
        unknown = {k: v for k, v in unknown.items() if k not in _NOT_HERE}
        unknown = refuse_unknown(unknown, keyword_names(RolloutRepair), "RolloutRepair")
        self._layout = layout
        mask_key = unravel_key(mask_key)
        mask_key = mask_key if isinstance(mask_key, tuple) else (mask_key,)
        self._engine = Rollouts(Options.build(**options, **unknown), mask_key)
        self._origin = None
        self._losses = LostObservations("repair")
        self._as_numpy: bool | None = None  # dicts of arrays in: dicts out (and at flush)
        self._single = False  # the batches are one 1-D stream

    @classmethod
    def _options_for(cls, env: Any, reading: Reading, overrides: dict) -> dict:
        """What ``for_env`` read, for ``[*E, T]`` batches of one producer.

        A ``MultiSyncCollector``'s batches ``[W, E, T]`` stack every
        worker's envs, each worker its own reset group, and are repaired as
        one producer's. A collector that yields one worker's batch at a
        time (``MultiAsyncCollector`` of several workers) or stacks remote
        collectors (``RayCollector``) is refused: repair each worker's
        batches (``postproc=``), or use the filter. A raw loop's rollouts
        are taken as stored time first, ``[T, E]``. A single env that
        resets only when the loop says so needs no repair: it passes
        through (``mode="disabled"``) and the repr says so.
        """
        options = {**reading.options, **overrides}
        if options.get("producer_key") is not None or reading.streams is not None:
            raise CleanbufError(
                f"{type(env).__name__} yields batches of several producers; RolloutRepair "
                "repairs one producer's [*E, T] batches. Give each worker its own repair, "
                "or use AutoresetFilter."
            )
        if reading.options.get("layout") == "step" and "layout" not in overrides:
            options["layout"] = "time_first"  # a raw loop's rollout, stored [T, E]
        elif options.get("layout") in ("step", "stream_key"):
            options.pop("layout")
        return options

    @property
    def stats(self) -> dict:
        """The counters, plain ints.

        ``rows_in == rows_out + reset_rows_masked + lost_rows_masked +
        rows_held``: every row that came in is returned, valid
        (``rows_out``) or masked, or is held. Also ``next_obs_restitched``,
        ``terminal_obs_missing``, ``next_obs_missing`` and
        ``episodes_completed``, as the filter counts them.
        """
        return self._engine.stats

    def __call__(self, batch: Any) -> Any:
        """Repairs one batch; returns it with its time axis (see the class).

        Usable as ``Collector(..., postproc=repair)``. A batch that fails
        raises before anything changes.
        """
        if isinstance(batch, Mapping) and not isinstance(batch, TensorDictBase):
            td, as_numpy = to_tensordict(
                batch,
                "RolloutRepair",
                time_first=self._layout == "time_first",
                done_key=self.options.done_key,
            )
            out = self(td)
            self._as_numpy = as_numpy
            return None if out is None else to_dict(out, as_numpy)
        td, single = self._time_last(batch)
        axis_known = single or self._layout == "time_first"
        if not axis_known and not self._engine.stats["rows_in"]:
            self._check_time_last(td, None)  # a first batch [T, E] would be read wrongly
        lost = self._engine.stats["terminal_obs_missing"]
        try:
            out = self._engine(td)
        except (LayoutError, ResetRowError, ContinuityError) as err:
            if not axis_known:
                self._check_time_last(td, err)
            raise
        self._single = single
        self._count_lost(self._engine.stats["terminal_obs_missing"] - lost)
        return self._back(out, single)

    def flush(self) -> Any:
        """Returns the held last column (``[*E, 1]``, or ``[1, *E]`` time first), or None.

        Call it at the end of collection. A held done row whose reset row
        will not come has lost its terminal observation (counted; the
        lost-observation policy applies).
        """
        out = self._engine.flush()
        if out is None:
            return None
        out = self._back(out, self._single)
        return out if self._as_numpy is None else to_dict(out, self._as_numpy)

    def state_dict(self) -> dict:
        """The state, laid out as the filter's: ``{"_extra_state": ...}``.

        The carry, the held column and the counters, as tensors and plain
        values (``torch.save`` keeps it).
        """
        return {"_extra_state": self._engine.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restores what :meth:`state_dict` returned.

        Raises:
            StateError: ``state`` is not a repair's state.
            InputError: it was saved by a repair with other options.
        """
        inner = state.get("_extra_state", state) if isinstance(state, dict) else None
        if not isinstance(inner, dict) or not set(inner) & set(ROLLOUT_FIELDS):
            raise StateError(
                f"state: expected the dict RolloutRepair.state_dict() returned, got "
                f"{type(state).__name__}"
                + (f" with keys {sorted(map(str, state))}" if isinstance(state, dict) else "")
                + ". Pass what state_dict() returned, unchanged. Nothing was changed."
            )
        self._engine.load_state_dict(inner)

    def _repr_parts(self) -> list:
        parts = super()._repr_parts()
        if self._layout is not None:
            parts.insert(1, f"layout={self._layout!r}")
        if self._engine.mask_key != MASK_KEY:
            parts.insert(1, f"mask_key={self._engine.mask_key!r}")
        return parts

    # ------------------------------------------------------------ helpers
    def _time_last(self, td: Any) -> tuple[TensorDictBase, bool]:
        """The batch as ``[*E, T]``, and whether it was a single 1-D stream."""
        if not isinstance(td, TensorDictBase):
            raise InputError(f"expected a TensorDict or a dict of arrays, got {type(td).__name__}.")
        if td.batch_dims == 0:
            raise LayoutError(
                "got a batch with batch_size=[] (no time axis); RolloutRepair takes "
                "[*E, T] batches (layout=None) or [T, *E] rollouts (layout='time_first')."
            )
        names = td.names
        single = td.batch_dims == 1 and (self._layout == "time_first" or names[0] == "time")
        if single:
            return td.unsqueeze(0), True
        if self._layout == "time_first":
            n = td.batch_dims
            return td.permute(*range(1, n), 0), False
        if td.batch_dims == 1:
            raise LayoutError(
                f"a 1-D batch of batch_size={list(td.batch_size)} has no stream dimension "
                "and is not named ['time']: it could be one step of E envs or a flattened "
                "batch, and neither has a time axis to keep. Pass [*E, T] batches, name a "
                "single stream data.refine_names('time'), or pass layout='time_first'."
            )
        return td, False

    def _check_time_last(self, td: TensorDictBase, err: Exception | None) -> None:
        """Raises a LayoutError if the ``[A, B]`` batch read as ``[E, T]`` looks ``[T, E]``.

        Within a stream, a row's next observation is the next row's
        observation except at episode ends: along the time axis that chain
        holds for most rows, along the env axis for almost none. A batch
        whose chain holds along its first axis rather than its last is a
        rollout stored time first (CleanRL, Stable-Baselines3, steps
        stacked with ``torch.stack(rows, 0)``). ``err`` is the error the
        batch got, if any, said after the axis order. Never raises anything
        else (a batch too odd to tell gets its own error from the cleaner).
        """
        if batch_time_axis(td, self.options) != 0:
            return
        a, b = td.batch_size
        raise LayoutError(
            f"this batch looks time-first [T, E]: its rows continue along its first axis "
            f"(size {a}), not its last (size {b}), and RolloutRepair() reads batches as "
            "[*E, T] (time last, as TorchRL collectors give them). Pass "
            "layout='time_first' (RolloutRepair(mode, layout='time_first')) for rollouts "
            "stored [T, E], or transpose the batch. Nothing was changed."
            + (f" (The cleaner said: {err})" if err is not None else "")
        ) from err

    def _back(self, out: TensorDictBase, single: bool) -> TensorDictBase:
        if single:
            return out.squeeze(0)
        if self._layout == "time_first":
            n = out.batch_dims
            return out.permute(n - 1, *range(n - 1)).contiguous()
        return out
