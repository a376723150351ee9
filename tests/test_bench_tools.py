"""The benchmarks' instruments: they time cleanbuf's calls and leave it as it was.

``bench/kernel_time.py`` puts timers around the numba kernels and
``bench/profile_e2e.py`` around every cleanbuf function; both patch module
globals and class attributes while open, so each must time real calls,
change no result, and put back every object it replaced.
"""

from __future__ import annotations

import sys

from torchrl.data import LazyTensorStorage, ReplayBuffer, RoundRobinWriter

from bench.data import make_batch
from bench.kernel_time import KernelClock
from bench.profile_e2e import WRITE, Clocks, phase_of
from bench.run import chained
from cleanbuf import AutoresetFilter
from tests.batches import assert_same_rows


def _cleanbuf_objects() -> dict:
    """Every attribute of every cleanbuf module and of each class defined there."""
    seen = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "cleanbuf" or name.startswith("cleanbuf.")):
            continue
        for attr, value in list(vars(module).items()):
            seen[(name, attr)] = value
            if isinstance(value, type) and value.__module__ == name:
                for k, v in list(vars(value).items()):
                    seen[(name, attr, k)] = v
    return seen


def test_the_kernel_clock_times_the_kernels_and_puts_them_back():
    """A filter call with the clock open: kernel calls counted, time spent, the
    same rows out; after it closes, every module global is the object it was.

    Bugs caught: a clock that finds no kernel (the kernel row of
    ``bench.run`` would read 0 and divide by it), a timer that changes what
    a kernel returns, and a timer left in a module after the clock closes
    (every later call slowed, or a later compile seeing a timer where it
    calls a helper kernel).
    """
    batch = make_batch("mujoco", 0.02, device="cpu")
    expected = AutoresetFilter().inv(batch)  # also the warm-up the clock asks for
    before = _cleanbuf_objects()
    with KernelClock() as clock:
        got = AutoresetFilter().inv(batch)
    assert clock.names and clock.calls > 0 and clock.seconds > 0
    assert_same_rows(got, expected, "with the kernel clock")
    after = _cleanbuf_objects()
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before), "an object was not put back"


def test_the_profiler_clocks_time_an_extend_and_put_everything_back():
    """Extends through the filter with ``Clocks`` open: the writer and cleanbuf
    functions timed, each in a phase, the same rows stored as without the
    clocks; after they close, every module global and class attribute of
    cleanbuf is the object it was, and the writer has no timer of its own.

    Bugs caught: a class method or a module function put back as the timer
    (the next ``Clocks`` wraps the timer, and its own time lands in the
    profiler's module), a writer left timed, timers that change what the
    filter stores, and labels no phase claims.
    """
    windows = chained("mujoco", 0.02, 8, 32, 4)

    def stored(timed: bool):
        writer = RoundRobinWriter()
        rb = ReplayBuffer(
            storage=LazyTensorStorage(1024), writer=writer, transform=AutoresetFilter()
        )
        rb.extend(windows[0])  # warm up outside the clocks
        if not timed:
            for w in windows[1:]:
                rb.extend(w)
            return rb[:], None
        with Clocks(writer) as clocks:
            for w in windows[1:]:
                rb.extend(w)
        assert "extend" not in vars(writer), "the writer keeps a timer"
        return rb[:], clocks

    before = _cleanbuf_objects()
    expected, _ = stored(timed=False)
    got, clocks = stored(timed=True)
    after = _cleanbuf_objects()
    assert_same_rows(got, expected, "with the profiler's clocks")
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before), "an object was not put back"
    assert clocks.calls[WRITE] == 3
    cleanbuf_labels = [k for k in clocks.calls if k != WRITE]
    assert len(cleanbuf_labels) > 5
    assert all("profile_e2e" not in k for k in cleanbuf_labels), "a timer was timed"
    assert all(phase_of(k) for k in clocks.calls)
    assert sum(clocks.own.values()) > 0
