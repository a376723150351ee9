"""The checks a call of the cleaner must pass, and their error messages.

Each names the key, what was expected, what came, and the fix; each runs
before the cleaner commits anything.
"""

from __future__ import annotations

from cleanbuf.engine._carry import Carry
from cleanbuf.engine._errors import (
    InputError,
    LayoutError,
    ResetRowError,
    TerminalObservationLostError,
    key_name,
)
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
        raise InputError(
            f"the batch keys changed while rows are held: held rows have "
            f"{sorted(held, key=str)}, this batch has {sorted(leaves, key=str)}. Keep "
            "the keys stable, or call flush() before changing them."
        )
    for k, v in leaves.items():
        h = held[k]
        if h.dtype != v.dtype or h.shape[1:] != v.shape[batch_dims:]:
            raise InputError(
                f"key {key_name(k)} changed while rows are held: held rows have shape "
                f"{list(h.shape[1:])} and dtype {h.dtype} per row, this batch has "
                f"{list(v.shape[batch_dims:])} and {v.dtype}. Call flush() before changing it."
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
        "check_reset_rows=False. Nothing was written."
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
            "(floating observations only). Nothing was written."
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
