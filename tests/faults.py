"""A harness for fault cases: a bad call, its expected outcome, and the run after it.

A fault case puts one bad call into a good stream of calls and says what
must come of it:

- **clear**: a cleanbuf error of a given class whose message contains given
  substrings (the key, what was expected, what came, the fix). The call must
  change no state (byte-equal ``state_dict()``) and write nothing, and the
  rest of the good stream must then give the same rows and stats as a run
  that never saw the bad call.
- **handled**: no error; the run (the bad call standing in for, or coming
  before, a good call) ends with the same rows and stats as the good run,
  and the case's own check (a warning, a repr) holds.

The subject under test (a filter with its buffer, a repair, a raw loop) is
wrapped in a :class:`Subject`; :class:`FilterSubject` is the one of
:class:`cleanbuf.AutoresetFilter`. Each suite lists its cases and runs them
with :func:`run_case`; :func:`tally` counts them per outcome, and
``python -m tests.faults`` prints the table over every fault suite.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torchrl.data import LazyTensorStorage, ReplayBuffer

from cleanbuf import AutoresetFilter
from tests.batches import assert_same_rows, next_step_batch

#: The fault suites ``python -m tests.faults`` tallies (each has a ``CASES`` list).
SUITES = ("tests.test_faults_filter", "tests.test_faults_edges")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a bad call must give.

    Attributes:
        error: the cleanbuf exception class, or None for "handled".
        needles: substrings the error message must contain (case-sensitive).
    """

    error: type | None
    needles: tuple = ()

    @property
    def kind(self) -> str:
        """The outcome kind: "clear" or "handled"."""
        return "handled" if self.error is None else "clear"


def clear(error: type, *needles: str) -> Outcome:
    """A clear error: ``error`` raised, its message containing each of ``needles``."""
    return Outcome(error, needles)


HANDLED = Outcome(None)


@dataclasses.dataclass(frozen=True)
class Case:
    """One fault case.

    Attributes:
        name: what the bad call is (the test id).
        call: ``call(subject, good, at)`` makes the bad call; ``good`` is the
            good stream's calls, ``at`` the index the bad call comes before.
        expect: the outcome (:func:`clear` or :data:`HANDLED`).
        at: how many good calls come before the bad one.
        replaces: handled cases: the bad call stands for this many good
            calls from ``good[at]`` on (the same batches in another form), so
            the run goes on after them.
        check: handled cases: ``check(subject, result)`` after the bad call
            (``result`` is what ``call`` returned), for what the rows cannot
            show (a warning, a repr, an unchanged state).
        stream: the name of the good stream (the suite maps it to its calls).
        bug: the bug the case catches (goes into the test's failure message).
    """

    name: str
    call: Callable
    expect: Outcome
    at: int = 1
    replaces: int = 0
    check: Callable | None = None
    stream: str = "default"
    bug: str = ""


class Subject:
    """What a fault case runs against: one producer's calls into one sink.

    Subclasses say how a good call is made, what the state is, what was
    written, and what the run gave at its end.
    """

    def feed(self, item: Any) -> None:
        """Makes one good call."""
        raise NotImplementedError

    def state(self) -> bytes:
        """The subject's state, as bytes (compared before and after a rejected call)."""
        raise NotImplementedError

    def written(self) -> Any:
        """What the sink holds now (compared before and after a rejected call)."""
        raise NotImplementedError

    def finish(self) -> tuple[Any, dict]:
        """Ends the run (flush); returns what was stored and the stats."""
        raise NotImplementedError

    def same(self, got: tuple[Any, dict], want: tuple[Any, dict], where: str) -> None:
        """Asserts that two runs' results are the same: rows stream by stream, and stats.

        Clean means equal row for row within each stream; how calls were
        cut changes the order in which streams' rows interleave, so rows
        are compared after a stable sort by their ``"stream"`` key.
        """
        assert_same_rows(by_stream(got[0]), by_stream(want[0]), where)
        assert got[1] == want[1], f"{where}: stats {got[1]} != {want[1]}"


def by_stream(rows: Any) -> Any:
    """Flat rows in a stable order of their ``"stream"`` key (as they are without one)."""
    if rows is None or "stream" not in rows.keys() or rows.batch_dims != 1:
        return rows  # (a repair's [E, T] batch keeps its streams on its first axis)
    order = torch.sort(rows.get("stream").reshape(len(rows)), stable=True).indices
    return rows[order]


def state_bytes(state: Any) -> bytes:
    """``torch.save`` bytes of a state dict (tensors included), for byte equality."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


class FlakyStorage(LazyTensorStorage):
    """A storage whose next write raises once ``fail_next`` is set (a full disk)."""

    fail_next = False

    def set(self, *args, **kwargs):
        if self.fail_next:
            self.fail_next = False
            raise OSError("disk full (injected)")
        return super().set(*args, **kwargs)


class FilterSubject(Subject):
    """An :class:`~cleanbuf.AutoresetFilter` in a ``ReplayBuffer`` over a :class:`FlakyStorage`.

    Args:
        options: the filter's mode and options, ``{"mode": ..., **kwargs}``.
    """

    def __init__(self, options: dict | None = None):
        options = dict(options or {})
        mode = options.pop("mode", "next_step")
        self.filt = AutoresetFilter(mode, **options)
        self.storage = FlakyStorage(10_000)
        self.rb = ReplayBuffer(storage=self.storage, transform=self.filt)

    def feed(self, item: Any) -> None:
        self.rb.extend(item)

    def fail_write(self, item: Any) -> None:
        """Extends with ``item`` while the storage fails.

        TorchRL's writer moves past the slots before the storage writes; the
        filter puts it back once it sees the write failed.
        """
        self.storage.fail_next = True
        with pytest.raises(OSError, match="injected"):
            self.rb.extend(item)

    def stored(self) -> Any:
        """Every slot the buffer's writer passed, once the filter settled its last write.

        A failed write must leave no slot holding nothing behind the writer
        (a sampler would draw it): the writer has written as many rows as
        the buffer holds.
        """
        _ = self.filt.stats  # (settles the last write: a failed one puts the writer back)
        n = self.rb.write_count
        assert n == len(self.rb), f"the writer passed {n} slots, the buffer holds {len(self.rb)}"
        if not n or self.storage._storage is None:
            return None
        return self.storage._storage[:n].clone()

    def state(self) -> bytes:
        return state_bytes(self.filt.state_dict())

    def written(self) -> Any:
        return self.stored()

    def finish(self) -> tuple[Any, dict]:
        self.filt.flush(self.rb)
        return self.stored(), self.filt.stats


class PostprocSubject(Subject):
    """An :class:`~cleanbuf.AutoresetFilter` called on its own, as a collector's ``postproc``."""

    def __init__(self, options: dict | None = None):
        options = dict(options or {})
        mode = options.pop("mode", "next_step")
        self.filt = AutoresetFilter(mode, **options)
        self.rows: list = []

    def feed(self, item: Any) -> None:
        self.rows.append(self.filt(item))

    def state(self) -> bytes:
        return state_bytes(self.filt.state_dict())

    def written(self) -> int:
        return len(self.rows)

    def finish(self) -> tuple[Any, dict]:
        rows = [r for r in [*self.rows, self.filt.flush()] if r is not None and r.batch_size[0]]
        return torch.cat(rows), self.filt.stats


def good_calls(n_streams: int = 3, steps: int = 6, n_calls: int = 8, seed: int = 21,
               traj_ids: bool = True) -> list:  # fmt: skip
    """A good next-step stream cut into ``n_calls`` calls ``[E, steps]``.

    Observations encode their position (``tests.reference``). With
    ``traj_ids``, one ``("collector", "traj_ids")`` value per episode of each
    stream, never reused.
    """
    both = next_step_batch(n_streams, n_calls * steps, seed)
    if traj_ids:
        starts = both["is_init"].squeeze(-1).long().cumsum(1)
        both["collector", "traj_ids"] = starts + 1000 * torch.arange(n_streams).unsqueeze(1)
    return [both[:, i : i + steps].clone() for i in range(0, n_calls * steps, steps)]


def run_case(case: Case, make: Callable[[], Subject], good: Sequence) -> None:
    """Runs ``case`` against subjects made by ``make`` over the good calls ``good``.

    Asserts the case's outcome; for a rejected call the unchanged state and
    sink; for every case the rest of the run equal to the good run's.
    """
    where = f"{case.name} ({case.bug})" if case.bug else case.name
    want_subject = make()
    for item in good:
        want_subject.feed(item)
    want = want_subject.finish()

    subject = make()
    for item in good[: case.at]:
        subject.feed(item)
    state, written = subject.state(), subject.written()
    rest = good[case.at :]
    if case.expect.error is not None:
        with pytest.raises(case.expect.error) as info:
            case.call(subject, good, case.at)
        message = str(info.value)
        for needle in case.expect.needles:
            assert needle in message, f"{where}: {needle!r} not in the message: {message}"
        assert subject.state() == state, f"{where}: the failed call changed the state"
        _same_written(subject.written(), written, where)
    else:
        result = case.call(subject, good, case.at)
        if case.check is not None:
            case.check(subject, result)
        rest = rest[case.replaces :]
    for item in rest:
        subject.feed(item)
    subject.same(subject.finish(), want, where)


def _same_written(got: Any, want: Any, where: str) -> None:
    if isinstance(got, tuple) and isinstance(want, tuple):
        assert len(got) == len(want), where
        for g, w in zip(got, want, strict=True):
            _same_written(g, w, where)
    elif hasattr(want, "batch_size"):
        assert_same_rows(got, want, f"{where}: the failed call wrote into the buffer")
    else:
        assert got == want, f"{where}: the failed call wrote into the buffer ({got} != {want})"


GC_WARNING = "garbage-collected while holding"


def lost_warnings(record) -> list:
    """The CleanbufWarnings of ``record``, without the forgotten-flush ones.

    A filter that earlier tests left holding rows warns when the garbage
    collector takes it, at whatever line runs then, inside another test's
    ``pytest.warns`` too; tests that count their own warnings leave those out.
    """
    from cleanbuf import CleanbufWarning

    return [
        r
        for r in record
        if issubclass(r.category, CleanbufWarning) and GC_WARNING not in str(r.message)
    ]


def tally(cases: Sequence[Case]) -> Counter:
    """The cases per outcome kind ("clear", "handled")."""
    return Counter(case.expect.kind for case in cases)


def table(suites: Sequence[str] = SUITES) -> str:
    """The per-outcome table over the fault suites that exist, as text."""
    lines = [f"{'suite':<28} {'clear':>6} {'handled':>8} {'total':>6}"]
    total = Counter()
    for name in suites:
        try:
            cases = importlib.import_module(name).CASES
        except ModuleNotFoundError:
            continue
        counts = tally(cases)
        total += counts
        lines.append(
            f"{name:<28} {counts['clear']:>6} {counts['handled']:>8} {sum(counts.values()):>6}"
        )
    lines.append(f"{'all':<28} {total['clear']:>6} {total['handled']:>8} {sum(total.values()):>6}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
