"""The lost-terminal-observation warning, shown once per filter or repair where the user looks.

By default (next-step mode, no ``on_lost_terminal_obs`` chosen) a terminal
observation lost before the filter saw it (a TorchRL joint reset) is stored
as a NaN next observation. The filter warns once, in the process that ran
the call. Copies of the filter in worker processes or Ray actors warn in
their own process, which the user may not see; each copy therefore
publishes how many observations its calls lost (under :data:`LOST_KEY`),
and the filter in the parent warns with their sum when it reads its stats
or flushes, unless it warned already. A flush that stores rows whose
terminal observation is lost (done on the last step collected, the next
observation not stored, the reset row that holds it never collected), or
rows not done whose next observation is lost (their env's next row never
collected), warns too, with its own counts and the flush's own way out
(:func:`flush_message`).
"""

from __future__ import annotations

import warnings

from cleanbuf.engine._errors import CleanbufWarning, lost_message, user_stacklevel
from cleanbuf.engine._options import Options

LOST_KEY = "lost_in_calls"  # in a published state: what the copy's calls stored as NaN


def flush_message(n_lost: int, n_next: int = 0) -> str:
    """The flush's warning: the counts, the causes, what NaN does, the ways out.

    Args:
        n_lost: done rows stored with their terminal observation lost.
        n_next: rows not done stored with their next observation lost.

    Examples:
        >>> text = flush_message(2)
        >>> text.startswith("2 row(s) stored by filt.flush(rb) lost their terminal observation")
        True
        >>> "filt.flush(rb, on_lost_terminal_obs='drop')" in text
        True
        >>> flush_message(0, 4).startswith("4 row(s) stored by filt.flush(rb) are not done")
        True
    """
    said = []
    if n_lost:
        said.append(
            f"{n_lost} row(s) stored by filt.flush(rb) lost their terminal observation: each "
            "ended an episode on the last step collected, its producer did not store the "
            "terminal observation in that row (TorchRL's GymEnv(num_envs=N) zero-fills it), and "
            "the reset row that holds it had not come. They are stored with a NaN next "
            "observation (TorchRL's mark for a missing one: a loss that bootstraps from it "
            "gives NaN); stats['terminal_obs_missing'] counts them."
        )
    if n_next:
        said.append(
            f"{n_next} row(s) stored by filt.flush(rb) are not done and lost their next "
            "observation: each waited for the next row of its env, which had not come "
            "(rows stored without their next observation, as Collector(compact_obs=True) "
            "stores them, take it from that row; or a batch-end mark of set_truncated=True "
            "still undecided). They are stored with a NaN next observation and done=False, so "
            "a TD target bootstraps from NaN with no done to mask it; "
            "stats['next_obs_missing'] counts them."
        )
    fix = " To store no such row, flush with filt.flush(rb, on_lost_terminal_obs='drop')"
    if n_lost:
        fix += "; to lose none, use a lossless producer, cleanbuf.lossless_gym_env(name, num_envs)"
    return " ".join(said) + fix + "."


class LostObservations:
    """What a filter's or a repair's calls lost by default, and whether it warned.

    Args:
        who: "filter" or "repair", for the warning's text.

    Examples:
        >>> from cleanbuf.engine._options import Options
        >>> losses = LostObservations("filter")
        >>> losses.counting(Options.build("next_step"))
        True
        >>> losses.counting(Options.build("next_step", on_lost_terminal_obs="drop"))
        False
    """

    def __init__(self, who: str = "filter"):
        self.who = who
        self.in_calls = 0  # terminal observations this copy's calls stored as NaN
        self.warned = False  # shown in this process

    def __getstate__(self) -> dict:
        return {"who": self.who, "in_calls": 0, "warned": False}  # a copy counts on its own

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    @staticmethod
    def counting(options: Options) -> bool:
        """Whether lost observations are stored as NaN without the user's say.

        A user who chose ``on_lost_terminal_obs`` knows, and same-step data
        raises instead of marking by default.
        """
        return options.on_lost_terminal_obs is None and options.mode == "next_step"

    def after_call(self, n_lost: int) -> None:
        """Counts what one call lost; warns the first time (at the user's line)."""
        if not n_lost:
            return
        self.in_calls += n_lost
        if not self.warned:
            self.warned = True
            warnings.warn(
                CleanbufWarning(lost_message(n_lost, self.who, first_batch=True)),
                stacklevel=user_stacklevel(),
            )

    def after_flush(self, n_lost: int, n_next: int = 0) -> None:
        """Warns about what a flush stored as NaN by default (at the user's line).

        Every flush that loses any warns, whether or not a call warned
        before: the flush's rows are another loss, with another cause.

        Args:
            n_lost: done rows stored with their terminal observation lost.
            n_next: rows not done stored with their next observation lost.
        """
        if n_lost or n_next:
            warnings.warn(
                CleanbufWarning(flush_message(n_lost, n_next)), stacklevel=user_stacklevel()
            )

    def after_copies(self, states: dict) -> None:
        """Warns once with what every copy's calls lost (at the user's line).

        Args:
            states: each copy's last published state, this one's included.
        """
        if self.warned:
            return
        n_lost = sum(int(s.get(LOST_KEY, 0)) for s in states.values())
        if n_lost:
            self.warned = True
            where = "'s copies in worker processes or Ray actors"
            warnings.warn(
                CleanbufWarning(lost_message(n_lost, self.who, where)), stacklevel=user_stacklevel()
            )
