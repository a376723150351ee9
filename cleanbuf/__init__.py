"""cleanbuf: make auto-resetting RL data safe for replay buffers.

The public API:

* :class:`AutoresetFilter`: a TorchRL replay-buffer transform that cleans on
  the write path; ``AutoresetFilter.for_env(env)`` configures it from the
  producer.
* :func:`clean`: one-shot cleaning of a TensorDict or a dict of arrays.
* the errors, all ``ValueError`` subclasses.
"""

from cleanbuf._clean import clean
from cleanbuf._errors import (
    CleanbufError,
    InputError,
    LayoutError,
    ResetRowError,
    TerminalObservationLostError,
)
from cleanbuf._transform import AutoresetFilter

__all__ = [
    "AutoresetFilter",
    "CleanbufError",
    "InputError",
    "LayoutError",
    "ResetRowError",
    "TerminalObservationLostError",
    "clean",
]
__version__ = "0.1.0"
