"""A batch written again: going back to before the last call.

A replay buffer runs the filter, then writes what the filter returned. If
that write fails (a full disk, a storage that raises), the filter has
already moved on: the held rows the call released, and its flags, belong
to rows that never reached the buffer. A user who writes the same batch
again gets those rows again. :class:`Retry` keeps the cleaner's state from
before its last call (:class:`Undo`) and that call's fingerprint (the
first row of each stream, :class:`~cleanbuf.engine._read.Fingerprint`):

- a call whose batch is the last call's again goes back first, and is
  cleaned as if the last call had not happened;
- once the buffer is known to hold the last call's rows (:meth:`Retry.stored`),
  the same batch again is written twice, a
  :class:`~cleanbuf.ContinuityError`;
- once the write is known to have failed (:meth:`Retry.undo`), the
  cleaner goes back to before that call at once.

A call that fails leaves the cleaner as it was. The step knows nothing of
this: it raises having changed nothing, and its error carries its
fingerprint (:func:`~cleanbuf.engine._read.fingerprint_of`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tensordict import TensorDictBase

from cleanbuf.engine._errors import CleanbufError, ContinuityError
from cleanbuf.engine._read import Fingerprint, SameBatchAgain, fingerprint_of
from cleanbuf.engine._state import State


@dataclasses.dataclass
class Undo:
    """What a cleaner was before a call, and that call's fingerprint."""

    state: State
    fingerprint: Fingerprint | None = None
    stored: bool = False  # the call's rows reached the buffer: the batch again is a duplicate


class Retry:
    """The undo of a cleaner's last call, and the rule for its batch written again.

    The cleaner it serves has a ``state`` (a :class:`State`, read and
    replaced here) and a ``step(td, before)`` that cleans one batch against
    that state, given the last call's fingerprint, and returns the rows and
    the call's fingerprint, or raises having changed nothing.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from cleanbuf.engine._cleaner import Cleaner
        >>> from cleanbuf.engine._options import Options
        >>> batch = TensorDict({  # the done row's terminal observation comes next call
        ...     "observation": torch.tensor([[[0.0], [1.0]]]),
        ...     ("next", "observation"): torch.tensor([[[1.0], [0.0]]]),
        ...     ("next", "reward"): torch.ones(1, 2, 1),
        ...     ("next", "done"): torch.tensor([[[False], [True]]]),
        ... }, batch_size=[1, 2])
        >>> cleaner = Cleaner(Options.build("next_step"))
        >>> len(cleaner(batch)), cleaner.stats["rows_held"]  # the done row waits
        (1, 1)
        >>> cleaner.undo_last_call()  # its rows never reached the buffer
        True
        >>> cleaner.stats["rows_in"], cleaner.stats["rows_held"]
        (0, 0)
    """

    def __init__(self):
        self.last: Undo | None = None

    @property
    def before(self) -> Fingerprint | None:
        """The last call's fingerprint (None: no call to compare with)."""
        return None if self.last is None else self.last.fingerprint

    def call(self, cleaner: Any, td: TensorDictBase) -> TensorDictBase:
        """``cleaner.step(td)``, going back first if ``td`` is the last call's batch.

        The step raises :class:`~cleanbuf.engine._read.SameBatchAgain` when
        the rows' fingerprint with trajectory ids says so; a step that fails
        otherwise is retried from before the last call when its fingerprint
        matches that call's. A call that fails leaves the cleaner as it was.
        """
        undo = cleaner.state.snapshot()
        try:
            out, fingerprint = cleaner.step(td, self.before)
        except (SameBatchAgain, CleanbufError) as err:
            again = self.last is not None and (
                isinstance(err, SameBatchAgain) or _again(fingerprint_of(err))
            )
            if not again:
                raise
            if self.last.stored:
                self._refuse_stored_again(cleaner, td, undo, err)
            last, self.last = self.last, None
            cleaner.state = last.state
            retry = cleaner.state.snapshot()
            try:
                out, fingerprint = cleaner.step(td, None)
            except CleanbufError:
                cleaner.state = undo  # as before this call, which changes nothing
                self.last = last
                if isinstance(err, SameBatchAgain):
                    raise
                raise err from None
            undo = retry
        self.last = Undo(undo, fingerprint)
        return out

    def stored(self) -> None:
        """Says that the last call's rows were stored: its batch again is written twice."""
        if self.last is not None:
            self.last.stored = True

    def undo(self, cleaner: Any) -> bool:
        """Puts ``cleaner`` back to before the last call, whose rows never reached the buffer.

        Returns whether there was a call to undo.
        """
        if self.last is None or self.last.stored:
            return False
        last, self.last = self.last, None
        cleaner.state = last.state
        return True

    def forget(self) -> None:
        """Forgets the last call (a flush, a loaded state: no call to repeat)."""
        self.last = None

    def _refuse_stored_again(
        self, cleaner: Any, td: TensorDictBase, undo: State, err: Exception
    ) -> None:
        """Raises for a call that looks like the last one again, whose rows were stored.

        The first rows alone may match another batch (a fresh start of every
        stream looks the same each time): it is the same batch if it cleans
        from where the last call started. Either way the cleaner is left as
        it was.
        """
        last, self.last = self.last, None
        cleaner.state = last.state.snapshot()  # (the probe must not change what undo restores)
        try:
            cleaner.step(td, None)
        except (SameBatchAgain, CleanbufError):
            same = False
        else:
            same = True
        cleaner.state = undo
        self.last = last
        if same or isinstance(err, SameBatchAgain):
            raise written_twice() from None
        raise err


def _again(fingerprint: Fingerprint | None) -> bool:
    return fingerprint is not None and fingerprint.again


def written_twice() -> ContinuityError:
    """The error for a batch that comes again after its rows were stored."""
    return ContinuityError(
        "this batch is the one the last call cleaned (the same first row in every stream), "
        "and that call's rows were stored: it was written twice. Expected the next batch of "
        "each stream, got the last one again. Write each batch once (a batch whose write "
        "into the buffer failed may be written again; this one's write succeeded). In a raw "
        "loop, this is also what a step that does not move on looks like: set obs = next_obs "
        "after each step. Nothing was written."
    )
