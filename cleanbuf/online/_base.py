"""What the filter and the repair share: their face, one definition for both.

:class:`~cleanbuf.AutoresetFilter` (flat rows, for replay buffers) and
:class:`~cleanbuf.RolloutRepair` (the ``[*E, T]`` batch kept, for on-policy
losses) are two writers of one engine. :class:`OnlineCleaner` holds what a
user meets on both the same way: ``for_env``, ``options``, ``stats``, the
repr, the lost-observation warning, and the option names they share. Each
class differs in its writer and in what only it has (the filter's buffer,
copies and flush into a buffer; the repair's time axis and mask).
"""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

from cleanbuf.engine._options import Options
from cleanbuf.online._losses import LostObservations
from cleanbuf.online._producers import Reading, options_for_env

_Self = TypeVar("_Self", bound="OnlineCleaner")


class OnlineCleaner:
    """The shared face of the two online cleaners (a mixin: no ``__init__``).

    A subclass sets, in its ``__init__``: ``_engine`` (the engine object,
    with ``options`` and ``stats``), ``_origin`` (what
    ``for_env`` read, or None) and ``_losses`` (a
    :class:`~cleanbuf.online._losses.LostObservations`).
    """

    _engine: Any
    _origin: str | None
    _losses: LostObservations
    _held_note = "not returned until flush()"  # after rows_held=N in the repr

    @classmethod
    def for_env(cls: type[_Self], env: Any, **overrides: Any) -> _Self:
        """Builds one configured for the producer ``env``.

        Reads the auto-reset behaviour from TorchRL ``GymEnv`` /
        ``GymWrapper`` (also inside ``TransformedEnv``, and ``ParallelEnv``
        / ``SerialEnv`` of them, where each worker is its own reset group),
        a TorchRL collector (``compact_obs=True`` makes the data
        observation-only), a ``MultiSyncCollector`` or
        ``MultiAsyncCollector`` (each worker its own reset group), a
        ``RayCollector`` (read in its first remote collector), a Gymnasium
        ``VectorEnv`` or single env, a Stable-Baselines3 ``VecEnv`` or an
        EnvPool env. The filter takes every one of them (it tells an async
        collector's batches apart by trajectory ids). The repair takes a
        ``MultiSyncCollector``'s stacked ``[W, E, T]`` batches as one
        producer's, and refuses a producer that yields several producers'
        batches in turn (``MultiAsyncCollector`` of several workers,
        ``RayCollector``): repair each worker's batches (``postproc=``).

        A ``GymEnv(name, num_envs=N)`` loses the terminal observations of
        envs that end on the same step (TorchRL resets them together): the
        repr says so when its sub-envs have a time limit, and the first
        call that loses one warns (by default).

        A TorchRL env that resets inside its step (built with
        ``auto_reset=True``: ``AutoResetEnv`` with ``AutoResetTransform``,
        alone or as the workers of a ``SerialEnv`` / ``ParallelEnv``) is
        read as same-step: TorchRL fills each done step's next observation
        and keeps no terminal observation, so every one is lost. With
        floating observations they stay NaN, counted
        (``on_lost_terminal_obs="nan"``); with others no policy is chosen
        and the first done row raises, naming the choices.

        Args:
            env: the producer.
            **overrides: options that replace what was read from ``env``.

        Returns:
            The filter or repair. Its repr says how it was configured.

        Raises:
            CleanbufError: the producer is unknown (pass an explicit mode),
                an env id (a str) instead of an env, or a producer whose
                batches this class cannot take (said in the message).
        """
        reading = options_for_env(env)
        made = cls(**cls._options_for(env, reading, overrides))
        made._origin = reading.why
        return made

    @classmethod
    def _options_for(cls, env: Any, reading: Reading, overrides: dict) -> dict:
        """The constructor's arguments from what ``for_env`` read (a subclass adapts)."""
        return {**reading.options, **overrides}

    @property
    def options(self) -> Options:
        """The validated options (a :class:`cleanbuf.Options`)."""
        return self._engine.options

    @property
    def stats(self) -> dict:
        """The counters, as plain Python ints (see the class for their names)."""
        return self._engine.stats

    def _count_lost(self, n_lost: int) -> None:
        """Counts the terminal observations a call stored as NaN by default; warns once."""
        if n_lost and self._losses.counting(self.options):
            self._losses.after_call(n_lost)

    def _repr_parts(self) -> list:
        """``name=value`` for each option that differs from its default, and the origin."""
        o, parts = self.options, []
        for name in ("mode", *_REPR_OPTIONS):
            value = getattr(o, name)
            if name == "mode" or value != _DEFAULTS[name]:
                parts.append(f"{name}={value!r}")
        if self._origin:
            parts.append(f"from={self._origin!r}")
        held = self._engine.stats["rows_held"]
        if held:
            parts.append(f"rows_held={held} ({self._held_note})")
        return parts

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(self._repr_parts())})"


# The options a repr shows when they differ from the default, in this order.
_REPR_OPTIONS = (
    "layout",
    "stream_key",
    "joint_reset",
    "reset_group_size",
    "joint_key",
    "on_lost_terminal_obs",
    "terminal_obs_in_done_row",
    "producer_key",
    "compact",
    "check_reset_rows",
    "check_continuity",
    "reward_key",
    "done_key",
)
_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(Options).parameters.items()
    if p.default is not inspect.Parameter.empty
}
