"""cleanbuf: make auto-resetting RL data safe for replay buffers.

The public API:

* :class:`AutoresetFilter`: a TorchRL replay-buffer transform that cleans on
  the write path; ``AutoresetFilter.for_env(env)`` configures it from the
  producer.
* :func:`clean`: one-shot cleaning of a TensorDict, a dict of arrays, a
  replay buffer filled without the filter, or a dataset on disk.
* :func:`audit`: what auto-reset artifacts stored data holds (also the
  ``cleanbuf audit`` / ``cleanbuf clean`` command line).
* :func:`to_minari`: the cleaned episodes as a Minari dataset (also
  ``cleanbuf export``; needs the ``minari`` extra).
* :func:`check`: runs an env under each producer and against explicit
  resets, and shows what each stores wrong and whether the cleaned rows
  equal the explicit-reset run (also ``cleanbuf check ENV``); it returns a
  :class:`CheckReport`.
* :func:`step_rows`: one raw vector-env step as the rows the filter expects.
* :class:`RolloutRepair`: the same cleaning for on-policy learners: the
  collector's ``[*E, T]`` batch returned repaired (time axis kept, reset rows
  masked), so that GAE and the PPO loss equal the explicit-reset run.
* :func:`lossless_gym_env`: TorchRL's ``GymEnv(name, num_envs=N)`` on a
  vector env that loses no terminal observation (no filter needed).
* :class:`LosslessMjlabEnv`: an mjlab env built with ``auto_reset=False``,
  reset by the wrapper, its terminal observations handed over as mjlab's
  terminal extras (for :func:`step_rows`).
* :class:`CompactStorage`: a replay-buffer storage for the filter's rows that
  keeps each observation once and gives back every next observation exactly.
* :class:`Options`: the options all of them take, validated and documented.
* the errors, all ``ValueError`` subclasses.
"""

from cleanbuf._version import __version__ as __version__
from cleanbuf.check import CheckReport, check
from cleanbuf.engine._errors import (
    CleanbufError,
    CleanbufWarning,
    ContinuityError,
    InputError,
    LayoutError,
    ResetRowError,
    StateError,
    TerminalObservationLostError,
)
from cleanbuf.engine._options import Options
from cleanbuf.offline import audit
from cleanbuf.offline._clean import clean
from cleanbuf.offline._minari import to_minari
from cleanbuf.online._compact import CompactStorage
from cleanbuf.online._lossless import LosslessMjlabEnv, lossless_gym_env
from cleanbuf.online._repair import RolloutRepair
from cleanbuf.online._rows import step_rows
from cleanbuf.online._transform import AutoresetFilter

__all__ = [
    "AutoresetFilter",
    "CheckReport",
    "CompactStorage",
    "CleanbufError",
    "CleanbufWarning",
    "ContinuityError",
    "InputError",
    "LayoutError",
    "LosslessMjlabEnv",
    "Options",
    "ResetRowError",
    "RolloutRepair",
    "StateError",
    "TerminalObservationLostError",
    "audit",
    "check",
    "clean",
    "lossless_gym_env",
    "step_rows",
    "to_minari",
]
