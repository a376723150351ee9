"""What cleanbuf raises and warns: the errors, the warning, and where a warning points.

Every error is a ``ValueError`` (so ``except ValueError`` keeps working) that names the key, what
was expected, what came and the fix; a call that raises one changes no state and writes nothing.
"""

from __future__ import annotations

import os
import sys


def key_name(key: tuple) -> str:
    """A key as the user wrote it, for messages: ``'obs'`` or ``('next', 'obs')``.

    Examples:
        >>> key_name(("obs",)), key_name(("next", "obs"))
        ("'obs'", "('next', 'obs')")
    """
    return repr(key[0]) if len(key) == 1 else repr(key)


class CleanbufError(ValueError):
    """Base class of every error cleanbuf raises on bad input or configuration."""


class LayoutError(CleanbufError):
    """The batch layout is ambiguous, undeclared, or changed between calls."""


class InputError(CleanbufError):
    """A key is missing, or a shape or dtype is not what the cleaner needs."""


class ResetRowError(CleanbufError):
    """A supposed reset row does not look like one: the configuration is wrong."""


class TerminalObservationLostError(CleanbufError):
    """A terminal observation is lost and the policy says to raise (or none was chosen)."""


class ContinuityError(CleanbufError):
    """A call's rows do not continue the streams of the calls before it."""


class StateError(CleanbufError):
    """A state given to ``load_state_dict`` is not a consistent cleanbuf state.

    Raised before anything changes; the message names the field.
    """


class CleanbufWarning(UserWarning):
    """A warning from cleanbuf.

    Filterable: ``warnings.simplefilter("ignore", cleanbuf.CleanbufWarning)``.
    """


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning name the user's line.

    Counted from the caller of ``warnings.warn`` to the first frame outside cleanbuf, TorchRL,
    tensordict and torch (a filter warns from below ``rb.extend`` or ``nn.Module.__call__``).

    Examples:
        >>> import warnings
        >>> def library_call():  # a cleanbuf function would sit here
        ...     warnings.warn("lost", CleanbufWarning, stacklevel=user_stacklevel())
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     library_call()
        >>> caught[0].filename == library_call.__code__.co_filename
        True
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_library_dirs()):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


def _library_dirs() -> tuple:
    """Where cleanbuf, TorchRL, tensordict and torch live (those imported by now)."""
    names = ("cleanbuf", "torchrl", "tensordict", "torch")
    mods = [sys.modules.get(n) for n in names]
    return tuple(os.path.dirname(m.__file__) + os.sep for m in mods if m and m.__file__)


# What a NaN next observation does downstream, per writer.
EFFECTS = {
    "filter": (
        "are stored as NaN next observations, which turn a TD target NaN even under a done mask"
    ),
    "repair": (
        "are NaN next observations, which TorchRL's value estimators read as the row's "
        "own observation (an approximate bootstrap, never one from zeros)"
    ),
    "clean()": (
        "are NaN next observations in the rows it returned, which turn a TD target NaN "
        "even under a done mask"
    ),
}


def lost_message(n_lost: int, who: str, where: str = "", first_batch: bool = False) -> str:
    """The lost-terminal-observation warning's text, one for the filter, the repair and ``clean()``.

    Args:
        n_lost: how many terminal observations were lost.
        who: "filter", "repair" or "clean()" (the writer, which decides what NaN does).
        where: after "the filter", where the calls ran (copies elsewhere).
        first_batch: ``n_lost`` is the first losing batch's count (the warning comes once;
            later batches only count).

    Examples:
        >>> text = lost_message(3, "repair")
        >>> text.startswith("3 terminal observation(s) were lost before the repair saw")
        True
        >>> "lossless_gym_env" in text and "on_lost_terminal_obs='drop'" in text
        True
        >>> lost_message(3, "filter", first_batch=True).endswith("count every batch's.")
        True
    """
    drop = "keep those rows out of the loss (masked)" if who == "repair" else "store no such row"
    subject = who if who == "clean()" else f"the {who}"
    return (
        f"{n_lost} terminal observation(s) were lost before {subject}{where} saw them "
        "(TorchRL resets all envs of a GymEnv(num_envs=N) together when they end on "
        f"the same step, as fixed-horizon tasks always do) and {EFFECTS[who]}; "
        "stats['terminal_obs_missing'] counts them. Use a "
        "lossless producer, cleanbuf.lossless_gym_env(name, num_envs) (TorchRL's "
        "GymWrapper over gymnasium.make_vec(name, num_envs, vectorization_mode='sync', "
        "vector_kwargs={'autoreset_mode': AutoresetMode.DISABLED}), whose partial resets "
        "TorchRL makes itself), or "
        "on_lost_terminal_obs='drop' to "
        f"{drop}." + _shown_once(who, first_batch)
    )


def _shown_once(who: str, first_batch: bool) -> str:
    if who == "clean()":
        return ""
    if first_batch:
        return (
            f" This warning is shown once per {who}, for the first batch that lost any; "
            "its stats count every batch's."
        )
    return f" This warning is shown once per {who}."
