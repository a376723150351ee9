"""The package's four rooms and their walls, read from the source.

``cleanbuf/engine`` (kernels, the cleaner and its parts) knows no producer
and no file format; ``cleanbuf/online`` (the TorchRL transform, producers,
processes, Ray) and ``cleanbuf/offline`` (formats, audit, clean) each build
on the engine alone; ``cleanbuf/check`` (``cleanbuf check``'s runs, report
and plot, and the one command-line module) builds on all three, and none of
them on it. Every import counts, the ones inside functions too.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "cleanbuf"
EXTERNAL_OF_THE_SIDES = ("torchrl", "h5py", "ray", "gymnasium", "envpool")


def _modules() -> dict:
    """Module name -> (path, parsed tree)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = (path, ast.parse(path.read_text()))
    return out


MODULES = _modules()


def _imports(tree: ast.AST) -> set:
    """Every module an import names, at module level or inside a function."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _internal(name: str) -> set:
    return {m for m in _imports(MODULES[name][1]) if m in MODULES and m != name}


def test_no_import_cycle():
    """Bug caught: two modules importing each other, even lazily inside a
    function (the transform and the Ray glue did), so that neither can be
    read, tested or moved alone.
    """
    state: dict = {}

    def visit(name, stack):
        if state.get(name) == "done":
            return
        assert state.get(name) != "open", "import cycle: " + " -> ".join([*stack, name])
        state[name] = "open"
        for dep in sorted(_internal(name)):
            visit(dep, [*stack, name])
        state[name] = "done"

    for name in MODULES:
        visit(name, [])


ROOMS = ("cleanbuf.engine", "cleanbuf.online", "cleanbuf.offline", "cleanbuf.check")


@pytest.mark.parametrize("room", ROOMS[:3])
def test_each_room_builds_on_the_engine_alone(room):
    """Bugs caught: the engine importing the TorchRL glue, a file format or
    torchrl itself (it must clean plain TensorDicts anywhere); the offline
    side leaning on the online side or the other way round; any of them
    leaning on the check room (``cleanbuf check`` and the command line).
    """
    others = {"cleanbuf.online", "cleanbuf.offline", "cleanbuf.check"} - {room}
    for name in (m for m in MODULES if m.startswith(room)):
        for dep in _imports(MODULES[name][1]):
            assert not any(dep == o or dep.startswith(o + ".") for o in others), (name, dep)
            if room == "cleanbuf.engine":
                assert dep.split(".")[0] not in EXTERNAL_OF_THE_SIDES, (name, dep)


def test_every_module_lives_in_a_room():
    """Bug caught: a module left at the package top beside the rooms (the
    check's four modules sat there, and ``__main__`` special-cased
    ``check`` while the other commands lived in ``offline/cli.py``): only
    the facade, the version, the demo and the dispatching ``__main__`` may.
    """
    top = {"cleanbuf", "cleanbuf._version", "cleanbuf.demo", "cleanbuf.__main__"}
    loose = [m for m in MODULES if m not in top and not m.startswith(tuple(r + "." for r in ROOMS))]
    assert not [m for m in loose if m not in ROOMS], loose


def test_one_command_line_module():
    """Bug caught: two command lines that partly repeat each other (one for
    ``check``, one for the others), ``__main__`` choosing between them:
    every command is parsed in ``cleanbuf.check.cli``, and ``__main__``
    only dispatches to it.
    """
    clis = [m for m in MODULES if m.endswith(".cli") or "argparse" in _imports(MODULES[m][1])]
    assert clis == ["cleanbuf.check.cli"], clis
    assert _internal("cleanbuf.__main__") == {"cleanbuf.check.cli"}
    from cleanbuf.check.cli import _parser

    commands = _parser()._subparsers._group_actions[0].choices
    assert set(commands) == {"check", "audit", "clean", "export"}
