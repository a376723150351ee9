"""The checks a call of the cleaner must pass, and their error messages.

Each names the key, what was expected, what came, and the fix; each runs
before the cleaner commits anything.
"""

from __future__ import annotations

from typing import Any

import torch

from cleanbuf.engine._carry import Carry
from cleanbuf.engine._errors import (
    InputError,
    LayoutError,
    ResetRowError,
    TerminalObservationLostError,
    key_name,
)
from cleanbuf.engine._keys import observation_keys
from cleanbuf.engine._layout import CallLayout
from cleanbuf.engine._options import Options


def same_streams(carry: Carry, layout: CallLayout) -> None:
    """Raises unless a call's streams are those of the calls before it."""
    if carry.layout_kind is None or layout.kind == "stream_key":
        return
    if layout.kind != carry.layout_kind or layout.stream_shape != carry.stream_shape:
        raise LayoutError(
            f"the streams changed between calls: earlier calls had {carry.layout_kind} "
            f"streams of shape {list(carry.stream_shape)}, this call has {layout.kind} "
            f"streams of shape {list(layout.stream_shape)}. Each stream must stay "
            "the same env across calls. Call flush() and use a new filter for a new "
            "env set, or use stream_key= if envs come and go."
        )


def same_schema_as_held(held: dict, leaves: dict, batch_dims: int) -> None:
    """Raises unless a batch's leaves match the held rows (while rows are held)."""
    if set(held) != set(leaves):
        gone = ", ".join(key_name(k) for k in sorted(set(held) - set(leaves), key=str))
        new = ", ".join(key_name(k) for k in sorted(set(leaves) - set(held), key=str))
        raise InputError(
            f"the batch keys changed between calls while rows are held: expected the held "
            f"rows' keys, got a batch without [{gone}] and with new [{new}]. Keep the keys "
            "stable (every batch of a producer has the same keys), or call flush(rb) before "
            "changing them. Nothing was written."
        )
    for k, v in leaves.items():
        h = held[k]
        if h.dtype != v.dtype or h.shape[1:] != v.shape[batch_dims:]:
            what = "dtype" if h.dtype != v.dtype else "feature shape"
            cast = f"data.set({key_name(k)}, data.get({key_name(k)}).to({h.dtype}))"
            raise InputError(
                f"key {key_name(k)} changed its {what} between calls while rows are held: "
                f"expected shape {list(h.shape[1:])} and dtype {h.dtype} per row (as the held "
                f"rows), got {list(v.shape[batch_dims:])} and {v.dtype}. Keep it stable "
                f"(cast before the filter: {cast}), "
                "or call flush(rb) before changing it. Nothing was written."
            )


def same_observations(before: dict, now: dict) -> None:
    """Raises unless the observation keys kept their dtype and feature shape.

    Args:
        before: key -> (dtype, feature shape) of the calls before.
        now: the same for this call.

    Raises:
        InputError: a key present in both changed (a new or a dropped key is
            left to the continuity check).
    """
    for k, (dtype, shape) in before.items():
        if k not in now or now[k] == (dtype, shape):
            continue
        new_dtype, new_shape = now[k]
        what = "dtype" if dtype != new_dtype else "feature shape"
        cast = f"data.set({key_name(k)}, data.get({key_name(k)}).to({dtype}))"
        raise InputError(
            f"observation key {key_name(k)} changed its {what} between calls: expected dtype "
            f"{dtype} and feature shape {list(shape)} (as the calls before), got {new_dtype} "
            f"and {list(new_shape)}. This is no other producer: a stream's observations keep "
            f"their kind from step to step. Cast before the filter ({cast}, and its "
            "('next', ...) twin), or flush(rb) and use a new filter for data of another kind. "
            "Nothing was written."
        )


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
        raise TerminalObservationLostError(
            f"{n_lost} next observation(s) are lost (the producer reset every env of "
            "a reset group at once, the final observation is absent, or the row after "
            f"never arrived) and {why}. Choose on_lost_terminal_obs='drop' (do not "
            "store those rows), 'keep' (store them as the producer left them) or 'nan' "
            "(floating observations only); at the end of collection it can be given to the "
            "flush alone: filt.flush(rb, on_lost_terminal_obs='keep'). Nothing was written."
        )
    if policy == "nan" and ints:
        raise InputError(
            f"on_lost_terminal_obs='nan' cannot mark observation keys "
            f"{', '.join(f'{key_name(k)} ({leaves[k].dtype})' for k in ints)}. Choose "
            "'drop' or 'keep'."
        )
    return policy or "nan"


def same_options(saved: dict | None, options: Options) -> None:
    """Raises unless a state was saved by a cleaner with ``options``.

    ``saved`` is None for an older state that did not record them.
    """
    if saved is None:
        return
    diff = [
        f"{k}={saved.get(k)!r} (this filter: {v!r})"
        for k, v in options.as_dict().items()
        if saved.get(k) != v
    ]
    if diff:
        raise InputError(
            f"this state was saved by a filter with other options: {', '.join(diff)}. "
            "Build the filter with the options it was saved with (or the same "
            "for_env producer) before loading it."
        )


def reset_groups(group: int, n_streams: int, stream_shape: tuple) -> None:
    """Raises unless reset groups of ``group`` streams tile the streams."""
    if n_streams % group:
        raise LayoutError(
            f"reset_group_size={group} does not divide the {n_streams} streams of "
            f"shape {list(stream_shape)}; it must be the number of envs that "
            "reset together (the envs of one TorchRL GymEnv / worker)."
        )


def looks_time_first(td: Any, options: Options) -> bool:
    """Whether a ``[A, B]`` batch read as ``[E, T]`` looks time-first ``[T, E]``.

    Within a stream, a row's next observation is the next row's
    observation except at episode ends. Read along the last axis (time
    last, as TorchRL collectors give batches) that chain should hold; when
    it holds along the first axis instead, the batch is most likely
    ``[T, E]`` (CleanRL, Stable-Baselines3, a rollout stacked step by
    step). Only looked at on the way to an error, or on a repair's first
    batch. Never raises: a batch too odd to tell is not time-first here
    (the cleaner's own check says what is wrong with it).

    Examples:
        >>> from tensordict import TensorDict
        >>> obs = torch.arange(8.0).reshape(4, 2, 1)  # [T=4, E=2]: obs[t + 1] follows obs[t]
        >>> td = TensorDict({"obs": obs, ("next", "obs"): obs + 2}, batch_size=[4, 2])
        >>> looks_time_first(td, Options()), looks_time_first(td.transpose(0, 1), Options())
        (True, False)
    """
    if getattr(td, "batch_dims", 0) != 2 or min(td.batch_size) < 2:
        return False
    try:
        leaves = dict(td.items(include_nested=True, leaves_only=True))
        leaves = {k if isinstance(k, tuple) else (k,): v for k, v in leaves.items()}
        bookkeeping = {k for k in (options.is_init_key, options.step_count_key) if k}
        keys, obs_only = observation_keys(leaves, options.observation_keys, bookkeeping)
        obs, nxt = leaves.get(keys[0]), leaves.get(("next", *keys[0]))
        if obs_only or obs is None or nxt is None or obs.shape != nxt.shape or obs.is_meta:
            return False
        obs, nxt = obs.detach().cpu(), nxt.detach().cpu()

        def chain(a: torch.Tensor, b: torch.Tensor) -> float:
            same = (a == b).reshape(a.shape[0], a.shape[1], -1).all(-1)
            return float(same.float().mean())

        along_time, along_envs = chain(nxt[:, :-1], obs[:, 1:]), chain(nxt[:-1], obs[1:])
    except Exception:  # noqa: BLE001 - too odd to tell
        return False
    return along_envs >= 0.5 and along_envs > along_time


def time_first_hint(td: Any, options: Options) -> str:
    """The filter's sentence for a batch of inferred layout that looks ``[T, E]``, or "".

    See :func:`looks_time_first`.
    """
    if options.layout is not None or not looks_time_first(td, options):
        return ""
    a, b = td.batch_size
    return (
        f"This batch looks time-first [T, E]: its rows continue along the first axis "
        f"(size {a}), not the last (size {b}), and the filter reads batches as [E, T] "
        "(time last, as TorchRL collectors give them). Transpose it first "
        "(batch.transpose(0, 1)), or store it as flat rows with layout='stream_key'. "
        "If the batch is [E, T] after all:"
    )
