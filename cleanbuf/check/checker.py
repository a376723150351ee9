"""``cleanbuf check ENV``: what each producer stores wrong, and whether cleanbuf's output is right.

Runs one env under each producer (Gymnasium next-step and same-step
vector envs, TorchRL ``GymEnv(name, num_envs=N)``, ``SerialEnv`` /
``ParallelEnv`` of single envs, a ``SerialEnv`` of envs that reset inside
their step under ``AutoResetTransform``, Stable-Baselines3 ``DummyVecEnv``) with
seeded random actions, and the truth: the same env with explicit partial
resets (Gymnasium ``AutoresetMode.DISABLED``), the same seeds and the same
actions per env. Then it cleans each producer's rows with cleanbuf and
compares them with the truth, row for row within each env.

Exit status, as ``cleanbuf audit``'s:

* 0: every producer's cleaned rows equal the truth (observations a
  producer lost for good are reported, not hidden);
* 1: a difference: a reproducer file is written (seeds, actions, the
  differing rows) and the command that replays it is printed;
* 2: an error (an unknown env id, a factory that fails, a producer whose
  package is not installed: named);
* 3: the env is not reproducible under seeds (two truth runs with the
  same seeds and actions differ): nothing can be compared.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import json
import os
import re
import shlex
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import cleanbuf.check.report as report_
import cleanbuf.check.runs as runs_
from cleanbuf.engine._errors import CleanbufError, TerminalObservationLostError
from cleanbuf.offline._audit import program

CleanFn = Callable[[list, Any], Any]
_FORMAT = "cleanbuf-check-reproducer/1"


def _clean_fn(clean: CleanFn | str | None) -> tuple[CleanFn, str, str | None]:
    """``(function, what to call it, module:function or None)``."""
    if clean is None:
        return runs_.filter_cleaning, "AutoresetFilter.for_env(producer)", None
    if isinstance(clean, str):
        module, _, attr = clean.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as err:
            raise CleanbufError(
                f"--clean {clean}: cannot import it ({err}). Pass package.module:function, a "
                "function (batches, env) -> cleaned rows."
            ) from err
        return fn, clean, clean
    name = f"{getattr(clean, '__module__', '?')}:{getattr(clean, '__qualname__', '?')}"
    importable = re.fullmatch(r"[\w.]+:\w+", name) is not None
    return clean, name, name if importable else None


def _producers(
    producers: Sequence[str] | str | None, source: Any, observation_space: Any
) -> tuple[list[str], dict]:
    """The producers to run, and those not run with why."""
    if isinstance(producers, str):
        producers = [p.strip() for p in producers.split(",") if p.strip()]
    not_run: dict = {}
    chosen = []
    if producers is None or list(producers) == ["all"]:
        names = list(runs_.PRODUCERS) if producers else list(runs_.DEFAULT_PRODUCERS)
        for name in names:
            package = runs_.PRODUCERS[name][1]
            if not runs_.installed(package):
                not_run[name] = f"{package} is not installed"
            else:
                chosen.append(name)
    else:
        unknown = [p for p in producers if p not in runs_.PRODUCERS]
        if unknown:
            raise CleanbufError(
                f"unknown producer(s) {unknown}; choose from {list(runs_.PRODUCERS)} or 'all'."
            )
        for name in dict.fromkeys(producers):
            runs_.require(name)
            chosen.append(name)
    if "envpool" in chosen and runs_.envpool_id(source) is None:
        chosen.remove("envpool")
        not_run["envpool"] = runs_.envpool_why_not(source)
        if not chosen:
            raise CleanbufError(f"no producer to run: envpool: {not_run['envpool']}.")
    why = runs_.autoreset_why_not(observation_space)
    if "torchrl-autoreset" in chosen and why is not None:
        chosen.remove("torchrl-autoreset")
        not_run["torchrl-autoreset"] = why
        if not chosen:
            raise CleanbufError(f"no producer to run: torchrl-autoreset: {why}.")
    return chosen, not_run


def _progress(enabled: bool | None, total: int, file: Any = None):
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        desc="cleanbuf check",
        unit="step",
        file=sys.stderr if file is None else file,
        disable=None if enabled is None else not enabled,
        leave=False,
    )


@contextlib.contextmanager
def each_line_once():
    """What the runs write to stderr (fd 2), each distinct line said once, at the end.

    Third-party libraries warn each time an env is built (MuJoCo's
    ``settotalmass is deprecated``, from C, once per sub-env of each
    producer: 34 identical lines before the table). Their lines are
    gathered while the runs build envs, worker processes included, and
    said once each, with how many times they came. Yields the file the
    progress bar draws on (the stderr of before).
    """
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no file descriptor (a notebook): as is
        yield sys.stderr
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    bar = os.fdopen(os.dup(saved), "w")
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield bar
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            bar.close()
            tmp.seek(0)
            said = collections.Counter(
                line for line in tmp.read().decode(errors="replace").splitlines() if line.strip()
            )
            for line, n in said.items():  # (in the order they first came)
                print(line + (f"  [said {n} times, shown once]" if n > 1 else ""), file=sys.stderr)


def _options_of(env: Any) -> str:
    """How ``AutoresetFilter.for_env`` configures itself for ``env``, in words."""
    from cleanbuf.engine._errors import CleanbufWarning
    from cleanbuf.online._transform import AutoresetFilter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CleanbufWarning)
        o = AutoresetFilter.for_env(env).options
    words = f"for_env: mode={o.mode}"
    if o.layout:
        words += f", layout={o.layout}"
    if o.joint_reset:
        words += ", joint_reset=True"
    if o.on_lost_terminal_obs:
        words += f", on_lost_terminal_obs={o.on_lost_terminal_obs}"
    return words


def _timeline(rows: Any, real: np.ndarray | None, truth: Any) -> dict:
    """Env 0's first observation component and done flags, for the plot.

    ``terminals``: the true terminal observations (component 0) of the
    truth's (``truth``: env 0's truth rows) episode ends, in order.
    """
    n = rows.batch_size[0]
    obs = report_.obs_columns(rows[:n], report_.OBS)[:, 0]
    nxt = report_.obs_columns(rows[:n], report_.NEXT_OBS)[:, 0]
    done = rows["next", "done"][:n].reshape(n).numpy()
    real = np.ones(n, bool) if real is None else real[:n]
    ends = truth["next", "done"].reshape(-1)
    terminals = report_.obs_columns(truth[ends], report_.NEXT_OBS)[:, 0].tolist()
    return {"obs": obs, "next": nxt, "done": done, "real": real, "terminals": terminals}


def _run_one(name, source, settings, actions, truth, clean_fn, tick) -> Any:
    """Runs, cleans and compares one producer; returns ``(result, timeline)``."""
    num_envs, steps, seed = settings
    run = runs_.run_producer(name, source, num_envs, steps, seed, actions, tick)
    try:
        # Untimed, over every batch: numba compiles (or loads) each kernel the
        # rows need, some only at the first episode end, on its first call.
        runs_.filter_cleaning(run.batches, run.env)
        start = time.perf_counter()
        cleaned = clean_fn(run.batches, run.env)
        seconds = time.perf_counter() - start
        options = _options_of(run.env)
        repaired = runs_.repair_cleaning(run.batches, run.env)
    finally:
        run.close()
    stored = report_.count_stored(run, truth)
    compared = report_.compare_cleaned(run, cleaned, truth)
    repair = None
    if repaired is not None:
        got = report_.compare_cleaned(run, repaired, truth)
        repair = {
            "rows": stored["rows"],
            "masked": stored["rows"] - got["cleaned_rows"],
            "differ": got["differ"],
            "lost": got["lost"],
            "differences": got["differences"],
        }
    result = report_.ProducerResult(
        producer=name,
        description=runs_.PRODUCERS[name][0],
        **stored,
        **compared,
        clean_seconds=seconds,
        collect_seconds=run.seconds,
        repair=repair,
        options=options,
    )
    return result, _timeline(run.rows[0], run.real[0], truth[0])


def check(
    env: str = "CartPole-v1",
    *,
    producers: Sequence[str] | str | None = None,
    num_envs: int = 4,
    steps: int = 300,
    seed: int = 0,
    max_episode_steps: int | None = None,
    clean: CleanFn | str | None = None,
    reproducer: str | os.PathLike | None = None,
    replay: str | os.PathLike | None = None,
    progress: bool | None = False,
    time_budget: float = 60.0,
) -> report_.CheckReport:
    """Runs ``env`` under each producer and against explicit resets; cleans and compares.

    Each producer steps ``num_envs`` sub-envs ``steps`` times with seeded
    random actions (env ``e``'s own sequence, the same in every run; a
    reset step, whose action the env ignores, takes none). The truth is the
    same env factory under Gymnasium ``AutoresetMode.DISABLED`` with
    explicit partial resets, the same seeds and actions; it runs twice, and
    an env whose two truth runs differ is not reproducible (status 3).
    Each producer's rows are counted against the truth as stored (reset
    rows, wrong terminal observations, truncations flagged as
    terminations, wrong ``is_init`` / ``step_count``), then cleaned
    (``AutoresetFilter.for_env(producer)``, as a buffer's transform) and
    compared with the truth, row for row within each env.

    Args:
        env: a Gymnasium id, or ``package.module:function`` returning one
            Gymnasium env.
        producers: names from ``gym-next-step``, ``gym-same-step``,
            ``torchrl-gymenv``, ``torchrl-serial``, ``torchrl-parallel``,
            ``torchrl-autoreset``, ``sb3-dummy``, ``envpool`` (a list or a
            comma-separated str), or ``"all"``. None: those that start no
            process and are installed. ``torchrl-autoreset`` (TorchRL envs
            that reset inside their step, ``auto_reset=True``) keeps no
            terminal observation: each is counted lost; it is not run on
            integer observations (the report says why). EnvPool runs its
            own version of a registered id, compared with that version
            under explicit resets (one pool per env); a factory or an id it
            lacks is not run (the report says why).
        num_envs: sub-envs per producer.
        steps: steps per producer, at least: where an env of the truth
            ends no episode in them, the truth runs again with more steps
            (past the env's time limit, if it has one; else twice as
            many), for up to ``time_budget`` seconds; an env that still
            ends none gives no verdict (status 3).
        seed: sub-env ``e`` starts from ``reset(seed=seed + e)``; env
            ``e``'s actions are drawn from its action space seeded ``seed + e``.
        max_episode_steps: a time limit put on every sub-env.
        clean: the cleaning to check, a function ``(batches, env) ->
            cleaned rows`` (a TensorDict of flat rows keeping each row's
            ``"env_id"``) or its ``"module:function"``; None:
            ``AutoresetFilter.for_env(env)`` on each batch, then ``flush()``.
        reproducer: where to write the reproducer when a difference is
            found (None: ``cleanbuf-check-<env>.json`` here).
        replay: a reproducer file: run its env, settings and actions again
            (the other arguments but ``clean`` and ``progress`` are ignored).
            Without ``clean``, cleanbuf's cleaning runs, and the report says
            which cleaning the reproducer recorded.
        progress: a progress bar on stderr (None: on a terminal).
        time_budget: seconds the truth may take to run again with more
            steps until every env ended an episode (0: never).

    Returns:
        The :class:`report_.CheckReport`; ``report.status`` is 0 (equal), 1 (a
        difference; the reproducer is written) or 3 (not reproducible, or
        an env of the truth ended no episode: nothing was compared).

    Raises:
        CleanbufError: the env cannot be built, a producer is unknown or
            not installed (named), or a setting is out of range.

    Examples:
        >>> import cleanbuf
        >>> report = cleanbuf.check("CartPole-v1", producers="gym-next-step", steps=60)
        >>> report.status, report.producers[0].differ
        (0, 0)
        >>> p = report.producers[0]
        >>> p.reset_rows == p.rows - p.cleaned_rows
        True
    """
    actions = None
    if replay is not None:
        saved = _load(replay)
        env, num_envs, steps = saved["env"], saved["num_envs"], saved["steps"]
        seed, max_episode_steps = saved["seed"], saved["max_episode_steps"]
        producers = saved["producers"]
        actions = np.asarray(saved["actions"]["values"], dtype=saved["actions"]["dtype"])
    clean_fn, clean_name, clean_ref = _clean_fn(clean)
    if replay is not None and clean is None and saved.get("clean"):
        # Replayed with cleanbuf's own cleaning: say that it is not the one recorded.
        clean_name += (
            f" (the reproducer recorded {saved['clean']}, not used: pass --clean "
            f"{saved['clean']} to replay it)"
        )
    if num_envs < 1 or steps < 2:
        raise CleanbufError(f"num_envs={num_envs}, steps={steps}: need num_envs >= 1, steps >= 2.")
    source = runs_.EnvSource(env, max_episode_steps)
    with each_line_once() as stderr:
        observation_space, action_space = source.probe()
        names, not_run = _producers(producers, source, observation_space)
        limit = runs_.time_limit(source)
        out, actions = _run_all(
            source, names, not_run, (num_envs, steps, seed), (actions, action_space),
            (limit, time_budget), (clean_fn, clean_name), progress, stderr,
        )  # fmt: skip
    if out.status == 1:
        _write_reproducer(out, actions, clean_ref, reproducer, replay)
    return out


def _run_all(source, names, not_run, settings, acts, ends, cleaning, progress, stderr) -> tuple:
    """The truth (run longer where it held no episode end), then every producer.

    Returns:
        ``(report, actions)``: the actions each env took (``steps`` of them).
    """
    num_envs, steps, seed = settings
    (actions, action_space), (limit, time_budget) = acts, ends
    clean_fn, clean_name = cleaning
    env, max_episode_steps, asked = source.name, source.max_episode_steps, steps
    with (
        _progress(progress, steps * (len(names) + 2), stderr) as bar,
        warnings.catch_warnings(),
    ):
        # EnvPool's spaces cast their bounds to float32, with a warning each: not the user's.
        warnings.filterwarnings("ignore", message=".*precision lowered by casting")
        if actions is None:
            truth, actions, unseen = _truth_with_ends(
                source, (num_envs, steps, seed), action_space, limit, time_budget
            )
            steps = actions.shape[1]
            bar.total = steps * (len(names) + 2)
        else:
            truth = runs_.run_truth(source, num_envs, steps, seed, actions)
            unseen = _unseen(truth, steps, limit, time_budget)
        again = runs_.run_truth(source, num_envs, steps, seed, actions)
        bar.update(2 * steps)
        ends = truth["next", "done"]
        trunc = truth["next", "truncated"] & ~truth["next", "terminated"]
        out = report_.CheckReport(
            env,
            num_envs,
            steps,
            seed,
            max_episode_steps,
            int(ends.sum()),
            int(trunc.sum()),
            [],
            not_run,
            report_.first_truth_difference(truth, again),
            clean_name,
            steps_asked=asked,
            time_limit=limit,
            unseen=unseen,
        )
        if out.unseen is not None:
            return out, actions
        truths = {"": truth}
        if "envpool" in names and out.not_reproducible is None:
            truths["envpool"] = runs_.run_envpool_truth(source, num_envs, steps, seed, actions)
            again = runs_.run_envpool_truth(source, num_envs, steps, seed, actions)
            differ = report_.first_truth_difference(truths["envpool"], again)
            if differ is not None:
                out.not_reproducible = f"EnvPool's version: {differ}"
        if out.not_reproducible is not None:
            return out, actions
        out.timelines["truth"] = _timeline(truth[0], None, truth[0])
        for name in names:
            try:
                result, timeline = _run_one(
                    name,
                    source,
                    (num_envs, steps, seed),
                    actions,
                    truths.get(name, truth),
                    clean_fn,
                    lambda: bar.update(1),
                )
            except TerminalObservationLostError as err:
                if clean_fn is not runs_.filter_cleaning or "not floating point" not in str(err):
                    raise  # (a user's cleaning, or a loss the reason below does not name)
                out.not_run[name] = _refused(err)
                continue
            out.producers.append(result)
            out.timelines[name] = timeline
        if not out.producers:  # no verdict on nothing compared
            why = "; ".join(f"{k}: {v}" for k, v in out.not_run.items())
            raise CleanbufError(f"no producer was compared: {why}.")
    return out, actions


def _refused(err: TerminalObservationLostError) -> str:
    """Why a producer whose rows ``AutoresetFilter.for_env`` refuses was not compared."""
    lost = re.match(r"(\d+) next observation", str(err))
    count = f"{lost[1]} done row(s)" if lost else "done rows"
    return (
        f"it ran, but {count} lack their terminal observation and no later row "
        "gives it back (a joint reset, or an episode that ended on the run's last step), and "
        "its observations are not floating point, so NaN cannot mark them: "
        "AutoresetFilter.for_env(env) refuses such rows, at a call or at flush, until "
        "on_lost_terminal_obs is chosen. A filter for this producer needs "
        "on_lost_terminal_obs='drop' (store no such row) or 'keep' (store them as the "
        "producer left them)"
    )


MAX_STEPS = 100_000  # steps the truth is ever extended to (its rows are kept in memory)


def _truth_with_ends(source, settings, action_space, limit, budget) -> tuple:
    """The truth, run again with more steps until every env ended an episode (or the budget).

    Returns:
        ``(truth, actions, unseen)``: ``unseen`` says what the truth did
        not show and the settings that would show it (None: every env
        ended an episode).
    """
    num_envs, steps, seed = settings
    asked, deadline = steps, time.monotonic() + budget
    while True:
        actions = runs_.action_sequences(action_space, num_envs, steps, seed)
        truth = runs_.run_truth(source, num_envs, steps, seed, actions)
        unseen = _unseen(truth, steps, limit, budget, asked)
        if unseen is None or steps >= MAX_STEPS or time.monotonic() >= deadline:
            return truth, actions, unseen
        more = 2 * steps if limit is None or limit < steps else max(2 * steps, limit + 1)
        steps = min(MAX_STEPS, more)


def _unseen(
    truth: Any, steps: int, limit: int | None, budget: float, asked: int | None = None
) -> str | None:
    """What the truth did not show, in words with the settings that would show it; or None.

    A producer's way with an episode end is what the check compares: an
    env of the truth that ended no episode exercised none of it.
    """
    ended = truth["next", "done"].reshape(truth.batch_size[0], -1).any(-1)
    if bool(ended.all()):
        return None
    envs = [int(e) for e in (~ended).nonzero().reshape(-1)]
    longer = 4 * steps if limit is None or limit < steps else limit + 1
    shorter = max(10, (asked or steps) // 4)  # episodes that end within the steps asked
    return (
        f"in {steps} steps (time budget {budget:g} s), env(s) {envs} of the truth ended no "
        "episode"
        + ("" if limit is None else f" (time limit: {limit} steps)")
        + ", so nothing a producer does at an episode end was exercised, and nothing was "
        f"compared. Run longer, --steps {longer} (steps={longer}), or give the episodes a "
        f"time limit, --max-episode-steps {shorter} (max_episode_steps={shorter})."
    )


def _write_reproducer(
    report: report_.CheckReport, actions: np.ndarray, clean_ref, path, replay
) -> None:
    if path is None:
        path = (
            replay
            if replay is not None
            else ("cleanbuf-check-" + re.sub(r"[^\w.-]+", "_", report.env) + ".json")
        )
    path = os.fspath(path)
    bad = [p for p in report.producers if p.differs]
    saved = {
        "format": _FORMAT,
        "env": report.env,
        "num_envs": report.num_envs,
        "steps": report.steps,
        "seed": report.seed,
        "max_episode_steps": report.max_episode_steps,
        "producers": [p.producer for p in bad],
        "clean": clean_ref,
        "actions": {"dtype": str(actions.dtype), "values": actions.tolist()},
        "differences": {p.producer: p.differences for p in bad},
        "repair_differences": {p.producer: p.repair["differences"] for p in bad if p.repair},
    }
    with open(path, "w") as f:
        json.dump(saved, f)
    report.reproducer = path
    flags = f" --clean {shlex.quote(clean_ref)}" if clean_ref else ""
    report.replay = f"{program()} check --replay {shlex.quote(path)}{flags}"
    if clean_ref is None and report.cleaning != "AutoresetFilter.for_env(producer)":
        report.replay += f"  (from Python: cleanbuf.check(replay={path!r}, clean=...))"


def _load(path: str | os.PathLike) -> dict:
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as err:
        raise CleanbufError(f"cannot read the reproducer {os.fspath(path)!r}: {err}") from err
    if not isinstance(saved, dict) or saved.get("format") != _FORMAT:
        raise CleanbufError(
            f"{os.fspath(path)!r} is not a cleanbuf check reproducer (no format {_FORMAT!r})."
        )
    return saved
