"""``python -m cleanbuf``: the command line (see :mod:`cleanbuf.offline.cli`)."""

import sys

from cleanbuf.offline.cli import main

sys.exit(main())
