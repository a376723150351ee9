"""``cleanbuf check``: every number of its table, its verdicts and its exit codes.

The numbers are checked against counts made here from the producers' raw
rows and cleaned rows (recorded through the ``clean=`` seam, which runs the
real filter), without the check's own alignment with the truth. The
cleaned rows are also compared with a second explicit-reset run that the
check does not build: the raw rows of TorchRL's ``SerialEnv`` of single
envs, which resets explicitly.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import cleanbuf
from cleanbuf import AutoresetFilter
from cleanbuf.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
IN_PROCESS = ["gym-next-step", "gym-same-step", "torchrl-gymenv", "torchrl-serial", "sb3-dummy"]
WITH_ENVPOOL = [*IN_PROCESS, "envpool"]


class Recorder:
    """A ``clean=`` hook: the filter, as the check runs it, recording raw and cleaned rows."""

    def __init__(self):
        self.raw, self.cleaned = [], []

    def __call__(self, batches, env):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", cleanbuf.CleanbufWarning)
            filt = AutoresetFilter.for_env(env)
            parts = [filt(b) for b in batches] + [filt.flush()]
        rows = torch.cat([p for p in parts if p is not None and p.batch_size[0]])
        step = batches[0].batch_dims == 1
        self.raw.append(torch.stack(batches, 1) if step else torch.cat(batches, 1))
        self.cleaned.append(rows)
        return rows


def _obs(td, key):
    return td[key].reshape(*td.batch_size, -1).to(torch.float64)


def _counts(raw, cleaned, producer, reset_reward=0.0):
    """The table's numbers, counted from the rows alone.

    Reset rows are the rows with the reward a reset step gives (0; the
    envs used here never pay exactly 0 on a real step).
    """
    n_envs, steps = raw.batch_size
    reward = raw["next", "reward"].reshape(n_envs, steps)
    reset = reward == reset_reward
    done = raw["next", "done"].reshape(n_envs, steps)
    nxt = _obs(raw, ("next", "observation"))
    zero = done & (nxt == 0).all(-1)
    nan = done & torch.isnan(nxt).any(-1)
    wrong_final = torch.zeros_like(done)
    if ("next", "_final_obs") in raw.keys(True, True):
        has = raw["next", "_final_obs"].reshape(n_envs, steps)
        final = _obs(raw, ("next", "final_obs"))
        wrong_final = done & has & ~(final == nxt).all(-1)
    trunc_as_term = torch.zeros_like(done)
    if producer == "sb3-dummy":  # SB3's dones hold its truncations
        trunc_as_term = raw["next", "truncated"].reshape(n_envs, steps)
    wrong_book = None
    if "step_count" in raw.keys():
        wrong_book = 0
        for e in range(n_envs):
            c = 0
            for t in range(steps):
                if reset[e, t]:
                    continue
                got = (bool(raw["is_init"][e, t]), int(raw["step_count"][e, t]))
                wrong_book += got != (c == 0, c)
                c = 0 if done[e, t] else c + 1
    lost = torch.isnan(cleaned["next", "observation"].reshape(len(cleaned), -1)).any(-1)
    return {
        "rows": n_envs * steps,
        "reset_rows": int(reset.sum()),
        "done_rows": int((done & ~reset).sum()),
        "terminal_zero": int(zero.sum()),
        "terminal_nan": int(nan.sum()),
        "terminal_reset_obs": int(wrong_final.sum()),
        "terminal_other": 0,
        "truncation_as_termination": int(trunc_as_term.sum()),
        "wrong_init_or_step": wrong_book,
        "cleaned_rows": len(cleaned),
        "lost": int(lost.sum()),
    }


def _same_as_explicit_resets(cleaned, explicit):
    """Each env's cleaned rows equal the explicit-reset rows (lost ones aside); returns NaNs."""
    ids = cleaned["env_id"].reshape(-1)
    n_lost = 0
    for e in range(explicit.batch_size[0]):
        got = cleaned[ids == e]
        n = len(got)
        want = explicit[e][:n]
        for key in (
            "observation",
            ("next", "observation"),
            ("next", "reward"),
            ("next", "terminated"),
            ("next", "truncated"),
        ):
            x, y = _obs(got, key), _obs(want, key)
            lost = torch.isnan(x).any(-1)
            n_lost += int(lost.sum()) if key == ("next", "observation") else 0
            assert torch.equal(x[~lost], y[~lost]), (e, key)
    return n_lost


def _chained(cleaned):
    """Within each env, a row's next observation is the next row's, but at episode ends."""
    ids = cleaned["env_id"].reshape(-1)
    for e in ids.unique():
        rows = cleaned[ids == e]
        done = rows["next", "done"].reshape(-1)[:-1]
        nxt, obs = _obs(rows, ("next", "observation"))[:-1], _obs(rows, "observation")[1:]
        assert torch.equal(nxt[~done], obs[~done]), int(e)
        assert (rows["next", "reward"] != 0).all(), int(e)


def _check_every_number(report, recorder):
    assert [p.producer for p in report.producers] == WITH_ENVPOOL[: len(report.producers)]
    explicit = recorder.raw[[p.producer for p in report.producers].index("torchrl-serial")]
    assert report.truth_episode_ends == int(explicit["next", "done"].sum())
    only_truncated = explicit["next", "truncated"] & ~explicit["next", "terminated"]
    assert report.truth_truncations == int(only_truncated.sum())
    for p, raw, cleaned in zip(report.producers, recorder.raw, recorder.cleaned):
        counted = _counts(raw, cleaned, p.producer)
        table = {k: getattr(p, k) for k in counted}
        if p.wrong_init_or_step is None:
            assert counted["wrong_init_or_step"] is None
        assert table == counted, p.producer
        assert p.cleaned_rows == p.rows - p.reset_rows
        assert p.differ == 0 and p.clean_seconds > 0
        if p.producer == "envpool":  # its own C++ env: chained rows, no reset row left
            _chained(cleaned)
        else:
            assert _same_as_explicit_resets(cleaned, explicit) == p.lost
        if p.producer.startswith("torchrl-"):  # [E, T] batches: the on-policy repair too
            assert p.repair["masked"] == counted["reset_rows"]
            assert p.repair["differ"] == 0 and p.repair["lost"] == p.lost
        else:
            assert p.repair is None


def test_cartpole_every_number_against_the_raw_rows():
    """Bugs caught: a count of the table taken from the wrong rows (reset
    rows counted as done rows, zero-filled terminal observations missed,
    the same-step reset observation not counted, the step counts of
    TorchRL's rows after a reset row not flagged), a producer whose cleaned
    rows differ from an explicit-reset run while the check says 0, a
    verdict of "equal" that was never checked, the wrong exit status, the
    on-policy repair of TorchRL's batches masking other rows than the reset
    rows.
    """
    recorder = Recorder()
    report = cleanbuf.check("CartPole-v1", producers=WITH_ENVPOOL, steps=150, clean=recorder)
    assert report.status == 0
    _check_every_number(report, recorder)
    by = {p.producer: p for p in report.producers}
    # what each producer is known to store wrong on CartPole
    assert by["gym-next-step"].reset_rows == by["gym-next-step"].done_rows > 0
    assert by["torchrl-gymenv"].terminal_zero > 0 and by["torchrl-gymenv"].wrong_init_or_step > 0
    assert by["gym-same-step"].terminal_reset_obs == by["gym-same-step"].done_rows > 0
    assert by["torchrl-serial"].stored_wrong == 0
    text = str(report)
    assert "Prefer torchrl-serial" in text and "Exit 0" in text
    for p in report.producers:
        line = next(row for row in text.splitlines() if row.startswith(p.producer + " "))
        numbers = [int(n) for n in re.findall(r"(?<![\w.])\d+(?![\w.])", line.split("|")[0])]
        assert numbers[:2] == [p.rows, p.reset_rows], line


def test_pendulum_joint_resets_are_reported_as_lost():
    """Pendulum (every episode ends at the 200-step limit, in all envs at
    once). Bugs caught: the terminal observations TorchRL's GymEnv loses at
    its joint resets reported as a difference (exit 1) or hidden (not in
    the lost count, no reason given), SB3's truncations not counted as
    flagged terminations, a fixed-horizon reset row (every env at once in a
    raw loop) taken for a joint reset.
    """
    recorder = Recorder()
    report = cleanbuf.check("Pendulum-v1", producers=WITH_ENVPOOL, steps=210, clean=recorder)
    assert report.status == 0
    _check_every_number(report, recorder)
    by = {p.producer: p for p in report.producers}
    assert by["torchrl-gymenv"].lost == 4 and by["torchrl-gymenv"].lost_why == {"joint": 4}
    assert by["gym-next-step"].lost == 0 and by["gym-next-step"].reset_rows == 4
    assert by["sb3-dummy"].truncation_as_termination == 4
    text = str(report)
    assert "4 terminal observation(s) lost for good" in text and "lossless_gym_env" in text


def test_custom_factory_from_the_command_line(capsys, monkeypatch, tmp_path):
    """A ``module:function`` factory with its own time limit. Bugs caught: a
    custom env refused or built as a Gymnasium id, TorchRL's GymEnv unable
    to take it, a truncation read as a termination by the truth, a step
    that both terminated and truncated (SB3 reports it terminated only)
    called a difference of the cleaning.
    """
    monkeypatch.chdir(tmp_path)  # where a reproducer would go
    status = main(
        [
            "check",
            "tests.check_envs:make_walk",
            "--steps",
            "120",
            "--producer",
            ",".join(IN_PROCESS),
            "--no-progress",
        ]
    )
    out, err = capsys.readouterr()
    assert status == 0, out + err
    truth = re.search(r"(\d+)\s+episode\s+ends\s+\((\d+)\s+truncations\)", out)
    assert int(truth.group(1)) > int(truth.group(2)) > 0, out  # both kinds of episode end
    assert "sb3-dummy: 1 step(s) ended both ways" in out  # counted apart, not a difference
    assert "Exit 0" in out


def test_an_env_whose_reset_ignores_its_seed_exits_3(capsys, monkeypatch, tmp_path):
    """Bug caught: an env that is not reproducible under seeds compared
    anyway (a difference blamed on the cleaning, exit 1) or called clean.
    """
    monkeypatch.chdir(tmp_path)
    status = main(
        ["check", "tests.check_envs:make_unseeded_walk", "--steps", "60", "--no-progress"]
    )
    out = capsys.readouterr().out
    assert status == 3, out
    assert "not reproducible under seeds" in out and "self.np_random" in out
    assert "producer" not in out  # no table: nothing was compared


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["NoSuchEnv-v0"], "NoSuchEnv-v0"),
        (["tests.check_envs:make_not_an_env"], "not a Gymnasium env"),
        (["tests.check_envs:make_dict_walk"], "FlattenObservation"),
        (["CartPole-v1", "--producer", "gym-nextstep"], "gym-nextstep"),
        (["tests.check_envs:make_walk", "--producer", "envpool"], "not from a Gymnasium factory"),
    ],
)
def test_errors_exit_2_and_say_what(args, named, capsys):
    """Bugs caught: an unknown env id, a factory that returns no env, an
    observation the check cannot compare (a Dict), a misspelt producer or
    EnvPool on a factory ending in a traceback or in exit 1
    (which means "a difference"), or an error that does not name the thing.
    """
    assert main(["check", *args, "--no-progress"]) == 2
    assert named in capsys.readouterr().err


def test_a_producer_not_installed_exits_2_naming_it(monkeypatch, capsys):
    """Bug caught: a producer asked for whose package is missing skipped
    silently (the user thinks it was checked) or failing with a bare
    ImportError; left out of the defaults, it is listed as not run.
    """
    monkeypatch.setitem(sys.modules, "stable_baselines3", None)  # import fails
    assert main(["check", "--producer", "sb3-dummy", "--no-progress"]) == 2
    assert "stable-baselines3" in capsys.readouterr().err
    report = cleanbuf.check(producers=None, steps=30)
    assert "sb3-dummy" not in [p.producer for p in report.producers]
    assert "not installed" in report.not_run["sb3-dummy"]


def test_a_broken_cleaning_exits_1_with_a_reproducer_that_replays(tmp_path, capsys):
    """A test double that keeps one reset row. Bugs caught: a cleaning that
    differs from the explicit-reset run passing the check, exit 1 without
    a reproducer, a reproducer that does not replay (other actions, other
    seeds, another producer), a printed command that does not run.
    """
    path = tmp_path / "repro.json"
    hook = "tests.check_envs:keeps_one_reset_row"
    status = main(
        [
            "check",
            "--producer",
            "gym-next-step",
            "--steps",
            "80",
            "--clean",
            hook,
            "--reproducer",
            str(path),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert status == 1, out
    assert "DIFFERENCE: gym-next-step" in out and str(path) in out
    saved = json.loads(path.read_text())
    assert saved["producers"] == ["gym-next-step"] and saved["clean"] == hook
    assert np.asarray(saved["actions"]["values"]).shape == (4, 80)
    command = next(line for line in out.splitlines() if line.startswith("Replay it: "))
    argv = command.removeprefix("Replay it: ").split()
    assert argv[1:] == ["check", "--replay", str(path), "--clean", hook], argv
    assert main(argv[1:]) == 1  # the printed command replays the difference
    capsys.readouterr()
    again = cleanbuf.check(replay=path, clean=hook)
    assert again.status == 1
    assert again.producers[0].differences == saved["differences"]["gym-next-step"]
    fixed = cleanbuf.check(replay=path)  # the same run, cleaned by cleanbuf: equal
    assert fixed.status == 0 and fixed.producers[0].differ == 0
    # ... and it says that the cleaning recorded was not the one replayed
    said = " ".join(str(fixed).split())  # (the prose is wrapped)
    assert f"the reproducer recorded {hook}, not used: pass --clean {hook}" in said
    assert "Prefer gym-next-step" not in out  # a producer that differs is never advised


def test_a_run_with_no_episode_end_gives_no_verdict(capsys):
    """Bug caught: ``cleanbuf check HalfCheetah-v5`` (300 steps, episodes of
    1000) compared rows that held no episode end and answered "Prefer
    gym-next-step, gym-same-step, torchrl-gymenv, ...: nothing stored wrong",
    exit 0. Here an env that never ends (no time limit): the truth is run
    longer within the time budget, then the check exits 3, compares
    nothing, says which envs ended no episode and the settings that show
    them; the printed fix runs as printed and gives a verdict on ends.
    """
    args = ["check", "tests.check_envs:make_endless_drift", "--producer", "gym-next-step"]
    status = main([*args, "--time-budget", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert status == 3, out
    said = " ".join(out.split())  # (the prose is wrapped)
    assert "NO VERDICT" in said and "env(s) [0, 1, 2, 3] of the truth ended no episode" in said
    assert "Prefer" not in said and "Exit 0" not in said and "rows differ" not in said, out
    report = cleanbuf.check("tests.check_envs:make_endless_drift", time_budget=0)
    assert report.status == 3 and not report.producers and report.truth_episode_ends == 0
    fix = re.search(r"(--max-episode-steps \d+)", said)
    assert fix and "max_episode_steps=75" in said, said
    assert main([*args, *fix[1].split(), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "Exit 0" in out and "(0 truncations" not in out, out


def test_a_time_limit_longer_than_the_run_is_reached():
    """A drift that ends only at its 400-step time limit (as MuJoCo's tasks
    at 1000), checked with the default 300 steps. Bug caught: no episode
    end in the truth, every producer "preferred", among them TorchRL's
    GymEnv, which loses every terminal observation of such a task. Now the
    truth runs past the limit, every env truncates, and the loss shows.
    """
    report = cleanbuf.check(
        "tests.check_envs:make_long_drift", producers="gym-next-step,torchrl-gymenv"
    )
    assert report.status == 0 and report.steps_asked == 300 and report.steps > 400, str(report)
    assert report.truth_truncations == report.truth_episode_ends == 4
    by = {p.producer: p for p in report.producers}
    assert by["torchrl-gymenv"].lost == 4 and by["gym-next-step"].reset_rows == 4
    text = " ".join(str(report).split())
    assert "300 asked: run until every env ended an episode" in text
    assert "Prefer gym-next-step: cleaned" in text and "Prefer gym-next-step, torchrl" not in text


def test_a_time_limit_not_reached_is_said():
    """Bug caught: a run of CartPole (time limit 500) whose random episodes
    all terminate early said "0 truncations" as if truncations had been
    checked. Now the truth line says the time limit was never reached.
    """
    report = cleanbuf.check("CartPole-v1", producers="gym-next-step", steps=60)
    assert report.status == 0 and report.time_limit == 500 and report.truth_truncations == 0
    assert "(0 truncations: time limit 500 never reached)" in " ".join(str(report).split())


@pytest.mark.slow  # MuJoCo: 1001 steps of HalfCheetah per producer
def test_halfcheetah_default_run_reaches_its_episode_ends():
    """The issue's example: ``cleanbuf check HalfCheetah-v5`` with its
    defaults. Bug caught: 300 steps of 1000-step episodes, 0 episode ends,
    every producer recommended, exit 0. Now the truth runs past the time
    limit: every env truncates, and TorchRL's GymEnv loses each terminal
    observation (joint resets), which the report says.
    """
    pytest.importorskip("mujoco")
    report = cleanbuf.check("HalfCheetah-v5", producers="gym-next-step,torchrl-gymenv")
    assert report.status == 0 and report.steps > 1000 and report.truth_truncations == 4
    by = {p.producer: p for p in report.producers}
    assert by["torchrl-gymenv"].lost == 4, str(report)
    assert "lost for good" in str(report)


def test_a_factory_name_that_is_wrong_says_what(tmp_path, monkeypatch, capsys):
    """Bug caught: module:function names whose function or module is missing
    answered with Gymnasium's env-registration advice ("Environment `nope`
    doesn't exist. Did you mean: `Hopper`?"), which points the wrong way.
    """
    (tmp_path / "mymod.py").write_text("def make():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", "mymod:nope", "--no-progress"]) == 2
    assert "module 'mymod' has no 'nope'" in capsys.readouterr().err
    assert main(["check", "nomodule_here:make", "--no-progress"]) == 2
    assert "module 'nomodule_here' cannot be imported" in capsys.readouterr().err


def test_a_factory_in_the_working_directory_is_found(tmp_path, monkeypatch, capsys):
    """The installed ``cleanbuf`` script, run from the directory that holds
    ``mypackage/envs.py``, does not have that directory on ``sys.path``
    (``python -m`` and ``python -c`` do). Bug caught: ``cleanbuf check
    mypackage.envs:make_env`` refused with "cannot be imported ... Run from
    the directory that holds it", run from that very directory.
    """
    (tmp_path / "mypackage").mkdir()
    (tmp_path / "mypackage" / "__init__.py").write_text("")
    (tmp_path / "mypackage" / "envs.py").write_text(
        "import gymnasium\n\ndef make_env():\n    return gymnasium.make('CartPole-v1')\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    args = ["check", "mypackage.envs:make_env", "--steps", "40", "--producer", "gym-next-step"]
    assert main([*args, "--no-progress"]) == 0, capsys.readouterr()
    assert str(tmp_path) not in sys.path  # (put back as it was)


def test_json_holds_the_table(capsys):
    """Bug caught: ``--json`` failing on a value JSON cannot hold (NumPy
    numbers, the plot's arrays) or leaving out the status.
    """
    assert main(["check", "--steps", "40", "--producer", "gym-next-step", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == 0 and out["producers"][0]["reset_rows"] > 0


def test_help_lists_every_command(capsys):
    """Bug caught: ``cleanbuf --help`` that leaves out check (or the
    commands on data on disk), and ``cleanbuf audit`` no longer reached.
    """
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(c in out for c in ("check", "audit", "clean"))
    assert main(["audit", "no/such/file.npz"]) == 2


def _check_stderr(*args: str) -> subprocess.CompletedProcess:
    """``python -m cleanbuf check ...`` in a fresh process (stderr as a terminal user sees it)."""
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    argv = [sys.executable, "-m", "cleanbuf", "check", *args, "--no-progress"]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_a_third_party_line_said_per_env_is_shown_once():
    """Bug caught: ``cleanbuf check`` on a MuJoCo env printed 34 identical
    ``settotalmass is deprecated`` lines (from C, once per sub-env built)
    before its table. Here a factory says a line the same way each time it
    is built: it is shown once, with its count, and the table follows.
    """
    done = _check_stderr("tests.check_envs:make_noisy_walk", "--steps", "60")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "once per env built" in line]
    assert len(lines) == 1, done.stderr
    said = int(re.search(r"\[said (\d+) times, shown once\]", lines[0])[1])
    assert said > 4 * 5, lines  # (the truth's envs, twice, and each producer's)
    assert "Verdict" in done.stdout and "once per env built" not in done.stdout


@pytest.mark.slow  # MuJoCo
def test_mujoco_s_deprecation_line_is_shown_once():
    """The issue's case: HalfCheetah-v5's ``settotalmass is deprecated``,
    once per sub-env built (34 lines before the table), now once.
    """
    pytest.importorskip("mujoco")
    done = _check_stderr("HalfCheetah-v5", "--steps", "60", "--max-episode-steps", "20")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("settotalmass") == 1, done.stderr
    assert "shown once]" in done.stderr


def test_the_plot_legend_does_not_cover_the_title():
    """Bug caught: in every ``--plot`` the legend was drawn over the title.
    Now neither box overlaps the other, nor the legend any panel.
    """
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from cleanbuf.check.plot import figure

    report = cleanbuf.check("CartPole-v1", producers="gym-next-step,torchrl-gymenv", steps=60)
    fig = figure(report)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (legend,) = fig.legends
        box = legend.get_window_extent(renderer)
        title = fig._suptitle.get_window_extent(renderer)
        assert not box.overlaps(title), (box, title)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_tightbbox(renderer)), ax.get_title()
    finally:
        plt.close(fig)


def test_plot_draws_a_png(tmp_path):
    """Bug caught: ``--plot`` failing after the table was printed (the
    status lost to a traceback) or writing nothing.
    """
    pytest.importorskip("matplotlib")
    path = tmp_path / "check.png"
    assert main(["check", "--steps", "60", "--plot", str(path), "--no-progress"]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # MuJoCo and a process per sub-env (ParallelEnv)
def test_mujoco_every_producer():
    """HalfCheetah-v5 with a 50-step limit: every episode a joint
    truncation. Bugs caught: float64 observations compared after a cast,
    the ParallelEnv's workers seeded otherwise than the truth, MuJoCo's
    lost observations taken for differences, EnvPool's MuJoCo compared with
    Gymnasium's instead of its own.
    """
    pytest.importorskip("mujoco")
    report = cleanbuf.check("HalfCheetah-v5", producers="all", steps=120, max_episode_steps=50)
    assert report.status == 0, str(report)
    by = {p.producer: p for p in report.producers}
    assert by["torchrl-gymenv"].lost == 8 and by["torchrl-parallel"].stored_wrong == 0
    assert by["envpool"].reset_rows == 8  # EnvPool's own HalfCheetah, its own truth


@pytest.mark.slow  # a fresh interpreter running the command
def test_the_readme_shows_the_command_and_its_output():
    """Bug caught: the README's first section showing a command or an
    output that the command no longer gives (times aside).
    """
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```console\n(.*?)```", text, re.S).group(1)
    command, *shown = block.splitlines()
    assert command.startswith("$ .venv/bin/cleanbuf check")  # (the install's venv)
    args = command.removeprefix("$ .venv/bin/cleanbuf ").split()
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "cleanbuf", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr

    def norm(lines):
        return [" ".join(re.sub(r"\d+ ms", "N ms", line).split()) for line in lines if line.strip()]

    assert norm(done.stdout.splitlines()) == norm(shown)


@pytest.mark.parametrize("env", ["CartPole-v1", "tests.check_envs:make_walk"])
def test_torchrl_auto_reset_loses_every_terminal_observation(env):
    """TorchRL's native auto-reset path (envs resetting inside their step,
    ``auto_reset=True``: ``AutoResetTransform``), against TorchRL's
    ``SerialEnv`` of single envs, which resets explicitly (the walk: its
    terminations and its time limit's truncations). Bugs caught: the
    producer's rows not TorchRL's format (the reset observation not in the
    next step's root, a done step's next observation not NaN, a sub-env
    seeded otherwise than the truth's); ``for_env`` reading these envs as
    explicit resets (mode ``disabled``, the fills passed on as data); a
    lost count other than the explicit run's episode ends (each one is
    lost, truncations too), or counted without its reason; the fills
    called a difference (exit 1) or cleaned rows unlike the explicit
    run's; the repair masking rows; the report preferring this producer,
    or not saying that no option gives the observations back and which
    producer keeps them.
    """
    recorder = Recorder()
    names = ["torchrl-serial", "torchrl-autoreset"]
    report = cleanbuf.check(env, producers=names, steps=120, clean=recorder)
    assert report.status == 0, str(report)
    explicit, raw = recorder.raw
    auto, cleaned = report.producers[1], recorder.cleaned[1]
    done = explicit["next", "done"].reshape(explicit.batch_size)
    n_ends = int(done.sum())
    assert n_ends == report.truth_episode_ends > 0
    if env != "CartPole-v1":
        assert report.truth_truncations > 0
    # TorchRL's format, row for row against the explicit run (no reset row)
    assert torch.equal(raw["observation"], explicit["observation"])
    nxt, want = _obs(raw, ("next", "observation")), _obs(explicit, ("next", "observation"))
    assert torch.isnan(nxt).all(-1).eq(done).all()
    assert torch.equal(nxt[~done], want[~done])
    assert torch.equal(raw["next", "done"], explicit["next", "done"])
    assert "mode=same_step" in auto.options
    counted = _counts(raw, cleaned, auto.producer)
    assert {k: getattr(auto, k) for k in counted} == counted
    assert auto.reset_rows == 0 and auto.wrong_init_or_step == 0
    assert auto.terminal_nan == auto.done_rows == auto.lost == n_ends
    assert auto.lost_why == {"filled": n_ends} and auto.differ == 0
    assert _same_as_explicit_resets(cleaned, explicit) == n_ends
    assert auto.repair == {
        "rows": auto.rows,
        "masked": 0,
        "differ": 0,
        "lost": n_ends,
        "differences": [],
    }
    text = " ".join(str(report).split())  # (the prose is wrapped)
    assert "Prefer torchrl-serial: nothing stored wrong" in text
    assert "Prefer torchrl-serial, torchrl-autoreset" not in text
    assert f"torchrl-autoreset: every terminal observation ({n_ends}) lost for good" in text
    assert "No option of cleanbuf gives them back" in text and "lossless_gym_env" in text
    assert f"({n_ends} lost terminal observation(s) marked NaN, counted above)" in text


def test_torchrl_auto_reset_on_integer_observations_is_not_run(capsys):
    """Integer observations, which ``AutoResetTransform`` fills with -1
    where NaN cannot mark them (``for_env`` then chooses no policy). Bugs
    caught: the check crashing on the filter's error (exit 2 for an
    explicit list with other producers, or for the defaults), or leaving
    the producer out without saying why.
    """
    report = cleanbuf.check(
        "tests.check_envs:make_grid_walk", producers="torchrl-serial,torchrl-autoreset", steps=40
    )
    assert report.status == 0 and [p.producer for p in report.producers] == ["torchrl-serial"]
    assert "not floating point" in report.not_run["torchrl-autoreset"]
    assert "torchrl-autoreset: not compared: its observations (int64)" in str(report)
    args = ["check", "tests.check_envs:make_grid_walk", "--producer", "torchrl-autoreset"]
    assert main([*args, "--no-progress"]) == 2
    assert "no producer to run: torchrl-autoreset" in capsys.readouterr().err


def test_a_producer_whose_integer_rows_the_filter_refuses_is_not_compared(capsys):
    """Bugs caught: on an env with integer observations, ``torchrl-gymenv``
    (a joint reset loses a terminal observation that NaN cannot mark) made
    the default check stop with the filter's Python-side error and exit 2,
    with a "garbage-collected while holding rows" warning after it, and no
    table for the producers that ran; a verdict given with that producer
    silently left out; a verdict given when no producer was compared.
    """
    import gc

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = cleanbuf.check(
            "tests.check_envs:make_grid_walk", producers="torchrl-serial,torchrl-gymenv"
        )
        gc.collect()
    assert not [w for w in seen if "garbage-collected" in str(w.message)]
    assert report.status == 0 and [p.producer for p in report.producers] == ["torchrl-serial"]
    why = report.not_run["torchrl-gymenv"]
    assert "on_lost_terminal_obs='drop'" in why and "not floating point" in why
    assert "not compared: torchrl-gymenv" in str(report)
    args = ["check", "tests.check_envs:make_grid_walk", "--producer", "torchrl-gymenv"]
    assert main([*args, "--no-progress"]) == 2
    assert "no producer was compared: torchrl-gymenv" in capsys.readouterr().err
