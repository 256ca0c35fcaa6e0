"""Compiled transformer blocks: each rewritten block's body run through ``torch.compile(fullgraph=True)``.

What is compiled is :meth:`ParallelBlock._body <lightning_seqpar.transformer.declared_block.ParallelBlock._body>`:
norms, the g all-gathers, column- and row-parallel projections, core attention (checkpointed inside the graph under
selective recomputation), the MLP, the ḡ reduce-scatters, dropouts and residual adds — every kernel of the layer.
The block's argument checks (names refused, a key/value cache holding tokens, the mask conventions) stay in Python
around it: they raise errors by name, and they read objects the graph should not guard on.

One graph per block, never a graph break (``fullgraph=True``: a break is an error naming the block), as torchtitan
compiles its blocks. Collectives are traced as functional collectives: the custom backwards of the g/ḡ operators
are traced with them, so no gradient is reduced twice, and the in-flight overlap the eager backward does by hand is
left to the compiler (:meth:`ParallelGroup._eager <lightning_seqpar.parallel.collectives.ParallelGroup>`).

A mixture of experts with a capacity (``moe=DispatchConfig(capacity_factor=...)``) compiles: its all-to-all sizes are
host integers fixed by the shapes, and its routing (sorts, cumulative sums, scatters into capacity slots) has static
shapes.

Under context parallelism (and packed documents) a pre-norm block compiles in two halves, each one graph, around its
attention across the cp ranks, which runs eagerly: the ring's point-to-point transfers and the per-forward layout
have no traceable form (:meth:`ParallelBlock._around_context_attention
<lightning_seqpar.transformer.declared_block.ParallelBlock>`). The halves pass on only what the other half reads, so
the gradients' sums are eager's, bit for bit under ``aot_eager``.

Not compiled, refused before training (:func:`compile_blocks`): a post-norm block under context parallelism,
dropless mixtures of experts (the dispatch reads its split sizes on the host), a Hugging Face mixture recording its
router logits (transformers' hooks on the router) and dropout drawn from the tensor-parallel random stream (attention
dropout; residual dropout under sequence parallelism): swapping the generator's state in and out is not traceable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import torch
import torch.nn as nn

from lightning_seqpar.moe import GroupedExperts
from lightning_seqpar.transformer.roles import ParallelLayer

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileConfig:
    """How the strategy compiles each rewritten block (``RewriteConfig(compile=...)``).

    Attributes:
        backend: a ``torch.compile`` backend: ``"inductor"`` (fused kernels; the default) or a debugging one
            (``"aot_eager"``: the same autograd graphs run op by op, bit-equal to eager).
        mode: ``torch.compile``'s mode (``None``, ``"default"``, ``"reduce-overhead"``, ``"max-autotune"``,
            ``"max-autotune-no-cudagraphs"``).
        dynamic: ``torch.compile``'s ``dynamic``: ``False`` (the default) specializes on shapes, as training with
            fixed-length blocks of tokens wants; ``None`` lets torch mark changing sizes dynamic after a recompile.

    Raises:
        ValueError: a backend torch does not list, a mode not above, a ``dynamic`` that is not ``True``, ``False`` or
            ``None``.
    """

    backend: str = "inductor"
    mode: Optional[str] = None
    dynamic: Optional[bool] = False

    def __post_init__(self) -> None:
        known = torch.compiler.list_backends(exclude_tags=())
        if not isinstance(self.backend, str) or self.backend not in known:
            raise ValueError(f"compile backend={self.backend!r}: not a torch.compile backend; one of {sorted(known)}.")
        if self.mode not in MODES:
            raise ValueError(f"compile mode={self.mode!r}: one of {list(MODES)}.")
        if self.dynamic not in (True, False, None):
            raise ValueError(f"compile dynamic={self.dynamic!r}: True, False or None.")

    def compile(self, function: Callable) -> Callable:
        """``torch.compile(function, fullgraph=True, ...)`` with these settings."""
        return torch.compile(function, fullgraph=True, backend=self.backend, mode=self.mode, dynamic=self.dynamic)


def compile_config_of(value: Union[bool, CompileConfig, Mapping[str, Any], None]) -> Optional[CompileConfig]:
    """The strategy's ``compile=`` argument as a :class:`CompileConfig`, or ``None`` (eager).

    ``True``: the defaults (inductor); a mapping (a recipe's ``strategy.rewriting.compile: {backend: aot_eager}``):
    its keys.

    Raises:
        ValueError: anything else, or a mapping with keys :class:`CompileConfig` does not have.
    """
    if value is None or value is False:
        return None
    if value is True:
        return CompileConfig()
    if isinstance(value, CompileConfig):
        return value
    if isinstance(value, Mapping):
        unknown = set(value) - {"backend", "mode", "dynamic"}
        if unknown:
            raise ValueError(f"compile={dict(value)!r}: unknown key(s) {sorted(unknown)}; the keys are backend, mode "
                             f"and dynamic.")
        return CompileConfig(**value)
    raise ValueError(f"compile={value!r}: True, False, a CompileConfig or a mapping of backend / mode / dynamic.")


def _recorded_router_logits(model: nn.Module) -> str:
    """The class of a transformers config in ``model`` with ``output_router_logits=True``, or ``""``. (The reference
    GPT computes its load-balancing loss in its own blocks, which compiles.)"""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "output_router_logits", False) is True and type(config).__module__.startswith("transformers."):
            return type(config).__name__
    return ""


def compile_blocks(model: nn.Module, config: CompileConfig) -> int:
    """Have every rewritten block of ``model`` run its body compiled with ``config`` (at its first call, after the
    recomputation a callback applies; a later change of recomputation recompiles). Returns the number of blocks.

    Raises:
        ValueError: a post-norm block under context parallelism, with a dropless mixture of experts or with
            tensor-parallel-stream dropout (not compiled yet); a Hugging Face mixture of experts whose config records
            its router logits (``output_router_logits=True``: transformers' recording hooks on the router break the
            graph); naming the block and the fix, before any block is changed.
    """
    blocks = [(name, m) for name, m in model.named_modules() if isinstance(m, ParallelLayer)]
    for name, block in blocks:
        refusal = block.not_compilable()
        if refusal:
            raise ValueError(f"compile=True: the block {name!r} {refusal}.")
    recorded = _recorded_router_logits(model)
    if recorded:
        experts = next((name for name, block in blocks if any(isinstance(m, GroupedExperts) for m in block.modules())),
                       None)
        if experts is not None:
            raise ValueError(
                f"compile=True: the block {experts!r} holds a mixture of experts whose router logits {recorded} "
                f"records with output_router_logits=True for its load-balancing loss; transformers records them "
                f"with hooks on the router that a compiled graph cannot run. Set output_router_logits=False, or "
                f"train with compile=False.")
    for _, block in blocks:
        block.compile_config = config
    return len(blocks)
