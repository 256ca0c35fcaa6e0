"""Your own block as data: a :class:`~lightning_seqpar.transformer.declared_block.BlockSpec` turned into a policy.

    policy = DeclaredBlockPolicy(Block, BlockSpec(attention_norm="ln_1", mlp_norm="ln_2", qkv="attn.c_attn",
                                                  attention_out="attn.c_proj", mlp_in="mlp.c_fc",
                                                  mlp_out="mlp.c_proj", activation="F.gelu", num_heads="attn.n_head"))
    SeqParallelStrategy(tp=2, rewriting=RewriteConfig(policies=[policy]))

The built-in Hugging Face policy is one of these, its spec read off each model's config
(:mod:`lightning_seqpar.hf.layouts`).
"""

from __future__ import annotations

import copy
import inspect
from typing import Optional

import torch
import torch.nn as nn

from lightning_seqpar.transformer.block_arguments import NO_EFFECT, USED
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.block_spec import (
    ATTENTION_IMPLEMENTATIONS,
    BlockSpec,
    resolve,
    rotary_function,
    undeclared_parts,
    value_of,
)
from lightning_seqpar.transformer.declared_block import ParallelBlock
from lightning_seqpar.rewriting.policy import Policy, require_divisible
from lightning_seqpar.rewriting.verify import verify_parallel_block
from lightning_seqpar.transformer.lora import lora_parts
from lightning_seqpar.transformer.tuner_layers import linear_of


def refuse_unknown_parameters(module: nn.Module, spec: BlockSpec, name: str) -> None:
    """Refuse a block whose ``forward`` requires an argument the parallel block cannot use (litgpt's
    ``Block.forward(x, cos, sin, ...)``): the model must pass it, and ignoring it would compute another function.
    Optional ones are checked when passed (:func:`~lightning_seqpar.transformer.block_arguments.parse_block_arguments`).

    Raises:
        ValueError: naming the parameters, the block and the fix.
    """
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())[1:]  # after the hidden states
    except (TypeError, ValueError):
        return
    known = set(USED) | set(NO_EFFECT)
    unknown = [p.name for i, p in enumerate(parameters)
               if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and p.name not in known and (i >= len(spec.arguments) or spec.arguments[i] not in known)]
    if unknown:
        raise ValueError(
            f"{name} ({type(module).__name__}): its forward requires {unknown}, which the parallel block built from "
            f"the BlockSpec cannot use (it uses {list(USED)}; rotary embeddings as position_embeddings=(cos, sin) with "
            f"BlockSpec(rotary=...)). Ignoring them would compute another function. Pass what the block needs under "
            f"those names (and name positional ones in BlockSpec(arguments=...)), or write a Policy for this block."
        )


class DeclaredBlockPolicy(Policy):
    """Rewrites every instance of ``block`` into a :class:`ParallelBlock` built from ``spec``.

    Args:
        block: the user's block class (exact class).
        spec: which submodules play which part; see :class:`BlockSpec`.

    Raises (from :meth:`check` and :meth:`verify`, before any process communicates):
        ValueError: a declared path that does not exist or is not an ``nn.Linear``; neither or both of ``qkv``
            and ``q``/``k``/``v`` (or of ``mlp_in`` and ``gate``/``up``); a parameter or buffer of the block in no
            declared part; heads, key/value heads or MLP width not divisible by tp; an attention implementation
            other than eager/sdpa; a parallel block that does not compute what the block computes.
    """

    def __init__(self, block: type[nn.Module], spec: Optional[BlockSpec] = None) -> None:
        self.block = block  # type: ignore[misc]
        self.spec = spec

    def __eq__(self, other: object) -> bool:  # a declaration is its value: equal across processes
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), self.block, self.spec))

    def spec_for(self, module: nn.Module) -> BlockSpec:
        """The declaration for ``module`` (a subclass may read it off the module, e.g. its config)."""
        assert self.spec is not None
        return self.spec

    def check(self, module: nn.Module, ctx: RewriteContext, name: str) -> None:
        spec = self.spec_for(module)
        attention, _ = spec.projections()
        if bool(spec.attention.qkv) == bool(spec.attention.q or spec.attention.k or spec.attention.v) or (not spec.attention.qkv and not (spec.attention.q and spec.attention.k and spec.attention.v)):
            raise ValueError(f"{name}: declare the attention input as qkv='...' (fused) or as q=, k=, v= (all three).")
        spec.mlp.check_declaration(name)
        linears = {*attention, spec.attention.attention_out, *spec.mlp.linears()}
        try:
            for role, path in spec.paths().items():
                found = resolve(module, path)
                if path in linears and lora_parts(found, f"{name}: the declared {role} '{path}'") is not None:
                    found = linear_of(found)  # a LoRA adapter the parallel block carries: the base is split
                transposed_ok = spec.transposed and getattr(getattr(found, "weight", None), "dim", lambda: 0)() == 2
                packed = path == spec.attention.qkv and isinstance(found, nn.MultiheadAttention)
                if path in linears and not (isinstance(found, nn.Linear) or transposed_ok or packed):
                    raise ValueError(f"{name}: the declared {role} '{path}' is a {type(found).__name__}, not an "
                                     f"nn.Linear (a Conv1D-style [in, out] weight needs transposed=True).")
            heads = value_of(module, spec.attention.num_heads)
            kv_heads = value_of(module, spec.attention.num_kv_heads) or heads
            for function in (spec.mlp.activation, getattr(spec.mlp, "glu", None)):  # a MoE's glu is a method
                if function and not function.startswith("F."):
                    resolve(module, function)
            if spec.attention.rotary and not callable(rotary_function(module, spec)):
                raise ValueError(f"{name}: the declared rotary function '{spec.attention.rotary}' is not in "
                                 f"{type(module).__module__}.")
        except AttributeError as error:
            raise ValueError(f"{name} ({type(module).__name__}): the block declaration names a part that does not "
                             f"exist: {error} Fix the BlockSpec.") from None
        refuse_unknown_parameters(module, spec, name)
        left_out = undeclared_parts(module, spec)
        if left_out:
            raise ValueError(self.undeclared_message(module, name, left_out))
        require_divisible(name, "the number of attention heads", heads, ctx.tp)
        if kv_heads % ctx.tp:
            valid = [t for t in range(1, kv_heads + 1) if kv_heads % t == 0 and heads % t == 0]
            raise ValueError(
                f"{name}: num_key_value_heads = {kv_heads} is not divisible by the tensor-parallel size tp = {ctx.tp} "
                f"(grouped-query attention splits the key/value heads over tp ranks). Valid tp: {valid}."
            )
        spec.mlp.check_split(module, ctx, name)
        implementation = value_of(module, spec.attention.implementation) if "." in spec.attention.implementation else spec.attention.implementation
        if implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"{name}: attn_implementation={implementation!r} is not supported under tensor parallelism. Use "
                f"'eager' (explicit core attention: selective recomputation applies) or 'sdpa' (fused: keeps no s² "
                f"tensor)."
            )

    def undeclared_message(self, module: nn.Module, name: str, left_out: list[str]) -> str:
        """The refusal of a block with parts its declaration does not name."""
        return (f"{name} ({type(module).__name__}): parts of the block are in no declared part of its BlockSpec: "
                f"{', '.join(left_out)}. The parallel block would compute without them (a different function) and "
                f"drop their weights. Declare them (e.g. q_norm=/k_norm= for per-head query/key norms), or write a "
                f"Policy for this block.")

    def sample_block(self, module: nn.Module) -> nn.Module:
        """A block of ``module``'s class, with values, for :meth:`verify` to consume: a copy of ``module`` whose
        floating-point parameters are redrawn (an initialization that zeroes a projection would hide a misnamed
        part), allocated on the CPU if ``module`` is on the meta device."""
        sample = copy.deepcopy(module)
        if any(t.is_meta for t in [*sample.parameters(), *sample.buffers()]):
            sample = sample.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in sample.parameters():
                if param.is_floating_point():
                    param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.5)
        return sample

    def verify(self, module: nn.Module, ctx: RewriteContext, name: str) -> None:
        """Check that the parallel block computes what ``module`` computes, at ``ctx``'s tp and SP, on a small
        input (:func:`~lightning_seqpar.rewriting.verify.verify_parallel_block`); once per block class."""
        sample = self.sample_block(module)
        spec = self.spec_for(sample)
        # Experts split over ranks are checked split over the emulated tp ranks: the dispatch runs too.
        verify_parallel_block(sample, spec, ctx, name, lambda block, c: ParallelBlock(block, spec, c))

    def describe(self, module: nn.Module, ctx: RewriteContext) -> str:
        spec = self.spec_for(module)
        attention, _ = spec.projections()
        heads = value_of(module, spec.attention.num_heads)
        kv_heads = value_of(module, spec.attention.num_kv_heads) or heads
        implementation = value_of(module, spec.attention.implementation) if "." in spec.attention.implementation else spec.attention.implementation
        heads_text = (f"{heads} query / {kv_heads} key-value heads → {heads // ctx.tp} / {kv_heads // ctx.tp}"
                      if kv_heads != heads else f"{heads} heads → {heads // ctx.tp}")
        return (
            f"{type(module).__name__}{self.layout_name()}: {heads_text} per rank "
            f"({'/'.join(attention)} column-parallel, one gather; {spec.attention.attention_out} row-parallel); "
            f"{spec.mlp.describe(module, ctx)}; "
            f"{'/'.join(dict.fromkeys(p for p in (spec.attention.attention_norm, spec.attention.attention_post_norm, spec.mlp.mlp_norm, spec.mlp.mlp_post_norm) if p))} "
            f"{'sequence-parallel' if ctx.sp else 'replicated'}; "
            f"{'parallel residual; ' if spec.parallel_residual else ''}attention {implementation}"
            + (f" soft-capped at {value_of(module, spec.attention.attention_softcap)}"
               if value_of(module, spec.attention.attention_softcap) is not None and implementation != "sdpa" else "")
            + (" (fused kernel: no s² tensor, selective recompute unnecessary)" if implementation == "sdpa" else "")
            + (self._context_text(module, spec, ctx) if ctx.cp > 1 else "")
            + self._lora_text(module, spec, ctx)
        )

    @staticmethod
    def _lora_text(module: nn.Module, spec: BlockSpec, ctx: RewriteContext) -> str:
        """The LoRA adapters a PEFT model put on the projections, and how they are split."""
        attention, _ = spec.projections()
        adapted = {}
        for path in (*attention, spec.attention.attention_out, *spec.mlp.linears()):
            parts = lora_parts(resolve(module, path), path)
            if parts is not None:
                adapted[path] = parts
        if not adapted:
            return ""
        ranks = sorted({p.a.shape[0] for p in adapted.values()})
        frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
        rows = {spec.attention.attention_out, *spec.mlp.row_linears()}
        return (f"; LoRA r={'/'.join(map(str, ranks))} on {'/'.join(adapted)} (column: A replicated, B split; row: "
                f"A split, B replicated, added before the one reduction); {frozen:,} frozen parameters: no gradient, "
                f"no optimizer state" + (f"; {sum(p not in rows for p in adapted)} r-sized all-gathers per layer"
                                          if ctx.sp and ctx.tp > 1 else ""))

    def _context_text(self, module: nn.Module, spec: BlockSpec, ctx: RewriteContext) -> str:
        window = value_of(module, spec.attention.sliding_window)
        c = ctx.cp
        return (f"; context parallel over cp={c} ({ctx.context.comm}): each rank's s/{c} tokens in chunks r and "
                f"{2 * c - 1}−r of {2 * c}, attention block by block (log-sum-exp merged; no s² tensor kept"
                + (f"; window {window}, blocks outside it skipped" if window is not None else "") + ")")

    def layout_name(self) -> str:
        """Shown after the class name by :meth:`describe` (e.g. ``" (Llama layout)"``)."""
        return " (declared block)"

    def rewrite(self, module: nn.Module, ctx: RewriteContext, *, enter_region: bool, exit_region: bool) -> nn.Module:
        return ParallelBlock(module, self.spec_for(module), ctx, enter_region=enter_region, exit_region=exit_region)
