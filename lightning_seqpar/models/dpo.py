"""Direct preference optimization (Rafailov et al., *Direct Preference Optimization*, 2023) on a causal LM split over
tensor-, context-, pipeline- and data-parallel ranks.

For a pair (prompt x, chosen y_w, rejected y_l), with ``log π(y|x)`` the sum of the reply tokens' log-probabilities
under the policy π and ``log π_ref(y|x)`` under the reference model:

    z = [log π(y_w|x) − log π_ref(y_w|x)] − [log π(y_l|x) − log π_ref(y_l|x)]
    sigmoid (DPO, eq. 7):   ℓ = −log σ(β·z)
    ipo (Azar et al. 2023): ℓ = (z − 1/(2β))², with each log-probability the mean over the reply's tokens (as TRL)

The rewards TRL logs are ``β·(log π − log π_ref)`` of each reply; ``rewards/accuracies`` the share of pairs whose
chosen reward is the larger, ``rewards/margins`` chosen minus rejected. The step's loss is one process's mean of ℓ
over the step's pairs (every data-parallel rank, accumulated and pipeline micro-batch).

The log-probabilities come from the model's own loss path with ``sum_per_row=True``
(:class:`~lightning_seqpar.hf.vocabulary.CausalLMLoss`): vocabulary-parallel cross entropy over the tp shards, in
chunks of the sequence when ``loss_chunk`` is set (no rank holds a whole sequence's ``[s, v]`` logits), summed over
the cp ranks, on the last pipeline stage, in float32 (float64 models: float64).

The reference: with LoRA, the same weights with the adapters switched off, in the same step under ``no_grad``
(:func:`~lightning_seqpar.transformer.lora.adapters_disabled`: no second copy; under pipeline parallelism, a
forward-only schedule of its own before the step's, the module's ``reference_step``); or, for full fine-tuning, the
``reference_logps`` a batch carries (:class:`~lightning_seqpar.data.preference_datamodule.PreferenceDataModule`'s
``reference``).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

DPO_LOSSES = ("sigmoid", "ipo")
"""The preference losses (TRL's ``loss_type`` names)."""


class PreferenceTerms(NamedTuple):
    """Per pair ``[n]``: the loss ℓ, the chosen and rejected rewards (detached); ``valid`` ``[n]`` (packed rows: 1 for
    a pair, 0 for an empty slot; ``None``: every entry is a pair)."""

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    valid: Optional[Tensor] = None

    def total(self, values: Tensor) -> Tensor:
        """The sum of ``values`` ``[n]`` over the pairs."""
        return values.sum() if self.valid is None else (values * self.valid).sum()

    def mean(self, values: Tensor) -> Tensor:
        """The mean of ``values`` ``[n]`` over the pairs (0 when there is none)."""
        if self.valid is None:
            return values.mean()
        return self.total(values) / self.valid.sum().clamp_min(1)


def check_settings(beta: float, loss: str) -> None:
    """Raises ``ValueError`` for ``loss`` not one of :data:`DPO_LOSSES`, or ``beta`` not positive."""
    if loss not in DPO_LOSSES:
        raise ValueError(f"dpo.loss={loss!r}: one of {DPO_LOSSES}.")
    if not beta > 0:
        raise ValueError(f"dpo.beta={beta}: β must be positive (TRL's default is 0.1).")


def dpo_terms(policy_chosen: Tensor, policy_rejected: Tensor, reference_chosen: Tensor, reference_rejected: Tensor,
              beta: float, loss: str = "sigmoid") -> PreferenceTerms:
    """ℓ and the rewards of ``n`` pairs from their log-probabilities ``[n]`` (see the module docstring).

    Raises:
        ValueError: ``loss`` not one of :data:`DPO_LOSSES`, or ``beta`` not positive.
    """
    check_settings(beta, loss)
    chosen = policy_chosen - reference_chosen
    rejected = policy_rejected - reference_rejected
    z = chosen - rejected
    losses = -F.logsigmoid(beta * z) if loss == "sigmoid" else (z - 1 / (2 * beta)) ** 2
    return PreferenceTerms(losses, beta * chosen.detach(), beta * rejected.detach())


def reply_tokens(labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Supervised tokens of each row after transformers' shift ``[rows]`` (the labels of the whole row)."""
    return (labels[:, 1:] != ignore_index).sum(-1)


def document_tokens(labels: Tensor, documents: Tensor, ignore_index: int = -100) -> Tensor:
    """Supervised tokens of each document of packed rows after transformers' shift ``[rows, D]`` (``documents``
    ``[rows, s, D]`` aligned with ``labels``: :class:`~lightning_seqpar.hf.vocabulary.CausalLMLoss`'s
    ``sum_per_document``)."""
    supervised = (labels[:, 1:] != ignore_index).to(torch.int64)
    return torch.einsum("bs,bsd->bd", supervised, documents[:, 1:].to(torch.int64))


class PreferenceLoss:
    """The DPO step of a Hugging Face causal LM (see the module docstring).

    Args:
        beta: β.
        loss: ``"sigmoid"`` or ``"ipo"``.
        has_adapters: the model is LoRA-wrapped (its frozen base is the reference when batches carry none).

    Raises:
        ValueError: an unknown ``loss`` or a non-positive ``beta``.
    """

    def __init__(self, beta: float, loss: str, has_adapters: bool) -> None:
        check_settings(beta, loss)
        self.beta, self.loss, self.has_adapters = beta, loss, has_adapters

    def row_logps(self, model: nn.Module, batch: dict) -> Tensor:
        """``[2b]`` Σ log p of each row's reply tokens under ``model`` (see the module docstring); packed rows
        (``sum_per_document`` in ``batch``): ``[b, 2K]``, each reply slot's.

        Raises:
            ValueError: the model's forward does not take ``sum_per_row=``, or its loss did not come back per row (its
                forward does not pass keyword arguments on to its loss function), naming it.
        """
        packed = "sum_per_document" in batch
        names = ("input_ids", "labels", "position_ids", "sum_per_document") if packed else (
            "input_ids", "labels", "attention_mask")
        inputs = {k: batch[k] for k in names if k in batch}
        try:
            per_row = model(**inputs, **({} if packed else {"sum_per_row": True})).loss
        except TypeError as error:
            if "sum_per_row" not in str(error):
                raise
            raise ValueError(f"{type(model).__name__}'s forward takes no keyword arguments beyond its own ({error}), "
                             f"so it cannot hand sum_per_row=True to its loss function: DPO needs the per-row sums. "
                             f"Use a model whose forward passes **kwargs on to loss_function (transformers' causal "
                             f"LMs do).") from None
        rows = batch["input_ids"].shape[0]
        want = (rows, batch["sum_per_document"].shape[-1]) if packed else (rows,)
        if per_row is None or tuple(per_row.shape) != want:
            raise ValueError(f"{type(model).__name__} returned a loss of shape "
                             f"{None if per_row is None else tuple(per_row.shape)} for "
                             f"{'sum_per_document=' if packed else 'sum_per_row=True'}, not one per "
                             f"{'reply slot' if packed else 'row'} {want}: its forward does "
                             f"not pass its keyword arguments on to its loss function (or adds a term to it, such as a "
                             f"router's auxiliary loss). DPO needs the sums per reply.")
        return -per_row

    def base_logps(self, model: nn.Module, batch: dict) -> Tensor:
        """``[2b]`` Σ log p under the model as the reference: adapters off (LoRA), else the weights as they are (a
        reference pass before training, :mod:`~lightning_seqpar.models.dpo_reference`); without gradients."""
        from lightning_seqpar.transformer.lora import adapters_disabled

        with torch.no_grad(), adapters_disabled(model) if self.has_adapters else nullcontext():
            return self.row_logps(model, batch)

    def reference_logps(self, model: nn.Module, batch: dict, pipelined: bool) -> Tensor:
        """``[2b]`` the reference's Σ log p: the batch's ``reference_logps``, or the frozen base (LoRA, adapters off).

        Raises:
            ValueError: no reference in the batch and no adapters (full fine-tuning), or under pipeline parallelism
                (one forward per micro-batch: the reference comes from the module's ``reference_step``), naming the
                fix.
        """
        if "reference_logps" in batch:
            return batch["reference_logps"]
        if not self.has_adapters:
            raise ValueError("DPO needs the reference model's log-probabilities, and full fine-tuning has no frozen "
                             "copy of the starting model. Compute them before trainer.fit and give them to the data: "
                             "data.reference = lightning_seqpar.models.dpo_reference.reference_for_run(trainer, "
                             "module, data), as recipes/finetune.py objective=dpo does.")
        if pipelined:
            raise ValueError("Under pipeline parallelism each micro-batch runs one forward through the stages, so the "
                             "LoRA reference (adapters off) comes from the module's reference_step, which the "
                             "strategy runs before the step (FineTuneModule's), or from the batch's reference_logps; "
                             "this micro-batch has neither.")
        return self.base_logps(model, batch)

    def terms(self, model: nn.Module, batch: dict, pipelined: bool) -> tuple[PreferenceTerms, Tensor]:
        """The pairs' :class:`PreferenceTerms` and the policy's per-row log-probabilities ``[2b]``.

        Raises:
            ValueError: an odd number of rows (a pair cut by the micro-batches), or from :meth:`reference_logps` and
                :meth:`row_logps`.
        """
        rows = batch["input_ids"].shape[0]
        packed = "sum_per_document" in batch
        if rows % 2 and not packed:
            raise ValueError(f"A DPO micro-batch of {rows} rows cuts a preference pair in two: under pipeline "
                             f"parallelism use a data.batch_size (pairs) divisible by num_microbatches.")
        if pipelined:  # the forward first: a stage before the last leaves the step in it, the reference on the last
            policy = self.row_logps(model, batch)
            reference = self.reference_logps(model, batch, pipelined)
        else:  # the reference first, as one process's step (dropout draws in this order)
            reference = self.reference_logps(model, batch, pipelined)
            policy = self.row_logps(model, batch)
        reference = reference.to(policy.dtype)
        if self.loss == "ipo":  # TRL: the mean over the reply's tokens
            tokens = (document_tokens(batch["labels"], batch["sum_per_document"]) if packed
                      else reply_tokens(batch["labels"])).clamp_min(1).to(policy.dtype)
            policy, reference = policy / tokens, reference / tokens
        if packed:  # [b, 2K] slots: chosen 2k, rejected 2k+1 of each row's k-th pair, empty slots weighed 0
            valid = (batch["pair_index"] >= 0).reshape(-1).to(policy.dtype)
            policy, reference = policy.reshape(-1), reference.reshape(-1)
            terms = dpo_terms(policy[0::2], policy[1::2], reference[0::2], reference[1::2], self.beta, self.loss)
            return terms._replace(valid=valid), policy
        return dpo_terms(policy[0::2], policy[1::2], reference[0::2], reference[1::2], self.beta, self.loss), policy

    @staticmethod
    def metrics(terms: PreferenceTerms, policy: Tensor) -> dict[str, Tensor]:
        """TRL's names: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
        ``logps/chosen``, ``logps/rejected`` (means over the micro-batch's pairs)."""
        chosen, rejected = terms.chosen_rewards, terms.rejected_rewards
        policy = policy.detach()
        return {"rewards/chosen": terms.mean(chosen), "rewards/rejected": terms.mean(rejected),
                "rewards/accuracies": terms.mean((chosen > rejected).to(chosen.dtype)),
                "rewards/margins": terms.mean(chosen - rejected),
                "logps/chosen": terms.mean(policy[0::2]), "logps/rejected": terms.mean(policy[1::2])}


def refuse_unsupported(config: Any, objective: str) -> None:
    """Refuse, before training, a model whose loss DPO cannot read per row (GRPO: per token).

    Raises:
        ValueError: a mixture of experts recording its router logits (transformers adds the load-balancing loss to
            the loss, which is per row here), naming the fix.
    """
    if objective in ("dpo", "grpo") and getattr(config, "output_router_logits", False):
        reads = "per row" if objective == "dpo" else "per token"
        raise ValueError(f"{getattr(config, 'model_type', 'the model')} records its router logits "
                         f"(output_router_logits=True), and transformers adds their load-balancing loss to the loss, "
                         f"which {objective.upper()} reads {reads}. Set output_router_logits=False in its config for "
                         f"{objective.upper()}.")

