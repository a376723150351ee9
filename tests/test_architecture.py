"""The package's three rooms and their walls, read from the source.

``cleanbuf/engine`` (kernels, the cleaner and its parts) knows no producer
and no file format; ``cleanbuf/online`` (the TorchRL transform, producers,
processes, Ray) and ``cleanbuf/offline`` (formats, audit, clean, command
line) each build on the engine alone. Every import counts, the ones inside
functions too.
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


@pytest.mark.parametrize("room", ["cleanbuf.engine", "cleanbuf.online", "cleanbuf.offline"])
def test_each_room_builds_on_the_engine_alone(room):
    """Bugs caught: the engine importing the TorchRL glue, a file format or
    torchrl itself (it must clean plain TensorDicts anywhere); the offline
    side leaning on the online side or the other way round.
    """
    others = {"cleanbuf.online", "cleanbuf.offline"} - {room}
    for name in (m for m in MODULES if m.startswith(room)):
        for dep in _imports(MODULES[name][1]):
            assert not any(dep == o or dep.startswith(o + ".") for o in others), (name, dep)
            if room == "cleanbuf.engine":
                assert dep.split(".")[0] not in EXTERNAL_OF_THE_SIDES, (name, dep)
