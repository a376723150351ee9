"""The second part of a call's step: what to do with each row, from flags only.

read -> **plan** -> write, over a :class:`~cleanbuf.engine._state.Carry`.
:func:`plan` reads what the kernel planned for a
:class:`~cleanbuf.engine._read.Call` (:func:`~cleanbuf.engine._kernels.one_pass`,
run by the read step): the rows to drop, hold or emit, the held rows it
releases (:class:`Release`) and the lost-observation policy
(:func:`lost_policy`). A :class:`Plan` is numpy arrays and counts; no tensor
is touched here.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from cleanbuf.engine._errors import (
    InputError,
    ResetRowError,
    TerminalObservationLostError,
    key_name,
)
from cleanbuf.engine._kernels import (
    NO_ROWS,
    RELEASED_LOST,
    KernelResult,
    Selection,
)
from cleanbuf.engine._keys import Views, done_flags
from cleanbuf.engine._options import Options
from cleanbuf.engine._read import Call
from cleanbuf.engine._state import Carry


def bad_reset_row(row: int, stream: int, done: bool) -> ResetRowError:
    """The error for a supposed reset row that is not one (the safety net)."""
    what = "is itself done" if done else "has a nonzero reward"
    return ResetRowError(
        f"row {row} (stream {stream}) follows a done row, so in next-step mode it "
        f"must be an auto-reset row (reward exactly 0, not done), but it {what}. "
        "The configuration is likely wrong: same-step or already-clean data "
        "(TorchRL GymWrapper over a SAME_STEP or DISABLED env, SB3 VecEnv) needs "
        "mode='same_step' or 'disabled'; TorchRL GymEnv(num_envs=N) needs "
        "joint_reset=True; AutoresetFilter.for_env(env) sets both. If a reward "
        "transform inside the env shifts rewards away from 0, pass "
        "check_reset_rows=False. If the configuration is right, a batch was skipped or "
        "came out of order (the row after a done row is not its reset row). Nothing was "
        "written."
    )


def lost_policy(
    options: Options, obs_keys: list, leaves: dict, n_lost: int, final_missing: bool
) -> str:
    """The lost-observation policy to apply to ``n_lost`` rows, or raise.

    Args:
        options: the cleaner's options.
        obs_keys: the observation keys.
        leaves: the call's leaves (for the observations' dtypes).
        n_lost: rows whose next observation is lost.
        final_missing: the rows are same-step done rows without a final
            observation, where the default is to raise.

    Returns:
        "nan", "drop" or "keep".

    Raises:
        TerminalObservationLostError: the policy is to raise, or none was
            chosen where NaN cannot mark the rows.
        InputError: "nan" chosen for integer observations.
    """
    policy = options.on_lost_terminal_obs
    if n_lost == 0:
        return policy or "nan"
    if policy is None and final_missing:
        raise TerminalObservationLostError(
            f"{n_lost} done row(s) have no final observation (no final-observation "
            "entry such as ('next', 'final_obs'), ('next', 'final_observation') or "
            "('next', 'terminal_observation'), or its mask says it is absent), so "
            "their next observation would be the reset observation. Store the final "
            "observation (cleanbuf.step_rows reads it from the info), name it with "
            "final_obs_key=, or choose on_lost_terminal_obs='drop' (do not store those "
            "rows), 'nan' (mark them) or 'keep' (store them as they are). Nothing was "
            "written."
        )
    ints = [k for k in obs_keys if not leaves[k].is_floating_point()]
    if policy == "raise" or (policy is None and ints):
        why = (
            f"observation keys {', '.join(key_name(k) for k in ints)} are not floating "
            "point, so NaN cannot mark them"
            if policy is None
            else "on_lost_terminal_obs='raise'"
        )
        keys = ", ".join(key_name(("next", *k)) for k in obs_keys)
        raise TerminalObservationLostError(
            f"{n_lost} next observation(s) ({keys}) are lost (the producer reset every env of "
            "a reset group at once, the final observation is absent, or the row after "
            f"never arrived) and {why}. Choose on_lost_terminal_obs='drop' (do not "
            "store those rows), 'keep' (store them as the producer left them) or 'nan' "
            "(floating observations only). Nothing was written."
        )
    if policy == "nan" and ints:
        raise InputError(
            f"on_lost_terminal_obs='nan' cannot mark observation keys "
            f"{', '.join(f'{key_name(k)} ({leaves[k].dtype})' for k in ints)}. Choose "
            "'drop' or 'keep'."
        )
    return policy or "nan"


_NO_FLAGS = np.zeros(0, np.bool_)


class Release:
    """The held rows a call releases, in output order (they come first).

    Attributes:
        streams: their streams.
        slots: their slots in the carry's held rows.
        src: per row, the call's row holding its next observation, or
            ``RELEASED_LOST`` (lost: a restart cut it off),
            ``RELEASED_AS_IS`` (complete as stored: its end was only a mark)
            or ``RELEASED_STORED`` (complete as stored: a real end whose
            terminal observation it holds).
        lost_done: per lost row (dropped ones included), whether it is a
            done row.
        n_dropped: lost rows left out (the "drop" policy).
        n: rows released (``len(streams)``).
        n_stitched: released rows whose next observation this call brings.
        n_lost: released rows whose next observation is lost.
        n_terminal_lost: of those, the done rows.
    """

    __slots__ = (
        "streams", "slots", "src", "lost_done", "n_dropped", "n", "n_stitched", "n_lost",
        "n_terminal_lost",
    )  # fmt: skip

    def __init__(self, streams, slots, src, lost_done, n_dropped: int = 0):
        self.streams, self.slots, self.src, self.lost_done = streams, slots, src, lost_done
        self.n_dropped = n_dropped
        self.n = len(streams)
        self.n_stitched = int(np.count_nonzero(src >= 0)) if self.n else 0
        self.n_lost = len(lost_done)
        self.n_terminal_lost = int(np.count_nonzero(lost_done)) if self.n_lost else 0

    @classmethod
    def of(cls, carry: Carry, released_src: np.ndarray, done_key) -> Release:
        """Reads the kernel's per-stream ``released_src`` against the held rows."""
        if not len(carry.held_stream):
            return NO_RELEASE
        slot_of = np.full(len(released_src), -1, np.int64)
        slot_of[carry.held_stream] = np.arange(len(carry.held_stream))
        streams = np.flatnonzero((released_src != -1) & (slot_of >= 0))
        slots, src = slot_of[streams], released_src[streams]
        lost_done = _NO_FLAGS
        if np.count_nonzero(src == RELEASED_LOST):
            held = Views(carry.held, 1, len(carry.held_stream))
            lost_done = done_flags(held, done_key)[slots[src == RELEASED_LOST]]
        return cls(streams, slots, src, lost_done)

    def without_lost(self) -> Release:
        """The same release with the lost rows left out (the "drop" policy)."""
        keep = self.src != RELEASED_LOST
        return Release(
            self.streams[keep],
            self.slots[keep],
            self.src[keep],
            self.lost_done,
            n_dropped=len(self.src) - int(np.count_nonzero(keep)),
        )


NO_RELEASE = Release(NO_ROWS, NO_ROWS, NO_ROWS, _NO_FLAGS)  # no held row: nothing released


class Plan(NamedTuple):
    """What the kernel planned for a call, and what it means for the held rows.

    Attributes:
        sel: the call's rows to emit and to hold, and their patches.
        released_src: per stream, the source of its held row's next
            observation (see :class:`~cleanbuf.engine._kernels.KernelResult`).
        per_stream: the new carry flags, int64[5, S].
        n_drop: reset rows dropped.
        n_lost: done rows of the call whose terminal observation is lost.
        n_next_lost: other rows of the call whose next observation is lost.
        n_done: episode ends completed.
        release: the held rows of earlier calls this call releases.
        policy: the lost-observation policy that applies ("nan", "drop" or
            "keep").
    """

    sel: Selection
    released_src: np.ndarray
    per_stream: np.ndarray
    n_drop: int
    n_lost: int
    n_next_lost: int
    n_done: int
    release: Release
    policy: str


def plan(call: Call, options: Options) -> Plan:
    """Reads the kernel's plan of a call (``call.planned``) into a :class:`Plan`.

    Changes nothing: the kernel returned a fresh carry array.

    Args:
        call: a call read (and planned) by the read step.
        options: the cleaner's options.

    Raises:
        ResetRowError: a row that should be a reset row is not one.
        TerminalObservationLostError, InputError: see :func:`lost_policy`.
    """
    layout = call.layout
    sel, *rest = call.planned  # (read and planned in one kernel call)
    k = KernelResult(Selection(*sel), *rest)
    if k.bad_row >= 0:
        stream = int(layout.stream_of(np.array([k.bad_row]))[0])
        raise bad_reset_row(k.bad_row, stream, bool(call.done[k.bad_row]))
    release = Release.of(call.carry, k.released_src, options.done_key)
    policy = lost_policy(
        options,
        call.obs_keys,
        call.views.tensors,
        k.n_lost + k.n_next_lost + release.n_lost,
        final_missing=options.mode == "same_step",
    )
    if policy == "drop":
        release = release.without_lost()
    return Plan(
        k.sel, k.released_src, k.carry, k.n_drop, k.n_lost, k.n_next_lost, k.n_done,
        release, policy,
    )  # fmt: skip
