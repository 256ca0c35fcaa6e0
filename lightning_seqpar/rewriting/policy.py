"""Policies: how one block class becomes its tensor + sequence parallel version.

Three kinds, each saying how the rewriter applies it (:meth:`Policy.replace`), so the rewriter never asks a policy
what it is:

* :class:`Policy`: a transformer layer; consecutive layers in a list share one parallel region.
* :class:`StackPolicy`: a module that runs its own layers and opens and closes its own region.
* :class:`ModelPolicy`: a model whose parts around its layers (embedding, LM head, loss) the policy splits in
  place; its layers are rewritten by their own policies, and the model is checked whole.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Protocol, runtime_checkable

import torch.nn as nn

from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.roles import require_divisible  # noqa: F401  (re-exported)


class Policy:
    """Rewrites instances of one block class.

    Subclass it (or :class:`StackPolicy` / :class:`ModelPolicy`), set :attr:`block`, and implement :meth:`check`, :meth:`describe`
    and :meth:`rewrite`. Hand it to the strategy with
    ``SeqParallelStrategy(rewriting=RewriteConfig(policies=[...]))``, or let the block class declare it
    (:class:`DeclaresPolicy`).

    What the replacement must provide (:mod:`lightning_seqpar.transformer.roles`), so that every feature works:

    * Each transformer layer is a :class:`~lightning_seqpar.transformer.roles.ParallelLayer`: it implements
      ``layer_dims()`` (the memory model, ``granularity="auto"``, ``FlopsUtilization``) and honours
      ``recompute_layer`` (full recomputation); pipeline parallelism splits a list of them.
    * A module that runs its own list of layers (a :class:`StackPolicy`'s replacement) is a
      :class:`~lightning_seqpar.transformer.roles.LayerStack`: ``stack_layers()``, runs them with
      :func:`~lightning_seqpar.transformer.stack.run_layers` (``recompute_chunks``), and may read
      ``stage_position`` to skip its embedding on later pipeline stages.
    * For a model built on the meta device (``configure_model``), :meth:`rewrite` builds each replacement
      block through ``ctx.build(original, name, construct)`` (and small modules it slices through
      ``ctx.prepare``), and the replacement's state-dict keys mirror the original's: the strategy then
      fills only the shards this rank keeps.
    * Core attention is a :class:`~lightning_seqpar.transformer.core_attention.CoreAttention`
      (selective recomputation checkpoints those).
    * Parameters take their roles through the tags of :mod:`lightning_seqpar.tensor_parallel.sharding` (``ColumnParallelLinear``,
      ``RowParallelLinear``, ``VocabParallelEmbedding``, ``shard_parameter`` and ``mark_sequence_parallel``
      do it): sharded ones carry a ``ShardSpec`` (checkpoints gather them, clipping counts each shard once),
      and replicated parameters that see s/t tokens per rank under SP (norms, the row-parallel bias)
      are sequence-parallel (their gradients are summed over the tensor-parallel group).

    Attributes:
        block: the exact class this policy handles (subclasses need their own policy, since they may
            change ``forward``).
        role: what :func:`~lightning_seqpar.explain` calls it (``"layer"``; ``"stack"`` for a
            :class:`StackPolicy`, ``"vocabulary"`` for a :class:`ModelPolicy`); shown, not dispatched on.
        chains: consecutive modules of this policy in an ``nn.ModuleList``/``nn.Sequential`` share one parallel
            region (their input and output are ``[s/t, b, h]`` between rewritten neighbours).
        around_layers: the policy changes the model around its layers (:class:`ModelPolicy`).
    """

    block: ClassVar[type[nn.Module]]
    role: ClassVar[str] = "layer"
    chains: ClassVar[bool] = True
    around_layers: ClassVar[bool] = False

    def matches(self, module: nn.Module) -> bool:
        """Whether this policy rewrites ``module``: by default, exactly the instances of :attr:`block`. A policy
        that recognizes a layout by structure (e.g. every Hugging Face model of the Llama layout) overrides it."""
        return type(module) is self.block

    def mismatch(self, module: nn.Module) -> list[str]:
        """Why this policy does not rewrite ``module``, or what in it the policy cannot implement, in the field's
        words (e.g. ``"fused qkv_proj"``, ``"post-norms"``): shown when no policy takes a model. Default: nothing."""
        return []

    def check(self, module: nn.Module, ctx: RewriteContext, name: str) -> None:
        """Raise ``ValueError`` naming ``name`` and the numbers if ``module`` cannot be split t ways."""
        raise NotImplementedError

    def verify(self, module: nn.Module, ctx: RewriteContext, name: str) -> None:
        """Check, before training, that the replacement of ``module`` computes what ``module`` computes; called once
        per block class by the rewrite (unless turned off). Raise ``ValueError`` naming ``name`` when it does not.
        By default nothing is checked (the built-in policies are proven by parity tests); a policy built from a
        declaration checks it (:class:`~lightning_seqpar.DeclaredBlockPolicy`)."""

    def describe(self, module: nn.Module, ctx: RewriteContext) -> str:
        """One line saying what the rewrite does to ``module``."""
        raise NotImplementedError

    def rewrite(self, module: nn.Module, ctx: RewriteContext, *, enter_region: bool, exit_region: bool) -> nn.Module:
        """Return the parallel replacement of ``module`` (weights sliced from it)."""
        raise NotImplementedError

    def replace(self, module: nn.Module, ctx: RewriteContext, name: str, *, enter_region: bool,
                exit_region: bool) -> nn.Module:
        """How the rewriter applies this policy to ``module`` (qualified ``name``): a layer is built through
        ``ctx.build`` (a meta-device layer becomes a skeleton filled after the pipeline split)."""
        return ctx.build(module, name, lambda m: self.rewrite(m, ctx, enter_region=enter_region,
                                                              exit_region=exit_region))

    def verify_model(self, module: nn.Module, ctx: RewriteContext, name: str,
                     rewrite_small: Callable[[nn.Module, RewriteContext], nn.Module]) -> None:
        """Check the whole model ``module`` (a :class:`ModelPolicy`'s), once every block passed its own checks;
        ``rewrite_small(model, ctx)`` rewrites a small copy with the same policies. Nothing for other kinds."""

    def pipeline_placement(self, module: nn.Module) -> dict[str, str]:
        """Parts of ``module`` outside the layer stack that one pipeline stage needs, by path relative to ``module``:
        ``"first"`` (an embedding, run before the stack) or ``"last"`` (final norm, LM head, run after it). Other
        stages hold a placeholder instead (:mod:`lightning_seqpar.pipeline_parallel.placement`). By default
        nothing is placed: what is outside the stack stays on every stage."""
        return {}


class StackPolicy(Policy):
    """A policy for a module that runs its own list of layers (a :class:`~lightning_seqpar.transformer.roles.LayerStack`
    replacement): it opens and closes its own parallel region and builds its layers itself."""

    role = "stack"
    chains = False

    def replace(self, module: nn.Module, ctx: RewriteContext, name: str, *, enter_region: bool,
                exit_region: bool) -> nn.Module:
        return self.rewrite(module, ctx, enter_region=True, exit_region=True)


class ModelPolicy(Policy):
    """A policy for a whole model whose parts around the layers (embedding, LM head, loss) it splits in place; its
    layers are visited and rewritten by their own policies. Applied at t > 1 only; :meth:`rewrite` takes ``name=``
    (the model's qualified name, for the materializer) and returns the model itself."""

    role = "vocabulary"
    chains = False
    around_layers = True

    def replace(self, module: nn.Module, ctx: RewriteContext, name: str, *, enter_region: bool,
                exit_region: bool) -> nn.Module:
        return self.rewrite(module, ctx, enter_region=False, exit_region=False, name=name)  # type: ignore[call-arg]

    def install_entry(self, module: nn.Module, ctx: RewriteContext, name: str) -> None:
        """At t = 1 and c = 1, where nothing around the layers is split: what the model's call must still do for
        its rewritten layers (a Hugging Face model's packed documents read from ``position_ids``). Nothing by
        default."""


@runtime_checkable
class DeclaresPolicy(Protocol):
    """A block class that names its own :class:`Policy` (``policy.block`` must be that class).

    The rewrite asks ``type(module).parallel_policy()`` for a module no registered policy knows, so a
    model can ship its parallel version beside it without the strategy importing either
    (:class:`lightning_seqpar.models.GPT` does this).
    """

    @classmethod
    def parallel_policy(cls) -> Policy: ...
