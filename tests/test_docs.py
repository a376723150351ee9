"""The docs' programs run as pasted, and the demo runs quickly.

Every ```python block of README.md and of every docs/*.md page is a
complete program: each runs here in a fresh interpreter (``sys.executable``)
from an empty temporary directory, as a user who pastes it into a file
would run it, and must exit 0. What is not a complete program is marked
```text, ```bash or ```console, and is not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT_S = 240  # the programs take under a minute alone; the margin is for a loaded CI machine
FENCE = re.compile(r"^```(\S*)\s*$")
LANGUAGES = {"python", "bash", "console", "text", "json"}


def _blocks(page: Path) -> list[tuple[int, str, str]]:
    """The fenced blocks of ``page``: (line of the opening fence, language, text)."""
    blocks, opened, body = [], None, []
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        match = FENCE.match(line)
        if opened is None and match:
            opened, body = (number, match.group(1)), []
        elif opened is not None and line.rstrip() == "```":
            blocks.append((opened[0], opened[1], "\n".join(body) + "\n"))
            opened = None
        elif opened is not None:
            body.append(line)
    assert opened is None, f"{page.name}: the block opened on line {opened[0]} is never closed"
    return blocks


def _programs() -> list:
    return [
        pytest.param(page, text, id=f"{page.relative_to(ROOT)}:{line}")
        for page in PAGES
        for line, language, text in _blocks(page)
        if language == "python"
    ]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Runs ``args`` from ``cwd`` with this checkout's cleanbuf first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.slow  # each program is a fresh interpreter; some start processes or Ray
@pytest.mark.parametrize(("page", "program"), _programs())
def test_program_runs_as_pasted(page, program, tmp_path):
    """Bug caught: a README or guide program that does not run as pasted.

    A missing import, a name never defined (``policy``, ``make_env``), a
    fragment (``...``, an indented loop body), TorchRL's spawned sub-env
    processes started without an ``if __name__ == "__main__":`` guard, a
    Ray program that hangs for lack of CPUs (the timeout), or an API that
    changed under the docs.
    """
    script = tmp_path / "program.py"
    script.write_text(program)
    work = tmp_path / "cwd"
    work.mkdir()
    try:
        done = _run([sys.executable, str(script)], cwd=work)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{page.name}: still running after {TIMEOUT_S} s\n{err.stderr or ''}")
    status = done.returncode
    assert status == 0, (
        f"{page.name}: exit status {status}\n--- program ---\n{program}"
        f"--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-8000:]}"
    )
    if page.name == "ray.md":
        _assert_quiet(done)


def _assert_quiet(done: subprocess.CompletedProcess) -> None:
    """The Ray guide's program prints its result, and cleanbuf's loss warning if any.

    Bugs caught: the result buried in Ray's and TorchRL's noise (about 60
    lines: Ray's start-up, TorchRL's INFO lines, the actors' reprs), and a
    quieting that also hides the warning that terminal observations were
    lost (cleanbuf reports the actors' losses in the driver, and the
    flush's own, when rows it stored lost theirs).
    """
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    lost = re.search(r"'terminal_obs_missing': (\d+)", done.stdout)
    assert lost is not None, f"no stats printed:\n{done.stdout}"
    warned = "CleanbufWarning" in done.stderr
    assert warned == (int(lost.group(1)) > 0), f"loss warning {warned}, stats:\n{done.stdout}"
    # (the flush's own loss warning, when held rows lost theirs: two lines more)
    flush = 2 if "stored by filt.flush(rb) lost their terminal observation" in done.stderr else 0
    assert len(lines) <= 3 + flush, "the program prints more than its result:\n" + "\n".join(lines)


def test_fences_are_tagged_and_programs_found():
    """Bug caught: a program that escapes the harness.

    A block with no language, or one tagged ``py`` or ``python3``, would not
    be run; a parser that finds no ``python`` block in the README would
    pass every page unread.
    """
    untagged = [
        f"{page.name}:{line} ({language or 'no language'})"
        for page in PAGES
        for line, language, _ in _blocks(page)
        if language not in LANGUAGES
    ]
    assert not untagged, f"blocks tagged outside {sorted(LANGUAGES)}: {untagged}"
    in_readme = [b for b in _blocks(ROOT / "README.md") if b[1] == "python"]
    assert len(in_readme) >= 3, f"the README's python blocks found: {len(in_readme)}"
    assert len(PAGES) > 1, "no guide page found under docs/"


def test_readme_is_short_and_docs_stand_alone():
    """Bug caught: the README growing back into a reference (24 KB).

    Also a doc pointing to a design file that is not part of the project.
    """
    size = (ROOT / "README.md").stat().st_size
    assert size < 10_000, f"README.md is {size} bytes; move reference material to docs/"
    pages = [p for p in ROOT.rglob("*.md") if ".venv" not in p.parts]
    citing = [str(p.relative_to(ROOT)) for p in pages if "DESIGN.md" in p.read_text()]
    assert not citing, f"these pages mention DESIGN.md: {citing}"


@pytest.mark.slow  # a fresh interpreter, timed by its own clock: not under a loaded fast run
def test_demo_is_quick_short_and_matches(tmp_path):
    """Bug caught: a first run that takes most of a minute or buries its result.

    Or a demo that stops showing the artifacts it cleans.
    The demo's dirty env used to be ``GymEnv(num_envs=8)``, which starts 8
    spawned processes (38 to 53 s here). Its own clock (after imports) must
    stay under 20 s, its output (stdout and stderr: log lines and warnings
    count) within 20 lines, the plain buffer must hold reset rows and the
    filter must drop exactly those, and the cleaned buffer must match the
    explicit-reset run.
    """
    done = _run([sys.executable, "-m", "cleanbuf.demo"], cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    lines = out.splitlines()
    assert len(lines) <= 20, f"{len(lines)} lines:\n{out}"
    assert "matches explicit resets:  yes" in out, out
    bogus = int(re.search(r"bogus reset rows in the plain buffer: +(\d+)", out).group(1))
    dropped = int(re.search(r"reset rows dropped by the filter: +(\d+)", out).group(1))
    assert bogus > 0 and dropped == bogus, out
    seconds = float(re.search(r"^\((\d+\.\d) s, torch", out, re.M).group(1))
    assert seconds < 20, f"the demo took {seconds} s after its imports"
