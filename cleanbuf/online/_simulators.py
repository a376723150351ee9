"""The end-of-episode formats of vector simulators, read on the rows' own device.

Each auto-resetting simulator returns the first observation of the new
episode for an env that ended at a step, and hands over the terminal
observation in its own way, if at all:

* ``"gymnasium"``: ``info["final_obs"]``, an object array with one entry per
  env (None where not done), and the mask ``info["_final_obs"]``
  (Gymnasium >= 1.0, ``AutoresetMode.SAME_STEP``; gym 0.26 called it
  ``"final_observation"``).
* ``"sb3"``: Stable-Baselines3's list of per-env info dicts, with
  ``"terminal_observation"`` on the envs that were done.
* ``"isaaclab"``: Isaac Lab's ``extras["final_obs"]``, the observation groups
  (``{"policy": ..., "critic": ...}``) of the whole batch before the reset,
  present on a step where an env reset if the env was built with
  ``compute_final_obs=True``; ``extras["time_outs"]`` holds the truncations.
* ``"mjlab"``: mjlab's ``extras["terminal"] = {"env_ids": ..., "observations":
  {...}}``, the observation groups of the done envs only (rows in the order of
  ``env_ids``), present on a step where an env reset if the env was built
  with ``cfg.capture_terminal_observations = True``.
* ``"maniskill"``: ManiSkill3's ``ManiSkillVectorEnv``:
  ``infos["final_observation"]`` for the whole batch and the mask
  ``infos["_final_observation"]`` (the done envs), on a step where an env
  reset.

:func:`final_entry` turns each into one entry shaped like the step's
observations and a mask that says per env whether it holds the terminal
observation. Torch tensors stay on their device: the entry is built with
torch operations there (the simulator's own tensor where it gives the whole
batch, one ``index_copy`` where it gives the done rows), and no observation
is copied to the host; only flags are read there (a check that the envs
given are done envs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from cleanbuf.engine._errors import InputError

PRODUCERS = ("gymnasium", "sb3", "isaaclab", "mjlab", "maniskill")

_GYM_KEYS = ("final_obs", "final_observation")
_INFO_KINDS = (
    "info must be Gymnasium's info dict (or Isaac Lab's extras, mjlab's extras, "
    "ManiSkill3's infos) or Stable-Baselines3's list of info dicts; "
)


def _is_tensor_tree(value: Any) -> bool:
    """A torch tensor, or a (nested) mapping whose leaves are torch tensors."""
    if isinstance(value, torch.Tensor):
        return True
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(_is_tensor_tree(v) for v in value.values())
    )


def _keys_of(info: Any) -> list:
    """The keys of ``info`` that name a final-observation format, per producer."""
    if not isinstance(info, Mapping):
        return []
    found = []
    if "terminal" in info and isinstance(info["terminal"], Mapping):
        found.append(("mjlab", "terminal"))
    for key in _GYM_KEYS:
        if key not in info or info[key] is None:
            continue
        value = info[key]
        if key == "final_obs" and _is_tensor_tree(value):
            found.append(("isaaclab", key))
        elif key == "final_observation" and _is_tensor_tree(value):
            found.append(("maniskill", key))
        else:
            found.append(("gymnasium", key))
    if "time_outs" in info and not any(p == "isaaclab" for p, _ in found):
        found.append(("isaaclab", "time_outs"))
    return found


def producer_of(info: Any, declared: str | None = None) -> str | None:
    """The producer whose end-of-episode format ``info`` holds.

    Args:
        info: a step's info (a dict, or Stable-Baselines3's list of dicts).
        declared: the producer the caller named (``producer=``), or None to
            read it from the keys present.

    Returns:
        One of :data:`PRODUCERS`, or None where ``info`` holds no format
        (a step where no env ended, from a producer not declared).

    Raises:
        InputError: ``declared`` is not known, or the keys present are
            another producer's (or two producers' at once).

    Examples:
        >>> import torch
        >>> producer_of({"time_outs": torch.zeros(2, dtype=torch.bool)})
        'isaaclab'
        >>> producer_of({"terminal": {"env_ids": torch.tensor([1]), "observations": {}}})
        'mjlab'
        >>> producer_of({"final_observation": torch.zeros(2, 3)})
        'maniskill'
        >>> producer_of({}) is None
        True
    """
    if declared is not None and declared not in PRODUCERS:
        raise InputError(f"producer={declared!r} is not known; pass one of {PRODUCERS} or None.")
    if isinstance(info, Sequence) and not isinstance(info, (str, Mapping)):
        found = [("sb3", "a list of info dicts")]
    elif isinstance(info, Mapping):
        found = _keys_of(info)
    else:
        raise InputError(_INFO_KINDS + f"got {type(info).__name__}.")
    kinds = sorted({p for p, _ in found})
    where = ", ".join(f"{k!r} ({p}'s)" for p, k in found)
    if declared is not None:
        others = [p for p in kinds if p != declared]
        if others:
            raise InputError(
                f"producer={declared!r}, but the step's info holds {where}: that is "
                f"{' and '.join(others)}'s end-of-episode format, not {declared}'s. Pass "
                f"producer={others[0]!r} (or leave producer= out to read it from the keys), "
                "or pass the info of the env that made this step."
            )
        return declared
    if len(kinds) > 1:
        raise InputError(
            f"the step's info holds {where}: the end-of-episode formats of "
            f"{' and '.join(kinds)} at once, so the terminal observations are ambiguous. "
            f"Pass producer= (one of {kinds}) to say which one the env follows."
        )
    return kinds[0] if kinds else None


def _leaves(tree: Any, path: tuple = ()):
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _leaves(v, (*path, k))
    else:
        yield path, tree


def _name(what: str, path: tuple) -> str:
    return what + "".join(f"[{k!r}]" for k in path)


def _like(template: Any, given: Any, what: str, rows: int | None):
    """``given`` checked to have ``template``'s structure, dtypes and row shapes.

    ``rows`` is the number of rows expected (None: the template's).
    """
    if isinstance(template, Mapping):
        if not isinstance(given, Mapping) or set(given) != set(template):
            have = sorted(given) if isinstance(given, Mapping) else type(given).__name__
            raise InputError(
                f"{what} holds {have}; expected the observation groups {sorted(template)} "
                "(the structure of next_obs). Pass the info of the same step, unchanged."
            )
        return {k: _like(template[k], given[k], f"{what}[{k!r}]", rows) for k in template}
    if not isinstance(given, torch.Tensor):
        raise InputError(
            f"{what} is a {type(given).__name__}; expected a torch tensor like next_obs "
            f"(dtype {template.dtype}, on {template.device}). Pass the info of the same step."
        )
    want = (template.shape[0] if rows is None else rows, *template.shape[1:])
    if tuple(given.shape) != tuple(want) or given.dtype != template.dtype:
        raise InputError(
            f"{what} has shape {list(given.shape)} and dtype {given.dtype}; expected shape "
            f"{list(want)} and dtype {template.dtype} (next_obs's rows"
            f"{'' if rows is None else ', one per env in env_ids'}). Pass the info of the "
            "same step, unchanged."
        )
    if given.device != template.device:
        raise InputError(
            f"{what} is on {given.device}, next_obs on {template.device}; pass both as the "
            "simulator gave them (on one device)."
        )
    return given


def _device_of(tree: Any) -> torch.device:
    return next(v for _, v in _leaves(tree)).device


def _flags_on(value: Any, n: int, device: torch.device, what: str) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if tuple(t.shape) not in ((n,), (n, 1)) or t.dtype != torch.bool:
        raise InputError(
            f"{what} must be one torch.bool per env, shape [{n}]; got shape {list(t.shape)} "
            f"and dtype {t.dtype}. Pass the mask the simulator's step gave, unchanged."
        )
    return t.reshape(n).to(device)


def _only_done(mask: torch.Tensor, done: torch.Tensor, what: str) -> None:
    """Raises where a final observation is given for an env that is not done (flags only)."""
    extra = mask & ~done
    if bool(extra.any()):
        rows = torch.nonzero(extra).reshape(-1)[:5].cpu().tolist()
        raise InputError(
            f"{what} gives a terminal observation for envs {rows}, which are not done at "
            "this step (terminated and truncated both False). Pass the terminated, "
            "truncated and info of the same step."
        )


def _torch_final(producer: str | None, info: Any, next_obs: Any, done: torch.Tensor, n: int):
    """The final-observation entry and mask from a simulator that gives torch tensors."""
    device = _device_of(next_obs)
    info = info if isinstance(info, Mapping) else {}
    if producer == "isaaclab" and info.get("final_obs") is not None:
        final = _like(next_obs, info["final_obs"], "info['final_obs']", None)
        return final, done
    if producer == "maniskill" and info.get("final_observation") is not None:
        final = _like(next_obs, info["final_observation"], "info['final_observation']", None)
        mask = _flags_on(
            info.get("_final_observation", done), n, device, "info['_final_observation']"
        )
        _only_done(mask, done, "info['_final_observation']")
        return final, mask
    if producer == "mjlab" and info.get("terminal") is not None:
        terminal = info["terminal"]
        if not isinstance(terminal, Mapping) or not {"env_ids", "observations"} <= set(terminal):
            have = sorted(terminal) if isinstance(terminal, Mapping) else type(terminal)
            raise InputError(
                f"info['terminal'] holds {have}; mjlab's terminal extras hold 'env_ids' "
                "and 'observations'. Pass the extras of the same step, unchanged."
            )
        ids = terminal["env_ids"]
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point():
            raise InputError(
                f"info['terminal']['env_ids'] must be a 1-D integer tensor of env indices; "
                f"got {type(ids).__name__} {list(getattr(ids, 'shape', []))}. Pass the "
                "extras of the same step, unchanged."
            )
        ids = ids.to(device)
        rows = _like(next_obs, terminal["observations"], "info['terminal']['observations']",
                     int(ids.shape[0]))  # fmt: skip
        mask = torch.zeros(n, dtype=torch.bool, device=device).index_fill_(0, ids, True)
        _only_done(mask, done, "info['terminal']['env_ids']")

        def scatter(template: Any, given: Any):
            if isinstance(template, Mapping):
                return {k: scatter(template[k], given[k]) for k in template}
            return template.index_copy(0, ids, given)  # a new tensor, on the rows' device

        return scatter(next_obs, rows), mask
    # no final observation at this step: the entry holds next_obs (no copy), masked out
    return next_obs, torch.zeros(n, dtype=torch.bool, device=device)


def final_entry(producer: str | None, info: Any, next_obs: Any, done: torch.Tensor, n: int):
    """The terminal observations of one step, as an entry shaped like ``next_obs``.

    Args:
        producer: one of :data:`PRODUCERS` (from :func:`producer_of`), or
            None where the info holds none of their formats.
        info: the step's info.
        next_obs: the observations the step returned (post-reset where an
            env was done): a tensor or array ``[n, ...]``, or a dict of them.
        done: bool ``[n]``, terminated or truncated, on next_obs's device.
        n: the number of envs.

    Returns:
        ``(final, mask)``: ``final`` shaped like ``next_obs``, holding the
        terminal observation on the rows where the bool ``mask`` ``[n]`` is
        True; on the others it holds zeros (numpy observations) or
        ``next_obs`` itself (torch observations). Torch entries stay on
        their device.

    Raises:
        InputError: the entry's groups, shapes, dtypes or device differ from
            next_obs's, or it names envs that are not done.

    Examples:
        >>> import torch
        >>> next_obs = {"actor": torch.tensor([[1.0], [2.0], [3.0]])}
        >>> rows = {"actor": torch.tensor([[9.0]])}
        >>> terminal = {"env_ids": torch.tensor([2]), "observations": rows}
        >>> final, mask = final_entry("mjlab", {"terminal": terminal}, next_obs,
        ...                           torch.tensor([False, False, True]), 3)
        >>> final["actor"].reshape(-1).tolist(), mask.tolist()
        ([1.0, 2.0, 9.0], [False, False, True])
    """
    if producer in ("gymnasium", "sb3") or not _is_tensor_tree(next_obs):
        return _host_final(info, next_obs, n)
    return _torch_final(producer, info, next_obs, done, n)


def _host_final(info: Any, next_obs: Any, n: int):
    """Gymnasium's object array or Stable-Baselines3's infos: per-env entries, on the host."""
    entries: list = [None] * n
    if isinstance(info, Mapping):
        key = next((k for k in _GYM_KEYS if k in info), None)
        if key is not None:
            if len(info[key]) != n:
                raise InputError(
                    f"info[{key!r}] has {len(info[key])} entries; expected one per env ({n}). "
                    "Pass the info dict of this step of the same vector env."
                )
            mask = np.asarray(info.get("_" + key, [x is not None for x in info[key]]), bool)
            for i in np.flatnonzero(mask):
                entries[i] = info[key][i]
    elif isinstance(info, Sequence) and not isinstance(info, str):
        check_infos(info, n)
        for i, d in enumerate(info):
            if d.get("terminal_observation") is not None:
                entries[i] = d["terminal_observation"]
    else:
        raise InputError(_INFO_KINDS + f"got {type(info).__name__}.")
    present = np.array([e is not None for e in entries], bool)
    return _fill(next_obs, entries, present, lambda e: e), torch.from_numpy(present)


def _fill(template: Any, entries: list, present: np.ndarray, pick):
    """``template``'s structure, zeros but where ``present``: ``pick(entries[i])``."""
    if isinstance(template, Mapping):
        return {
            k: _fill(v, entries, present, lambda e, k=k: pick(e)[k]) for k, v in template.items()
        }
    if isinstance(template, torch.Tensor):  # torch observations, numpy entries
        out = torch.zeros_like(template)
        for i in np.flatnonzero(present):
            out[int(i)] = torch.as_tensor(np.asarray(pick(entries[i])), device=out.device)
        return out
    out = np.zeros_like(np.asarray(template))
    for i in np.flatnonzero(present):
        out[i] = pick(entries[i])
    return out


def check_infos(info: Sequence, n: int) -> None:
    """A Stable-Baselines3 list of infos: one dict per env."""
    if len(info) != n or not all(isinstance(d, Mapping) for d in info):
        kinds = sorted({type(d).__name__ for d in info})
        raise InputError(
            f"info is a list of {len(info)} entries ({', '.join(kinds) or 'none'}); expected "
            f"one info dict per env ({n}, from terminated). Pass the infos the VecEnv's "
            "step returned at this step."
        )
