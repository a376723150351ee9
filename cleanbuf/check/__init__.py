"""``cleanbuf check``: one env under each producer, against explicit resets.

* :func:`check`: runs the env under each producer and with explicit
  resets, cleans each producer's rows and compares them with the truth; it
  returns a :class:`CheckReport`.
* :mod:`cleanbuf.check.runs`: the runs (producers and the truth);
  :mod:`cleanbuf.check.report`: what is counted and compared, and the
  table; :mod:`cleanbuf.check.plot`: ``--plot``'s picture.
* :mod:`cleanbuf.check.cli`: the ``cleanbuf`` command line, every command
  (``check``, ``audit``, ``clean``, ``export``).

This room uses the online side (the producers, the filter) and the offline
side (the audit, the files); neither uses it.
"""

from cleanbuf.check.checker import check
from cleanbuf.check.report import CheckReport

__all__ = ["CheckReport", "check"]
