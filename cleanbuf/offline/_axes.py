"""Which leading axis of stored arrays is time, from the data or as told.

Arrays come as flat rows ``[N, ...]``, as ``[T, E, ...]`` (CleanRL,
Stable-Baselines3 buffers, rollouts: ``layout="time_first"``) or as
``[E, T, ...]`` (TorchRL batches: ``layout="time_last"``). Along the time
axis a row's next observation is the next row's observation, byte for
byte, except where an episode ended; along the env axis it is not. That
decides the axis (:func:`cleanbuf.engine._orientation.time_axis`, the
filter's own detector) when the user does not; where both
or neither axis chains, or no two rows can be compared, nothing is
decided and the audit says it cannot tell.

A rectangle is then read as flat rows in time order, step after step
(row ``t * E + e``), each with its env (:func:`flatten`).
"""

from __future__ import annotations

import numpy as np

from cleanbuf.engine._errors import InputError

LAYOUTS = ("time_first", "time_last", "flat")


def check_layout(layout: str | None, envs: int | None) -> None:
    """Raises on a layout word cleanbuf does not know, or ``envs`` without ``flat``."""
    if layout is not None and layout not in LAYOUTS:
        raise InputError(
            f"layout={layout!r} is not known for stored data: pass 'time_first' ([T, E, ...] "
            "arrays: CleanRL, Stable-Baselines3), 'time_last' ([E, T, ...]: TorchRL batches), "
            "'flat' ([N, ...] rows; with envs=N, N envs' rows one env after the other), or "
            "None to decide from the data."
        )
    if envs is not None and layout != "flat":
        raise InputError(
            f"envs={envs!r} goes with layout='flat' (rows of envs one env after the other): "
            f"pass --layout flat --envs {envs} (layout='flat', envs={envs})."
        )
    if envs is not None and int(envs) < 1:
        raise InputError(f"envs={envs!r}: the number of envs must be at least 1.")


def flatten(arrays: dict, time: int) -> tuple[dict, np.ndarray, int]:
    """Rectangle arrays as flat rows, step after step, and each row's env.

    Args:
        arrays: name -> ``[A, B, ...]`` arrays.
        time: the time axis (0: ``[T, E]``, 1: ``[E, T]``).

    Returns:
        ``(rows, env, E)``: name -> ``[T * E, ...]`` arrays (row ``t * E + e``),
        ``[T * E]`` env indices, the number of envs.

    Examples:
        >>> rows, env, e = flatten({"x": np.array([[0, 1, 2], [10, 11, 12]])}, time=1)
        >>> rows["x"].tolist(), env.tolist(), e
        ([0, 10, 1, 11, 2, 12], [0, 1, 0, 1, 0, 1], 2)
    """
    out = {}
    for name, a in arrays.items():
        a = a if time == 0 else np.swapaxes(a, 0, 1)
        out[name] = np.ascontiguousarray(a).reshape(a.shape[0] * a.shape[1], *a.shape[2:])
    first = next(iter(arrays.values()))
    steps, envs = (first.shape[0], first.shape[1]) if time == 0 else first.shape[1::-1]
    return out, np.tile(np.arange(envs), steps), int(envs)


def env_after_env(arrays: dict, envs: int, where: str) -> dict:
    """Flat rows of ``envs`` envs, one env's rows after the other's, as ``[E, T]``."""
    n = len(next(iter(arrays.values())))
    if n % envs:
        raise InputError(
            f"{where}: {n} rows do not split into envs={envs} envs of equal length "
            "(--layout flat --envs N reads N blocks of rows, one env each)."
        )
    return {k: a.reshape(envs, n // envs, *a.shape[1:]) for k, a in arrays.items()}
