"""Where each microsecond of one ``rb.extend`` with the filter goes.

``python -m bench.profile_e2e [mujoco|clean|step|wide|atari|repair] [calls]``
(``mujoco`` and 300 calls by default) prints two tables for one case of
``bench.run`` (the same distinct chained batches, device declared):

1. **Timers around public entry points**, no profiler, the variants
   alternated round after round: a plain extend (flat batch), an extend
   through the identity transform, the filter's extend, the filter's
   ``inv`` called directly (a second filter fed the same batches) and a
   plain extend of the filter's output rows. From them: TorchRL's
   transform path (identity minus plain), the filter's own work (its
   ``inv``), the storage write of the rows it keeps, and what the three
   leave of the filter's extend.
2. **Phases inside the filter's extend**: timers around every function
   and method of the ``cleanbuf`` modules and every numba kernel found
   there (found by walking the modules: :class:`Clocks`) and around the
   buffer's writer (``writer.extend``, TorchRL's writer and storage
   write), in blocks of calls that alternate with blocks without them.
   Each timed function's own time (its time less the timed calls it makes;
   the torch, tensordict and numpy work it calls is its own) goes to a
   phase by its module and name (:data:`PHASES`; ``online/`` is the
   transform's own layer); what the extend spends outside them is
   TorchRL's extend and transform path. Each timer's own cost, measured on
   a trivial function, is taken off its caller, and the phases' sum is
   printed beside the call without timers. Then the same own time by
   cleanbuf module (calls per extend included) and the functions with the
   most.

It uses no name of the engine's: when modules or functions change names,
only the phase a function falls in can move (:data:`PHASES`), and the
module and function tables show where. ``repair`` times ``RolloutRepair``
called directly (no buffer).
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from numba.core.dispatcher import Dispatcher
from torchrl.data import LazyTensorStorage, ReplayBuffer, RoundRobinWriter

import cleanbuf
from bench.data import Identity
from bench.run import Feed, alternate_fed, chained, steps_of
from cleanbuf import AutoresetFilter, RolloutRepair

CLEANBUF = str(Path(cleanbuf.__file__).parent) + os.sep

KERNEL = "cleaner: numba kernels"
LAYER = "cleanbuf: the transform's own layer (online/)"
OTHER = "cleaner: other (the step's own lines)"
TORCHRL_PATH = "TorchRL: extend and transform path"
WRITE = "TorchRL: writer and storage write"
# A cleanbuf engine function's phase: the first pattern that its qualified
# name matches, else the first that its module's name matches.
PHASES = [
    ("cleaner: commit, undo, state", r"commit|undo|retry|carry|state|stats|snapshot"),
    (
        "cleaner: gathers and output",
        r"write|gather|take|move|patch|stitch|output|rollout|as_td|emit|slab|tensordict",
    ),
    (
        "cleaner: read and schema",
        r"read|schema|key|view|walk|lea[fv]|signature|continuity|check|orient|axis|layout"
        r"|column|word|flag|dtype",
    ),
    ("cleaner: plan and kernel arguments (Python)", r"plan|kernel|decide|rule|code"),
]
ORDER = [TORCHRL_PATH, LAYER, *(p for p, _ in PHASES), KERNEL, OTHER, WRITE]


def cases(case: str, n: int) -> tuple[list, dict]:
    """The case's distinct chained batches (``n`` and a few to warm up) and filter options."""
    if case in ("step", "wide"):
        return steps_of(16 if case == "step" else 4096, n + 3), {"layout": "step"}
    if case == "atari":
        return chained("atari", 0.02, 8, 128, 4), {}
    if case == "repair":
        return chained("mujoco", 0.02, 4, 128, n + 3), {}
    return chained("mujoco", 0.0 if case == "clean" else 0.02, 8, 128, n + 3), {}


def capacity_of(windows: list) -> int:
    return max(4096, windows[0].numel() * 8)


# ------------------------------------------------------------------ public timers
def entry_points(case: str, windows: list, options: dict, rounds: int) -> None:
    """Table 1: the public entry points timed in alternated rounds, and what they leave."""
    cap = capacity_of(windows)
    rbs = {
        "plain": ReplayBuffer(storage=LazyTensorStorage(cap)),
        "identity": ReplayBuffer(storage=LazyTensorStorage(cap), transform=Identity()),
        "filter": ReplayBuffer(
            storage=LazyTensorStorage(cap), transform=AutoresetFilter(**options)
        ),
    }
    calls = {name: rb.extend for name, rb in rbs.items()}
    feeds = {name: Feed(windows, flat=name != "filter") for name in rbs}
    direct = AutoresetFilter(**options)
    calls["inv"], feeds["inv"] = direct.inv, Feed(windows)
    # the rows the filter keeps, made by a third filter on the same batches
    maker, source = AutoresetFilter(**options), Feed(windows)
    outs = [maker.inv(source.next()) for _ in range(min(rounds, len(windows)) + 3)]
    outs = [o for o in outs if o is not None and o.numel()]
    calls["write"] = ReplayBuffer(storage=LazyTensorStorage(cap)).extend
    feeds["write"] = Feed(outs)
    times = alternate_fed(calls, feeds, rounds)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}

    def diff(a, b):
        return statistics.median(x - y for x, y in zip(times[a], times[b])) * 1e6

    path = diff("identity", "plain")
    rest = med["filter"] - (path + med["inv"] + med["write"])
    print(f"\n{case}: timers around public entry points, medians of {rounds} alternated rounds")
    print("| what | us per call |")
    print("|---|---|")
    rows = [
        ("plain extend of the batch (flat), device declared", med["plain"]),
        ("extend through the identity transform", med["identity"]),
        ("extend through the filter", med["filter"]),
        ("  TorchRL's transform path (identity - plain)", path),
        ("  the filter's own work (its inv, called directly)", med["inv"]),
        ("  the storage write of the kept rows (a plain extend of them)", med["write"]),
        ("  left: filter extend - (transform path + inv + kept rows' write)", rest),
    ]
    for what, us in rows:
        print(f"| {what} | {us:.1f} |")


# ------------------------------------------------------------------ phases
def cleanbuf_phase(module: str, qualname: str) -> str:
    """The phase of a cleanbuf function, from its module path and qualified name."""
    if module.startswith("online"):
        return LAYER
    for source in (qualname, module):
        for phase, pattern in PHASES:
            if re.search(pattern, source):
                return phase
    return OTHER


def _where(fn, cls=None) -> str:
    """The path under ``cleanbuf/`` of the module that defines ``fn`` (or ``cls``)."""
    path = sys.modules[cls.__module__].__file__ if cls is not None else fn.__code__.co_filename
    return path[len(CLEANBUF) :] if path.startswith(CLEANBUF) else path


class Clocks:
    """Timers around every function and method of the ``cleanbuf`` modules, each
    numba kernel and the buffer's writer, while open: each one's own time (its
    time less the timed calls it makes) and calls.

    The functions are found by walking the modules (module-level functions,
    the methods of classes defined there), so no engine name is written
    here; one the engine keeps elsewhere (in a table built at import) runs
    untimed and its time counts as its caller's.
    """

    def __init__(self, writer=None):
        self.own: dict = defaultdict(float)
        self.calls: dict = defaultdict(int)
        self.stack: list = []
        self.nested: dict = defaultdict(int)  # per label, the timed calls it made
        self.roots = 0  # timed calls made from untimed code
        self.writer = writer
        self._patched: list = []

    def wrap(self, fn, label: str):
        clocks = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            frame = [0.0, 0]  # the timed calls' time and count
            clocks.stack.append(frame)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = time.perf_counter() - start
                clocks.stack.pop()
                clocks.own[label] += total - frame[0]
                clocks.calls[label] += 1
                clocks.nested[label] += frame[1]
                if clocks.stack:
                    clocks.stack[-1][0] += total
                    clocks.stack[-1][1] += 1
                else:
                    clocks.roots += 1

        return timed

    def _patch(self, owner, attr, value) -> None:
        """Sets ``owner.attr`` (a module's, a class's or an instance's), keeping what
        its own ``__dict__`` held (None: nothing, as for an instance's method).
        """
        self._patched.append((owner, attr, vars(owner).get(attr)))
        setattr(owner, attr, value)

    def __enter__(self) -> Clocks:
        wrapped: dict = {}

        def timed(fn, label):
            if id(fn) not in wrapped:
                wrapped[id(fn)] = self.wrap(fn, label)
            return wrapped[id(fn)]

        for name, module in list(sys.modules.items()):
            if module is None or not (name == "cleanbuf" or name.startswith("cleanbuf.")):
                continue
            for attr, value in list(vars(module).items()):
                if isinstance(value, Dispatcher):
                    label = f"{_where(value.py_func)}:{value.py_func.__qualname__} (numba)"
                    self._patch(module, attr, timed(value, label))
                elif inspect.isfunction(value) and value.__module__ == name:
                    self._patch(module, attr, timed(value, f"{_where(value)}:{value.__qualname__}"))
                elif isinstance(value, type) and value.__module__ == name:
                    self._patch_class(value, timed)
        if self.writer is not None:
            self._patch(self.writer, "extend", self.wrap(self.writer.extend, WRITE))
        return self

    def _patch_class(self, cls, timed) -> None:
        where = _where(None, cls)
        for attr, value in list(vars(cls).items()):
            if attr.startswith("__") and attr != "__call__":
                continue
            label = f"{where}:{cls.__qualname__}.{attr}"
            if inspect.isfunction(value):
                self._patch(cls, attr, timed(value, label))
            elif isinstance(value, (staticmethod, classmethod)):
                self._patch(cls, attr, type(value)(timed(value.__func__, label)))
            elif isinstance(value, property) and value.fget is not None:
                self._patch(cls, attr, property(timed(value.fget, label), value.fset))

    def __exit__(self, *exc) -> None:
        for owner, attr, value in reversed(self._patched):
            if value is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, value)
        self._patched.clear()


def _trivial() -> None:
    pass


def wrapper_cost() -> float:
    """The seconds a timer adds to its caller's own time: a loop of trivial calls,
    timed against untimed.
    """
    k = 20_000
    costs = []
    for _ in range(7):
        clocks = Clocks()
        fn = clocks.wrap(_trivial, "trivial")
        start = time.perf_counter()
        for _ in range(k):
            _trivial()
        bare = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(k):
            fn()
        costs.append((time.perf_counter() - start - bare - clocks.own["trivial"]) / k)
    return statistics.median(costs)


def phase_of(label: str) -> str:
    if label == WRITE:
        return WRITE
    module, qualname = label.split(":", 1)
    return KERNEL if qualname.endswith(" (numba)") else cleanbuf_phase(module, qualname)


def phases(case: str, windows: list, options: dict, n: int, block: int = 10) -> None:
    """Table 2: the phases of ``n`` filter extends (or repair calls), per call: blocks
    of ``block`` calls with the timers in, alternating with blocks without them.
    """
    writer = None
    if case == "repair":
        call, feed = RolloutRepair(), Feed(windows)
    else:
        writer = RoundRobinWriter()
        rb = ReplayBuffer(
            storage=LazyTensorStorage(capacity_of(windows)),
            writer=writer,
            transform=AutoresetFilter(**options),
        )
        call, feed = rb.extend, Feed(windows)
    for _ in range(3):  # warm up: numba, caches, the storage
        call(feed.next())
    batches = [feed.next() for _ in range(n)]
    block = max(1, min(block, n // 2))
    cost = wrapper_cost()
    bare: list = []
    per_call: list = []  # each timed call's phases, in us
    own: dict = defaultdict(float)
    calls: dict = defaultdict(int)
    runs = 0
    for k in range(0, n - 2 * block + 1, 2 * block):
        for b in batches[k : k + block]:
            start = time.perf_counter()
            call(b)
            bare.append(time.perf_counter() - start)
        with Clocks(writer) as clocks:
            for b in batches[k + block : k + 2 * block]:
                before = (dict(clocks.own), dict(clocks.nested), clocks.roots)
                start = time.perf_counter()
                call(b)
                per_call.append(phases_of_call(clocks, before, time.perf_counter() - start, cost))
        for label, value in clocks.own.items():
            own[label] += value - clocks.nested[label] * cost
            calls[label] += clocks.calls[label]
        runs += block
    names = {p for c in per_call for p in c}
    per = {p: statistics.median(c.get(p, 0.0) for c in per_call) for p in names}
    corrected = {k: v / runs * 1e6 for k, v in own.items()}
    report(case, per, corrected, calls, runs, cost, block, statistics.median(bare) * 1e6)


def phases_of_call(clocks: Clocks, before: tuple, outer: float, cost: float) -> dict:
    """One timed call's phases in us, from the clocks' totals before and after it."""
    own, nested, roots = before
    out: dict = defaultdict(float)
    spent = 0.0
    for label, value in clocks.own.items():
        mine = value - own.get(label, 0.0)
        spent += mine
        out[phase_of(label)] += (mine - (clocks.nested[label] - nested.get(label, 0)) * cost) * 1e6
    out[TORCHRL_PATH] = (outer - spent - (clocks.roots - roots) * cost) * 1e6
    return out


def report(case, per, corrected, calls, runs, cost, block, bare_us) -> None:
    """Prints table 2: the phases, the modules and the functions."""
    total = sum(per.values())
    what = "RolloutRepair call" if case == "repair" else "rb.extend with the filter"
    print(f"\n{case}: phases of one {what}: timers around every cleanbuf function, the")
    print(f"numba kernels and the buffer's writer, {runs} calls in blocks of {block}, each")
    print(f"timer's {cost * 1e9:.0f} ns taken off its caller (see Clocks); medians per call,")
    print("so the phases need not add up to their sum's median")
    print("| phase | us per call | share |")
    print("|---|---|---|")
    for p in sorted(per, key=lambda p: ORDER.index(p) if p in ORDER else len(ORDER)):
        if case == "repair" and p == TORCHRL_PATH:
            continue
        print(f"| {p} | {per[p]:.1f} | {per[p] / total:.0%} |")
    print(f"| sum of the phases' medians | {total:.1f} | |")
    print(f"| the same call without timers (median of {runs}) | {bare_us:.1f} | |")
    modules: dict = defaultdict(lambda: [0.0, 0])
    for label, us in corrected.items():
        if label != WRITE:
            m = modules[label.split(":", 1)[0]]
            m[0] += us
            m[1] += calls[label] / runs
    print("\nby cleanbuf module (own time: its functions less the timed calls they make; means)")
    print("| module | us per call | calls per call |")
    print("|---|---|---|")
    for m, (us, c) in sorted(modules.items(), key=lambda x: -x[1][0]):
        print(f"| {m} | {us:.1f} | {c:.1f} |")
    print("\nthe cleanbuf functions with the most own time")
    print("| function | phase | us per call | calls per call |")
    print("|---|---|---|---|")
    for label, us in sorted(corrected.items(), key=lambda x: -x[1])[:20]:
        print(f"| {label} | {phase_of(label)} | {us:.1f} | {calls[label] / runs:.1f} |")


def main(argv: list) -> None:
    torch.set_num_threads(1)
    case = argv[0] if argv else "mujoco"
    n = int(argv[1]) if len(argv) > 1 else 300
    if case == "atari":
        n = min(n, 20)  # 55 MiB a batch
    windows, options = cases(case, n)
    if case != "repair":
        entry_points(case, windows, options, n)
    phases(case, windows, options, n)


if __name__ == "__main__":
    main(sys.argv[1:])
