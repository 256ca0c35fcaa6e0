"""Walk a model, find blocks a policy knows, and replace them with their parallel versions.

The engine takes the whole, ordered list of policies (the user's, then the built-in ones that
:mod:`lightning_seqpar.policies` adds); it applies each through :meth:`Policy.replace` and checks whole models through
:meth:`Policy.verify_model`, never asking a policy what it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import torch.nn as nn

from lightning_seqpar.rewriting.policy import DeclaresPolicy, Policy
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.lora import refuse_unsupported_peft


@dataclass
class PlannedRewrite:
    """One module to be replaced."""

    name: str
    block: str
    policy: Policy
    enter_region: bool
    exit_region: bool
    detail: str


@dataclass
class RewritePlan:
    """What :func:`rewrite` will do (or did): one entry per replaced module, in model order."""

    tp: int
    sequence_parallel: bool
    entries: list[PlannedRewrite] = field(default_factory=list)
    entries_only: list[tuple[str, Policy]] = field(default_factory=list)
    """models whose parts around the layers stay whole (t = c = 1) but whose call needs its entry
    (:meth:`ModelPolicy.install_entry`): ``(qualified name, policy)``"""
    cp: int = 1
    cp_comm: str = "ring"
    memory: Optional[Any] = None
    """:func:`explain`'s table of memory choices per layer (a :class:`~.memory_choices.LayerMemory`), when asked"""
    pipeline: Optional[Any] = None
    """:func:`explain`'s pipeline schedule report (bubble, peak per rank), when asked with ``pp > 1``
    (:class:`lightning_seqpar.pipeline_parallel.report.ScheduleReport`)"""

    def __str__(self) -> str:
        mode = ("TP+SP" if self.sequence_parallel else "TP") + (f"+CP ({self.cp_comm})" if self.cp > 1 else "")
        at = f"tp={self.tp}" + (f", cp={self.cp}" if self.cp > 1 else "")
        lines = [f"{mode} rewrite at {at}: {len(self.entries)} module(s)"]
        for e in self.entries:
            region = "".join(["  [enters region]" if e.enter_region else "", "  [leaves region]" if e.exit_region else ""])
            lines.append(f"  {e.name or '<root>'} ({e.block}){region}\n      {e.detail}")
        lines += [str(part) for part in (self.memory, self.pipeline) if part is not None]
        return "\n".join(lines)


class _Registry:
    """Policies by exact block class (earlier in the list first), then what a class declares, then the policies that
    recognize a layout by structure (:meth:`Policy.matches`), earlier first."""

    def __init__(self, policies: Iterable[Policy]) -> None:
        every = list(policies)
        self.structural = [p for p in every if p.block is nn.Module]  # recognized by structure
        self.by_class: dict[type, Optional[Policy]] = {p.block: p for p in reversed(every) if p.block is not nn.Module}

    def get(self, module: nn.Module) -> Optional[Policy]:
        cls = type(module)
        if cls not in self.by_class:
            declared = cls.parallel_policy() if issubclass(cls, DeclaresPolicy) else None
            if declared is None or declared.block is not cls:
                declared = next((p for p in self.structural if p.matches(module)), None)
            self.by_class[cls] = declared
        return self.by_class[cls]

    def known(self) -> list[str]:
        return sorted({cls.__name__ for cls, p in self.by_class.items() if p is not None and not p.around_layers}
                      | {"Hugging Face decoder blocks of the Llama, GPT-2, GPT-NeoX and Falcon layouts"})


def _candidate_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Classes that look like transformer blocks, with one instance each: elements of layer lists; where there are
    none, modules holding projections (children with a 2-D weight: ``nn.Linear``, Hugging Face's ``Conv1D`` ...)."""
    in_lists: dict[str, nn.Module] = {}
    holding: dict[str, nn.Module] = {}
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            for child in module.children():
                in_lists.setdefault(type(child).__name__, child)
        elif module is not model and any(getattr(getattr(c, "weight", None), "dim", lambda: 0)() == 2
                                         for c in module.children()):
            holding.setdefault(type(module).__name__, module)
    return dict(sorted((in_lists or holding).items()))  # the layers of a layer list, where there is one


_POSITION_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_number", "layer_index", "idx", "index"})


def configuration(module: nn.Module) -> tuple:
    """What can make two blocks of one class compute differently, besides their weights: the plain attributes
    (flags, numbers, strings) of the block and its submodules, a layer's position excepted. Blocks of one class are
    self-checked once per configuration (SmolLM3's layers without rotary embeddings differ by ``use_rope``)."""
    plain = (bool, int, float, str, type(None))
    return tuple((path, key, repr(value)) for path, sub in module.named_modules() for key, value in sorted(vars(sub).items())
                 if not key.startswith("_") and key not in _POSITION_ATTRIBUTES and isinstance(value, plain))


def _why_not(candidates: dict[str, nn.Module], registry: _Registry) -> str:
    """Each candidate block class with the reasons the structural policies give for not taking it."""
    lines = []
    for name, module in candidates.items():
        reasons = [r for p in registry.structural for r in p.mismatch(module)]
        lines.append(f"{name}: {'; '.join(dict.fromkeys(reasons)) if reasons else 'not a known layout'}")
    return "; ".join(lines) or "none"


def plan_rewrite(model: nn.Module, ctx: RewriteContext, policies: Iterable[Policy], verify: bool = True) -> RewritePlan:
    """Find what to rewrite with ``policies`` (every one, in order of precedence) and check every shape, changing
    nothing.

    ``verify``: also run each policy's self-check (:meth:`Policy.verify`) on one block of each class: the parallel
    block computes what the block computes, on a small input (no communication; a forward of one small block).

    Raises:
        ValueError: if no module is recognized (naming the block classes found and how to register a
            policy), if a recognized module cannot be split t ways (naming it and the numbers), or if a
            self-check finds a parallel block that computes something else.
    """
    policies = list(policies or ())
    registry = _Registry(policies)
    plan = RewritePlan(ctx.tp, ctx.sp, cp=ctx.cp, cp_comm=ctx.context.comm if ctx.context is not None else "ring")
    claimed: list[str] = []
    verified: set[tuple] = set()
    whole_models: list[tuple[str, nn.Module, Policy]] = []  # checked whole, once every block passed its own checks

    def check(policy: Policy, module: nn.Module, name: str) -> None:
        policy.check(module, ctx, name)
        if not verify or any(name.startswith(f"{prefix}.") or not prefix for prefix, _, _ in whole_models):
            return  # the blocks of a model checked whole need no check of their own
        key = (type(module), configuration(module))
        if key not in verified:
            verified.add(key)
            policy.verify(module, ctx, name)

    def check_model(policy: Policy, module: nn.Module, name: str) -> None:
        policy.check(module, ctx, name)
        if verify:
            whole_models.append((name, module, policy))

    def visit(prefix: str, module: nn.Module) -> None:
        children = list(module.named_children())
        chain_ok = isinstance(module, (nn.ModuleList, nn.Sequential))
        i = 0
        while i < len(children):
            name, child = children[i]
            full = f"{prefix}.{name}" if prefix else name
            policy = registry.get(child)
            if policy is not None and policy.around_layers:  # the layers inside are visited too
                check_model(policy, child, full)
                if ctx.tp > 1 or ctx.cp > 1:  # cp: the model's entry splits the sequence
                    plan.entries.append(PlannedRewrite(full, type(child).__name__, policy, False, False,
                                                       policy.describe(child, ctx)))
                elif ctx.context is not None:  # one rank: packed documents still reach the rewritten layers
                    plan.entries_only.append((full, policy))
                policy = None
            if policy is None:
                visit(full, child)
                i += 1
                continue
            if not policy.chains or not chain_ok:
                run = [(full, child, policy)]
            else:
                run = []
                while i + len(run) < len(children):
                    n, c = children[i + len(run)]
                    p = registry.get(c)
                    if p is None or not p.chains:
                        break
                    run.append((f"{prefix}.{n}" if prefix else n, c, p))
            for j, (n, c, p) in enumerate(run):  # a run of one opens and closes its region
                check(p, c, n)
                plan.entries.append(PlannedRewrite(n, type(c).__name__, p, j == 0, j == len(run) - 1, p.describe(c, ctx)))
                claimed.append(n)
            i += len(run)

    root_policy = registry.get(model)
    if root_policy is not None and not root_policy.around_layers:
        check(root_policy, model, type(model).__name__)
        plan.entries.append(PlannedRewrite("", type(model).__name__, root_policy, True, True, root_policy.describe(model, ctx)))
    else:
        if root_policy is not None:  # a causal LM given as the model itself (explain)
            check_model(root_policy, model, "")
        if root_policy is not None and (ctx.tp > 1 or ctx.cp > 1):
            plan.entries.append(PlannedRewrite("", type(model).__name__, root_policy, False, False,
                                               root_policy.describe(model, ctx)))
        elif root_policy is not None and ctx.context is not None:
            plan.entries_only.append(("", root_policy))
        visit("", model)
    if all(entry.policy.around_layers for entry in plan.entries):  # a vocabulary alone is no transformer
        known = ", ".join(registry.known())
        raise ValueError(
            f"No transformer block that lightning_seqpar can parallelize was found in {type(model).__name__}. "
            f"Block-like classes found (in layer lists, or holding projections), and why none is known: "
            f"{_why_not(_candidate_blocks(model), registry)}. "
            f"Known blocks: {known}. Describe your block in a few lines: `DeclaredBlockPolicy(MyBlock, BlockSpec("
            f"attention_norm=..., qkv=... or q/k/v=..., attention_out=..., mlp_in=... or gate/up=..., mlp_out=..., "
            f"activation=..., num_heads=...))` from lightning_seqpar, passed as "
            f"`SeqParallelStrategy(rewriting=RewriteConfig(policies=[...]))`; or write a `lightning_seqpar.Policy` (or "
            f"return one from the class's `parallel_policy()` classmethod)."
        )
    refuse_unsupported_peft(model, [e.name for e in plan.entries if not e.policy.around_layers])
    policies = list(policies)
    for name, module, policy in whole_models:  # after the blocks' own checks, whose refusals say more

        def rewrite_small(small: nn.Module, small_ctx: RewriteContext) -> nn.Module:
            rewrite(small, small_ctx, policies, verify=False)
            return small

        policy.verify_model(module, ctx, f"{name} ({type(module).__name__})" if name else type(module).__name__,
                            rewrite_small)
    return plan


def rewrite(model: nn.Module, ctx: RewriteContext, policies: Iterable[Policy], verify: bool = True) -> RewritePlan:
    """Replace every module of ``model`` that one of ``policies`` knows, in place, by its tensor (+sequence) parallel
    version (:meth:`Policy.replace`).

    Weights are sliced from the single-device modules, so the rewritten model computes the same
    function as before. ``model`` itself cannot be replaced: a recognized root (e.g. a bare
    :class:`~lightning_seqpar.models.GPT`) must sit inside a parent module (a LightningModule); a model changed in
    place (:class:`~lightning_seqpar.rewriting.policy.ModelPolicy`) can be the root.

    Returns:
        The executed :class:`RewritePlan`.

    Raises:
        ValueError: from :func:`plan_rewrite`, before any module is changed.
    """
    plan = plan_rewrite(model, ctx, policies, verify)
    for entry in plan.entries:
        if not entry.name and entry.policy.around_layers:
            entry.policy.replace(model, ctx, "", enter_region=False, exit_region=False)
            continue
        if not entry.name:
            raise ValueError(f"{entry.block} is the model itself; wrap it in a LightningModule attribute to rewrite it.")
        parent_name, _, attr = entry.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, attr) if not attr.isdigit() else parent[int(attr)]
        replacement = entry.policy.replace(module, ctx, entry.name, enter_region=entry.enter_region,
                                           exit_region=entry.exit_region)
        if attr.isdigit():
            parent[int(attr)] = replacement
        else:
            setattr(parent, attr, replacement)
    for name, policy in plan.entries_only:
        policy.install_entry(model.get_submodule(name) if name else model, ctx, name)  # type: ignore[attr-defined]
    return plan


def explain(model: nn.Module, ctx: RewriteContext, policies: Iterable[Policy], verify: bool = True,
            seq_len: Optional[int] = None, micro_batch_size: int = 1, bytes_per_element: int = 2,
            pipeline: Optional[Callable[[nn.Module, Optional[Any]], Any]] = None) -> RewritePlan:
    """Print and return what a rewrite with ``policies`` under ``ctx`` (a rank's context over a virtual mesh:
    :meth:`~lightning_seqpar.transformer.context.RewriteContext.of`) would do to ``model``; change nothing. With
    ``seq_len`` (tokens of a sequence, the whole one under cp) also the activation bytes one layer keeps on a rank
    per micro-batch of ``micro_batch_size`` sequences under each recomputation and offload choice, and the bytes an
    offload moves (``bytes_per_element``: 2 for 16-bit activations; :mod:`.memory_choices`, read from a meta-device
    copy rewritten the same way). ``pipeline``: called with that copy and the memory table (or ``None``), its result
    kept as :attr:`RewritePlan.pipeline` (the pipeline schedule's report, which this layer below the pipeline does
    not build itself).

    Needs no process group. Raises the same ``ValueError`` as the real rewrite would, and for ``seq_len`` or
    ``micro_batch_size`` below 1.
    """
    if seq_len is not None and (seq_len < 1 or micro_batch_size < 1):
        raise ValueError(f"explain(seq_len={seq_len}, micro_batch_size={micro_batch_size}): both must be at least 1 "
                         f"(tokens per sequence, sequences per micro-batch).")
    policies = list(policies)
    plan = plan_rewrite(model, ctx, policies, verify)
    if seq_len is not None or pipeline is not None:
        from lightning_seqpar.rewriting.memory_choices import layer_memory, meta_rewrite

        copy, on_meta = meta_rewrite(model, ctx)
        rewrite(copy, on_meta, policies, verify=False)
        if seq_len is not None:
            plan.memory = layer_memory(copy, ctx, seq_len, micro_batch_size, bytes_per_element)
        if pipeline is not None:
            plan.pipeline = pipeline(copy, plan.memory)
    print(plan)
    return plan


def pipeline_placement(model: nn.Module, policies: Iterable[Policy]) -> dict[str, str]:
    """``{qualified path: "first" | "last"}``: the parts outside the layer stack that one pipeline stage holds, as
    the policies of the models found in ``model`` place them (:meth:`Policy.pipeline_placement`; a Hugging Face
    causal LM's embeddings on the first stage, its final norm and LM head on the last). At any tp."""
    registry = _Registry(policies)
    placement: dict[str, str] = {}
    for name, module in model.named_modules():
        policy = registry.get(module)
        if policy is not None:
            placement.update({f"{name}.{path}" if name else path: where
                              for path, where in policy.pipeline_placement(module).items()})
    return placement
