"""Oracle tests of the Minari export: the episodes loaded are the explicit-reset run's.

Each test runs a real producer (a Gymnasium vector-env loop in next-step or
same-step mode, TorchRL's ``GymEnv(num_envs=N)`` through a Collector),
exports its data with :func:`cleanbuf.to_minari` (or ``cleanbuf export``),
loads the dataset with ``minari.load_dataset`` and compares every episode
with the same env's episode of the run with explicit resets (Gymnasium
``AutoresetMode.DISABLED``, same seeds, same deterministic policy):
observations including the final one, actions, rewards, terminations and
truncations. An exported episode is either equal to its oracle episode,
flags included, or, when it did not end in the data (the last one of each
env) or lost its final observation, the oracle episode's first steps,
truncated at its end.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import gymnasium as gym
import numpy as np
import pytest
import torch

import cleanbuf
from cleanbuf import InputError, TerminalObservationLostError
from tests.loops import ENVS, run_loop

minari = pytest.importorskip("minari")

NEXT_STEP, SAME_STEP = gym.vector.AutoresetMode.NEXT_STEP, gym.vector.AutoresetMode.SAME_STEP
DISABLED = gym.vector.AutoresetMode.DISABLED
E, STEPS = 3, 80


@pytest.fixture(autouse=True)
def minari_root(tmp_path, monkeypatch):
    """Every dataset goes to a temporary Minari root."""
    root = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    return root


def _np(x):
    if hasattr(x, "keys"):  # a TensorDict of observations: a dict, as Minari gives it back
        return {k: _np(x.get(k)) for k in x.keys()}
    return x.numpy()


def _cat(a, b):
    if isinstance(a, dict):
        return {k: _cat(a[k], b[k]) for k in a}
    return np.concatenate([a, b])


def _head(x, n):
    return {k: _head(v, n) for k, v in x.items()} if isinstance(x, dict) else x[:n]


def _same(a, b) -> bool:
    if isinstance(a, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    return a.shape == b.shape and np.array_equal(a, b)


def oracle_episodes(stream) -> list[dict]:
    """One env's explicit-reset rows ``[L]`` as episodes (the last one may be unfinished)."""
    end = (stream["next", "terminated"] | stream["next", "truncated"]).reshape(-1).numpy()
    out, start = [], 0
    for i in range(len(end)):
        if end[i] or i == len(end) - 1:
            rows = stream[start : i + 1]
            out.append(
                {
                    "obs": _cat(_np(rows["observation"]), _np(rows["next", "observation"][-1:])),
                    "action": rows["action"].numpy(),
                    "reward": rows["next", "reward"].reshape(-1).numpy(),
                    "terminated": rows["next", "terminated"].reshape(-1).numpy(),
                    "truncated": rows["next", "truncated"].reshape(-1).numpy(),
                    "ended": bool(end[i]),
                }
            )
            start = i + 1
    return out


def compare_with_oracle(dataset_id, export, oracle: dict, action_index) -> tuple[int, int]:
    """Every loaded episode against its env's oracle episode; (exact, truncated prefixes).

    ``oracle``: per env, its episodes; ``action_index``: the oracle's
    actions as the dataset's action space holds them.
    """
    data = minari.load_dataset(dataset_id)
    assert data.total_episodes == export.episodes == len(export.episode_envs)
    assert data.total_steps == export.steps
    seen, exact, prefix = defaultdict(int), 0, 0
    for ep, env in zip(data.iterate_episodes(), export.episode_envs):
        want = oracle[env][seen[env]]
        seen[env] += 1
        t = len(ep.rewards)
        assert 0 < t <= len(want["reward"]), (env, seen[env], t)
        assert len(ep.actions) == len(ep.terminations) == len(ep.truncations) == t
        assert _same(ep.observations, _head(want["obs"], t + 1)), (env, seen[env])
        assert np.array_equal(ep.actions, action_index(want["action"][:t])), (env, seen[env])
        assert np.array_equal(ep.rewards, want["reward"][:t]), (env, seen[env])
        if t == len(want["reward"]) and want["ended"]:
            assert np.array_equal(ep.terminations, want["terminated"]), (env, seen[env])
            assert np.array_equal(ep.truncations, want["truncated"]), (env, seen[env])
            exact += 1
        else:  # not ended in the data, or its final observation lost: a truncated prefix
            assert not ep.terminations.any(), (env, seen[env])
            assert ep.truncations.tolist() == [False] * (t - 1) + [True], (env, seen[env])
            prefix += 1
    return exact, prefix


def _column(x):
    return x.reshape(len(x), -1)[:, 0]


def _one_hot_index(x):
    return x.argmax(-1)


def _raw(name, kwargs, policy, mode, with_info=True, n_envs=E, steps=STEPS):
    """A raw Gymnasium loop's rows, ``[T, E]``."""
    venv, rows = run_loop(name, kwargs, policy, n_envs, steps, mode, with_info=with_info)
    venv.close()
    return torch.stack(rows, 0)


def _raw_oracle(name, kwargs, policy, n_envs=E, steps=STEPS) -> dict:
    rows = _raw(name, kwargs, policy, DISABLED, n_envs=n_envs, steps=steps)
    return {e: oracle_episodes(rows[:, e]) for e in range(n_envs)}


def _check_counts(export):
    """The report's identities: every cleaned row exported or counted as left out."""
    assert export.rows == export.steps + export.steps_left_out
    assert export.rows == export.stats["rows_out"]
    kinds = export.terminated + export.truncated + export.unfinished + export.lost_shortened
    assert kinds == export.episodes
    assert export.restarts == 0  # no env restarts in these runs: nothing cut mid-episode


def test_next_step_loop_exports_the_explicit_reset_episodes():
    """A Gymnasium next-step loop's rows (``[T, E]``), exported with the env
    recorded. Bugs caught: the bogus reset transition exported as a step
    (rows shift against the oracle), an episode cut at the wrong row or two
    episodes run together, the final observation taken from the next
    episode's first row, an env's rows mixed with another's, a flag moved
    off its step, the last unfinished episode exported as ended (or lost),
    and a dataset whose env cannot be recovered.
    """
    name, kwargs, policy = ENVS["CartPole-terminates"]
    oracle = _raw_oracle(name, kwargs, policy)
    rows = _raw(name, kwargs, policy, NEXT_STEP)
    export = cleanbuf.to_minari(rows, "cartpole/next-step-v0", env="CartPole-v1", author="tests")
    print(export)
    _check_counts(export)
    assert export.stats["reset_rows_dropped"] > 0 and export.lost_shortened == 0
    exact, prefix = compare_with_oracle("cartpole/next-step-v0", export, oracle, _column)
    assert exact == export.terminated + export.truncated > E
    assert prefix == export.unfinished == E  # one unfinished episode per env, at the end
    data = minari.load_dataset("cartpole/next-step-v0")
    assert data.recover_environment().spec.id == "CartPole-v1"
    assert data.storage.metadata["author"] == {"tests"}
    # The same steps extended into a replay buffer one step at a time (flat rows, envs
    # interleaved): the envs are recovered from the data, and the episodes are the same.
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyTensorStorage(10_000))
    for step in rows:
        rb.extend(step)
    from_rb = cleanbuf.to_minari(rb, "cartpole/from-rb-v0", env="CartPole-v1")
    assert from_rb.episode_envs == export.episode_envs
    assert compare_with_oracle("cartpole/from-rb-v0", from_rb, oracle, _column) == (exact, prefix)
    left_out = cleanbuf.to_minari(rows, "cartpole/ended-only-v0", unfinished="drop")
    assert left_out.unfinished_dropped == E and left_out.unfinished == 0
    assert left_out.episodes == export.episodes - E
    # No env recorded: the spaces are read from the data ([1] integer actions, as stored).
    assert compare_with_oracle("cartpole/ended-only-v0", left_out, oracle, lambda a: a) == (
        exact,
        0,
    )


def test_same_step_loop_with_and_without_final_observations():
    """A Gymnasium same-step loop: with the info's ``final_obs`` every ended
    episode is exported whole; without it (a producer that never stored
    the final observation) none is exported as complete. Bugs caught: the
    reset observation exported as an episode's final one, the info entry
    ignored, and a lost final observation exported as if it were there
    (NaN or the next episode's first observation) or not counted.
    """
    name, kwargs, policy = ENVS["CartPole-terminates"]
    oracle = _raw_oracle(name, kwargs, policy)
    kept = cleanbuf.to_minari(
        _raw(name, kwargs, policy, SAME_STEP), "cartpole/same-step-v0", env="CartPole-v1"
    )
    _check_counts(kept)
    exact, prefix = compare_with_oracle("cartpole/same-step-v0", kept, oracle, _column)
    assert exact == kept.terminated > E and prefix == kept.unfinished == E
    lost = cleanbuf.to_minari(
        _raw(name, kwargs, policy, SAME_STEP, with_info=False),
        "cartpole/same-step-lost-v0",
        env="CartPole-v1",
    )
    print(lost)
    _check_counts(lost)
    assert lost.terminated == 0 and lost.lost_shortened == kept.terminated
    assert lost.lost_shortened == lost.stats["terminal_obs_missing"]
    exact, prefix = compare_with_oracle("cartpole/same-step-lost-v0", lost, oracle, _column)
    assert exact == 0 and prefix == lost.episodes == lost.lost_shortened + E


def _split_obs():
    """CartPole with a Dict observation: ``pos`` (x, angle) and ``vel`` (their speeds)."""
    box = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
    env = gym.make("CartPole-v1")
    return gym.wrappers.TransformObservation(
        env, lambda o: {"pos": o[[0, 2]], "vel": o[[1, 3]]}, gym.spaces.Dict(pos=box, vel=box)
    )


def _int_obs():
    """CartPole with integer observations (thousandths), as a discretised state would be."""
    box = gym.spaces.Box(-(2**20), 2**20, (4,), np.int32)
    env = gym.make("CartPole-v1")
    return gym.wrappers.TransformObservation(
        env, lambda o: np.round(o * 1000).astype(np.int32), box
    )


def _wrapped_loop(make, mode, as_rows=False, with_info=True):
    """A sync vector env of ``make``, pushing left; explicit resets when DISABLED.

    Returns the rows per step, or (DISABLED) the oracle's episodes per env.
    """
    venv = gym.vector.SyncVectorEnv([make] * E, autoreset_mode=mode)
    obs, _ = venv.reset(seed=0)
    rows = []
    for _ in range(STEPS):
        action = np.zeros(E, np.int64)
        next_obs, reward, terminated, truncated, info = venv.step(action)
        info = info if with_info else None
        rows.append(cleanbuf.step_rows(obs, action, next_obs, reward, terminated, truncated, info))
        obs, done = next_obs, terminated | truncated
        if mode == DISABLED and done.any():
            reset_obs, _ = venv.reset(options={"reset_mask": done})
            if isinstance(obs, dict):
                obs = {k: np.where(done[:, None], reset_obs[k], next_obs[k]) for k in obs}
            else:
                obs = np.where(done[:, None], reset_obs, next_obs)
    venv.close()
    if as_rows:
        return rows
    stacked = torch.stack(rows, 0)
    return {e: oracle_episodes(stacked[:, e]) for e in range(E)}


def test_dict_observations_become_a_dict_space():
    """Dict observations (a wrapper splits CartPole's into two entries),
    exported without an env: the spaces are read from the data. Bugs
    caught: a dict observation flattened or one entry dropped, the final
    observation restored in one entry but not the other, a space that does
    not hold the data.
    """
    oracle = _wrapped_loop(_split_obs, DISABLED)
    rows = torch.stack(_wrapped_loop(_split_obs, NEXT_STEP, as_rows=True), 0)
    export = cleanbuf.to_minari(rows, "cartpole/dict-v0")
    _check_counts(export)
    space = minari.load_dataset("cartpole/dict-v0").observation_space
    assert isinstance(space, gym.spaces.Dict) and set(space.spaces) == {"pos", "vel"}
    exact, prefix = compare_with_oracle("cartpole/dict-v0", export, oracle, lambda a: a)
    assert exact == export.terminated > E and prefix == E


def test_integer_observations_lost_by_a_same_step_producer():
    """Integer observations from a same-step loop that never stored the
    final observations: no NaN can mark a lost integer, yet every lost one
    must be found. Bugs caught: an integer episode exported whole with the
    reset observation as its final one, the export refusing integer data
    (or failing on an integer entry it does not export), the observations
    stored as floats.
    """
    oracle = _wrapped_loop(_int_obs, DISABLED)
    rows = torch.stack(_wrapped_loop(_int_obs, SAME_STEP, as_rows=True, with_info=False), 0)
    # Another observation entry beside it (uint8 pixels, as a TorchRL env renders): not
    # exported, and no reason to fail.
    rows.set("pixels", (rows["observation"] % 251).to(torch.uint8))
    rows.set(("next", "pixels"), (rows["next", "observation"] % 251).to(torch.uint8))
    export = cleanbuf.to_minari(rows, "cartpole/int-v0")
    print(export)
    _check_counts(export)
    assert export.lost_shortened == export.stats["terminal_obs_missing"] > E
    assert export.terminated == 0
    data = minari.load_dataset("cartpole/int-v0")
    assert data.observation_space.dtype == np.int32 and data[0].observations.dtype == np.int32
    exact, prefix = compare_with_oracle("cartpole/int-v0", export, oracle, lambda a: a)
    assert exact == 0 and prefix == export.episodes


def test_command_line_export_of_an_npz_file(tmp_path, capsys):
    """``cleanbuf export`` on a ``.npz`` of CleanRL-named ``[T, E]`` arrays.
    Bugs caught: the source's names not mapped to roles, the metadata
    options not reaching the dataset, an existing id replaced without
    ``--force``, a non-zero exit status on success.
    """
    from cleanbuf.check.cli import main

    name, kwargs, policy = ENVS["CartPole-terminates"]
    oracle = _raw_oracle(name, kwargs, policy)
    rows = _raw(name, kwargs, policy, NEXT_STEP, with_info=False)
    src = tmp_path / "rollout.npz"
    np.savez(
        src,
        obs=rows["observation"].numpy(),
        next_obs=rows["next", "observation"].numpy(),
        actions=rows["action"].numpy(),
        rewards=rows["next", "reward"].numpy(),
        terminations=rows["next", "terminated"].numpy(),
        truncations=rows["next", "truncated"].numpy(),
    )
    args = [str(src), "cartpole/cli-v0", "--env", "CartPole-v1", "--author", "A. Person"]
    args += ["--algorithm-name", "push-left", "--code-permalink", "https://example.org/x"]
    assert main(["export", *args]) == 0
    printed = capsys.readouterr().out
    print(printed)
    assert "Minari dataset cartpole/cli-v0" in printed and "metadata missing" in printed
    data = minari.load_dataset("cartpole/cli-v0")
    assert data.storage.metadata["algorithm_name"] == "push-left"
    assert data.storage.metadata["code_permalink"] == "https://example.org/x"
    export = cleanbuf.to_minari(str(src), "cartpole/api-v0", env="CartPole-v1")
    assert compare_with_oracle("cartpole/cli-v0", export, oracle, _column)[0] > E
    assert main(["export", *args]) == 2
    assert "exists already" in capsys.readouterr().err
    assert main(["export", *args, "--force"]) == 0


def test_missing_extra_names_it(monkeypatch, tmp_path, capsys):
    """Without minari installed, the export says which extra installs it,
    in Python and on the command line. Bug caught: a bare
    ``ModuleNotFoundError`` from deep inside, or a traceback on the
    command line.
    """
    from cleanbuf.check.cli import main

    monkeypatch.setitem(sys.modules, "minari", None)  # import minari now raises ImportError
    with pytest.raises(InputError, match=r"pip install 'cleanbuf\[minari\]'"):
        cleanbuf.to_minari({"obs": np.zeros(3)}, "x/y-v0")
    assert main(["export", str(tmp_path / "any.npz"), "x/y-v0"]) == 2
    assert "pip install 'cleanbuf[minari]'" in capsys.readouterr().err


def test_bad_options_and_data_that_does_not_fit_the_env():
    """Bugs caught: a misspelt choice accepted, a malformed dataset id
    failing after the work (or writing half a dataset), actions of one env
    stored under another env's space, and a failed write leaving a
    half-written dataset behind.
    """
    name, kwargs, policy = ENVS["Pendulum-truncates"]
    rows = _raw(name, kwargs, policy, NEXT_STEP, steps=20)
    with pytest.raises(InputError, match="lost_final='cut'"):
        cleanbuf.to_minari(rows, "pendulum/x-v0", lost_final="cut")
    for bad in ("pendulum/x-vv", "pendulum/x", "p/x-v0"):
        with pytest.raises(InputError, match="not a Minari id"):
            cleanbuf.to_minari(rows, bad)
    with pytest.raises(InputError, match=r"observation has shape \[3\] .* holds \[4\]"):
        cleanbuf.to_minari(rows, "pendulum/x-v0", env="CartPole-v1")
    assert "pendulum/x-v0" not in minari.list_local_datasets()
    # Minari fails after creating the dataset's folder (a space it cannot store): no
    # half-written dataset is left to be loaded (or to block the id).
    unsupported = gym.spaces.Sequence(gym.spaces.Discrete(2))
    with pytest.raises(NotImplementedError):
        cleanbuf.to_minari(rows, "pendulum/x-v0", action_space=unsupported)
    assert not minari.storage.get_dataset_path("pendulum/x-v0").exists()
    assert cleanbuf.to_minari(rows, "pendulum/x-v0").episodes > 0
    with pytest.raises(InputError, match="max_episode_steps is for the env recorded"):
        cleanbuf.to_minari(rows, "pendulum/y-v0", max_episode_steps=6)


# --- TorchRL GymEnv(num_envs): sub-env processes, so slow -----------------------------


def _push_left(td):
    action = torch.zeros(*td.batch_size, 2)
    action[..., 0] = 1.0
    td.set("action", action)
    return td


def _pendulum(td):
    td.set("action", (-2.0 * td["observation"][..., 2:3]).clamp(-2.0, 2.0))
    return td


def _torchrl(name, n_envs, frames, policy, max_episode_steps=None):
    """``GymEnv(name, num_envs)`` collected, and the explicit-reset run: ``[E, L]`` each."""
    from tests.oracle import collect, make_env

    out = []
    for disabled in (False, True):
        env = make_env(name, n_envs, max_episode_steps, disabled=disabled)
        out.append(torch.cat(collect(env, 4 * n_envs * 8, frames, policy=policy), 1))
        env.close()
    rows, oracle = out
    return rows, {e: oracle_episodes(oracle[e]) for e in range(n_envs)}


@pytest.mark.slow  # GymEnv(num_envs) starts sub-env processes
def test_torchrl_gymenv_collection():
    """TorchRL's ``GymEnv(num_envs=2)`` through a Collector (``[E, T]``
    batches, one-hot actions, zero-filled terminal observations, joint
    resets when both envs end together). Bugs caught: the zero-filled
    next observation exported as a final one, a joint reset's lost
    observation exported as complete, one-hot actions not stored as the
    env's Discrete indices, the collector's trajectory bookkeeping
    mistaken for an env.
    """
    rows, oracle = _torchrl("CartPole-v1", 2, 2 * 32 * 8, _push_left)
    export = cleanbuf.to_minari(rows, "cartpole/torchrl-v0", env="CartPole-v1")
    print(export)
    _check_counts(export)
    stats = export.stats
    assert stats["next_obs_restitched"] > 0 and stats["terminal_obs_missing"] > 0
    assert export.lost_shortened + export.lost_dropped == stats["terminal_obs_missing"]
    exact, prefix = compare_with_oracle("cartpole/torchrl-v0", export, oracle, _one_hot_index)
    assert exact == export.terminated > 2
    assert prefix == export.unfinished + export.lost_shortened


@pytest.mark.slow  # GymEnv(num_envs) starts sub-env processes
def test_fixed_horizon_joint_resets_are_never_exported_as_complete():
    """Pendulum with a 6-step time limit under ``GymEnv(num_envs=3)``:
    every env truncates on the same step, TorchRL resets them jointly and
    every final observation is lost for good. Bugs caught: an episode
    exported with 6 steps and a zero (or NaN, or reset) final observation,
    a lost episode not counted, the ``drop`` and ``raise`` choices not
    honoured.
    """
    rows, oracle = _torchrl("Pendulum-v1", 3, 3 * 32 * 2, _pendulum, max_episode_steps=6)
    export = cleanbuf.to_minari(rows, "pendulum/joint-v0", env="Pendulum-v1", max_episode_steps=6)
    print(export)
    _check_counts(export)
    lost = export.stats["terminal_obs_missing"]
    assert export.audit.joint_reset and lost >= 3 * 8
    assert export.lost_shortened == lost and export.truncated == export.terminated == 0
    exact, prefix = compare_with_oracle("pendulum/joint-v0", export, oracle, lambda a: a)
    assert exact == 0 and prefix == export.episodes == lost + export.unfinished
    data = minari.load_dataset("pendulum/joint-v0")
    lengths = [len(ep.rewards) for ep in data.iterate_episodes()]
    assert max(lengths) == 5  # never the 6 steps of a complete episode
    assert data.recover_environment().spec.max_episode_steps == 6
    dropped = cleanbuf.to_minari(rows, "pendulum/joint-drop-v0", lost_final="drop")
    assert dropped.lost_dropped == lost and dropped.episodes == dropped.unfinished == 3
    with pytest.raises(TerminalObservationLostError, match="lost_final='shorten'"):
        cleanbuf.to_minari(rows, "pendulum/joint-raise-v0", lost_final="raise")


def test_env_restarts_end_episodes_unfinished():
    """A TorchRL Collector with ``reset_at_each_iter=True`` restarts every
    env at each batch, mid-episode, with no episode end in the data (here
    over Gymnasium's explicit-reset vector env: the data is clean). Bugs
    caught: the episode before a restart run together with the one after
    it (an observation chain broken inside an exported episode), or
    exported as ended, and restarts not counted.
    """
    from torchrl.collectors import Collector

    from tests.oracle import make_env, push_left_policy

    env = make_env("CartPole-v1", 2, disabled=True)
    collector = Collector(
        env, push_left_policy, frames_per_batch=2 * 24, total_frames=2 * 24 * 4,
        reset_at_each_iter=True,
    )  # fmt: skip
    batches = [b.clone() for b in collector]
    collector.shutdown()
    rows = torch.cat(batches, 1)
    ends_at_batch_end = sum(int(b["next", "done"][e, -1]) for b in batches[:-1] for e in range(2))
    export = cleanbuf.to_minari(rows, "cartpole/restarts-v0", env="CartPole-v1")
    print(export)
    assert export.audit.clean
    assert export.restarts == 2 * (len(batches) - 1) - ends_at_batch_end > 0
    assert export.unfinished == export.restarts + 2
    assert export.terminated == int(rows["next", "done"].sum())
    assert export.rows == export.steps
    ended_only = cleanbuf.to_minari(rows, "cartpole/restarts-ended-v0", unfinished="drop")
    assert ended_only.episodes == export.terminated
    assert ended_only.unfinished_dropped == export.unfinished


def test_a_wrapped_buffer_leaves_out_the_episodes_it_cut():
    """A next-step loop's steps extended into a buffer that wrapped: each
    env's oldest kept rows are the middle of an episode whose start was
    overwritten. Bug caught: those episodes exported as if they began
    there (a Minari episode starting mid-way, its first observation no
    reset observation), and counted as ended episodes; every other episode
    must equal its explicit-reset episode from its first step.
    """
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    name, kwargs, policy = ENVS["CartPole-terminates"]
    oracle = _raw_oracle(name, kwargs, policy)
    rb = ReplayBuffer(storage=LazyTensorStorage(E * (STEPS // 2)))
    for step in _raw(name, kwargs, policy, NEXT_STEP):
        rb.extend(step)
    export = cleanbuf.to_minari(rb, "cartpole/wrapped-v0")
    print(export)
    _check_counts(export)
    assert export.audit.wrapped and export.started_before == E
    data = minari.load_dataset("cartpole/wrapped-v0")
    first = {}
    for ep, env in zip(data.iterate_episodes(), export.episode_envs):
        first.setdefault(env, ep.observations[0])
    shifted = {}
    for env, obs in first.items():  # each env's oracle from its first exported episode on
        starts = [k for k, want in enumerate(oracle[env]) if np.array_equal(want["obs"][0], obs)]
        assert starts, f"env {env}: the first exported episode starts at no episode's start"
        shifted[env] = oracle[env][starts[0] :]
    exact, prefix = compare_with_oracle("cartpole/wrapped-v0", export, shifted, lambda a: a)
    assert exact > E and prefix == E  # one unfinished episode per env, at the end
