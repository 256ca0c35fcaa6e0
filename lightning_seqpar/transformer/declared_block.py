"""A transformer block built from a declaration (:class:`BlockSpec`): an attention part and an MLP part joined to the
residual stream.

Most decoder blocks are ``x + attention_out(attention(qkv(norm1(x))))`` then
``x + mlp_out(act(mlp_in(norm2(x))))`` (or a gated ``act(gate(·)) · up(·)``), with dropouts on the residual
branches and, in some families, rotary position embeddings on q and k. A :class:`BlockSpec` names the
submodules of a user's block that play each part; :class:`ParallelBlock` is the tensor (+sequence) parallel
block built from it, split as Megatron splits its GPT layer (Korthikanti et al. 2022, Fig. 5):

- the projections of the attention input (fused ``qkv``, or separate ``q``/``k``/``v``) and of the MLP input
  (``mlp_in``, or ``gate``/``up``) are column-parallel and share one g (all-gather of the ``[s/t, b, h]``
  norm output; only the shard is kept for backward: :func:`column_parallel_linears`);
- ``attention_out`` and ``mlp_out`` are row-parallel and end in ḡ (reduce-scatter);
- the norms, residual dropouts and residual adds run on ``[s/t, b, h]`` shards (their weights are tagged
  sequence-parallel); query and key/value heads are split over t ranks (grouped-query attention included).

The user's block is not called: its parameters are sliced into the parallel block, whose parameter names
mirror the user's (``attn.c_attn.weight`` stays ``attn.c_attn.weight``), so state-dict keys are unchanged.
The block is called as the user's model calls it: ``block(hidden_states, ...)`` with ``[b, s, h]`` batch-first
where the parallel region starts or ends, and keyword ``attention_mask`` / ``position_embeddings`` as Hugging
Face passes them.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar._compat import compile_errors
from lightning_seqpar.context_parallel import ContextParallelBatch
from lightning_seqpar.parallel.random import recomputed
from lightning_seqpar.tensor_parallel.layers import autocast_input, column_parallel_linears
from lightning_seqpar.transformer.attention_part import AttentionPart
from lightning_seqpar.transformer.block_arguments import parse_block_arguments
from lightning_seqpar.transformer.block_spec import BlockSpec
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.dropout import ParallelDropout
from lightning_seqpar.transformer.kv_cache import (
    cached_keys_values, cached_mask, refuse_training_cache, step_sequence_parallel, suspended_sequence_parallel,
    uses_cache,
)
from lightning_seqpar.transformer.masks import torch_attention_bias
from lightning_seqpar.transformer.mlp_slot import MLPSlot
from lightning_seqpar.transformer.part_builder import PartBuilder
from lightning_seqpar.transformer.region import enter_parallel_region, exit_parallel_region
from lightning_seqpar.transformer.roles import LayerDims, ParallelLayer
from lightning_seqpar.memory.saved_tensors import Rebuild


class ParallelBlock(ParallelLayer):
    """The tensor (+sequence) parallel version of a block described by a :class:`BlockSpec`: the one parallel
    transformer layer, serving Hugging Face decoder layers, the reference GPT's blocks, torch's
    ``nn.TransformerEncoderLayer`` and users' declared blocks. It is composed of the parts its spec declares: an
    attention part (:class:`~lightning_seqpar.transformer.attention_part.AttentionPart`) and whatever fills the MLP
    slot (``spec.mlp.build``: :class:`~lightning_seqpar.transformer.mlp_part.DenseMLPPart`); the block owns the
    region boundaries, the mask, the residual stream and their dropouts.

    Args:
        block: the single-device block; its norms (and activation module) are reused, its weights sliced.
        spec: the declaration.
        ctx: rewrite context.
        enter_region / exit_region: this block starts / ends the parallel region (``[b, s, h]`` batch-first, or
            ``[s, b, h]`` when ``spec.batch_first`` is false, outside it).

    Shapes: ``hidden_states`` ``[b, s, h]`` at a region boundary, ``[s/t, b, h]`` (SP) or ``[s, b, h]``
    between rewritten blocks; q ``[b, a/t, s, d]``, k/v ``[b, a_kv/t, s, d]``; output like the input.

    Masks (:mod:`~lightning_seqpar.transformer.masks`): ``attention_mask`` in Hugging Face's convention (bool
    ``True`` = attend, or additive; ``[b, 1, s, s]`` or ``[b, a/t, s, s]``) is applied as given; torch's
    ``src_mask``/``src_key_padding_mask`` are combined into one bias and ``is_causal`` masks future positions
    (the core attention's cached ``[s, s]`` mask, built once per length); with no mask, future positions are masked
    when the attention is declared causal.

    A key/value cache (transformers' ``Cache``) is filled and read in a forward without gradients (generation): each
    rank keeps its own heads, ``[b, a_kv/t, s, d]`` (:mod:`~lightning_seqpar.transformer.kv_cache`); a step whose
    positions do not split over t runs with sequence parallelism suspended. With gradients the config's default empty
    cache changes nothing, and one holding past tokens is refused.

    Arguments are taken as :mod:`~lightning_seqpar.transformer.block_arguments` says: positional ones named by
    ``spec.arguments``, the cache under either name, those without effect listed; anything else is refused.

    Raises:
        NotImplementedError: called with gradients and a key/value cache that holds past tokens; called with a
            cache under context parallelism; a cache for a block whose declaration names no layer index.
        TypeError: an argument the block does not understand, by name, before any communication.
        ValueError: at construction, what context parallelism cannot compute exactly (:meth:`AttentionPart.
            check_context_parallel`).
    """

    runs_offload = True

    def __init__(self, block: nn.Module, spec: BlockSpec, ctx: RewriteContext, *, enter_region: bool = True,
                 exit_region: bool = True) -> None:
        super().__init__()
        self.group, self.sp, self.rng_tracker = ctx.group, ctx.sp, ctx.rng_tracker
        self.enter_region, self.exit_region = enter_region, exit_region
        self.mask_cache = ctx.masks
        self.spec = spec
        self.returns_tuple = spec.returns_attention_weights
        self._name = f"The tensor-parallel {type(block).__name__}"
        builder = PartBuilder(block, self, ctx, self._name, spec.transposed)
        self.batch_first = bool(builder.value(spec.batch_first))
        self.norm_first = bool(builder.value(spec.norm_first))
        # The parts are plain objects, not submodules: their modules sit on the block under the user's paths, so the
        # state-dict keys and the order of the parameters are the single-device block's.
        self._attention: AttentionPart = spec.attention.build(builder)
        self._mlp: MLPSlot = spec.mlp.build(builder)
        self.fused_attention = self._attention.fused
        drops = [builder.resolve(p).p for p in spec.residual_dropouts] or [0.0, 0.0]
        for name, p in (("attention_residual_dropout", drops[0]), ("mlp_residual_dropout", drops[1])):
            builder.host_module(name, ParallelDropout(p, ctx.rng_tracker, sharded=ctx.sp), name.replace("_", " "))
        builder.finish()  # registered now, in their order: self.attention_residual_dropout, ... are these modules
        self.context = ctx.context
        multiplier = builder.value(spec.residual_multiplier)
        self.residual_multiplier = None if multiplier is None or float(multiplier) == 1.0 else float(multiplier)
        attention = self._attention
        self._dims = LayerDims(attention.hidden, attention.num_heads, self._mlp.ffn_hidden_size, ctx.tp, ctx.sp,
                               attention.num_kv_heads, spec.mlp.gated)
        self._compiled_body: dict[str, Callable] = {}  # built at the first call; not copied or pickled

    def layer_dims(self) -> LayerDims:
        return self._dims

    @property
    def mlp_slot(self) -> MLPSlot:
        return self._mlp

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        call = parse_block_arguments(self._name, self.spec.arguments, args, kwargs)
        if uses_cache(call.cache) and call.layout is None:  # (with a layout: the model's own empty cache, unread)
            return self._cached_forward(hidden_states, call)
        refuse_training_cache(self._name, call.cache)
        x = enter_parallel_region(hidden_states, self.group, self.sp, self.batch_first) if self.enter_region \
            else hidden_states
        layout = call.layout if self.context is None else self.context.layer_layout(call.layout, self._name)
        if layout is not None:  # the model's masks are of its local tokens: the layout says what each sees
            if self._attention.dropout_p > 0 and self.training:  # one cp rank, packed documents (cp > 1: refused)
                raise ValueError(f"{self._name}: attention dropout p={self._attention.dropout_p} with packed "
                                 f"documents (position_ids) is not supported: set the model's attention dropout to 0.")
            layout, mask, causal = layout.with_window(self._attention.window), None, None
        else:
            mask, causal = self._mask(call, x)
        if self.compile_config is None:
            body = self._body
        elif layout is not None and self.norm_first:  # the attention across ranks between two compiled halves
            body = partial(self._around_context_attention, self._compiled("_before_attention"),
                           self._compiled("_after_attention"))
        else:
            body = partial(self._compiled("_body"), self)
        if self.recompute_layer and torch.is_grad_enabled():
            x = recomputed(body, x, call.position_embeddings, mask, causal, layout, rng_tracker=self.rng_tracker)
        else:
            x = body(x, call.position_embeddings, mask, causal, layout)
        return exit_parallel_region(x, self.group, self.sp, self.batch_first) if self.exit_region else x

    def _cached_forward(self, hidden_states: Tensor, call: Any) -> Tensor:
        """A forward without gradients that fills and reads a key/value cache (:mod:`~.kv_cache`): the eager body,
        sequence parallelism suspended when the step's positions do not split over t."""
        if self.context is not None and self.context.group.size > 1:
            raise NotImplementedError(f"{self._name} was called with a key/value cache under context parallelism "
                                      f"(cp={self.context.group.size}): generate with cp=1.")
        if not self._attention.spec.causal:
            raise NotImplementedError(f"{self._name} was called with a key/value cache but is declared non-causal "
                                      f"(BlockSpec.causal=False): a cache continues a causal model, each position "
                                      f"seeing only those before it. Generate from a causal language model.")
        positions = hidden_states.shape[1 if self.batch_first else 0]
        split = step_sequence_parallel(call.cache, self.enter_region, positions, self.sp, self.group.size)
        parts = (self._attention, self._mlp, getattr(self._mlp, "shared", None))
        with suspended_sequence_parallel(self, parts) if self.sp and not split else contextlib.nullcontext():
            x = enter_parallel_region(hidden_states, self.group, self.sp, self.batch_first) if self.enter_region \
                else hidden_states
            mask, causal = self._mask(call, x)
            x = self._body(x, call.position_embeddings, mask, causal, None, call.cache)
            return exit_parallel_region(x, self.group, self.sp, self.batch_first) if self.exit_region else x

    def not_compilable(self) -> str:
        """Why this block's body cannot be compiled whole, and the fix (``""``: it can; :mod:`~.compiling`). A mixture
        of experts with a capacity compiles: its all-to-all sizes are host integers fixed by the shapes."""
        if self.context is not None and self.context.group.size > 1 and not self.norm_first:
            return (f"is a post-norm block attending across {self.context.group.size} context-parallel ranks, which is "
                    f"not compiled (its halves around the ring's attention are compiled for pre-norm blocks only): "
                    f"train with compile=False, or cp=1")
        if self._mlp.not_compilable():
            return self._mlp.not_compilable()
        forked = [m.p for m in self.modules() if isinstance(m, ParallelDropout) and m.p > 0 and m.sharded]
        if self._attention.dropout_p > 0 or forked:
            return (f"has dropout (attention p={self._attention.dropout_p}, sharded residual p={forked or 0}) drawn "
                    f"from the tensor-parallel random stream, whose generator swap is not traceable: set the "
                    f"model's dropout to 0 (as fine-tuning usually does), or train with compile=False")
        return ""

    def _compiled(self, method: str) -> Callable:
        """The method ``method`` (``_body``, or a half around the context-parallel attention) compiled as
        :attr:`compile_config` says, built once. The unbound function is compiled (called with the block as its
        first argument), so a copy of the block never runs the original's body."""
        if method not in self._compiled_body:
            assert self.compile_config is not None
            compiled = self.compile_config.compile(getattr(type(self), method))
            name = self._name

            def run(block: "ParallelBlock", *args: Any) -> Any:
                try:
                    return compiled(block, *args)
                except compile_errors() as error:  # a graph break under fullgraph=True: name the block and the fix
                    raise RuntimeError(f"{name} could not be compiled as one graph (compile=True, fullgraph): "
                                       f"{str(error).splitlines()[0]}. Train with compile=False, or report the "
                                       f"block's family.") from error
            self._compiled_body[method] = run
        return self._compiled_body[method]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_compiled_body"] = {}  # a compiled function is rebuilt at the next call, never shared by a copy
        return state

    def _mask(self, call: Any, x: Tensor) -> tuple[Optional[Tensor], Optional[bool]]:
        """The mask in Hugging Face's convention and the causal flag (``None``: causal when no mask is given and the
        block is declared causal). torch's ``src_mask``/``src_key_padding_mask`` are combined here (a standalone
        layer's call); an encoder stack passes its combined bias as ``attention_mask`` with ``is_causal``."""
        masks = call.torch_masks
        if "src_mask" not in masks and "src_key_padding_mask" not in masks:
            return call.attention_mask, (bool(masks["is_causal"]) if "is_causal" in masks else None)
        if call.attention_mask is not None:
            raise TypeError(f"{self._name} was called with both attention_mask and torch's src_mask / "
                            f"src_key_padding_mask: pass the mask in one convention.")
        s = x.shape[0] * (self.group.size if self.sp else 1)
        src_mask, padding = masks.get("src_mask"), masks.get("src_key_padding_mask")
        is_causal = bool(masks.get("is_causal"))
        heads = self._attention.num_heads
        return self.mask_cache.get((src_mask, padding), (is_causal, s, x.shape[1], x.dtype, x.device), lambda: (
            torch_attention_bias(src_mask, padding, is_causal, s, x.shape[1], heads, self.group, x.dtype, x.device)))

    def _body(self, x: Tensor, position_embeddings: Optional[tuple[Tensor, Tensor]], mask: Optional[Tensor],
              causal: Optional[bool] = None, layout: Optional[ContextParallelBatch] = None, cache: Any = None
              ) -> Tensor:
        attention, mlp = self._attention, self._mlp
        if not self.norm_first:  # post-norm: norm(x + f(x))
            with self.offloading("qkv_linear", *(position_embeddings or ())):
                q, k, v = attention.qkv(x, position_embeddings)
            attended = self._attention_output(self._attend(q, k, v, mask, causal, layout, cache))
            with self.offloading("attn_norm"):
                x = attention.norm(x + self.attention_residual_dropout(attended))
            out = self.mlp_residual_dropout(self._mlp_forward(x))
            with self.offloading("mlp_norm"):
                return mlp.norm(x + out)
        q, k, v, parallel = self._before_attention(x, position_embeddings)
        if parallel is not None:
            return self._after_attention(x, self._attend(q, k, v, mask, causal, layout, cache), parallel)
        # In this order, and no name for the context or the projection's output: each is freed (where nothing saved
        # it for backward) before the MLP runs, and so are q, k and v (GQA's unexpanded k and v, q before its scaling),
        # instead of living through the MLP in this frame. A recomputed layer's forward runs here again in backward.
        x = self._attention_residual(x, self._attend(q, k, v, mask, causal, layout, cache))
        del q, k, v
        return self._mlp_residual(x)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], causal: Optional[bool],
                layout: Optional[ContextParallelBatch], cache: Any = None) -> Tensor:
        if cache is not None:  # this rank's heads join the cache; attention over the past and the new positions
            k, v = cached_keys_values(cache, k, v, self._attention.layer_index, self._name)
            declared = self._attention.spec.causal if causal is None else causal
            mask, causal = cached_mask(mask, declared, q.shape[-2], k.shape[-2], q.device)
        with self.offloading("core_attn", mask):
            return self._attention.attend(q, k, v, mask, causal, self.training, layout)

    def _attention_output(self, context: Tensor) -> Tensor:
        with self.offloading("attn_proj"):
            return self._attention.output(context)

    def _around_context_attention(self, before: Callable, after: Callable, x: Tensor,
                                  position_embeddings: Optional[tuple[Tensor, Tensor]], mask: Optional[Tensor],
                                  causal: Optional[bool], layout: ContextParallelBatch) -> Tensor:
        """A pre-norm body under ``compile=True`` with a context-parallel layout: ``before`` and ``after``
        (:meth:`_before_attention`, :meth:`_after_attention` compiled, each one graph) around the attention across
        the cp ranks, which runs eagerly: its point-to-point ring and per-forward layout have no traceable form. The
        same operations as :meth:`_body`, in its order."""
        q, k, v, parallel = before(self, x, position_embeddings)
        context = self._attend(q, k, v, None, None, layout)
        return after(self, x, context, parallel)

    def _before_attention(self, x: Tensor, position_embeddings: Optional[tuple[Tensor, Tensor]]
                          ) -> tuple[Tensor, Tensor, Tensor, Optional[tuple[Tensor, Optional[list[Tensor]]]]]:
        """A pre-norm body up to its core attention: q, k, v (:meth:`AttentionPart.qkv`) and, for a parallel residual,
        what its MLP reads: the normed ``x`` and, when one norm feeds both parts, the MLP's input projections (made
        under the same all-gather). (Nothing else leaves: an unused output would change the sums of gradients a
        compiled half makes.)"""
        attention, mlp = self._attention, self._mlp
        with self.offloading("attn_norm"):
            normed = x if attention.norm is None else self._norm(attention.norm, x)
        # One norm feeding both parts (Cohere, Phi): every input projection under one all-gather of it.
        shared = self.spec.parallel_residual and mlp.norm is attention.norm
        with self.offloading("qkv_linear", *(position_embeddings or ()),
                             rebuild=self._rebuild(normed, attention.norm, x)):
            projected = column_parallel_linears(normed, [*attention.inputs, *mlp.inputs], self.group, self.sp) \
                if shared else None
            split = len(attention.inputs)
            q, k, v = attention.qkv(normed, position_embeddings, projected and projected[:split])
        parallel = (normed, projected[split:] if shared else None) if self.spec.parallel_residual else None
        return q, k, v, parallel

    def _after_attention(self, x: Tensor, context: Tensor,
                         parallel: Optional[tuple[Tensor, Optional[list[Tensor]]]]) -> Tensor:
        """A pre-norm body from its core attention's ``context`` on: the output projection, residuals and MLP
        (``parallel``: what :meth:`_before_attention` made for a parallel residual's MLP)."""
        if parallel is None:
            return self._mlp_residual(self._attention_residual(x, context))
        attended = self._scaled(self._attention_output(context))  # both parts read the block's input
        normed, mlp_inputs = parallel
        out = self._mlp_forward(normed, mlp_inputs) if mlp_inputs is not None else self._normed_mlp(x)
        return x + self.attention_residual_dropout(attended) + self.mlp_residual_dropout(self._scaled(out))

    def _attention_residual(self, x: Tensor, context: Tensor) -> Tensor:
        """``x`` plus the output projection of the core attention's ``context`` (a pre-norm, sequential body)."""
        return x + self.attention_residual_dropout(self._scaled(self._attention_output(context)))

    def _mlp_residual(self, x: Tensor) -> Tensor:
        """``x`` plus the MLP of its MLP norm (a pre-norm, sequential body): ``[s/t, b, h]``."""
        out = self._normed_mlp(x)
        return x + self.mlp_residual_dropout(self._scaled(out))  # [s/t, b, h]

    def _normed_mlp(self, x: Tensor) -> Tensor:
        """The MLP of the MLP norm of ``x`` (the norm's output rebuilt in backward under :attr:`recompute_norms`)."""
        normed = self._mlp_norm(x)
        return self._mlp_forward(normed, rebuild=self._rebuild(normed, self._mlp.norm, x))

    def _norm(self, norm: nn.Module, x: Tensor) -> Tensor:
        """``norm(x)`` as the input projections read it: under :attr:`recompute_norms`, cast to autocast's dtype here
        (the projections would cast it and keep the cast: the cast is what a rebuild must make)."""
        return projected_norm(norm, x) if self.recompute_norms else norm(x)

    def _rebuild(self, normed: Tensor, norm: Optional[nn.Module], x: Tensor) -> Optional[Rebuild]:
        """The norm output ``normed`` (:meth:`_norm` of ``x``) to make again in backward, under
        :attr:`recompute_norms`."""
        return Rebuild(normed, partial(projected_norm, norm), x) if self.recompute_norms and norm is not None else None

    def _mlp_norm(self, x: Tensor) -> Tensor:
        with self.offloading("mlp_norm"):
            return x if self._mlp.norm is None else self._norm(self._mlp.norm, x)

    def _mlp_forward(self, x: Tensor, outputs: Optional[list[Tensor]] = None,
                     rebuild: Optional[Rebuild] = None) -> Tensor:
        """The MLP part's forward; under module recomputation (:attr:`recompute_mlp`) keeping only its input (and
        the input projections made with the attention's), its inner activations made again in backward with the
        dropout masks they drew (the input kept: ``rebuild`` then has nothing to drop)."""
        if self.recompute_mlp and torch.is_grad_enabled():
            return recomputed(self._mlp.forward, x, outputs, rng_tracker=self.rng_tracker)
        with self.offloading("mlp", rebuild=rebuild):
            return self._mlp.forward(x, outputs)

    def _scaled(self, branch: Tensor) -> Tensor:
        """A part's output as it joins the residual: times the residual multiplier, if any."""
        return branch if self.residual_multiplier is None else branch * self.residual_multiplier


def projected_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """A norm's output in the dtype the input projections multiply in (autocast's, for a float32 output)."""
    return autocast_input(norm(x))
