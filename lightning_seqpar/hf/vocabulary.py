"""The vocabulary of a Hugging Face causal LM split over the tensor-parallel group, as the reference GPT's is.

``get_input_embeddings()`` becomes a :class:`~lightning_seqpar.VocabParallelEmbedding` (rows split, padded to a
multiple of t, ``padding_idx`` kept) and ``lm_head`` the
:class:`~lightning_seqpar.transformer.vocabulary.VocabParallelHead` the reference GPT uses too, sharing the
embedding's weight when the two are tied. The head returns :class:`~lightning_seqpar.tensor_parallel.vocab_logits.VocabShardedLogits`;
with ``labels=``, the model's loss function is :class:`CausalLMLoss`, the vocabulary-parallel cross entropy with
transformers' ``ForCausalLMLoss`` semantics (labels shifted inside, ``ignore_index=-100``, ``num_items_in_batch``),
so no rank materializes ``[b, s, v]`` logits; reading ``.logits`` gathers them (once, when used).
Megatron-LM: ``VocabParallelEmbedding``, the output layer as ``ColumnParallelLinear``, ``vocab_parallel_cross_entropy``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.hf.context_parallel import install_context_parallel
from lightning_seqpar.hf.model_check import check_causal_lm
from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.rewriting.policy import ModelPolicy
from lightning_seqpar.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_entropy
from lightning_seqpar.tensor_parallel.embedding import VocabParallelEmbedding, embedding_scale
from lightning_seqpar.parallel.split_sizes import padded_size
from lightning_seqpar.tensor_parallel.vocab_logits import VocabShardedLogits
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.vocabulary import parallel_lm_head


def is_causal_lm(module: nn.Module) -> bool:
    """A Hugging Face causal LM: ``get_input_embeddings()`` an ``nn.Embedding``, ``get_output_embeddings()`` an
    ``nn.Linear`` over the same vocabulary (``lm_head``; GPT-NeoX's ``embed_out``), a ``config`` and a settable
    ``loss_function``."""
    head, config = _output_embeddings(module), getattr(module, "config", None)
    get_embeddings = getattr(module, "get_input_embeddings", None)
    if not isinstance(head, nn.Linear) or config is None or not callable(get_embeddings) or not hasattr(
            type(module), "loss_function"):
        return False
    embedding = get_embeddings()
    return isinstance(embedding, nn.Embedding) and head.out_features == embedding.num_embeddings


def _output_embeddings(model: nn.Module) -> Optional[nn.Module]:
    get = getattr(model, "get_output_embeddings", None)
    try:
        return get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None


def _head_path(model: nn.Module) -> str:
    head = _output_embeddings(model)
    return next(name for name, module in model.named_modules() if module is head)


def _embedding_path(model: nn.Module) -> str:
    embedding = model.get_input_embeddings()
    return next(name for name, module in model.named_modules() if module is embedding)


def _replace(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


class CausalLMLoss:
    """transformers' causal-LM loss (``ForCausalLMLoss``) on vocabulary-sharded logits; ``original`` (the model's
    own loss function) for any other logits. An object, not a closure: the model stays picklable.

    ``context_parallel``: the model runs on one cp rank's tokens, whose labels only the model's entry can shift (over
    the whole row); a call without ``shift_labels`` (a model that does not pass its keyword arguments on to its loss)
    would shift them within the rank's chunks, and is refused.

    ``sum_per_row=True`` (passed to the model's forward, which hands its keyword arguments to its loss): the loss is
    ``[b]``, each row's cross entropy summed over its supervised tokens (``−Σ log p``; what DPO reads), in float32 or
    float64, from sharded or whole logits; ``num_items_in_batch`` is not applied. Under context parallelism the entry
    sums it over the cp ranks like any loss.

    ``token_logps=True``: the loss is ``[b, s]``, each target token's log-probability ``log p`` (0 where the label is
    ignored), aligned with the shifted labels (position j: the log-probability of token j+1), the same way; what GRPO's
    ratios read. With ``token_entropy=True`` too: ``[2, b, s]``, those and each position's entropy over the vocabulary
    (nats, without gradients; :func:`~lightning_seqpar.tensor_parallel.cross_entropy.vocab_parallel_entropy` from
    sharded logits). Refused under context parallelism (no rank holds a whole row).

    ``sum_per_document=`` a ``[b, s, D]`` bool tensor (packed rows: token j of row i belongs to document d), aligned
    with ``labels`` (with ``shift_labels`` when those are given): the loss is ``[b, D]``, each document's cross entropy
    summed over its supervised tokens, the same way (a product with the documents' one-hot weights, so no shape
    depends on the data and nothing is read on the host).
    """

    def __init__(self, original: Callable[..., Tensor], context_parallel: bool = False) -> None:
        if isinstance(original, CausalLMLoss):  # installed before the rewrite (DPO): wrap what it wrapped
            original = original.original
        self.original, self.context_parallel = original, context_parallel

    def __call__(self, logits: Tensor, labels: Tensor, vocab_size: int, num_items_in_batch: Optional[Tensor] = None,
                 ignore_index: int = -100, shift_labels: Optional[Tensor] = None, sum_per_row: bool = False,
                 sum_per_document: Optional[Tensor] = None, token_logps: bool = False, token_entropy: bool = False,
                 **kwargs: Any) -> Tensor:
        if self.context_parallel and token_logps:
            raise NotImplementedError("token_logps=True under context parallelism: each rank holds chunks of the "
                                      "sequence, and per-token log-probabilities are not gathered. Use cp=1.")
        if self.context_parallel and shift_labels is None:
            raise ValueError("Under context parallelism the model's loss was called without shift_labels=: its forward "
                             "does not pass its keyword arguments on to loss_function, so the labels of this rank's "
                             "chunks would be shifted within them. Train this model without cp.")
        documents = sum_per_document
        per_row = sum_per_row or documents is not None or token_logps
        if not isinstance(logits, VocabShardedLogits) and not per_row:
            return self.original(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                 ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if shift_labels is None:  # tokens < n predict n
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
            if documents is not None:  # each target's document: the next token's
                documents = F.pad(documents, (0, 0, 0, 1))[:, 1:]

        def reduced(per_token: Tensor, rows: slice, entropy: Optional[Tensor] = None) -> Tensor:
            """[b, rows] -> [b], [b, D], [b, s] (token_logps) or [2, b, s] (and token_entropy)."""
            if token_logps:  # log p, placed at the rows' positions (zero elsewhere: chunks add up to the whole row)
                first, last, _ = rows.indices(shift_labels.shape[-1])
                placed = F.pad(-per_token, (first, shift_labels.shape[-1] - last))
                if entropy is None:
                    return placed
                return torch.stack([placed, F.pad(entropy.to(placed.dtype), (first, shift_labels.shape[-1] - last))])
            if documents is None:
                return per_token.sum(-1)
            return torch.einsum("bs,bsd->bd", per_token, documents[:, rows].to(per_token.device, per_token.dtype))

        if not isinstance(logits, VocabShardedLogits):  # whole logits [b, s, v], one row sum each
            upcast = logits.to(torch.promote_types(logits.dtype, torch.float32))
            per_token = F.cross_entropy(upcast.flatten(0, -2), shift_labels.flatten().to(logits.device),
                                        ignore_index=ignore_index, reduction="none")
            entropy = None
            if token_entropy:
                with torch.no_grad():
                    entropy = -(upcast.softmax(-1) * upcast.log_softmax(-1)).sum(-1)
            return reduced(per_token.view(shift_labels.shape), slice(None), entropy)

        def summed(local: Tensor, rows: slice) -> Tensor:  # [b, rows, v'/t], upcast as transformers does
            target = shift_labels[:, rows].to(local.device)
            if per_row:
                upcast = local.to(torch.promote_types(local.dtype, torch.float32))
                entropy = vocab_parallel_entropy(upcast, logits.group, logits.vocab_size) if token_entropy else None
                return reduced(vocab_parallel_cross_entropy(upcast, target, logits.group, logits.vocab_size,
                                                            ignore_index=ignore_index, reduction="none"), rows, entropy)
            return vocab_parallel_cross_entropy(local.float(), target, logits.group, logits.vocab_size,
                                                ignore_index=ignore_index, reduction="sum")

        value = logits.over_chunks(summed)  # chunk by chunk when the head left the logits pending (loss_chunk)
        if per_row:
            return value
        if num_items_in_batch is None:  # the mean over supervised tokens
            return value / (shift_labels != ignore_index).sum().clamp(min=1).to(value.device)
        return value / (num_items_in_batch.to(value.device) if torch.is_tensor(num_items_in_batch)
                        else num_items_in_batch)


class HFVocabularyPolicy(ModelPolicy):
    """Splits a Hugging Face causal LM's embedding, LM head and loss over the vocabulary (see the module docstring).
    Its decoder layers are rewritten by their own policies; this one changes the model around them."""

    block = nn.Module  # recognized by structure (:meth:`matches`)

    def matches(self, module: nn.Module) -> bool:
        return is_causal_lm(module)

    def check(self, module: nn.Module, ctx: RewriteContext, name: str) -> None:
        """Any vocabulary (padded to a multiple of t); an embedding it can split (:func:`embedding_scale`)."""
        if ctx.tp > 1:
            try:
                embedding_scale(module.get_input_embeddings())
            except ValueError as error:
                raise ValueError(f"{name or type(module).__name__}: {error}") from None
            head = _output_embeddings(module)
            if head.bias is not None and head.weight is module.get_input_embeddings().weight:
                raise ValueError(f"{name or type(module).__name__}: its LM head is tied to the embedding and has a bias "
                                 f"of its own, which tensor parallelism does not support. Untie it "
                                 f"(tie_word_embeddings=False), or drop the bias.")

    def describe(self, module: nn.Module, ctx: RewriteContext) -> str:
        head = _output_embeddings(module)
        v = head.out_features
        v_padded = padded_size(v, ctx.tp)
        tied = head.weight is module.get_input_embeddings().weight
        return (f"{type(module).__name__}: {_embedding_path(module)} vocabulary-parallel ({v} rows, padded {v_padded} "
                f"→ {v_padded // ctx.tp} per rank), {_head_path(module)} column-parallel over the vocabulary{' (tied)' if tied else ''}; "
                f"labels= gives the vocabulary-parallel loss{'' if ctx.loss_parallel else ' (off: loss_parallel=False)'}; "
                f".logits gathered only when read (b·s·{v} elements per rank)"
                + (f"; loss over chunks of {ctx.loss_chunk} positions" if ctx.loss_chunk else "")
                + (f"; context parallel over cp={ctx.cp}: each rank embeds its s/{ctx.cp} tokens (chunks r and "
                   f"{2 * ctx.cp - 1}−r), true positions, labels shifted over the whole row, the loss summed over cp"
                   if ctx.cp > 1 else ""))

    def verify_model(self, module: nn.Module, ctx: RewriteContext, name: str,
                     rewrite_small: Callable[[nn.Module, RewriteContext], nn.Module]) -> None:
        """The whole-model check (:func:`~lightning_seqpar.hf.model_check.check_causal_lm`): a small copy rewritten
        with the same policies, tp and sequence parallelism on emulated ranks; before training.

        Raises:
            ValueError (:class:`~lightning_seqpar.rewriting.model_check.ModelCheckError`): the rewrite is refused.
        """

        def build(small: nn.Module, group: ParallelGroup) -> nn.Module:
            return rewrite_small(small, ctx.emulated(group))  # experts split over the emulated tp ranks too

        check_causal_lm(module, ctx.tp, build, name)

    def pipeline_placement(self, module: nn.Module) -> dict[str, str]:
        """The base model's children with parameters registered before its layer list (embeddings: token, and
        GPT-2's positions) on the first stage; those after it (the final norm) and ``lm_head`` on the last.
        Registration order is a guess at execution order that cannot go wrong silently: a placeholder that runs
        where its part was not expected raises (:mod:`lightning_seqpar.pipeline_parallel.placement`)."""
        base = getattr(module, "base_model", None)
        children = list(base.named_children()) if isinstance(base, nn.Module) and base is not module else []
        stack = next((i for i, (_, child) in enumerate(children) if isinstance(child, nn.ModuleList)), None)
        if stack is None:
            return {}
        prefix = next(name for name, m in module.named_modules() if m is base)
        placement = {_head_path(module): "last"}
        for i, (name, child) in enumerate(children):
            if i == stack or not any(True for _ in child.parameters()):
                continue
            if i > stack:
                placement[f"{prefix}.{name}"] = "last"
            elif isinstance(child, (nn.Embedding, VocabParallelEmbedding)):
                placement[f"{prefix}.{name}"] = "first"
        return placement

    def rewrite(self, module: nn.Module, ctx: RewriteContext, *, enter_region: bool, exit_region: bool,
                name: str = "") -> nn.Module:
        """Replace ``module``'s embedding and head in place (``name``: its qualified name, for the materializer)."""
        prefix = f"{name}." if name else ""
        path = _embedding_path(module)
        old_embedding, old_head = module.get_input_embeddings(), _output_embeddings(module)
        head_path = _head_path(module)
        tied = old_head.weight is old_embedding.weight
        embedding = ctx.build(old_embedding, f"{prefix}{path}",
                              lambda e: VocabParallelEmbedding.from_embedding(e, ctx.group, batch_first=True))
        _replace(module, path, embedding)

        _replace(module, head_path, parallel_lm_head(old_head, embedding, ctx, f"{prefix}{head_path}", tied=tied,
                                                     wrap_logits=True, loss_chunk=ctx.loss_chunk))
        if ctx.loss_parallel or ctx.cp > 1:  # cp: the loss is checked to get the labels shifted over the whole row
            module.loss_function = CausalLMLoss(module.loss_function, context_parallel=ctx.cp > 1)
        if ctx.context is not None:  # each cp rank runs the model on its own tokens
            install_context_parallel(module, ctx.context, ctx.tp if ctx.sp else 1, name)
        return module

    def install_entry(self, module: nn.Module, ctx: RewriteContext, name: str) -> None:
        """t = c = 1: the embedding and head stay whole, but a call with ``position_ids`` restarting at 0 still keeps
        each packed document to itself in the rewritten layers (the entry adds the documents' layout to the call)."""
        if ctx.context is not None:
            install_context_parallel(module, ctx.context, 1, name or type(module).__name__)

