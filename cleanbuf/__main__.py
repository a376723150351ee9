"""``python -m cleanbuf`` , the ``cleanbuf`` script: every command in :mod:`cleanbuf.check.cli`.

``cleanbuf check ENV`` runs an env under each producer and against
explicit resets; ``cleanbuf audit`` / ``cleanbuf clean`` / ``cleanbuf
export`` work on data on disk. ``cleanbuf --help`` lists them all.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    from cleanbuf.check.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
