"""The ``cleanbuf`` command: ``check`` here, the others in :mod:`cleanbuf.offline.cli`.

``cleanbuf check ENV`` runs an env under each producer and against
explicit resets; ``cleanbuf audit`` / ``cleanbuf clean`` (and the other
commands of :mod:`cleanbuf.offline.cli`) work on data on disk.
``cleanbuf --help`` lists them all.
"""

from __future__ import annotations

import sys

_CHECK_HELP = """commands:
  check               run an env under each producer (Gymnasium, TorchRL, SB3, EnvPool) and
                      with explicit resets: what each stores wrong, and whether cleanbuf's
                      cleaned rows equal the explicit-reset run (cleanbuf check --help)
  the commands below  data on disk (cleanbuf COMMAND --help)
"""


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "check":
        from cleanbuf._env_check import main as check_main

        return check_main(argv[1:])
    from cleanbuf.offline.cli import main as offline_main

    if argv[:1] in ([], ["-h"], ["--help"]):
        print("usage: cleanbuf check [ENV] [options]\n")
        print(_CHECK_HELP)
    return offline_main(argv)


if __name__ == "__main__":
    sys.exit(main())
