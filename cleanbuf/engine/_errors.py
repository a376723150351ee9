"""Exceptions raised by cleanbuf.

Every error names the key, what was expected, what came, and the fix. All are
``ValueError`` subclasses so that ``except ValueError`` keeps working, and a
call that raises one changes no state and writes nothing.
"""

from __future__ import annotations


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
