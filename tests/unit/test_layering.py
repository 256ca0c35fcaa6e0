"""The package's structure: imports run one way, private library names live in ``_compat`` only."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_seqpar"

# Lowest first. A module may import from its own layer and the layers below, never from one above.
LAYERS = [
    ("foundation: communication, parallel layers, roles, mesh, pure formulas",
     {"_compat", "roles", "tensor_parallel", "mesh", "memory", "faults"}),
    ("parallel building blocks", {"transformer"}),
    ("policies and the rewrite", {"rewrite"}),
    ("parallel runtime: pipeline, gradient reduction, sharded state, checkpoints, ZeRO-1, recomputation",
     {"pipeline_parallel", "gradients", "state", "checkpoint_checks", "checkpoint", "distributed_optimizer",
      "recompute"}),
    ("Lightning integration: strategy, precision, checkpoint IO, launcher, callbacks, data",
     {"strategy", "checkpointing", "precision", "checkpoint_io", "launcher", "callbacks", "data"}),
    ("reference models and measurement harnesses (ordinary users of the library)", {"models", "benchmarking"}),
    ("package facade", {"__init__"}),
]
LAYER_OF = {part: i for i, (_, parts) in enumerate(LAYERS) for part in parts}
THIRD_PARTY = ("torch", "lightning", "lightning_utilities", "pytorch_lightning")


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _part(path: Path) -> str:
    """The top-level component of a file of the package (``strategy``, ``pipeline_parallel``, ...)."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    return rel.parts[0]


def _runtime_nodes(tree: ast.AST):
    """Every node except those under ``if TYPE_CHECKING:`` (annotations only, never executed)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import executed at runtime, module-level or inside functions."""
    out = []
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module))
    return out


def _own_target(module: str) -> str | None:
    if module == "lightning_seqpar":
        return "__init__"
    if module.startswith("lightning_seqpar."):
        return module.split(".")[1]
    return None


def test_every_part_of_the_package_has_a_layer():
    parts = {_part(p) for p in _modules()}
    assert parts - set(LAYER_OF) == set(), "put the new module in a layer of LAYERS"


def test_no_import_runs_up_from_a_lower_layer():
    violations = []
    for path in _modules():
        here = LAYER_OF[_part(path)]
        for line, module in _imports(path):
            target = _own_target(module)
            if target is not None and LAYER_OF[target] > here:
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module} "
                                  f"({LAYERS[LAYER_OF[target]][0]}) from {LAYERS[here][0]}")
    assert violations == []


def test_parts_import_each_other_without_cycles():
    graph: dict[str, set[str]] = {}
    for path in _modules():
        for _, module in _imports(path):
            target = _own_target(module)
            if target is not None and target != _part(path):
                graph.setdefault(_part(path), set()).add(target)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = sorted(part for part in graph if reaches(part, part, {part}))
    assert cycles == []


def test_the_layer_check_catches_an_upward_import(tmp_path):
    """The check above can fail: an import from the strategy inside a building block is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from lightning_seqpar.strategy import SeqParallelStrategy\n")
    assert [(line, _own_target(m)) for line, m in _imports(bad)] == [(2, "strategy")]
    assert LAYER_OF["strategy"] > LAYER_OF["transformer"]


def _defined_private_attributes() -> set[str]:
    """Private names our own code defines (methods, attributes set on self/cls/instances)."""
    names = set()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith("_"):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names


def _private_library_uses(path: Path, ours: set[str]) -> list[str]:
    tree = ast.parse(path.read_text())
    library_names = set()  # local names bound to torch/Lightning modules or objects
    other_modules = set()  # names bound to other modules (os._exit is public)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in THIRD_PARTY:
                    other_modules.add((alias.asname or alias.name).split(".")[0])
                else:
                    library_names.add((alias.asname or alias.name).split(".")[0])
                    if any(p.startswith("_") for p in alias.name.split(".")):
                        found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in THIRD_PARTY:
            library_names.update(alias.asname or alias.name for alias in node.names)
            if any(p.startswith("_") for p in node.module.split(".")):
                found.append(f"{node.lineno}: from {node.module}")
            found += [f"{node.lineno}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in other_modules:
            continue
        if isinstance(root, ast.Name) and root.id in library_names:
            found.append(f"{node.lineno}: {root.id}....{node.attr}")
        elif node.attr not in ours:  # a private attribute our code never defines belongs to another library
            found.append(f"{node.lineno}: .{node.attr}")
    return found


def test_private_library_names_are_used_only_in_the_compat_module():
    ours = _defined_private_attributes()
    uses = {str(p.relative_to(PACKAGE.parent)): _private_library_uses(p, ours)
            for p in _modules() if p.name != "_compat.py"}
    assert {path: found for path, found in uses.items() if found} == {}


def test_the_private_name_check_catches_each_kind(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\n"
        "from lightning.fabric.utilities.distributed import _init_dist_connection\n"
        "from torch.utils._pytree import tree_flatten\n"
        "x = torch._C\n"
        "def f(optimizer):\n    return optimizer._optimizer\n"
        "import os\nos._exit(0)\n"
    )
    found = _private_library_uses(bad, ours={"_mesh"})
    assert [f.split(":")[0] for f in found] == ["2", "3", "4", "6"]


def test_importing_the_package_loads_neither_the_reference_models_nor_optional_extras():
    # Lightning itself loads transformers when it is installed (torchmetrics' BERTScore): count only what we add.
    code = ("import sys, lightning.pytorch; before = set(sys.modules); import lightning_seqpar; "
            "print(sorted(m for m in set(sys.modules) - before if m.startswith(('lightning_seqpar.models', "
            "'lightning_seqpar.benchmarking', 'transformers', 'safetensors', 'torchdata'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout.strip()
    assert out == "[]"


def test_pure_formulas_import_no_lightning():
    """The memory model is formulas: callbacks and harnesses import it, never the reverse."""
    lightning = [(str(p.relative_to(PACKAGE)), m) for p in _modules() if _part(p) == "memory"
                 for _, m in _imports(p) if m.split(".")[0] in ("lightning", "pytorch_lightning")]
    assert lightning == []
