"""Standalone cleaning of transitions already on disk: audit, then clean.

* :func:`audit`: what auto-reset artifacts a dataset holds (a
  :class:`Report`), with the layout and the producer's mode recovered from
  the rows themselves.
* :func:`clean_dataset`: the cleaned dataset, written next to the source in
  its format.

The command line (``cleanbuf audit PATH``, ``cleanbuf clean SRC DST``) is
:mod:`cleanbuf.offline.cli`.
"""

from cleanbuf.offline._audit import Report, audit
from cleanbuf.offline._clean_files import Cleaned, clean_dataset
from cleanbuf.offline._formats import Dataset, read

__all__ = ["Cleaned", "Dataset", "Report", "audit", "clean_dataset", "read"]
