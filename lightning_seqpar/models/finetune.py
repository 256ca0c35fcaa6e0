"""A LightningModule that fine-tunes a pretrained Hugging Face causal LM on supervised examples: in full, or with
LoRA adapters (PEFT) on the frozen model; what a user would write for one device.

PEFT and transformers are imported when the module builds its model, never by ``import lightning_seqpar``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_seqpar.checkpoint.peft_adapter import (
    LORA_TARGETS, check_adapter_directory, check_lora_parameters, check_lora_targets, expert_parameter_targets,
    lora_config,
)
from lightning_seqpar.hf.layouts import freeze_routers
from lightning_seqpar.hf.vocabulary import CausalLMLoss
from lightning_seqpar.hf.models import build_causal_lm, pretrained_state_dict
from lightning_seqpar.lightning.loss_average import data_parallel_replicas, loss_replicas, pipeline_microbatches
from lightning_seqpar.models.dpo import PreferenceLoss, refuse_unsupported
from lightning_seqpar.models.grpo_objective import GRPOObjective, GRPOSettings
from lightning_seqpar.models.hf_module import HFCausalLMModule

OBJECTIVES = ("sft", "dpo", "grpo")
LORA_DEFAULTS = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": list(LORA_TARGETS), "target_parameters": None}


class FineTuneModule(HFCausalLMModule):
    """Supervised fine-tuning (``objective="sft"``) or preference tuning (``objective="dpo"``) of
    ``AutoModelForCausalLM`` from a pretrained directory.

    Batches are dicts (:class:`~lightning_seqpar.data.finetune_datamodule.FineTuneDataModule`): ``input_ids`` and
    ``labels`` ``[b, s]`` (``-100`` off the supervised tokens), ``position_ids`` (packed examples) or
    ``attention_mask`` (padded), and ``num_items_in_step`` ``[b]``, the optimizer step's supervised-token count.
    The training loss of a micro-batch is its token sum over ``num_items_in_step / R``
    (:func:`~lightning_seqpar.lightning.loss_average.loss_replicas`): the step's gradient is that of one process's
    mean over the step's supervised tokens, however they fall across rows, ranks and micro-batches. Validation logs
    the mean over the supervised tokens of the validation batches run (``val/loss``; all of the split unless
    ``limit_val_batches`` stops it earlier); the recipe reports its exponential (``val/ppl``).

    With ``objective="grpo"`` batches are prompts (:class:`~lightning_seqpar.data.prompt_datamodule.PromptDataModule`),
    rolled out before each step and trained with GRPO's loss (:mod:`~lightning_seqpar.models.grpo_objective`, with
    ``grpo``'s :class:`~lightning_seqpar.models.grpo_objective.GRPOSettings`); TRL's rollout metrics are logged.

    With ``objective="dpo"`` batches are preference pairs
    (:class:`~lightning_seqpar.data.preference_datamodule.PreferenceDataModule`: rows ``2i`` chosen, ``2i+1``
    rejected, ``num_items_in_step`` the step's pairs) and the loss is :mod:`~lightning_seqpar.models.dpo`'s, one
    process's mean over the step's pairs; ``train/loss`` and TRL's ``rewards/*`` and ``logps/*`` are logged in training,
    ``val/loss`` and ``val/rewards/*`` in validation (means over the pairs of the batches run). While
    ``reference_collector`` is set (a reference pass, :mod:`~lightning_seqpar.models.dpo_reference`), validation
    collects the reference's log-probabilities instead.

    Args:
        pretrained: a local Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``).
        lora: ``None`` for full fine-tuning, or LoRA's settings: ``r``, ``alpha``, ``dropout``, ``target_modules``
            and ``target_parameters`` (a mixture's packed expert weights, ``mlp.experts.gate_up_proj`` and
            ``mlp.experts.down_proj``) (defaults :data:`LORA_DEFAULTS`); ``target_modules="all-linear"`` on a mixture
            adapts its experts too, unless ``target_parameters`` says otherwise. The model is wrapped with
            ``peft.get_peft_model`` and only the adapters train.
        attn_implementation: ``"eager"`` or ``"sdpa"``.
        adapter: a PEFT adapter directory to start from (its ``adapter_config.json`` sets r, α, dropout and the
            targets; ``lora`` is then ignored).
        freeze_router: a mixture of experts' routers are not trained (their weights as pretrained; the experts learn
            under the routing they give).
        objective: ``"sft"`` or ``"dpo"``.
        dpo_beta: β of the DPO loss.
        dpo_loss: ``"sigmoid"`` (DPO) or ``"ipo"``.
        grpo: GRPO's settings (:class:`~lightning_seqpar.models.grpo_objective.GRPOSettings`' fields).
        **optimization: :class:`~lightning_seqpar.models.module.CausalLMModule`'s arguments.

    Raises:
        ImportError: ``lora`` without PEFT installed, with the install command.
        FileNotFoundError: a missing model directory or weight file, or an adapter directory without its files.
        ValueError: LoRA target names that match no module (listing the model's linear names); an adapter made for
            another base, damaged, or differing from its export's digests (naming it and its base); an unknown
            objective or DPO loss, β ≤ 0, a mixture of experts adding its router loss under DPO.
    """

    def __init__(self, pretrained: str, lora: Optional[dict] = None, attn_implementation: str = "eager",
                 adapter: Optional[str] = None, freeze_router: bool = False, objective: str = "sft",
                 dpo_beta: float = 0.1, dpo_loss: str = "sigmoid", grpo: Optional[dict] = None,
                 **optimization: Any) -> None:
        super().__init__(None, pretrained, attn_implementation, **optimization)
        if objective not in OBJECTIVES:
            raise ValueError(f"objective={objective!r}: one of {OBJECTIVES}.")
        refuse_unsupported(self.hf_config, objective)
        self.adapter, self.freeze_router, self.objective = adapter, freeze_router, objective
        if adapter is not None or lora is not None:  # refused here, before any process starts, naming the fix
            with torch.device("meta"):
                base = build_causal_lm(self.hf_config)
        if adapter is not None:  # its own settings: the adapter continues as it was made
            saved = check_adapter_directory(adapter, base, pretrained)
            lora = {"r": saved["r"], "alpha": saved["lora_alpha"], "dropout": saved.get("lora_dropout", 0.0),
                    "target_modules": sorted(saved.get("target_modules") or []),
                    "target_parameters": sorted(saved.get("target_parameters") or []) or None}
        self.lora = None if lora is None else {**LORA_DEFAULTS, **lora}
        if self.lora is not None and adapter is None:
            check_lora_targets(self.lora["target_modules"], base)
            if self.lora["target_modules"] == "all-linear" and self.lora["target_parameters"] is None:
                self.lora["target_parameters"] = expert_parameter_targets(base) or None  # "all" includes the experts
            check_lora_parameters(self.lora["target_parameters"], base)
        self.preference = PreferenceLoss(dpo_beta, dpo_loss, self.lora is not None) if objective == "dpo" else None
        self.reference_collector = None  # set during a reference pass (lightning_seqpar.models.dpo_reference)
        self.grpo_settings = GRPOSettings(**(grpo or {})) if objective == "grpo" else None
        self.grpo: Optional[GRPOObjective] = None  # made at fit start, from the data module's prompts
        self.save_hyperparameters({"lora": self.lora, "adapter": adapter, "freeze_router": freeze_router,
                                   "objective": objective, "dpo_beta": dpo_beta, "dpo_loss": dpo_loss, "grpo": grpo})

    def declared_model(self) -> Any:
        """The model ``configure_model`` builds, its routers frozen and LoRA's adapters around it as configured, without
        any weight read (:class:`~lightning_seqpar.lightning.declared_model.DeclaresModel`)."""
        model = build_causal_lm(self.hf_config)
        if self.freeze_router:
            freeze_routers(model)
        return self.with_adapters(model) if self.lora is not None else model  # as configure_model under the strategy

    def configure_model(self) -> None:
        if hasattr(self, "model"):
            return
        model = build_causal_lm(self.hf_config)
        if self.freeze_router:
            freeze_routers(model)
        strategy = self.trainer.strategy
        into_shards = hasattr(strategy, "load_single_device_state_dict")
        resumed = self.trainer.ckpt_path is not None
        if not into_shards and not resumed:  # one device: the weights first, then the adapters around them
            model.load_state_dict(pretrained_state_dict(self.pretrained))
        if self.adapter is not None and not into_shards:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, self.adapter, is_trainable=True)
        elif self.lora is not None:
            model = self.with_adapters(model)
        if self.preference is not None or self.grpo_settings is not None:  # per row / per token, at tp = cp = 1 too
            causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
            causal_lm.loss_function = CausalLMLoss(causal_lm.loss_function)
        self.model = model
        # Read into the shards when they are made; adapters by LoRA's own rule, or from the adapter directory.
        # Resuming LoRA, the frozen base is read again too: the sharded checkpoint holds the adapters only.
        if into_shards and (not resumed or self.lora is not None):
            strategy.checkpointer.load_single_device_state_dict(self.pretrained, prefix="model.", adapter=self.adapter)

    def with_adapters(self, model: Any) -> Any:
        """``model`` wrapped with PEFT as this module's LoRA settings (or its adapter directory's config) say."""
        try:
            from peft import PeftConfig, get_peft_model
        except ImportError as error:
            raise ImportError("LoRA needs PEFT: pip install 'lightning_seqpar[peft]'.") from error
        if self.adapter is None:
            return get_peft_model(model, lora_config(self.lora))
        config = PeftConfig.from_pretrained(self.adapter)  # the adapter's own (its weights are read into the shards)
        config.inference_mode = False
        return get_peft_model(model, config)

    @property
    def reference_step(self) -> Optional[Callable[[dict, int], dict]]:
        """DPO with LoRA under pipeline parallelism: the forward-only step the strategy runs through the stages before
        each training and validation step, ``{"reference_logps": [2b]}`` (the frozen base's Σ log p per row, adapters
        off), merged into the micro-batch on the last stage; ``None`` otherwise (the step makes its reference itself,
        or reads it from the batch). See :meth:`~lightning_seqpar.lightning.pipelined_steps.PipelinedSteps`."""
        try:
            pipelined = getattr(self.trainer.strategy, "pipeline", None) is not None
        except RuntimeError:  # not attached to a trainer
            return None
        if self.preference is None or self.lora is None or self.reference_collector is not None or not pipelined:
            return None
        return self._reference

    def _reference(self, batch: dict, batch_idx: int) -> dict:
        return {"reference_logps": self.preference.base_logps(self.model, batch)}

    def _model_inputs(self, batch: dict) -> dict:
        return {k: v for k, v in batch.items() if k != "num_items_in_step"}

    def _preference_step(self, batch: dict, training: bool) -> Tensor:
        """The micro-batch's DPO loss, scaled so the step's gradient is one process's mean over its pairs (training),
        or the mean over the micro-batch's pairs (validation), with TRL's metrics logged (``val/`` in validation)."""
        pipelined = getattr(self.trainer.strategy, "pipeline", None) is not None
        terms, policy = self.preference.terms(self.model, batch, pipelined)
        pairs = terms.losses.shape[0]  # packed rows: slots (their pairs counted on the host in validation only)
        if not training and terms.valid is not None:  # an empty micro-batch (rows of padding) weighs nothing
            pairs = int(terms.valid.sum())
        if training:
            in_step = batch["num_items_in_step"][0].to(torch.float64)
            loss = terms.total(terms.losses) / (in_step / loss_replicas(self.trainer))
            self.log("train/loss", terms.mean(terms.losses), prog_bar=True, sync_dist=True, batch_size=pairs)
        else:
            loss = terms.mean(terms.losses)
            self.log("val/loss", loss, prog_bar=True, sync_dist=True, on_step=False, on_epoch=True, batch_size=pairs)
        metrics = self.preference.metrics(terms, policy)
        self.log_dict({("" if training else "val/") + k: v for k, v in metrics.items()}, sync_dist=True,
                      on_step=training, on_epoch=not training, batch_size=pairs)
        return loss

    def on_fit_start(self) -> None:
        """GRPO: its objective, from the data module's prompts, columns and tokenizer
        (:class:`~lightning_seqpar.data.prompt_datamodule.PromptDataModule`)."""
        if self.grpo_settings is None:
            return
        data = self.trainer.datamodule
        pad = int(data.tokenizer.separator[-1])
        self.grpo = GRPOObjective(self.grpo_settings, data.decode, data.prompts, data.columns,
                                  eos_token_id=self.hf_config.eos_token_id, pad_token_id=pad)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """GRPO: the rollout of the batch's prompts, before the step (and its pipeline schedule); its metrics logged
        under TRL's names."""
        if self.grpo is None:
            return
        start = _synchronized_clock(self.device)
        self.grpo.roll_out(self, batch)
        self._update_start = _synchronized_clock(self.device)
        self.log_dict({**self.grpo.metrics, "time/rollout_s": self._update_start - start}, sync_dist=True)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """GRPO: the seconds of the step's update (forward, backward, optimizer; after the rollout)."""
        if self.grpo is not None:
            self.log("time/update_s", _synchronized_clock(self.device) - self._update_start, sync_dist=True)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        if self.preference is not None:
            return self._preference_step(batch, training=True)
        if self.grpo is not None:
            loss = self.grpo.loss(self, batch)
            self.log("train/loss", loss / loss_replicas(self.trainer), prog_bar=True, sync_dist=True)
            self.log_dict(self.grpo.loss_metrics, sync_dist=True)
            return loss
        count = batch["num_items_in_step"][0].clamp_min(1).to(torch.float64)
        divisor = count / loss_replicas(self.trainer)
        loss = self.model(**self._model_inputs(batch), num_items_in_batch=divisor).loss
        self.log("train/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def on_validation_epoch_start(self) -> None:
        if self.preference is not None or self.reference_collector is not None:
            return  # means over pairs: the same count in every batch
        # The denominator: the supervised tokens of the validation batches that will run (every data-parallel rank's),
        # not of the whole split: limit_val_batches (or the sanity check) may run fewer. Read from the loader's own
        # steps (the same on every rank, pipeline stages included), so no rank communicates for it.
        trainer = self.trainer
        runs = (trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches)[0]
        self._val_tokens = max(1, trainer.val_dataloaders.dataset.supervised_in(runs))

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Logs ``val/loss``: this micro-batch's share of the mean over the supervised tokens of the validation batches
        run (:meth:`on_validation_epoch_start`), summed over batches and ranks; ranks holding the same replica
        (tensor-, context-, pipeline-parallel) each log ``1/k`` of it, and a pipeline's average over its m
        micro-batches is undone by ``m``. The recipe reports ``exp(val/loss)`` as the perplexity. Under DPO: the
        mean DPO loss and rewards over the pairs of the batches run."""
        if self.reference_collector is not None:  # a reference pass (lightning_seqpar.models.dpo_reference)
            self.reference_collector.add(batch["pair_index"], self.preference.base_logps(self.model, batch))
            return
        if self.preference is not None:
            self._preference_step(batch, training=False)
            return
        token_sum = self.model(**self._model_inputs(batch), num_items_in_batch=1).loss
        same_replica = self.trainer.world_size // data_parallel_replicas(self.trainer)
        share = token_sum * pipeline_microbatches(self.trainer) / (self._val_tokens * same_replica)
        self.log("val/loss", share, reduce_fx="sum", sync_dist=True, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        pass  # val/loss is a sum of logged shares (validation_step): no metric objects to compute


def _synchronized_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the device's queued work is done (CUDA: a synchronization; a step's timing
    only)."""
    import time

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
