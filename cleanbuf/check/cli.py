"""The ``cleanbuf`` command line, every command: ``check``, ``audit``, ``clean``, ``export``.

* ``cleanbuf check ENV`` runs an env under each producer and against
  explicit resets (:func:`cleanbuf.check`);
* ``cleanbuf audit PATH`` reports the auto-reset artifacts of data on disk
  (:func:`cleanbuf.audit`);
* ``cleanbuf clean SRC DST`` writes a cleaned copy (:func:`cleanbuf.clean`);
* ``cleanbuf export SRC DATASET_ID`` writes SRC's cleaned episodes as a
  Minari dataset (needs the ``minari`` extra; :func:`cleanbuf.to_minari`).

Exit status, so that ``cleanbuf audit`` and ``cleanbuf check`` can guard a
pipeline:

* 0: the data is clean (audit: checked, not assumed), was cleaned (clean),
  or every producer's cleaned rows equal the explicit-reset run (check);
* 1: the audit found artifacts (it prints the command that cleans them), or
  check found a difference (it writes a reproducer);
* 2: an error (the message on stderr);
* 3: the audit cannot tell (the time axis or the envs are not in the data,
  or no env has two rows to compare; say the layout with ``--layout``), or
  check cannot tell (the env is not reproducible under seeds, or its run
  held too few episode ends).

``audit``, ``clean`` and ``export`` take ``--layout time_first|time_last|flat``
(``--envs N`` with ``flat``: N envs' rows one env after the other) and
``--key ROLE=NAME`` (roles: obs, next_obs, action, reward, done, terminated,
truncated) for arrays named otherwise than TorchRL, CleanRL, offline-RL
(D4RL) or Stable-Baselines3 name them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from cleanbuf._version import __version__
from cleanbuf.engine._errors import CleanbufError
from cleanbuf.engine._options import LOST_POLICIES, MODES
from cleanbuf.offline._axes import LAYOUTS
from cleanbuf.offline._compat import quiet_torchrl_log
from cleanbuf.offline._names import parse_keys

EXAMPLES = """examples:
  cleanbuf check CartPole-v1
  cleanbuf audit runs/rb_dump
  cleanbuf audit runs/rb_dump --json
  cleanbuf clean runs/rb_dump runs/rb_clean
  cleanbuf clean data.npz clean.npz --on-lost-terminal-obs drop
  cleanbuf audit rollout.npz --layout time_first
  cleanbuf audit rows.npz --layout flat --envs 8 --key reward=r
  cleanbuf export runs/rb_dump cartpole/mine-v0 --env CartPole-v1 --author me

exit status: 0 clean (audit), cleaned (clean) or equal (check), 1 artifacts
or a difference found, 2 error, 3 cannot tell (audit: say --layout)
"""


def _shape_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layout",
        choices=LAYOUTS,
        help="leading dims of the arrays: time_first [T, E], time_last [E, T], flat [N] "
        "(default: decided from the data)",
    )
    parser.add_argument(
        "--envs", type=int, help="with --layout flat: N envs' rows, one env after the other"
    )
    parser.add_argument(
        "--key",
        action="append",
        metavar="ROLE=NAME",
        help="the array holding a role (obs, next_obs, action, reward, done, terminated, "
        "truncated); repeat for several",
    )


CHECK_EXAMPLES = """examples:
  cleanbuf check                                   CartPole-v1, 4 envs, 300 steps
  cleanbuf check Pendulum-v1 --steps 450
  cleanbuf check Hopper-v5 --producer all --plot hopper.png
  cleanbuf check mypackage.envs:make_env --max-episode-steps 100
  cleanbuf check --replay cleanbuf-check-CartPole-v1.json

producers: gym-next-step, gym-same-step, torchrl-gymenv, torchrl-serial,
torchrl-parallel (starts processes), torchrl-autoreset (TorchRL envs that
reset inside their step, auto_reset=True), sb3-dummy, envpool (EnvPool ids
only, against EnvPool's own env); default: those that start no process and
are installed.

exit status: 0 cleaned rows equal the explicit-reset run, 1 a difference
(reproducer written), 2 error, 3 the env is not reproducible under seeds,
or an env ended no episode (nothing compared: --steps, --max-episode-steps)
"""


def _check_parser(sub) -> None:
    """``cleanbuf check ENV``: the options of :func:`cleanbuf.check`."""
    p = sub.add_parser(
        "check",
        help="run an env under each producer (Gymnasium, TorchRL, SB3, EnvPool) and with "
        "explicit resets: what each stores wrong, and whether the cleaned rows equal the "
        "explicit-reset run",
        description="Run ENV under each producer and with explicit resets: what each producer "
        "stores wrong, and whether cleanbuf's cleaned rows equal the explicit-reset run.",
        epilog=CHECK_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "env",
        nargs="?",
        default="CartPole-v1",
        help="a Gymnasium id or package.module:function (default: CartPole-v1)",
    )
    p.add_argument(
        "--producer",
        action="append",
        metavar="NAME",
        help="a producer (repeat, or comma-separated; 'all': every one)",
    )
    p.add_argument("--num-envs", type=int, default=4, help="sub-envs (default: 4)")
    p.add_argument("--steps", type=int, default=300, help="steps per producer (default: 300)")
    p.add_argument("--seed", type=int, default=0, help="sub-env e starts at seed + e (default: 0)")
    p.add_argument("--max-episode-steps", type=int, help="a time limit on every sub-env")
    p.add_argument("--plot", metavar="FILE.png", help="draw env 0's rows against the truth")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--reproducer", metavar="FILE", help="where a difference's reproducer goes")
    p.add_argument("--replay", metavar="FILE", help="run a reproducer again")
    p.add_argument(
        "--clean",
        metavar="MODULE:FUNCTION",
        help="the cleaning to check, (batches, env) -> rows (default: the filter)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long the truth may run again with more steps until every env ended an "
        "episode (default: 60; 0: never)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cleanbuf",
        description="Check an env under each producer against explicit resets (check); audit, "
        "clean and export auto-reset artifacts in RL transitions on disk: a TorchRL "
        "replay-buffer dump (rb.dumps), a TensorDict memmap directory, a .npz or an "
        "HDF5 file (.h5, .hdf5).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"cleanbuf {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _check_parser(sub)
    audit = sub.add_parser("audit", help="report the artifacts; exit 1 if there are any")
    audit.add_argument("path")
    audit.add_argument("--json", action="store_true", help="print the report as JSON")
    audit.add_argument("--plot", metavar="FILE.png", help="draw the artifacts (needs matplotlib)")
    _shape_flags(audit)
    clean = sub.add_parser(
        "clean", help="write a cleaned copy of SRC to DST (DST.npz, DST.h5 or DST/, a directory)"
    )
    clean.add_argument("src")
    clean.add_argument("dst")
    clean.add_argument("--force", action="store_true", help="replace DST if it exists")
    clean.add_argument("--mode", choices=MODES, help="the producer's mode (default: audited)")
    clean.add_argument(
        "--joint-reset",
        choices=("yes", "no", "auto"),
        nargs="?",
        const="yes",
        default="auto",
        help="TorchRL GymEnv joint resets: yes, no, or auto (default: what the audit found; "
        "the flag alone means yes)",
    )
    _shape_flags(clean)
    clean.add_argument(
        "--on-lost-terminal-obs",
        choices=LOST_POLICIES,
        help="rows whose terminal observation is lost: nan (default), drop, raise, keep",
    )
    clean.add_argument(
        "--done-key",
        metavar="NAME",
        help="the array that marks episode ends, read alone (done_key= in Python; "
        "--key done=NAME, and terminated / truncated not compared with it)",
    )
    clean.add_argument(
        "--no-check-reset-rows",
        action="store_true",
        help="drop the row after each done row without checking its reward is 0 "
        "(check_reset_rows=False: a reward transform shifted the reset rows' reward)",
    )
    clean.add_argument(
        "--terminal-obs-in-done-row",
        choices=("yes", "no"),
        help="every done row holds its terminal observation, zeros included "
        "(terminal_obs_in_done_row=True), or none does (default: read row by row)",
    )
    clean.add_argument("--no-progress", action="store_true", help="no progress bar")
    clean.add_argument("--json", action="store_true", help="print the stats as JSON")
    _export_parser(sub)
    return parser


def _export_parser(sub) -> None:
    """``cleanbuf export SRC DATASET_ID``: the options of :func:`cleanbuf.to_minari`."""
    from cleanbuf.offline._minari import LOST_FINAL

    export = sub.add_parser(
        "export", help="write SRC's cleaned episodes as a Minari dataset (needs cleanbuf[minari])"
    )
    export.add_argument("src")
    export.add_argument("dataset_id", help="the Minari id, e.g. cartpole/mine-v0")
    export.add_argument("--env", help="the Gymnasium env id the data came from (recorded)")
    export.add_argument(
        "--max-episode-steps", type=int, help="the env's time limit, if not the registered one"
    )
    for name in ("author", "author-email", "algorithm-name", "code-permalink", "description"):
        export.add_argument(f"--{name}", help="dataset metadata")
    export.add_argument(
        "--lost-final",
        choices=LOST_FINAL,
        default="shorten",
        help="an episode whose final observation is lost: shorten (end it one step earlier, "
        "truncated; default), drop, raise",
    )
    export.add_argument(
        "--drop-unfinished",
        action="store_true",
        help="leave out the episodes that had not ended (default: exported as truncated)",
    )
    export.add_argument("--force", action="store_true", help="replace a dataset with that id")
    export.add_argument("--mode", choices=MODES, help="the producer's mode (default: audited)")
    export.add_argument("--joint-reset", choices=("yes", "no"), help="default: audited")
    _shape_flags(export)
    export.add_argument("--json", action="store_true", help="print the report as JSON")


def _export(args: argparse.Namespace) -> int:
    """Runs ``cleanbuf export``; prints its report."""
    from cleanbuf.offline._minari import to_minari

    done = to_minari(
        args.src,
        args.dataset_id,
        env=args.env,
        max_episode_steps=args.max_episode_steps,
        author=args.author,
        author_email=args.author_email,
        algorithm_name=args.algorithm_name,
        code_permalink=args.code_permalink,
        description=args.description,
        lost_final=args.lost_final,
        unfinished="drop" if args.drop_unfinished else "truncate",
        force=args.force,
        mode=args.mode,
        joint_reset=args.joint_reset,
        layout=args.layout,
        envs=args.envs,
        keys=parse_keys(args.key),
    )
    print(json.dumps(done.to_dict(), indent=1) if args.json else done)
    return 0


# A Python option an error names -> the flag that says it on the command line.
FLAGS = {
    "done_key=": "--done-key NAME",
    "reward_key=": "--key reward=NAME",
    "observation_keys=": "--key obs=NAME (with its next/NAME twin)",
    "check_reset_rows=False": "--no-check-reset-rows",
    "terminal_obs_in_done_row=": "--terminal-obs-in-done-row yes|no",
    "on_lost_terminal_obs=": "--on-lost-terminal-obs nan|drop|raise|keep",
    "joint_reset=": "--joint-reset yes|no",
    "mode=": "--mode next_step|same_step|disabled",
    "layout=": "--layout time_first|time_last|flat (with --envs N)",
}


def check_plot_path(path: str | None) -> None:
    """Refuses a ``--plot FILE`` whose directory does not exist, before any work.

    Examples:
        >>> check_plot_path("audit.png")
        >>> check_plot_path("no/such/dir/audit.png")
        Traceback (most recent call last):
        ...
        cleanbuf.engine._errors.CleanbufError: --plot no/such/dir/audit.png: the directory ...
    """
    folder = os.path.dirname(path) if path else ""
    if folder and not os.path.isdir(folder):
        raise CleanbufError(
            f"--plot {path}: the directory {folder} does not exist, so the plot cannot be "
            f"written there. Create it (mkdir -p {folder}) or name a file in an existing one."
        )


def flags_for(message: str) -> str:
    """The command-line flags for the Python options an error message names ("" if none).

    The cleaner's errors name its options as Python keywords; on the
    command line each is a flag, which this line names, so that the fix
    they give runs there too.

    Examples:
        >>> flags_for("... or pass check_reset_rows=False.")
        ' (on the command line: check_reset_rows=False is --no-check-reset-rows)'
        >>> flags_for("pass --mode same_step (mode='same_step')")
        ''
        >>> flags_for("nothing to say")
        ''
    """
    said = [
        f"{word} is {flag}"
        for word, flag in FLAGS.items()
        if re.search(rf"(?<![\w.]){re.escape(word)}", message)
        and flag.split()[0] not in message  # (a message that names the flag already)
    ]
    return f" (on the command line: {'; '.join(said)})" if said else ""


def _clean_options(args: argparse.Namespace, shape: dict) -> dict:
    """The options of ``cleanbuf clean``'s flags, for ``clean_dataset``."""
    if args.done_key is not None:
        shape = {**shape, "keys": {**shape["keys"], "done": args.done_key}}
    options = {k: v for k, v in shape.items() if v}
    if args.done_key is not None:
        options["done_key"] = ("next", "done")  # the array named, read alone
    if args.no_check_reset_rows:
        options["check_reset_rows"] = False
    if args.terminal_obs_in_done_row is not None:
        options["terminal_obs_in_done_row"] = args.terminal_obs_in_done_row == "yes"
    if args.mode is not None:
        options["mode"] = args.mode
    options["joint_reset"] = args.joint_reset
    if args.on_lost_terminal_obs is not None:
        options["on_lost_terminal_obs"] = args.on_lost_terminal_obs
    return options


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    from cleanbuf.offline import audit, clean_dataset

    args = _parser().parse_args(argv)
    if args.command == "check":
        return _check(args)
    with quiet_torchrl_log():  # no TorchRL INFO line among the report or the stats
        return _run(args, audit, clean_dataset)


def _run(args: argparse.Namespace, audit, clean_dataset) -> int:
    """Runs one parsed command; returns the exit status."""
    try:
        shape = {"layout": args.layout, "envs": args.envs, "keys": parse_keys(args.key)}
        if args.command == "audit":
            check_plot_path(args.plot)
            report = audit(args.path, **shape)
            print(report.to_json() if args.json else report)
            if args.plot and report.undecided is None:  # nothing checked: nothing to draw
                report.plot(args.plot)
            return report.status
        if args.command == "export":
            return _export(args)
        options = _clean_options(args, shape)
        done = clean_dataset(
            args.src,
            args.dst,
            force=args.force,
            progress=not args.no_progress,
            say=lambda note: print(f"cleanbuf clean: {note}", file=sys.stderr),
            command_line=True,
            **options,
        )
        stats, report = done.stats, done.report
        if args.json:
            out = {"stats": stats, "audit": report.to_dict(), "capacity": done.capacity}
            print(json.dumps(out, indent=1))
        else:
            print(f"cleaned {args.src} -> {args.dst}")
            for k, v in stats.items():
                print(f"  {k:22s}{v}")
            if done.capacity is not None:
                print(
                    f"  {'capacity':22s}{done.capacity} (load it into a buffer of exactly this "
                    f"size, built as SRC's was: rb = ReplayBuffer(storage=LazyTensorStorage("
                    f"{done.capacity})); rb.loads(DST), or LazyMemmapStorage)"
                )
        return 0
    except (CleanbufError, OSError) as err:
        print(f"cleanbuf {args.command}: {err}{flags_for(str(err))}", file=sys.stderr)
        return 2
    except Exception as err:  # exit 1 means "artifacts found": anything else is 2
        print(f"cleanbuf {args.command}: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"cleanbuf {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 2


def _check(args: argparse.Namespace) -> int:
    """Runs ``cleanbuf check``; prints its report; returns the exit status."""
    from cleanbuf.check.checker import check

    producers = None if not args.producer else ",".join(args.producer)
    # As `python -m` does: a module:function in the working directory imports
    # (the installed `cleanbuf` script does not look there by itself).
    here = os.getcwd()
    added = here not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        check_plot_path(args.plot)
        report = check(
            args.env,
            producers=producers,
            num_envs=args.num_envs,
            steps=args.steps,
            seed=args.seed,
            max_episode_steps=args.max_episode_steps,
            clean=args.clean,
            reproducer=args.reproducer,
            replay=args.replay,
            progress=False if args.no_progress else None,
            time_budget=args.time_budget,
        )
        print(json.dumps(report.to_dict(), indent=1) if args.json else report)
        if args.plot and report.producers:
            report.plot(args.plot)
            print(f"plot: {args.plot}")
        return report.status
    except CleanbufError as err:
        print(f"cleanbuf check: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cleanbuf check: interrupted", file=sys.stderr)
        return 2
    except Exception as err:  # exit 1 means "a difference": anything else is 2
        print(f"cleanbuf check: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    finally:
        if added and here in sys.path:
            sys.path.remove(here)
