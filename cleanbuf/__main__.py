"""The ``cleanbuf`` command: ``check`` here, the others in :mod:`cleanbuf.offline.cli`.

``cleanbuf check ENV`` runs an env under each producer and against
explicit resets; ``cleanbuf audit`` / ``cleanbuf clean`` (and the other
commands of :mod:`cleanbuf.offline.cli`) work on data on disk.
``cleanbuf --help`` lists them all.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "check":
        from cleanbuf._env_check import main as check_main

        return check_main(argv[1:])
    from cleanbuf.offline.cli import main as offline_main

    return offline_main(argv)  # (its help lists check too)


if __name__ == "__main__":
    sys.exit(main())
