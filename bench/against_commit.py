"""The cleaner of another commit against this tree's, in one process, on the same batches.

``python -m bench.against_commit COMMIT [case ...]`` (cases: ``mujoco``,
``clean``, ``step``, ``wide``, ``repair``; all by default) extracts
``cleanbuf/`` of ``COMMIT`` with ``git archive`` into a temporary
directory, renamed to the package ``cleanbuf_at_commit``, imports it beside
this tree's ``cleanbuf``, and calls both cleaners (the filter's ``inv``,
TorchRL's entry point of a write, or ``RolloutRepair``) directly, without a
buffer, on the same chained batches (``bench.run.chained``, device
declared): blocks of 20 calls each, the order swapping every
block. It prints each one's median time per call and the median of the
per-block ratios new / old. Run to run the machine's speed moves by more
than the changes it measures; within one process both see the same machine.

Cases: ``mujoco``, ``[8, 128]`` MuJoCo-like batches at 2% reset rows;
``clean``, the same with nothing to clean; ``step``, one step of 16 envs
(``layout="step"``, raw-loop rows); ``wide``, one step of 4096 envs;
``repair``, ``RolloutRepair`` on ``[4, 128]`` batches.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.run import chained, steps_of

NAME = "cleanbuf_at_commit"


def extract(commit: str, where: Path) -> None:
    """``cleanbuf/`` at ``commit``, as the package ``NAME`` under ``where``."""
    archive = subprocess.run(
        ["git", "archive", commit, "cleanbuf"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    (where / "cleanbuf").rename(where / NAME)
    for path in (where / NAME).rglob("*.py"):
        text = path.read_text()
        text = re.sub(r"\bcleanbuf\.", f"{NAME}.", text)
        text = re.sub(r"\bfrom cleanbuf import\b", f"from {NAME} import", text)
        text = re.sub(r"^import cleanbuf$", f"import {NAME}", text, flags=re.M)
        path.write_text(text)


def batches(case: str, count: int) -> tuple[list, dict]:
    """The case's batches and the filter's options."""
    if case in ("step", "wide"):
        return steps_of(16 if case == "step" else 4096, count), {"layout": "step"}
    if case == "repair":
        return chained("mujoco", 0.02, 4, 128, count), {}
    return chained("mujoco", 0.0 if case == "clean" else 0.02, 8, 128, count), {}


def cleaner(package, case: str, options: dict):
    """What the case calls: the filter's ``inv`` (public, whatever the engine's
    insides are called at either commit), or a repair.
    """
    if case == "repair":
        return package.RolloutRepair()
    return package.AutoresetFilter(**options).inv


def compare(old, new, case: str, block: int = 20) -> tuple[float, float, float]:
    """``(old us, new us, new / old)``: medians over alternated blocks of calls."""
    count = 240 if case == "wide" else 1200
    calls, options = batches(case, count)
    a, b = cleaner(old, case, options), cleaner(new, case, options)
    for td in calls[:40]:  # warm-up: numba, caches, held rows
        a(td)
        b(td)
    times_a, times_b = [], []
    for i in range(40, count - block + 1, block):
        part = calls[i : i + block]
        pairs = [(a, times_a), (b, times_b)]
        for fn, acc in pairs if (i // block) % 2 else pairs[::-1]:
            start = time.perf_counter()
            for td in part:
                fn(td)
            acc.append((time.perf_counter() - start) / block * 1e6)
    ratio = statistics.median(y / x for x, y in zip(times_a, times_b))
    return statistics.median(times_a), statistics.median(times_b), ratio


def main(argv: list) -> None:
    commit, cases = argv[0], argv[1:] or ["mujoco", "clean", "step", "wide", "repair"]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        extract(commit, Path(tmp))
        sys.path.insert(0, tmp)
        old = __import__(NAME)
        import cleanbuf as new

        for case in cases:
            t_old, t_new, ratio = compare(old, new, case)
            print(f"{case:7s} {commit[:7]} {t_old:7.1f} us   this tree {t_new:7.1f} us   "
                  f"new / old {ratio:.3f}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
