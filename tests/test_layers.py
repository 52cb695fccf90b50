"""Imports point down only: the library layers (p2p → dht → averaging, experts → workers →
orchestrator) and the orchestrator's rooms (host → config → providers → runs → instance → ui → sim →
fleet → chaos → cli).  Every import counts, those inside functions too, and none may close a circle."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["p2p", "dht", "averaging", "experts", "workers", "orchestrator"]
# a layer may import only the layers listed here (and itself)
MAY_IMPORT = {
    "p2p": set(),
    "dht": {"p2p"},
    "averaging": {"p2p", "dht"},
    "experts": {"p2p", "dht"},
    "workers": {"p2p", "dht", "averaging", "experts"},
    "orchestrator": {"p2p", "dht", "averaging", "experts", "workers"},
}
ROOMS = ["host", "config", "providers", "runs", "instance", "ui", "sim", "fleet", "chaos", "cli"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every module this file imports, absolute, with its line: at the top, in functions, under
    ``TYPE_CHECKING``, anywhere.  ``from package import module`` imports that module (the package's
    own ``__init__`` runs first in any case, so it is no edge of its own)."""
    module = _module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((submodule if _is_module(submodule) else base, node.lineno))
    return found


def _is_module(name: str) -> bool:
    relative = Path(*name.split("."))
    return (ROOT / relative).with_suffix(".py").exists() or (ROOT / relative / "__init__.py").exists()


def _sources() -> dict[str, Path]:
    return {_module_name(p): p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")}


def _graph() -> dict[str, set[str]]:
    sources = _sources()
    graph: dict[str, set[str]] = {}
    for name, path in sources.items():
        graph[name] = {target for target, _ in _imports(path) if target in sources and target != name}
    return graph


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "orchestrator" and len(parts) > 2 else None


def test_every_orchestrator_module_lives_in_a_room():
    loose = sorted(p.name for p in (ROOT / "orchestrator").glob("*.py") if p.name != "__init__.py")
    assert loose == []
    rooms = sorted(p.name for p in (ROOT / "orchestrator").iterdir() if (p / "__init__.py").exists())
    assert rooms == sorted(ROOMS)


def test_layers_import_only_the_layers_below():
    upward = []
    for name, path in _sources().items():
        layer = name.split(".")[0]
        for target, line in _imports(path):
            other = target.split(".")[0]
            if other in LAYERS and other != layer and other not in MAY_IMPORT[layer]:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {layer} imports {target}")
    assert upward == []


def test_rooms_import_only_the_rooms_below():
    upward = []
    for name, path in _sources().items():
        room = _room(name)
        if room is None:
            continue
        for target, line in _imports(path):
            other = _room(target)
            if other is not None and ROOMS.index(other) > ROOMS.index(room):
                upward.append(f"{path.relative_to(ROOT)}:{line}: {room} imports {target}")
    assert upward == []


def test_no_import_closes_a_circle():
    graph = _graph()
    circles, done, path = [], set(), []

    def visit(node: str) -> None:
        if node in path:
            circles.append(" -> ".join(path[path.index(node):] + [node]))
            return
        if node in done:
            return
        path.append(node)
        for target in sorted(graph[node]):
            visit(target)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    assert circles == []


def test_ray_is_imported_in_the_orchestrator_alone():
    found = [f"{path.relative_to(ROOT)}:{line}" for name, path in _sources().items()
             if not name.startswith("orchestrator") for target, line in _imports(path) if target.split(".")[0] == "ray"]
    assert found == []


def test_the_walk_sees_imports_in_functions_and_for_types_only(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """The checks above are only as good as this walk: it must find what a glance at the top misses."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    package = tmp_path / "orchestrator" / "ui"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "page.py").write_text("")
    (tmp_path / "orchestrator" / "cli.py").write_text("")
    module = package / "dashboard.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..cli import main\n"
                      "def serve():\n    import ray\n    from . import page\n")
    assert sorted(_imports(module)) == [("orchestrator.cli", 3), ("orchestrator.ui.page", 6), ("ray", 5),
                                        ("typing", 1)]
