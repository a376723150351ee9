"""``RolloutRepair``: auto-reset rollouts repaired in place, for on-policy learners."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from cleanbuf.engine._errors import (
    CleanbufError,
    CleanbufWarning,
    ContinuityError,
    InputError,
    LayoutError,
    ResetRowError,
)
from cleanbuf.engine._keys import DONE_KEYS
from cleanbuf.engine._options import Options
from cleanbuf.engine._read import looks_time_first
from cleanbuf.engine._rollout import MASK_KEY, Rollouts

LAYOUTS = (None, "time_last", "time_first")
# Filter options that describe other streams than one producer's [*E, T] batches.
_NOT_HERE = ("stream_key", "joint_key", "producer_key", "compact")


class RolloutRepair:
    """Repairs auto-reset rollouts in place, keeping their time axis, for on-policy losses.

    Value estimators (GAE, TD(0), TD(lambda), V-trace) walk a batch's time
    axis, so the rows :class:`cleanbuf.AutoresetFilter` drops must stay.
    The repair is the filter's second output form: the same planning (which
    rows are reset rows, where each done row's terminal observation is,
    which rows wait for the next batch, the ``is_init`` and step-count
    fixes), written into the batch instead of leaving rows out.

    **Core rule.** On the valid rows (``("collector", "mask")`` True), every
    TorchRL value estimator gives what it gives on the explicit-reset run of
    the same env (Gymnasium ``AutoresetMode.DISABLED``), and the valid rows
    are that run's rows. For this, in the returned batch:

    * each done row holds its true terminal observation (TorchRL zero-fills
      it; a next-step reset row holds it; a same-step producer's
      final-observation entry holds it);
    * each reset row stays in place, marked False in the mask, and is made
      inert: ``("next", "done")`` and ``("next", "terminated")`` True,
      ``("next", "truncated")`` False, reward 0, so no estimator chains the
      old episode into the new one or bootstraps from it. TorchRL's losses
      skip it (their default ``loss_mask_key="auto"`` reads the mask), and
      so does ``batch[batch["collector", "mask"]]``;
    * ``is_init`` and the step counts are those of the explicit-reset run
      on the valid rows;
    * a collector's batch-end truncation mark (``Collector(set_truncated=
      True)``; no option says so) waits in the held column until
      its stream's next row says whether it ended an episode; if not, the
      row is returned not done, so the estimators chain through it (a
      terminated row keeps the mark's truncated flag, which they ignore).

    **Shape.** Where the filter would hold a done row on a batch's last step
    until its reset row comes (TorchRL collectors, whose done rows lack the
    terminal observation), the repair holds the batch's whole last column:
    call ``k`` returns ``[*E, T]`` made of the column call ``k - 1`` held and
    its own first ``T - 1`` steps (the first call returns ``[*E, T - 1]``),
    and :meth:`flush` returns the last held column ``[*E, 1]``. Every
    returned done row is complete, and no frame is returned twice or lost.
    Where nothing needs holding (same-step producers, raw loops that keep
    the terminal observation: ``terminal_obs_in_done_row=True``, the
    default with ``layout="time_first"``), each call returns its batch's
    shape.

    **Lost terminal observations.** TorchRL's ``GymEnv(num_envs=N)`` resets
    all envs together when they end on the same step (fixed-horizon tasks
    always do), and their terminal observations are gone. They are never
    bootstrapped from as zeros. By default (``on_lost_terminal_obs=None``,
    "nan") the row's next observation is NaN, with a
    :class:`~cleanbuf.CleanbufWarning`, counted in
    ``stats["terminal_obs_missing"]``; TorchRL's value estimators read a NaN
    next observation as the row's own observation (their documented
    stand-in), so they bootstrap the row, and through it the earlier rows of
    its episode, from ``V(s_{T-1})`` instead of ``V(s_T)``: an error
    discounted by ``(gamma * lambda) ** k`` on the row ``k`` steps earlier
    (a terminated row is not bootstrapped: exact); other code sees the NaN.
    With ``"drop"`` the row is masked instead (no loss on it) and its next
    observation becomes its own observation, so every estimator does the
    same for the rows before it, which stay valid. ``"keep"`` leaves the
    zeros. To lose nothing, collect from :func:`cleanbuf.lossless_gym_env`.

    **Stats.** ``rows_in == rows_out + reset_rows_masked +
    lost_rows_masked + rows_held``: every row that came in is returned,
    valid (``rows_out``) or masked, or is held.

    **Advantage normalisation.** ``ClipPPOLoss(normalize_advantage=True)``
    reads only ``"shifted_valid"``, not the mask: drop the masked rows
    before the update (``batch[batch["collector", "mask"]]``), or set
    ``batch["shifted_valid"] = batch["collector", "mask"]`` after the value
    estimator has run (an estimator reads ``"shifted_valid"`` too, and
    before it would turn each termination before a masked row into a
    bootstrap).

    Args:
        mode: as for :class:`cleanbuf.AutoresetFilter`.

    Keyword Args:
        layout: None or "time_last" for TorchRL's ``[*E, T]`` batches (a
            1-D batch named ``["time"]`` is one stream); "time_first" for
            ``[T, *E]`` rollouts as CleanRL and Stable-Baselines3 store
            them (TensorDicts, or dicts of numpy arrays or tensors keyed as
            TorchRL's: ``"observation"``, ``("next", "observation")``,
            ``("next", "reward")``, ``("next", "done")``...).
        mask_key: where the validity mask goes.
        **options: the filter's options (``joint_reset``,
            ``reset_group_size``, ``on_lost_terminal_obs``,
            ``terminal_obs_in_done_row``, ``check_reset_rows``,
            ``observation_keys``, ``done_key``, ``reward_key``,
            ``is_init_key``, ``step_count_key``, ``final_obs_key``,
            ``keep_final_obs``, ``check_continuity``), with the same
            meaning.

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
    """

    def __init__(
        self,
        mode: Any = "next_step",
        *,
        layout: str | None = None,
        mask_key: Any = MASK_KEY,
        **options: Any,
    ):
        if layout not in LAYOUTS:
            raise CleanbufError(
                f"layout={layout!r} does not go with RolloutRepair, which keeps a time axis: "
                "pass None or 'time_last' for TorchRL [*E, T] batches, or 'time_first' for "
                "[T, *E] rollouts. For one step of E envs per call, or flat rows, use "
                "AutoresetFilter."
            )
        bad = sorted(k for k in _NOT_HERE if options.get(k) not in (None, False))
        if bad:
            raise CleanbufError(
                f"option(s) {bad} do not go with RolloutRepair, which repairs the [*E, T] "
                "batches of one producer in place; use AutoresetFilter for flat rows and "
                "several producers."
            )
        if layout == "time_first":
            options.setdefault("terminal_obs_in_done_row", True)
        self._layout = layout
        opts = Options.build(mode, **options)
        mask_key = mask_key if isinstance(mask_key, tuple) else (mask_key,)
        self._engine = Rollouts(opts, mask_key)
        self._origin = None
        self._warned_nan = False
        self._as_numpy: bool | None = None  # dicts of arrays in: dicts out (and at flush)
        self._single = False  # the batches are one 1-D stream

    @classmethod
    def for_env(cls, env: Any, **overrides: Any) -> RolloutRepair:
        """Builds a repair configured for the producer ``env``.

        Reads the producer as :meth:`cleanbuf.AutoresetFilter.for_env` does
        (TorchRL ``GymEnv`` / ``GymWrapper`` and their transformed, serial
        and parallel forms, a TorchRL ``Collector``, a Gymnasium
        ``VectorEnv`` or single env, a Stable-Baselines3 ``VecEnv``, an
        EnvPool env: raw loops, whose rollouts are taken as stored time
        first, ``[T, E]``). A ``MultiSyncCollector``'s batches ``[W, E, T]``
        stack every worker's envs, each worker its own reset group, and are
        repaired as one producer's. A collector that yields one worker's
        batch at a time (``MultiAsyncCollector`` of several workers) or
        stacks remote collectors (``RayCollector``) is refused: repair each
        worker's batches (``postproc=``), or use
        :class:`cleanbuf.AutoresetFilter`. A single env that resets only
        when the loop says so needs no repair: the repair passes it through
        (``mode="disabled"``) and its repr says so.

        Args:
            env: the producer.
            **overrides: options that replace what was read (``layout``
                and ``mask_key`` included).

        Returns:
            The repair; its repr says how it was configured. Nothing is
            warned here: the first call that loses a terminal observation
            warns (see the class).

        Raises:
            CleanbufError: a producer of several streams' batches in turn, an
                unknown producer, or an env id (a str) instead of an env.
        """
        from cleanbuf.online._producers import options_for_env

        reading = options_for_env(env)
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
        repair = cls(**options)
        repair._origin = reading.why
        return repair

    @property
    def options(self) -> Options:
        """The cleaner's options."""
        return self._engine.options

    @property
    def stats(self) -> dict:
        """The counters, plain ints (see the class for the identity they keep).

        ``rows_in``, ``rows_out`` (valid rows returned), ``reset_rows_masked``,
        ``lost_rows_masked``, ``rows_held``, ``next_obs_restitched``,
        ``terminal_obs_missing``, ``next_obs_missing``, ``episodes_completed``.
        """
        return self._engine.stats

    def __call__(self, batch: Any) -> Any:
        """Repairs one batch; returns it with its time axis (see the class).

        Usable as ``Collector(..., postproc=repair)``. A batch that fails
        raises before anything changes.
        """
        if isinstance(batch, Mapping) and not isinstance(batch, TensorDictBase):
            td, as_numpy = _to_td(batch, self._layout)
            out = self(td)
            self._as_numpy = as_numpy
            return _to_dict(out, as_numpy)
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
        self._warn_lost(self._engine.stats["terminal_obs_missing"] - lost)
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
        return out if self._as_numpy is None else _to_dict(out, self._as_numpy)

    def state_dict(self) -> dict:
        """The state (carry, held column, counters) as tensors and plain values."""
        return self._engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restores what :meth:`state_dict` returned."""
        self._engine.load_state_dict(state)

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
        if not looks_time_first(td, self.options):
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

    def _warn_lost(self, n_lost: int) -> None:
        """Warns once per repair when a call marks lost terminal observations NaN."""
        opts = self.options
        if not n_lost or self._warned_nan or opts.on_lost_terminal_obs is not None:
            return
        if opts.mode != "next_step":
            return
        self._warned_nan = True
        warnings.warn(
            CleanbufWarning(
                f"{n_lost} terminal observation(s) were lost before the repair saw them "
                "(TorchRL resets all envs of a GymEnv(num_envs=N) together when they end on "
                "the same step, as fixed-horizon tasks always do); their next observations "
                "are NaN, which TorchRL's value estimators read as the row's own observation "
                "(an approximate bootstrap, never one from zeros). Collect from "
                "cleanbuf.lossless_gym_env(name, num_envs) to lose none, or pass "
                "on_lost_terminal_obs='drop' to keep those rows out of the loss (masked). "
                "This warning is shown once per repair."
            ),
            stacklevel=3,
        )

    def __repr__(self) -> str:
        o = self.options
        parts = [f"mode={o.mode!r}"]
        if self._layout is not None:
            parts.append(f"layout={self._layout!r}")
        if o.joint_reset:
            parts.append(f"joint_reset=True, reset_group_size={o.reset_group_size}")
        if o.on_lost_terminal_obs is not None:
            parts.append(f"on_lost_terminal_obs={o.on_lost_terminal_obs!r}")
        if self._origin:
            parts.append(f"from={self._origin!r}")
        return f"{type(self).__name__}({', '.join(parts)})"


def _to_td(data: Mapping, layout: str | None) -> tuple[TensorDictBase, bool]:
    """A dict of arrays (nested dicts or tuple keys) as a TensorDict; numpy or not."""
    leaves: dict = {}

    def walk(node: Mapping, prefix: tuple) -> None:
        for k, v in node.items():
            key = prefix + (k if isinstance(k, tuple) else (k,))
            if isinstance(v, Mapping):
                walk(v, key)
            elif isinstance(v, (np.ndarray, torch.Tensor)):
                leaves[key] = v
            else:
                raise InputError(
                    f"key {key!r} holds {type(v).__name__}; a dict passed to RolloutRepair "
                    "must hold numpy arrays or torch tensors."
                )

    walk(data, ())
    kinds = {isinstance(v, np.ndarray) for v in leaves.values()}
    if len(kinds) > 1:
        raise InputError("the dict mixes numpy arrays and torch tensors; pass one kind.")
    done = next((leaves[k] for k in DONE_KEYS if k in leaves), None)
    if done is None:
        raise InputError(
            f"no done key in the dict: expected one of {list(DONE_KEYS)} (nested dicts or "
            f"tuple keys), found {sorted(map(str, leaves))}."
        )
    # A trailing 1 is TorchRL's flag dimension ([T, E, 1]), unless every array has it
    # (a loop of one env stored CleanRL's way: done [T, 1], observations [T, 1, ...]).
    dims = done.ndim
    if dims > 1 and done.shape[-1] == 1:
        if any(tuple(v.shape[:dims]) != tuple(done.shape) for v in leaves.values()):
            dims -= 1
    batch = list(done.shape[:dims])
    tensors = {k: torch.as_tensor(v) for k, v in leaves.items()}
    bad = {str(k): list(v.shape) for k, v in tensors.items() if list(v.shape[:dims]) != batch}
    if bad:
        raise InputError(
            f"arrays disagree on the batch shape: expected {batch} (from the done key) "
            f"first for every key, got {bad}."
        )
    td = TensorDict(batch_size=batch)
    for k, v in tensors.items():
        td.set(k, v)
    return td, kinds == {True}


def _to_dict(td: TensorDictBase | None, as_numpy: bool) -> dict | None:
    if td is None:
        return None
    out: dict = {}
    for k, v in td.items(include_nested=True, leaves_only=True):
        k = k if isinstance(k, tuple) else (k,)
        node = out
        for part in k[:-1]:
            node = node.setdefault(part, {})
        node[k[-1]] = v.numpy() if as_numpy else v
    return out
