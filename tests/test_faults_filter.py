"""The filter's fault suite: bad calls into a good stream (see ``tests.faults``)."""

from __future__ import annotations

import pytest

from cleanbuf import InputError
from tests.faults import Case, FilterSubject, clear, good_calls, run_case

STREAMS = {"default": good_calls()}


def _drop(key):
    def call(subject, good, at):
        subject.feed(good[at].exclude(key))

    return call


def _empty(subject, good, at):
    subject.feed(good[at][:, :0])


CASES = [
    Case(
        "missing done",
        _drop(("next", "done")),
        clear(InputError, "('next', 'done')"),
        bug="a batch without done flags cleaned as if nothing ended",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fault(case):
    """Bug caught: each case's ``bug`` (a bad call not refused clearly, a
    state changed by a refused call, or a stream that goes wrong after it).
    """
    run_case(case, FilterSubject, STREAMS[case.stream])
