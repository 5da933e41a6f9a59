"""The folder tree is the architecture: each package imports only the layers below it
(docs/architecture.md). Every import counts, at module level or inside a function."""
from __future__ import annotations

import ast
import gc
from pathlib import Path

from worker import ROOT

# package -> the packages it may import (besides itself). Top to bottom: nothing imports upwards.
ALLOWED = {
    "backend.job": set(),
    "backend.store": set(),
    "backend.cluster": {"backend.job", "backend.store"},
    "backend.telemetry": {"backend.job", "backend.store"},
    "backend.runs": {"backend.job", "backend.store", "backend.cluster", "backend.telemetry"},
    "backend.cli": {"backend.job", "backend.store", "backend.cluster", "backend.telemetry", "backend.runs"},
    "launcher": {"backend.job"},
    "studio": {"backend.job", "backend.store", "backend.cluster", "backend.telemetry", "backend.runs"},
}
# The one way up: the CLI's `studio` subcommand starts the UI (imported only when it runs).
ENTRY_POINTS = {("backend/cli.py", "studio.server")}


def package_of(module: str) -> str | None:
    if module in ("backend.cli", "backend.runcli"):
        return "backend.cli"
    parts = module.split(".")
    for depth in (2, 1):
        name = ".".join(parts[:depth])
        if name in ALLOWED:
            return name
    return None


def parse(path: Path) -> ast.Module:
    """ast.parse with the garbage collector paused: a collection inside it can run a finalizer that
    logs a traceback (asyncio's "Task exception was never retrieved"), which Python 3.11 prints by
    parsing source itself, and the parse inside the parse failed the outer one's depth check in a
    CI run (SystemError: AST constructor recursion depth mismatch; cpython gh-106905)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(path.read_text(), str(path))
    finally:
        if enabled:
            gc.enable()


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
    return found


def test_every_import_goes_down_the_layers():
    broken = []
    for path in sorted(p for top in ("backend", "launcher", "studio") for p in (ROOT / top).rglob("*.py")
                       if p != ROOT / "backend" / "__init__.py"):
        rel = path.relative_to(ROOT).as_posix()
        here = package_of(rel[:-3].replace("/", ".").removesuffix(".__init__"))
        assert here is not None, f"{rel} is in no package of the layer table"
        for module in imports(path):
            there = package_of(module)
            if there is None or there == here or there in ALLOWED[here]:
                continue
            if (rel, module) not in ENTRY_POINTS and not any(module.startswith(m + ".") for r, m in ENTRY_POINTS if r == rel):
                broken.append(f"{rel} imports {module} ({here} may import {sorted(ALLOWED[here]) or 'nothing else'})")
    assert broken == []


def test_the_backend_package_holds_only_its_layers():
    loose = sorted(p.name for p in (ROOT / "backend").glob("*.py") if p.name not in ("__init__.py", "cli.py", "runcli.py"))
    assert loose == [], "a module outside backend's sub-packages"
