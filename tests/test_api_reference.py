"""The API reference builds from the docstrings, warnings as errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a Sphinx build in a fresh interpreter
def test_api_reference_builds_without_warnings(tmp_path):
    """Bugs caught: a public docstring Sphinx cannot read (a broken Args
    section, an unclosed literal, a bad cross-reference target), a public
    name that is gone from ``cleanbuf`` while the reference still names it,
    and a reference that no longer shows ``AutoresetFilter``'s docstring, or
    leaves out the report ``audit()`` returns (and ``report.command()``).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    build = tmp_path / "html"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            str(ROOT / "docs" / "api"),
            str(build),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    page = (build / "index.html").read_text()
    for name in ("AutoresetFilter", "RolloutRepair", "step_rows", "audit", "ContinuityError"):
        assert f'id="cleanbuf.{name}"' in page, name
    # what audit() returns, and report.command() the guides use
    for name in ("offline.Report", "offline.Report.command", "offline.Report.clean"):
        assert f'id="cleanbuf.{name}"' in page, name
