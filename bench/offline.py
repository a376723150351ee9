"""Offline cleaning of a large memmap dataset: time against a plain copy, memory, audit speed.

``python -m bench.offline [--gb 2]`` writes a next-step dataset of Atari-
sized rows (``bench/offline_data.py``) to a temporary directory, then, in
one process, a few rounds of:

* the floor: a plain chunked copy of every key to a new memmap directory
  (the bytes read once and written once);
* ``cleanbuf clean`` of the same dataset to a new memmap directory;
* ``cleanbuf audit`` of it, warm (its pages already cached).

Before each timed copy or clean, ``os.sync()`` writes out the dirty pages
of the one before: otherwise the second variant of a round pays for the
first one's writeback. Each is timed twice: until it returns (its pages
may still be dirty in the page cache), and until the ``os.sync()`` after
it has put them on disk; and its thread's CPU time is taken (steadier
than either: the kernel's writeback runs in other threads). It prints
the median times, the clean/copy ratio, the audit's read rate and the
peak anonymous memory of each clean over the process's memory as that
clean starts (sampled every 2 ms in a further, untimed clean each round,
after one untimed clean that loads numba's compiler and caches), against the rows the clean takes at
a time (whole writes, up to ``PIECE_BYTES``). Not part of the tests.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import tempfile
import threading
import time

import torch
from tensordict import TensorDict

import cleanbuf
from bench.offline_data import FRAME, write_memmap
from cleanbuf.offline import audit, clean_dataset
from cleanbuf.offline._clean_files import PIECE_BYTES

ENVS, STEPS = 4, 64
ROW_BYTES = 2 * FRAME + 8 + 4 + 1


def _user_s() -> float:
    """User CPU seconds of the calling thread (Linux), else of the process."""
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_utime


def _anon_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Peak:
    """Samples the process's anonymous memory while it runs."""

    def __init__(self):
        self.peak, self._stop = 0.0, False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, _anon_mb())
            time.sleep(0.002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()


def copy(src: str, dst: str, rows_per_chunk: int) -> None:
    """The floor: every key copied chunk by chunk into a new memmap directory."""
    data = TensorDict.load_memmap(src)
    out = data.memmap_like(dst)
    n = data.shape[0]
    for lo in range(0, n, rows_per_chunk):
        hi = min(lo + rows_per_chunk, n)
        for key, leaf in data.items(True, True):
            out.get(key)[lo:hi] = leaf[lo:hi]


def checked(done, dst: str) -> None:
    """Stops the bench when the cleaned output does not hold the ``rows_out`` it reports.

    A bench that times a wrong result measures nothing: the output is
    loaded back as a user loads it and its rows counted.
    """
    rows = TensorDict.load_memmap(dst).batch_size[0]
    if rows != done.stats["rows_out"]:
        raise SystemExit(f"{dst}: {rows} rows read back, rows_out {done.stats['rows_out']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="dataset size")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    batches = max(1, int(args.gb * 1e9 / (ENVS * STEPS * ROW_BYTES)))
    root = tempfile.mkdtemp(prefix="cleanbuf-bench-")
    try:
        src = os.path.join(root, "src")
        t = time.perf_counter()
        size = write_memmap(src, batches, ENVS, STEPS)
        print(
            f"dataset: {size / 1e9:.2f} GB, {batches * ENVS * STEPS} rows, "
            f"written in {time.perf_counter() - t:.0f} s"
        )
        times = {"copy": [], "clean": [], "audit": []}
        # A first clean, untimed: numba's compiler and caches and torchrl's
        # storage code take their memory once per process.
        warm = os.path.join(root, "warm")
        checked(clean_dataset(src, warm), warm)
        shutil.rmtree(warm)
        peaks = []
        durable, cpu, user = ({"copy": [], "clean": []} for _ in range(3))
        for r in range(args.rounds):
            # Alternated, so neither variant always runs on the other's
            # freshly freed pages.
            for name in ("copy", "clean") if r % 2 == 0 else ("clean", "copy"):
                dst = os.path.join(root, name)
                shutil.rmtree(dst, ignore_errors=True)
                os.sync()  # no dirty pages of the last variant to flush while timed
                t, t_cpu, t_user = time.perf_counter(), time.thread_time(), _user_s()
                if name == "copy":
                    copy(src, dst, ENVS * STEPS)
                else:
                    done = clean_dataset(src, dst)
                times[name].append(time.perf_counter() - t)
                cpu[name].append(time.thread_time() - t_cpu)
                user[name].append(_user_s() - t_user)
                os.sync()  # its pages on disk: the time to a durable copy
                durable[name].append(time.perf_counter() - t)
                if name == "clean":
                    checked(done, dst)  # untimed
            # The memory of a further clean, untimed: sampling /proc every
            # 2 ms slowed the clean it watched by 10% to 40% here.
            dst = os.path.join(root, "sampled")
            shutil.rmtree(dst, ignore_errors=True)
            # Over the process's memory as the clean starts: what the copy,
            # the audit or an earlier clean left allocated is theirs.
            base = _anon_mb()
            with Peak() as peak:
                done = clean_dataset(src, dst)
            peaks.append(peak.peak - base)
            checked(done, dst)
            t = time.perf_counter()
            audit(src)
            times["audit"].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratios = sorted(a / b for a, b in zip(times["clean"], times["copy"]))
        on_disk = sorted(a / b for a, b in zip(durable["clean"], durable["copy"]))
        write_mb = ENVS * STEPS * ROW_BYTES / 1e6
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} cores; python "
            f"{platform.python_version()}, torch {torch.__version__}, cleanbuf "
            f"{cleanbuf.__version__}"
        )
        print("| measure | value |")
        print("|---|---|")
        print(f"| plain chunked copy (floor), s | {med['copy']:.2f} |")
        print(f"| cleanbuf clean, s | {med['clean']:.2f} |")
        print(
            f"| clean / copy, median of the rounds' ratios (lowest, highest) | "
            f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}x, {ratios[-1]:.2f}x) |"
        )
        print(
            f"| the same, each timed until its pages are on disk (os.sync), s: copy, clean, "
            f"ratio (lowest, highest) | {statistics.median(durable['copy']):.2f}, "
            f"{statistics.median(durable['clean']):.2f}, {statistics.median(on_disk):.2f}x "
            f"({on_disk[0]:.2f}x, {on_disk[-1]:.2f}x) |"
        )
        cpu_ratios = sorted(a / b for a, b in zip(cpu["clean"], cpu["copy"]))
        print(
            f"| the same, CPU time of the timed thread (user + system, its page faults "
            f"included), s: copy, clean, ratio (lowest, highest) | "
            f"{statistics.median(cpu['copy']):.2f}, {statistics.median(cpu['clean']):.2f}, "
            f"{statistics.median(cpu_ratios):.2f}x ({cpu_ratios[0]:.2f}x, {cpu_ratios[-1]:.2f}x) |"
        )
        user_ratios = sorted(a / b for a, b in zip(user["clean"], user["copy"]))
        print(
            f"| the same, user CPU time only (the process's own work), s: copy, clean, ratio "
            f"(lowest, highest) | {statistics.median(user['copy']):.2f}, "
            f"{statistics.median(user['clean']):.2f}, {statistics.median(user_ratios):.2f}x "
            f"({user_ratios[0]:.2f}x, {user_ratios[-1]:.2f}x) |"
        )
        print(f"| audit, warm, GB/s of the dataset | {size / 1e9 / med['audit']:.2f} |")
        print(
            f"| clean: peak anonymous memory over its start, MB, median (highest) | "
            f"{statistics.median(peaks):.1f} ({max(peaks):.1f}) |"
        )
        piece_mb = write_mb * max(1, PIECE_BYTES // int(write_mb * 1e6))
        print(
            f"| the rows one cleaner call takes (whole writes of {write_mb:.1f} MB), MB | "
            f"{piece_mb:.1f} |"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
