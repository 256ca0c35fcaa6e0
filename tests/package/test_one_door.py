"""Each thing has one door: a schedule's split backward is asked through one predicate, a parameter's placement is
imported from where it lives (not through a module that re-exports it), and the package has one map, in
docs/architecture.md, naming every folder and top-level module; the pipeline moves a payload beside its activations
without knowing what it is; the MLP slot is asked through its protocol, never type-tested; a rewrite context is made
in one place, from a layout and a mesh; a layer's memory policy is set in one place."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import lightning_seqpar.parallel.placement as placement

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for folder in ("lightning_seqpar", "tests", "recipes") for p in (ROOT / folder).rglob("*.py"))


def test_a_split_backward_is_asked_through_one_predicate():
    asked = [f"{path.relative_to(ROOT)}:{number}" for path in SOURCES
             if path.name != "schedules.py" and path != Path(__file__).resolve()
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\bin SPLIT_BACKWARD\b", line)]
    assert not asked, f"use pipeline_parallel.schedules.splits_backward(schedule) at {asked}"


def test_placement_names_are_imported_from_where_they_live():
    owned = {name for name in dir(placement) if not name.startswith("_")}
    through = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "lightning_seqpar.tensor_parallel.sharding":
                through += [f"{path.relative_to(ROOT)}: {a.name}" for a in node.names
                            if a.name in owned and a.name in vars(placement)
                            and getattr(vars(placement)[a.name], "__module__", None) == placement.__name__]
    assert not through, f"import these from lightning_seqpar.parallel.placement: {through}"


def test_the_one_map_names_every_folder_and_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("```", 2)[1]
    mapped = set(re.findall(r"^  ([a-z_]+/|[a-z_]+\.py)", block, re.M))
    package = ROOT / "lightning_seqpar"
    present = {f"{p.name}/" for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    present |= {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    assert present <= mapped, f"not in docs/architecture.md's map: {sorted(present - mapped)}"
    readme = (ROOT / "README.md").read_text()
    assert "lightning_seqpar/\n  parallel/" not in readme and "docs/architecture.md" in readme


def test_the_pipeline_knows_no_mixture_of_experts():
    # What crosses stages beside the activations is a payload (pipeline_parallel/payload.py); the router losses are one.
    folder = ROOT / "lightning_seqpar" / "pipeline_parallel"
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_seqpar.moe"):
                found.append(f"{path.name}:{node.lineno} imports {node.module}")
        found += [f"{path.name}:{n}" for n, line in enumerate(path.read_text().splitlines(), 1)
                  if re.search(r"router|expert", line, re.I) and path.name == "executor.py"]
    assert not found, f"the pipeline reaches into mixtures of experts at {found}"


def test_the_mlp_slot_is_asked_not_type_tested():
    # Offload, recomputation, the memory explanation and the build ask the slot (transformer/mlp_slot.py): no type test
    # of the part that fills it, and no read of the block's private attribute outside the block.
    package = ROOT / "lightning_seqpar"
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted(package.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"isinstance\([^)]*\b(MoEPart|DenseMLPPart)\b", line)
             or (re.search(r"\._mlp\b", line) and path.name != "declared_block.py")]
    assert not found, f"ask layer.mlp_slot (an MLPSlot) instead at {found}"


def test_a_rewrite_context_is_made_in_one_place():
    # The run, the checks before any rank starts, the dry run, the planner's inventory and probes, explain and the
    # self-checks: each makes its context with RewriteContext.of(layout, mesh) or derives it (emulated), never
    # by hand.
    package = ROOT / "lightning_seqpar"
    found = [f"{path.relative_to(ROOT)}:{n}" for path in sorted(package.rglob("*.py"))
             if path.relative_to(package).as_posix() != "transformer/context.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\bRewriteContext\(", line)]
    assert not found, f"make it with RewriteContext.of(layout, mesh) at {found}"


def test_a_layer_s_memory_policy_is_set_in_one_place():
    # Recomputation and offload replace a layer's frozen LayerMemory through ParallelLayer.set_memory (checked first),
    # which alone hands core attention and the MLP slot their parts: nothing else assigns a layer's policy or its
    # parts'.
    found = [f"{path.relative_to(ROOT)}:{n}" for path in SOURCES
             if path.relative_to(ROOT).as_posix() != "lightning_seqpar/transformer/roles.py"
             and path != Path(__file__).resolve()
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"(?<!plan)\.(memory|offload|recompute_layer|recompute_mlp|recompute_norms|"
                          r"checkpointed_whole)\s*=[^=]", line)
             or (re.search(r"\.(recompute_within|offload_within)\(", line) and "def " not in line)]
    assert not found, f"set the layer's policy with set_layer_memories / ParallelLayer.set_memory at {found}"
