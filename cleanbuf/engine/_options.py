"""Validated, immutable cleaner options, and the mode names they accept."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from typing import Any

from tensordict import NestedKey, unravel_key

from cleanbuf.engine._errors import CleanbufError, user_stacklevel

MODES = ("next_step", "same_step", "disabled")
LAYOUTS = ("time_last", "time_first", "step", "stream_key")
LOST_POLICIES = ("nan", "drop", "raise", "keep")

# Gymnasium's AutoresetMode values, so that the enum works without importing gymnasium here.
_GYMNASIUM_MODE_VALUES = {
    "NextStep": "next_step",
    "SameStep": "same_step",
    "Disabled": "disabled",
}


def normalize_mode(mode: Any) -> str:
    """Maps a mode name or a ``gymnasium.vector.AutoresetMode`` to a mode name.

    Args:
        mode: "next_step", "same_step", "disabled", or an ``AutoresetMode``.

    Returns:
        One of :data:`MODES`.

    Examples:
        >>> normalize_mode("next_step")
        'next_step'
        >>> import gymnasium
        >>> normalize_mode(gymnasium.vector.AutoresetMode.SAME_STEP)
        'same_step'
    """
    value = getattr(mode, "value", mode)
    if isinstance(value, str):
        if value in MODES:
            return value
        if value in _GYMNASIUM_MODE_VALUES:
            return _GYMNASIUM_MODE_VALUES[value]
    raise CleanbufError(
        f"mode={mode!r} is not a known auto-reset mode. Pass one of {MODES} or a "
        "gymnasium.vector.AutoresetMode member, or build the filter with "
        "AutoresetFilter.for_env(env) to read it from the producer."
    )


def _key(key: NestedKey | None) -> tuple | None:
    if key is None:
        return None
    key = unravel_key(key)
    return key if isinstance(key, tuple) else (key,)


@dataclasses.dataclass(frozen=True)
class Options:
    """The validated, immutable options of a filter, a repair or a clean.

    :class:`cleanbuf.AutoresetFilter`, :class:`cleanbuf.RolloutRepair` and :func:`cleanbuf.clean`
    take these as keyword arguments and build one with :meth:`build` (which checks them and
    normalizes keys to tuples); ``filt.options`` and ``repair.options`` return it.
    ``dataclasses.replace(opts, ...)`` gives an unchecked copy: check it with
    ``Options.build(**copy.as_dict())``. What each rule does: docs/rules.md.

    Attributes:
        mode: "next_step" (default; a reset row follows each done row: Gymnasium's default,
            EnvPool, TorchRL ``GymEnv(name, num_envs=N)``), "same_step" (the done row's next
            observation is the reset one, the terminal one is in an info entry: SB3 ``VecEnv``,
            Gymnasium ``SAME_STEP``, GPU simulators) or "disabled" (check and pass through).
            :meth:`build` also takes a ``gymnasium.vector.AutoresetMode``.
        layout: which rows of a call belong to which env. None (default) infers it (``[*E, T]``
            time-last collector batches; a 1-D batch named ``["time"]`` or of length one is one
            stream); "time_last" declares ``[*E, T]``; "time_first": ``[T, *E]`` rollouts as raw
            loops stack them (CleanRL, Stable-Baselines3); "step": each call is one step of E
            envs, batch ``[E]``; "stream_key": flat rows with a per-row env id under
            ``stream_key``.
        stream_key: the key of a per-row stream (env) id, for flat rows (default None).
        joint_reset: the producer resets a whole reset group when all its envs are done on the
            same step, and no reset row follows (TorchRL ``GymEnv(num_envs=N)``); default False.
        reset_group_size: streams per reset group (consecutive in C order); None (default): all
            streams of a call.
        joint_key: with ``layout="stream_key"``, a key holding True on a done row whose whole
            reset group was done on that step (flat rows do not show which rows share a step).
            Implies ``joint_reset``; default None.
        on_lost_terminal_obs: what a row whose terminal (or next) observation is lost gets:
            "nan" (NaN, counted), "drop" (the row is not stored; the repair masks it), "raise"
            (:class:`~cleanbuf.TerminalObservationLostError`) or "keep" (as it came). None
            (default): "nan" in next-step mode for floating observations, else an error that
            names the choices.
        terminal_obs_in_done_row: rarely needed. Whether a done row holds its terminal
            observation is read from the data, row by row (a zero-filled or NaN next observation
            is not held). True declares every done row complete, zeros included: for a terminal
            observation truly 0 in every element with no reset row after it
            (``AutoresetFilter.for_env(envs)`` sets it for a Gymnasium or EnvPool next-step
            vector env). None (default): read from the data. False is deprecated and ignored.
        check_reset_rows: check that each reset row has reward 0 and is not done (a
            :class:`~cleanbuf.ResetRowError` otherwise: the wrong mode, or a reward transform
            that moves 0); default True.
        observation_keys: the observation keys; None (default): every key present at the root
            and under "next" (done, reward and bookkeeping keys excluded). Observation-only data
            needs them.
        done_key: the done key; None (default): ``("next", "done")``, else
            ``("next", "terminated") | ("next", "truncated")``.
        reward_key: the reward key read by the reset-row check (default ``("next", "reward")``).
        is_init_key: the ``InitTracker`` key to set on each episode's first row (default
            ``("is_init",)``; None: leave it alone).
        step_count_key: the ``StepCounter`` key to fix, with its ``("next", ...)`` twin
            (default ``("step_count",)``; None: leave them alone).
        final_obs_key: same-step mode: the final-observation entry; None (default) looks for
            ``("next", "final_obs")``, ``("next", "final_observation")`` and
            ``("next", "terminal_observation")``.
        keep_final_obs: same-step mode: store the final-observation entry too (default False).
        compact: observation-only data: keep it observation-only (only the artifacts go, nothing
            is held, the terminal observations of done rows are not stored); default False.
        check_continuity: check that each call continues the streams of the calls before it (a
            :class:`~cleanbuf.ContinuityError` otherwise); default True.
        producer_key: batches come from several producers in turn (a ``MultiAsyncCollector``
            extended from the parent): this key's trajectory ids tell which producer's streams
            a batch continues (default None).

    Examples:
        >>> from cleanbuf import Options
        >>> opts = Options.build("same_step", final_obs_key=("next", "final"))
        >>> opts.mode, opts.final_obs_key, opts.is_init_key
        ('same_step', ('next', 'final'), ('is_init',))
        >>> from cleanbuf import AutoresetFilter
        >>> AutoresetFilter(**opts.as_dict()).options == opts  # the same filter again
        True
    """

    mode: str = "next_step"
    layout: str | None = None
    stream_key: tuple | None = None
    joint_reset: bool = False
    reset_group_size: int | None = None
    joint_key: tuple | None = None
    on_lost_terminal_obs: str | None = None
    terminal_obs_in_done_row: bool | None = None
    check_reset_rows: bool = True
    observation_keys: tuple | None = None
    done_key: tuple | None = None
    reward_key: tuple | None = ("next", "reward")
    is_init_key: tuple | None = ("is_init",)
    step_count_key: tuple | None = ("step_count",)
    final_obs_key: tuple | None = None
    keep_final_obs: bool = False
    compact: bool = False
    check_continuity: bool = True
    producer_key: tuple | None = None

    def __post_init__(self) -> None:
        # Built directly (not through build()), the named choices are still checked.
        for name, allowed in (
            ("mode", MODES),
            ("layout", (None, *LAYOUTS)),
            ("on_lost_terminal_obs", (None, *LOST_POLICIES)),
        ):
            if getattr(self, name) not in allowed:
                raise CleanbufError(
                    f"Options({name}={getattr(self, name)!r}): expected one of {allowed}. "
                    "Options.build(...) also takes a gymnasium AutoresetMode and key "
                    "names as strings."
                )

    def as_dict(self) -> dict:
        """The options as plain Python values (for a state dict).

        Examples:
            >>> Options(mode="same_step").as_dict()["mode"]
            'same_step'
        """
        return dataclasses.asdict(self)

    @functools.cached_property
    def step_count_keys(self) -> tuple:
        """The step-count keys to fix: ``step_count_key`` and its ``("next", ...)`` twin, or none.

        Examples:
            >>> Options().step_count_keys
            (('step_count',), ('next', 'step_count'))
            >>> Options(step_count_key=None).step_count_keys
            ()
        """
        key = self.step_count_key
        return () if key is None else (key, ("next", *key))

    @classmethod
    def build(cls, mode: Any = "next_step", **kwargs: Any) -> Options:
        """Validates user options and returns them normalized.

        Args:
            mode: the auto-reset mode (see :func:`normalize_mode`).
            **kwargs: the other fields of :class:`Options`.

        Returns:
            The options.

        Raises:
            CleanbufError: an unknown option or an invalid value.

        Examples:
            >>> Options.build("next_step", layout="step").layout
            'step'
        """
        if "set_truncated" in kwargs:
            kwargs.pop("set_truncated")
            warnings.warn(
                "set_truncated is no longer an option: a collector's batch-end marks are "
                "recognised from the rows themselves (the next row of the stream decides). "
                "Remove the argument; it is ignored.",
                DeprecationWarning,
                stacklevel=user_stacklevel(),
            )
        if (
            kwargs.get("terminal_obs_in_done_row") is not None
            and not kwargs["terminal_obs_in_done_row"]
        ):
            kwargs["terminal_obs_in_done_row"] = None
            warnings.warn(
                "terminal_obs_in_done_row=False is no longer an option: whether a done row "
                "holds its terminal observation is read from the data, row by row (a next "
                "observation that is neither zero-filled nor NaN is stored and kept). "
                "Remove the argument; it is ignored.",
                DeprecationWarning,
                stacklevel=user_stacklevel(),
            )
        names = {f.name for f in dataclasses.fields(cls)} - {"mode"}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise CleanbufError(f"unknown option(s) {unknown}; the options are {sorted(names)}.")
        mode = normalize_mode(mode)
        stream_key = _key(kwargs.pop("stream_key", None))
        layout = _layout(kwargs.pop("layout", None), stream_key, mode)
        policy = kwargs.get("on_lost_terminal_obs")
        if policy is not None and policy not in LOST_POLICIES:
            raise CleanbufError(
                f"on_lost_terminal_obs={policy!r} is not known; pass one of {LOST_POLICIES}."
            )
        joint_key = _key(kwargs.pop("joint_key", None))
        kwargs["joint_reset"] = _joint(kwargs, joint_key, layout, mode)
        if kwargs.get("producer_key") is not None and layout not in (None, "time_last"):
            raise CleanbufError(
                f"producer_key= tells apart producers of [*E, T] batches (a "
                f"MultiAsyncCollector's workers); it does not go with layout={layout!r}."
            )
        for name in _KEY_OPTIONS:
            if name in kwargs:
                kwargs[name] = _key(kwargs[name])
        return cls(
            mode=mode,
            layout=layout,
            stream_key=stream_key,
            joint_key=joint_key,
            observation_keys=_observation_keys(kwargs.pop("observation_keys", None)),
            **kwargs,
        )


def options_in(arguments: dict) -> dict:
    """The options among a call's arguments (its ``locals()``), by :class:`Options` field.

    The public API spells every option out in its signatures and passes them on with this.

    Examples:
        >>> options_in({"self": None, "mode": "same_step", "layout": "step", "rb": 1})
        {'mode': 'same_step', 'layout': 'step'}
    """
    return {name: arguments[name] for name in OPTION_NAMES if name in arguments}


_DEPRECATED = ("set_truncated",)  # taken, warned about and ignored by Options.build


def refuse_unknown(unknown: dict, accepted, caller: str) -> dict:
    """The deprecated options among a call's ``**unknown``; any other name raises.

    Args:
        unknown: the keyword arguments the signature did not name.
        accepted: the parameter names of the call, for the message.
        caller: the call the user made.

    Raises:
        CleanbufError: a name that is no option of ``caller`` (a misspelt one),
            with the options it takes.

    Examples:
        >>> refuse_unknown({"set_truncated": True}, ["mode"], "f()")
        {'set_truncated': True}
        >>> refuse_unknown({"joint_rest": True}, ["mode", "joint_reset"], "f()")
        Traceback (most recent call last):
        ...
        cleanbuf.engine._errors.CleanbufError: unknown option(s) ['joint_rest'] for f(); the options are ['joint_reset', 'mode'].
    """  # noqa: E501
    names = sorted(set(unknown) - set(_DEPRECATED))
    if names:
        raise CleanbufError(
            f"unknown option(s) {names} for {caller}; the options are {sorted(accepted)}."
        )
    return unknown


def keyword_names(fn) -> tuple:
    """The names of a function's (or a class's) parameters, ``**kwargs`` left out.

    Examples:
        >>> keyword_names(lambda data, *, mode=None, **unknown: None)
        ('data', 'mode')
    """
    params = inspect.signature(fn).parameters.values()
    return tuple(p.name for p in params if p.kind is not p.VAR_KEYWORD)


_KEY_OPTIONS = (
    "done_key",
    "reward_key",
    "is_init_key",
    "step_count_key",
    "final_obs_key",
    "producer_key",
)


def _layout(layout: str | None, stream_key: tuple | None, mode: str) -> str | None:
    """The declared layout, checked against ``stream_key``."""
    if layout is None and stream_key is not None:
        layout = "stream_key"
    if layout is not None and layout not in LAYOUTS:
        raise CleanbufError(
            f"layout={layout!r} is not known. Pass None or 'time_last' ([*E, T] "
            "time-last collector batches, or one stream for a 1-D batch named ['time']), "
            "'time_first' ([T, *E] rollouts, as raw loops stack their steps), 'step' "
            "(each call is one step of E envs, batch [E]), or stream_key=KEY (flat rows "
            "with a per-row stream id)."
        )
    if layout == "stream_key" and stream_key is None:
        raise CleanbufError(
            "layout='stream_key' needs stream_key=KEY, the key holding each row's stream (env) id."
        )
    if layout != "stream_key" and stream_key is not None:
        raise CleanbufError(
            f"stream_key={stream_key!r} only goes with layout='stream_key' (or no "
            f"layout); got layout={layout!r}."
        )
    if stream_key is not None and stream_key[-1] == "traj_ids" and mode != "disabled":
        raise CleanbufError(
            f"stream_key={stream_key!r}: trajectory ids name episodes, not envs, and "
            "TorchRL gives a next-step reset row the id of the next episode, so they "
            "cannot tell which env a reset row came from (nothing would be cleaned). "
            "Pass a key that holds each row's env index, or give the filter the "
            "collector's [*E, T] batches as they come (no stream_key)."
        )
    return layout


def _joint(kwargs: dict, joint_key: tuple | None, layout: str | None, mode: str) -> bool:
    """Whether the data has joint resets, checked against the other options."""
    if joint_key is not None and layout != "stream_key":
        raise CleanbufError(
            f"joint_key={joint_key!r} goes with layout='stream_key'; with time-aligned "
            "streams (layout None or 'step') pass joint_reset=True, and the joint "
            "resets are read from the done flags of each step."
        )
    joint = bool(kwargs.get("joint_reset", False)) or joint_key is not None
    group = kwargs.get("reset_group_size")
    if group is not None and (not joint or joint_key is not None or int(group) < 1):
        raise CleanbufError(
            f"reset_group_size={group!r} needs joint_reset=True (not joint_key) and a "
            "positive number of streams per reset group."
        )
    if joint and layout == "stream_key" and joint_key is None:
        raise CleanbufError(
            "joint_reset=True needs time-aligned streams (layout None or 'step'); "
            "with layout='stream_key' the rows of one step cannot be told apart. "
            "Extend the buffer with the collector's [*E, T] batches instead, or pass "
            "joint_key=KEY, a key holding True on each done row whose whole reset "
            "group was done on that step."
        )
    if joint and mode != "next_step":
        raise CleanbufError(
            f"joint_reset=True (or joint_key=) describes next-step data (TorchRL's "
            f"joint reset); it does not go with mode={mode!r}."
        )
    return joint


def _observation_keys(obs_keys) -> tuple | None:
    """The declared observation keys as a tuple of tuple keys."""
    if obs_keys is None:
        return None
    # A string or a tuple of strings is one (nested) key; anything else is a sequence of keys.
    if isinstance(obs_keys, str) or (
        isinstance(obs_keys, tuple) and all(isinstance(p, str) for p in obs_keys)
    ):
        obs_keys = [obs_keys]
    return tuple(_key(k) for k in obs_keys)


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(Options))
