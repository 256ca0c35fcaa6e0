"""Every name a module reads at its top level resolves, and no module defines a name it also imports: a function
named like the one it imports calls itself (a record predicate once shadowed the schedules' ``splits_backward``;
only the probed planner's slow tests would have run it). Read from the source, as a linter would."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for folder in ("lightning_seqpar", "tests", "recipes") for p in (ROOT / folder).rglob("*.py"))


def _imported(tree: ast.Module) -> dict[str, int]:
    return {(alias.asname or alias.name).split(".")[0]: node.lineno for node in tree.body
            if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}


def test_no_module_defines_a_name_it_imports():
    shadowed = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        imported = _imported(tree)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [target.id for target in node.targets if isinstance(target, ast.Name)]
            else:
                continue
            shadowed += [f"{path.relative_to(ROOT)}:{node.lineno} {name} (imported at line {imported[name]})"
                         for name in names if name in imported]
    assert not shadowed, shadowed


def test_every_name_read_is_bound_somewhere_in_its_module():
    unbound = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        bound = set(dir(builtins)) | {"__file__", "__name__", "__spec__", "__path__"} | set(_imported(tree))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                bound.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                bound.add(node.id)
            elif isinstance(node, ast.arg):
                bound.add(node.arg)
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                bound |= set(node.names)
            elif isinstance(node, (ast.ExceptHandler, ast.MatchAs)) and node.name:
                bound.add(node.name)
        unbound += [f"{path.relative_to(ROOT)}:{node.lineno} {node.id}" for node in ast.walk(tree)
                    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in bound]
    assert not unbound, unbound
