"""The time a call spends in cleanbuf's numba kernels, whatever they are named.

:class:`KernelClock` finds every numba dispatcher held as a module global
of a ``cleanbuf`` module (the kernels, wherever the engine keeps them) and,
while it is open, puts a timer around each: the time spent inside compiled
code, with no name of the engine's in this file. A kernel the engine keeps
elsewhere (in an object built before the clock opened) is not seen; the
clock's ``names`` tell what it found. Open it after a warm-up call: a
kernel compiled while it is open would find a timer where it calls a
helper kernel.
"""

from __future__ import annotations

import sys
import time

from numba.core.dispatcher import Dispatcher


def kernels(package: str = "cleanbuf") -> dict:
    """``{"module.name": dispatcher}`` of every numba dispatcher held as a module
    global of ``package`` or its submodules (each dispatcher once, under its first name).

    Examples:
        >>> import cleanbuf
        >>> len(kernels()) > 0
        True
    """
    found: dict = {}
    seen: set = set()
    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(package + ".")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, Dispatcher) and id(value) not in seen:
                seen.add(id(value))
                found[f"{name}.{attr}"] = value
    return found


class TimedKernel:
    """A dispatcher with a timer around its calls; other attributes pass through."""

    def __init__(self, dispatcher: Dispatcher, clock: KernelClock):
        self.dispatcher, self.clock = dispatcher, clock

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.dispatcher(*args, **kwargs)
        finally:
            self.clock.seconds += time.perf_counter() - start
            self.clock.calls += 1

    def __getattr__(self, name):
        return getattr(self.dispatcher, name)


class KernelClock:
    """A context manager that times cleanbuf's numba kernels while it is open.

    Examples:
        >>> from bench.data import make_batch
        >>> from cleanbuf import AutoresetFilter
        >>> batch = make_batch("mujoco", 0.02, device="cpu")
        >>> _ = AutoresetFilter().inv(batch)  # warm up: the kernels compiled or loaded
        >>> with KernelClock() as clock:
        ...     _ = AutoresetFilter().inv(batch)
        >>> clock.calls > 0 and clock.seconds > 0
        True
    """

    def __init__(self, package: str = "cleanbuf"):
        self.package = package
        self.seconds = 0.0
        self.calls = 0
        self.names: list = []
        self._patched: list = []

    def __enter__(self) -> KernelClock:
        found = kernels(self.package)
        self.names = list(found)
        wrappers = {id(d): TimedKernel(d, self) for d in found.values()}
        for name, module in list(sys.modules.items()):
            if module is None or not (name == self.package or name.startswith(self.package + ".")):
                continue
            for attr, value in list(vars(module).items()):
                if isinstance(value, Dispatcher) and id(value) in wrappers:
                    self._patched.append((module, attr, value))
                    setattr(module, attr, wrappers[id(value)])
        return self

    def __exit__(self, *exc) -> None:
        for module, attr, value in self._patched:
            setattr(module, attr, value)
        self._patched.clear()

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0
