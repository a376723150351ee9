"""The lost-terminal-observation warning, shown once per filter where the user looks.

By default (next-step mode, no ``on_lost_terminal_obs`` chosen) a terminal
observation lost before the filter saw it (a TorchRL joint reset) is stored
as a NaN next observation. The filter warns once, in the process that ran
the call. Copies of the filter in worker processes or Ray actors warn in
their own process, which the user may not see; each copy therefore
publishes how many observations its calls lost (under :data:`LOST_KEY`),
and the filter in the parent warns with their sum when it reads its stats
or flushes, unless it warned already. The rows a flush marks (their reset
row never came) are counted, not warned about: every run ends with some.
"""

from __future__ import annotations

import warnings

from cleanbuf.engine._errors import CleanbufWarning
from cleanbuf.engine._options import Options

LOST_KEY = "lost_in_calls"  # in a published state: what the copy's calls stored as NaN


def _message(n_lost: int, where: str) -> str:
    return (
        f"{n_lost} terminal observation(s) were lost before the filter{where} saw them "
        "(TorchRL resets all envs of a GymEnv(num_envs=N) together when they end on "
        "the same step, as fixed-horizon tasks always do) and are stored as NaN next "
        "observations, which turn a TD target NaN even under a done mask; "
        "stats['terminal_obs_missing'] keeps the running count. Use a "
        "lossless producer, cleanbuf.lossless_gym_env(name, num_envs) (TorchRL's "
        "GymWrapper over gymnasium.make_vec(..., vector_kwargs={'autoreset_mode': "
        "AutoresetMode.DISABLED or SAME_STEP})), or on_lost_terminal_obs='drop' to "
        "store no such row. This warning is shown once per filter."
    )


class LostObservations:
    """What a filter's calls lost by default, and whether it warned.

    Examples:
        >>> from cleanbuf.engine._options import Options
        >>> losses = LostObservations()
        >>> losses.counting(Options.build("next_step"))
        True
        >>> losses.counting(Options.build("next_step", on_lost_terminal_obs="drop"))
        False
    """

    def __init__(self):
        self.in_calls = 0  # terminal observations this copy's calls stored as NaN
        self.warned = False  # shown in this process

    def __getstate__(self) -> dict:
        return {"in_calls": 0, "warned": False}  # a copy counts and warns on its own

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
        """Counts what one call lost; warns the first time (from the filter's caller)."""
        if not n_lost:
            return
        self.in_calls += n_lost
        if not self.warned:
            self.warned = True
            warnings.warn(CleanbufWarning(_message(n_lost, "")), stacklevel=4)

    def after_copies(self, states: dict, stacklevel: int) -> None:
        """Warns once with what every copy's calls lost.

        Args:
            states: each copy's last published state, this one's included.
            stacklevel: from this call to the user's line.
        """
        if self.warned:
            return
        n_lost = sum(int(s.get(LOST_KEY, 0)) for s in states.values())
        if n_lost:
            self.warned = True
            where = "'s copies in worker processes or Ray actors"
            warnings.warn(CleanbufWarning(_message(n_lost, where)), stacklevel=stacklevel + 1)
