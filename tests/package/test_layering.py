"""The package's structure: one concept per folder, imports run one way, optional libraries stay behind their
boundary, private library names live in the ``_compat`` modules only."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_seqpar"

# Lowest first. A module may import from its own layer and the layers below, never from one above.
LAYERS = [
    ("foundation: process groups and the mesh, RNG streams, the memory/FLOPs model, torch's private names, which "
     "optional extras are installed, sizes as users write them", {"_compat", "parallel", "memory", "extras", "sizes"}),
    ("tensor-parallel layers, operators and sharding; context-parallel attention; expert dispatch and experts",
     {"tensor_parallel", "context_parallel", "moe"}),
    ("the parallel transformer layer, its declaration, masks and roles", {"transformer"}),
    ("rewriting: the policy contract, declared policies, self-checks and the engine", {"rewriting"}),
    ("Hugging Face layouts, weights and models (the [hf] extra)", {"hf"}),
    ("the built-in policies: where the rewriting engine and the Hugging Face layouts meet", {"policies"}),
    ("runtime: recomputation, activation offload, pipeline, gradients and optimizer, checkpoint files, the one build "
     "sequence of a rank", {"recompute", "offload", "pipeline_parallel", "optim", "checkpoint", "build"}),
    ("the layout: one value from the planner to the strategy", {"layout"}),
    ("planning: layouts, their bytes per rank and step time", {"plan"}),
    ("Lightning integration; generation in the training layout", {"lightning", "generation"}),
    ("reference models and data (ordinary users of the library)", {"models", "data"}),
    ("package facade", {"__init__"}),
]
LAYER_OF = {part: i for i, (_, parts) in enumerate(LAYERS) for part in parts}
THIRD_PARTY = ("torch", "lightning", "lightning_utilities", "pytorch_lightning", "transformers", "safetensors",
               "tokenizers")
LIGHTNING = ("lightning", "pytorch_lightning", "lightning_utilities", "lightning_fabric")
LIGHTNING_PARTS = {"lightning", "models", "data"}
HF_LIBRARIES = ("transformers", "safetensors", "tokenizers")


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _part(path: Path) -> str:
    """The top-level component of a file of the package (``lightning``, ``pipeline_parallel``, ``data``, ...)."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    return rel.parts[0]


def _module_name(path: Path) -> str:
    """``lightning_seqpar.a.b`` for ``a/b.py``, ``lightning_seqpar.a`` for ``a/__init__.py``."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """``(line, module, lazy)`` of every import in ``path``: module-level, inside functions and under
    ``if TYPE_CHECKING:`` alike (an annotation-only import is still a dependency of the design).
    ``lazy``: inside a function, where it runs only when called."""
    out = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            lazy = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((child.lineno, alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                out.append((child.lineno, child.module, in_function))
            visit(child, lazy)

    visit(ast.parse(path.read_text()), False)
    return out


def _own_target(module: str) -> str | None:
    if module == "lightning_seqpar":
        return "__init__"
    if module.startswith("lightning_seqpar."):
        return module.split(".")[1]
    return None


def _module_graph() -> dict[str, set[str]]:
    """Module → the package modules it imports (``from lightning_seqpar.a import x`` is an edge to ``a``)."""
    known = {_module_name(p) for p in _modules()}
    graph: dict[str, set[str]] = {}
    for path in _modules():
        here = _module_name(path)
        for _, module, _ in _imports(path):
            if module.startswith("lightning_seqpar") and module != here:
                while module not in known:
                    module = module.rpartition(".")[0]
                graph.setdefault(here, set()).add(module)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one node (Tarjan), as its sorted members."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_every_part_of_the_package_has_a_layer():
    parts = {_part(p) for p in _modules()}
    assert parts - set(LAYER_OF) == set(), "put the new folder or module in a layer of LAYERS"


def test_no_import_runs_up_from_a_lower_layer():
    violations = []
    for path in _modules():
        here = LAYER_OF[_part(path)]
        for line, module, _ in _imports(path):
            target = _own_target(module)
            if target is not None and LAYER_OF[target] > here:
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module} "
                                  f"({LAYERS[LAYER_OF[target]][0]}) from {LAYERS[here][0]}")
    assert violations == []


def test_folders_import_each_other_without_cycles():
    graph: dict[str, set[str]] = {}
    for path in _modules():
        for _, module, _ in _imports(path):
            target = _own_target(module)
            if target is not None and target != _part(path):
                graph.setdefault(_part(path), set()).add(target)
    assert _cycles(graph) == []


def test_modules_import_each_other_without_cycles():
    """Inside a folder too, counting imports under ``TYPE_CHECKING`` and inside functions."""
    assert _cycles(_module_graph()) == []


def test_the_cycle_check_catches_a_cycle_through_a_lazy_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_seqpar.b import B\n"
                   "def f():\n    from lightning_seqpar.c import C\n")
    assert [(line, m) for line, m, _ in _imports(bad)] == [(1, "typing"), (3, "lightning_seqpar.b"),
                                                           (5, "lightning_seqpar.c")]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_layer_check_catches_an_upward_import(tmp_path):
    """The check above can fail: an import from the strategy inside a building block is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from lightning_seqpar.lightning.strategy import SeqParallelStrategy\n")
    assert [(line, _own_target(m)) for line, m, _ in _imports(bad)] == [(2, "lightning")]
    assert LAYER_OF["lightning"] > LAYER_OF["transformer"]


def test_lightning_is_imported_only_by_the_lightning_folder_models_and_data():
    found = [f"{p.relative_to(PACKAGE.parent)}:{line} imports {m}" for p in _modules()
             if _part(p) not in LIGHTNING_PARTS for line, m, _ in _imports(p) if m.split(".")[0] in LIGHTNING]
    assert found == []


def test_hugging_face_libraries_are_imported_only_under_hf_and_only_when_used():
    outside = [f"{p.relative_to(PACKAGE.parent)}:{line} imports {m}" for p in _modules() if _part(p) != "hf"
               for line, m, _ in _imports(p) if m.split(".")[0] in HF_LIBRARIES]
    eager = [f"{p.relative_to(PACKAGE.parent)}:{line} imports {m} at module level" for p in _modules()
             if _part(p) == "hf" for line, m, lazy in _imports(p) if m.split(".")[0] in HF_LIBRARIES and not lazy]
    assert outside == [] and eager == []


PRICING_FORBIDS = ("torch", "transformers", "peft", "safetensors", "tokenizers", "lightning", "numpy")
# The runtime reads the planner only where it chooses or reports a layout (and the reference GPT says which Hugging Face
# config the planner prices it as, for those two).
PLAN_READERS = {"lightning/auto_layout.py", "lightning/callbacks/layout_report.py", "models/gpt.py"}


def _pricing_violations(start: list[Path]) -> list[str]:
    """What the modules ``start`` reach, through the package modules they import (module-level and lazy, followed),
    that the planner's pricing may not: torch and the libraries above it, or the planner's measuring and search."""
    known = {_module_name(p): p for p in _modules()}
    todo, seen, found = list(start), set(), []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for line, module, _ in _imports(path):
            here = path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path.name
            where = f"{here}:{line} imports {module}"
            if module.split(".")[0] in PRICING_FORBIDS:
                found.append(where)
            if not module.startswith("lightning_seqpar"):
                continue
            while module not in known:
                module = module.rpartition(".")[0]
            if module.startswith("lightning_seqpar.plan") and not module.startswith("lightning_seqpar.plan.pricing"):
                found.append(where)
            todo.append(known[module])
    return found


def test_the_planner_s_pricing_imports_no_torch_and_nothing_that_measures():
    # Its own imports and those of every package module it reaches (a package's __init__, which may load torch for
    # its other modules, is not one of them: pricing's code depends on none of it).
    assert _pricing_violations(sorted((PACKAGE / "plan" / "pricing").rglob("*.py"))) == []


def test_the_pricing_check_catches_torch_reached_through_another_module(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from lightning_seqpar.parallel.collectives import ParallelGroup\n")
    assert any("imports torch" in v for v in _pricing_violations([bad]))
    bad.write_text("from lightning_seqpar.plan.measuring.probe import fit_layer\n")
    assert _pricing_violations([bad])[0].endswith("imports lightning_seqpar.plan.measuring.probe")


def test_measuring_does_not_import_the_search_and_the_runtime_reads_the_planner_where_it_chooses_a_layout():
    upward = [f"{p.relative_to(PACKAGE.parent)}:{line} imports {m}"
              for p in sorted((PACKAGE / "plan" / "measuring").rglob("*.py")) for line, m, _ in _imports(p)
              if m in ("lightning_seqpar.plan", "lightning_seqpar.plan.planner", "lightning_seqpar.plan.__main__")]
    readers = {str(p.relative_to(PACKAGE)) for p in _modules() if _part(p) != "plan"
               for _, m, _ in _imports(p) if m == "lightning_seqpar.plan" or m.startswith("lightning_seqpar.plan.")}
    assert upward == [] and readers <= PLAN_READERS, (upward, readers - PLAN_READERS)


def test_the_public_names_import_from_the_package():
    import lightning_seqpar

    names = ["SeqParallelStrategy", "SelectiveRecompute", "BlockSpec", "DeclaredBlockPolicy", "explain", "Policy",
             "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelGroup", "RNGTracker",
             "CommunicationLog", "FlopsUtilization", "ParallelMesh", "RewriteContext", "apply_recompute", "rewrite",
             "validate_layout", "vocab_parallel_cross_entropy", "Layout", "ParallelDims", "Placement",
             "CheckpointConfig", "PrecisionConfig", "RewriteConfig", "LaunchConfig", "AttentionSpec", "DenseMLPSpec",
             "HostSyncCounter"]
    assert [n for n in names if not hasattr(lightning_seqpar, n)] == []
    assert set(names) <= set(lightning_seqpar.__all__)


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
            "'transformers', 'safetensors', 'torchdata'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PACKAGE.parent).stdout.strip()
    assert out == "[]"
