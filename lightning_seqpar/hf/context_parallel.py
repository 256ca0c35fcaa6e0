"""A Hugging Face causal LM under context parallelism: each cp rank runs the model on its own tokens only.

With one cp rank the entry only reads packed documents: a call with ``position_ids`` (``[b, s]``, restarting at 0
where a document starts, as transformers' ``DataCollatorWithFlattening`` makes them) runs attention inside each
document, block by block (:mod:`lightning_seqpar.context_parallel.blocks`), where transformers' eager and SDPA kernels
would attend across them; the call is otherwise unchanged.

Installed on the model by :class:`~lightning_seqpar.hf.vocabulary.HFVocabularyPolicy` when ``cp > 1``, as a forward
pre-hook and a forward hook (``torch.nn.Module.register_forward_pre_hook(with_kwargs=True)`` and
``register_forward_hook(with_kwargs=True, always_call=True)``), so the user's call stays
``model(input_ids=x, labels=x)`` and transformers' own forward runs unchanged. Before the forward, from the whole
batch (which every cp rank holds):

- the sequence is cut into ``2c`` chunks, this rank keeping chunks ``r`` and ``2c−1−r``
  (:func:`~lightning_seqpar.context_parallel.local_indices`); ``input_ids`` (or ``inputs_embeds``,
  ``token_type_ids``) are taken at those positions, so the embedding embeds only them;
- ``position_ids`` become the tokens' true global positions (given ones are kept: packed documents restart at 0,
  which also marks each document), so rotary embeddings and learned positions are those of one process;
- labels are shifted over the whole sequence first (token ``i`` predicts ``i+1``, across a chunk boundary too),
  then taken at the same positions (``shift_labels=``; a packed batch's ``sum_per_document`` likewise), and
  ``num_items_in_batch`` is the whole batch's count of supervised tokens (unless the caller gave one): each rank's
  loss is its tokens' sum over that count;
- ``attention_mask`` (``[b, s]``, 0 = padding) becomes the layout's key padding; the model gets none, and the
  layers ignore the masks transformers builds from the local tokens, masking each block from the layout instead;
- the layout travels with the call as ``context_parallel_layout=`` (``LAYOUT_ARGUMENT``), which transformers'
  models pass on to their decoder layers with the rest of their keyword arguments (as they pass packed sequences'
  ``cu_seq_lens``); a model that drops them is refused after its first forward (its layers received none).

After the forward, the loss is summed over the cp ranks (:func:`~lightning_seqpar.context_parallel.loss.sum_over_context`):
every rank holds the single-process loss. ``.logits`` are this rank's positions, ``[b, s/c, v]`` in local order
(:func:`~lightning_seqpar.context_parallel.local_indices`): no rank holds the whole sequence's logits.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_seqpar.context_parallel import (
    LAYOUT_ARGUMENT, ContextParallel, ContextParallelBatch, check_context_length, documents_from_positions, local_indices,
)
from lightning_seqpar.context_parallel.loss import sum_over_context

_SEQUENCE_ARGUMENTS = ("input_ids", "inputs_embeds", "token_type_ids")
"""Per-token inputs ``[b, s, ...]`` taken at this rank's positions."""
_REFUSED = ("cache_position", "past_key_values", "cache", "logits_to_keep")
"""Arguments that index positions of the single-device sequence: refused when set (none is a training argument)."""


class ContextParallelEntry:
    """The pre-hook and hook of one model (see the module docstring). An object, not closures: the model pickles.

    Args:
        context: the rewrite's :class:`~lightning_seqpar.context_parallel.ContextParallel`.
        tp_unit: t under sequence parallelism, else 1 (the local sequence is split t ways again).
        name: the model's name in errors.
    """

    def __init__(self, context: ContextParallel, tp_unit: int, name: str) -> None:
        self.context, self.tp_unit, self.name = context, tp_unit, name
        self._signature: Optional[inspect.Signature] = None

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Name every argument, then take this rank's tokens (see the module docstring).

        Raises:
            NotImplementedError: a key/value cache (generation) under cp > 1, naming the fix.
            TypeError: a cache position, a 4-D attention mask (its ``s × s`` could not be split), or
                ``logits_to_keep`` other than 0.
            ValueError: a sequence length that does not split into ``2·c·t`` (:func:`check_context_length`).
        """
        if self._signature is None:  # once: binding is on every forward's path
            self._signature = inspect.signature(type(module).forward)
        call = dict(self._signature.bind(module, *args, **kwargs).arguments)
        call.pop("self", None)
        call.update(call.pop("kwargs", {}) or {})
        if call.get("past_key_values") is not None or call.get("cache") is not None:
            if self.context.c == 1:  # generation: each new position attends over the cache, not within documents
                return args, kwargs
            raise NotImplementedError(
                f"{self.name} was called with a key/value cache (past_key_values=, as generate() does) under context "
                f"parallelism (cp={self.context.c}): a decoded position has no sequence to split over the cp ranks. "
                f"Generate from a run of the same model at cp=1 (its checkpoint resumes there).")
        if self.context.c == 1:
            return self._documents_only(args, kwargs, call)
        for name in _REFUSED:
            value = call.get(name)
            if value is not None and not (name == "logits_to_keep" and value == 0):
                raise TypeError(f"{self.name} under context parallelism (cp={self.context.c}) was called with {name}=: "
                                f"it indexes positions of the whole sequence, which no rank holds. Train and "
                                f"evaluate without it; generate from the single-device model.")
        tokens = call.get("input_ids") if call.get("input_ids") is not None else call.get("inputs_embeds")
        if tokens is None:
            raise TypeError(f"{self.name} under context parallelism needs input_ids= or inputs_embeds=.")
        b, s = tokens.shape[:2]
        check_context_length(s, self.context.c, self.tp_unit, self.name)
        device = tokens.device
        mine = local_indices(s, self.context.c, self.context.group.rank, device)
        positions = call.get("position_ids")
        documents = documents_from_positions(positions) if positions is not None else None
        padding = self._padding(call.pop("attention_mask", None), b, s)
        if positions is None:
            positions = torch.arange(s, device=device).expand(b, s)
        for name in _SEQUENCE_ARGUMENTS:
            if call.get(name) is not None:
                call[name] = call[name][:, mine]
        call["position_ids"] = positions[:, mine]
        labels = call.get("labels")
        if labels is not None:
            shifted = call.pop("shift_labels", None)
            if shifted is None:
                shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]  # ForCausalLMLoss's shift, over the whole row
            if call.get("num_items_in_batch") is None:
                call["num_items_in_batch"] = (shifted != -100).sum()
            call["labels"], call["shift_labels"] = labels[:, mine], shifted[:, mine]
            per_document = call.get("sum_per_document")
            if per_document is not None:  # [b, s, D] aligned with the labels: shifted as they are, then this rank's
                call["sum_per_document"] = F.pad(per_document, (0, 0, 0, 1))[:, 1:][:, mine]
        call[LAYOUT_ARGUMENT] = ContextParallelBatch(self.context.group, self.context.comm, s, documents, padding)
        return (), call

    def _documents_only(self, args: tuple, kwargs: dict, call: dict) -> tuple[tuple, dict]:
        """One cp rank: the call unchanged; with ``position_ids``, a layout whose documents start at their restarts
        (and whose padding is the attention mask's) added to it, so attention stays inside each document."""
        positions = call.get("position_ids")
        if positions is None or positions.dim() != 2:
            return args, kwargs
        s = positions.shape[1]
        check_context_length(s, 1, self.tp_unit, self.name)
        mask = call.get("attention_mask")
        padding = self._padding(mask, *positions.shape) if mask is not None and mask.dim() == 2 else None
        if mask is not None and mask.dim() != 2:
            raise TypeError(f"{self.name} was given position_ids and a {mask.dim()}-D attention_mask: packed documents "
                            f"are read from position_ids restarting at 0, with attention_mask as [b, s] padding.")
        layout = ContextParallelBatch(self.context.group, self.context.comm, s, documents_from_positions(positions),
                                      padding)
        return args, {**kwargs, LAYOUT_ARGUMENT: layout}

    def _padding(self, mask: Optional[torch.Tensor], b: int, s: int) -> Optional[torch.Tensor]:
        if mask is None:
            return None
        if mask.dim() != 2 or tuple(mask.shape) != (b, s):
            raise TypeError(f"{self.name} under context parallelism takes attention_mask as [b, s] (1 = token, "
                            f"0 = padding); got shape {tuple(mask.shape)}. Pass packed documents as position_ids "
                            f"restarting at 0, not as a 4-D mask.")
        return mask == 0

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """The loss summed over the cp ranks.

        Raises:
            TypeError: the forward returned, but none of its layers received the layout: the model does not pass its
                call's keyword arguments on to its decoder layers (transformers' models do, Falcon's does not).
        """
        layout = kwargs.get(LAYOUT_ARGUMENT)
        # A pipeline stage that hands its output on ends its forward by an exception (output None): not checked.
        if output is not None and layout is not None and not layout.delivered[0]:
            raise TypeError(f"{self.name}'s forward does not pass its keyword arguments on to its decoder layers, so "
                            f"the context-parallel layout of this forward ({LAYOUT_ARGUMENT}=) never reached them "
                            f"and they would attend across ranks' chunks or packed documents. Train this model "
                            f"with cp=1 and without packed position_ids.")
        loss = getattr(output, "loss", None)
        if loss is not None:
            output.loss = sum_over_context(loss, self.context.group)
        return output


def install_context_parallel(model: nn.Module, context: ContextParallel, tp_unit: int, name: str) -> None:
    """Run ``model`` (a Hugging Face causal LM) on this cp rank's tokens (see the module docstring)."""
    entry = ContextParallelEntry(context, tp_unit, name or type(model).__name__)
    model.register_forward_pre_hook(entry.before, with_kwargs=True)
    model.register_forward_hook(entry.after, with_kwargs=True, always_call=True)
