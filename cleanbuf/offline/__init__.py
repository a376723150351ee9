"""Standalone cleaning of transitions already on disk: audit, then clean.

* :func:`audit`: what auto-reset artifacts a dataset holds (a
  :class:`Report`), with the layout and the producer's mode recovered from
  the rows themselves.
* :func:`clean_dataset`: the cleaned dataset, written next to the source in
  its format.
* :func:`to_minari`: the cleaned episodes as a Minari dataset (an
  :class:`Export` says what was written and left out).

The command line (``cleanbuf audit PATH``, ``cleanbuf clean SRC DST``,
``cleanbuf export SRC DATASET_ID``) is
:mod:`cleanbuf.check.cli`, with ``cleanbuf check``.
"""

from cleanbuf.offline._audit import Report, audit
from cleanbuf.offline._clean_files import Cleaned, clean_dataset
from cleanbuf.offline._formats import Dataset, read
from cleanbuf.offline._minari import Export, to_minari

__all__ = ["Cleaned", "Dataset", "Export", "Report", "audit", "clean_dataset", "read", "to_minari"]
