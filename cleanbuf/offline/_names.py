"""The names stored data gives its arrays, mapped to the roles the checks read.

Data on disk comes with one of a few sets of names:

* TorchRL's keys (``observation``, ``next/observation``, ``action``,
  ``next/reward``, ``next/done``, ``next/terminated``, ``next/truncated``),
  what the audit and the cleaner read;
* a CleanRL / Gymnasium loop's (``obs``, ``next_obs``, ``actions``,
  ``rewards``, ``terminations``, ``truncations``, ``dones``);
* an offline-RL (D4RL-style) dataset's (``observations``,
  ``next_observations``, ``actions``, ``rewards``, ``terminals``,
  ``timeouts``);
* a Stable-Baselines3 ``ReplayBuffer``'s (``observations``,
  ``next_observations``, ``actions``, ``rewards``, ``dones``, ``timeouts``).

The reader renames the arrays to TorchRL's keys once (:func:`roles`), and
the writer gives them their source names back, so the cleaned copy keeps
them. ``--key ROLE=NAME`` (``keys={"reward": "r"}`` in Python) names any
other array.
"""

from __future__ import annotations

from collections.abc import Mapping

from cleanbuf.engine._errors import InputError
from cleanbuf.engine._keys import may_be_observation

# role -> TorchRL key, "/"-joined as in a .npz file
ROLE_KEYS = {
    "obs": "observation",
    "next_obs": "next/observation",
    "action": "action",
    "reward": "next/reward",
    "done": "next/done",
    "terminated": "next/terminated",
    "truncated": "next/truncated",
}
NAME_SETS = {
    "torchrl": dict(ROLE_KEYS),
    "cleanrl": {
        "obs": "obs",
        "next_obs": "next_obs",
        "action": "actions",
        "reward": "rewards",
        "terminated": "terminations",
        "truncated": "truncations",
        "done": "dones",
    },
    "offline-rl": {
        "obs": "observations",
        "next_obs": "next_observations",
        "action": "actions",
        "reward": "rewards",
        "terminated": "terminals",
        "truncated": "timeouts",
    },
    "sb3": {
        "obs": "observations",
        "next_obs": "next_observations",
        "action": "actions",
        "reward": "rewards",
        "done": "dones",
        "truncated": "timeouts",
    },
}
FLAG_ROLES = ("done", "terminated", "truncated")


def parse_keys(pairs: list[str] | None) -> dict:
    """``["reward=r", ...]`` (the ``--key`` flags) as ``{"reward": "r"}``.

    Raises:
        InputError: a pair without ``=`` or a role cleanbuf does not read.

    Examples:
        >>> parse_keys(["reward=rew", "obs=state"])
        {'reward': 'rew', 'obs': 'state'}
    """
    out = {}
    for pair in pairs or []:
        role, sep, name = pair.partition("=")
        if not sep or not name:
            raise InputError(f"--key {pair!r}: expected ROLE=NAME, e.g. --key reward=rewards.")
        out[role] = name
    return check_keys(out)


def check_keys(keys: Mapping | None) -> dict:
    """The user's ``{role: name}``, checked: every role one cleanbuf reads."""
    keys = dict(keys or {})
    bad = sorted(set(keys) - set(ROLE_KEYS))
    if bad:
        raise InputError(
            f"keys: unknown role(s) {bad}; the roles are {', '.join(ROLE_KEYS)} "
            "(e.g. keys={'reward': 'rew'}, or --key reward=rew)."
        )
    return keys


def roles(names: list[str], keys: Mapping | None = None) -> tuple[str, dict]:
    """Which name set the arrays use, and the renaming to TorchRL's keys.

    Args:
        names: the arrays' names (nested keys ``"/"``-joined).
        keys: ``{role: name}`` the user gave; they win over the name set.

    Returns:
        ``(name set, {source name: TorchRL name})`` for the arrays renamed
        (the others keep their names).

    Examples:
        >>> roles(["obs", "next_obs", "actions", "rewards", "terminations", "truncations"])[1]
        {'obs': 'observation', 'next_obs': 'next/observation', 'actions': 'action', \
'rewards': 'next/reward', 'terminations': 'next/terminated', 'truncations': 'next/truncated'}
        >>> roles(["observations", "next_observations", "rewards", "terminals"])[0]
        'offline-rl'
        >>> roles(["s", "next/observation", "r", "next/done"], {"obs": "s", "reward": "r"})[1]
        {'s': 'observation', 'r': 'next/reward'}
    """
    keys = check_keys(keys)
    present = set(names)

    def score(item):
        name, table = item
        return (
            table["obs"] in present,
            sum(n in present for n in table.values()),
            name == "torchrl",
        )

    which, table = max(NAME_SETS.items(), key=score)
    if table["obs"] not in present and not keys:
        which, table = "torchrl", NAME_SETS["torchrl"]
    mapping = {table[r]: ROLE_KEYS[r] for r in table if table[r] in present and r not in keys}
    mapping.update({name: ROLE_KEYS[role] for role, name in keys.items()})
    missing = sorted(name for name in mapping if name not in present)
    if missing:
        raise InputError(
            f"keys: no array named {missing}; the arrays are {sorted(present)}. "
            "Name an existing array: --key ROLE=NAME (keys={ROLE: NAME})."
        )
    mapping = {src: dst for src, dst in mapping.items() if src != dst}
    taken = (present - set(mapping)) & set(mapping.values())
    if taken:
        raise InputError(
            f"keys: {sorted(taken)} would be both an array of the data and the name another "
            "array is read as; name the roles so that each array has one (--key ROLE=NAME)."
        )
    return which, mapping


def need(names: set, where: str, renamed: Mapping | None = None) -> None:
    """Raises unless the arrays hold every role the audit reads.

    Observations and next observations (the chains), the reward (the
    reset-row check) and a done flag (``done``, or ``terminated`` /
    ``truncated``). ``renamed`` (source name -> TorchRL key) lets the
    message list the arrays under the names the file gives them.
    """
    wanted = {}
    if not obs_pair(names):
        has_obs = ROLE_KEYS["obs"] in names
        wanted = {r: ROLE_KEYS[r] for r in (("next_obs",) if has_obs else ("obs", "next_obs"))}
    if ROLE_KEYS["reward"] not in names:
        wanted["reward"] = ROLE_KEYS["reward"]
    if not any(ROLE_KEYS[r] in names for r in FLAG_ROLES):
        wanted["done"] = ROLE_KEYS["done"]
    if wanted:
        source = {v: k for k, v in (renamed or {}).items()}
        found = ", ".join(sorted(source.get(n, n) for n in names))
        raise InputError(
            f"{where}: found no array for the role(s) "
            + ", ".join(f"{r} {tuple(k.split('/'))}" for r, k in wanted.items())
            + " (the audit reads "
            f"each row's observation, next observation, reward and done flag; the reward "
            f"tells a reset row). The arrays are: {found}. Name them: "
            + " ".join(f"--key {role}=NAME" for role in wanted)
            + " (keys={ROLE: NAME} in Python)."
        )


def obs_pair(names) -> tuple[str, str] | None:
    """The observation array and its next one (``k``, ``next/k``); None if none.

    ``observation`` first, else the first name stored with its ``next/`` twin.

    Examples:
        >>> obs_pair(["pixels", "next/pixels", "next/reward"])
        ('pixels', 'next/pixels')
    """
    names = list(names)
    present = set(names)
    for k in ["observation", *names]:
        if may_be_observation(tuple(k.split("/"))) and f"next/{k}" in present:
            return k, f"next/{k}"
    return None
