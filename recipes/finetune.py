"""Fine-tune a local Hugging Face model on chat or instruction data, in full or with LoRA, under tensor / sequence /
pipeline parallelism.

    python recipes/finetune.py model.pretrained=DIR data.path=chat.jsonl                   # full, 2 CPU processes, tp 2
    python recipes/finetune.py model.pretrained=DIR data.path=chat.jsonl peft=lora peft.r=16 peft.alpha=32 \\
        export_hf=adapter export_hf_merged=merged                                          # LoRA, PEFT + merged export
    python recipes/finetune.py ... strategy=pp2_tp2 trainer.devices=4                      # pipeline 2 × tensor 2
    python recipes/finetune.py model.pretrained=DIR data.path=pairs.jsonl objective=dpo peft=lora dpo.beta=0.1
                                                                                           # preference tuning (DPO)

The data is JSON Lines: ``{"messages": [...]}`` (rendered with the tokenizer's chat template; loss on the assistant's
tokens), ``{"prompt", "completion"}`` (loss on the completion) or ``{"text"}``; examples are packed into rows of
``data.block_size`` tokens without attending to each other (``data.packing=false``: one per row, padded). The loss is
the mean over the supervised tokens of each optimizer step, as one process would compute it. At the end: validation
loss and perplexity on the held-out examples' supervised tokens, a reply decoded from ``sample.prompt`` and the
exports asked for. Every field of ``conf/finetune.yaml`` can be overridden on the command line (Hydra).

``objective=grpo``: the data is prompts (``{"prompt": str | [messages], "answer": ..., ...}``; any other column is
handed to the reward functions), ``data.batch_size`` prompts per rank and step, each rolled out ``grpo.num_generations``
times in the training layout before the step and trained with GRPO's loss (``grpo.loss_type``: dapo, grpo, dr_grpo,
bnpo; ``grpo.reward``: contains, exact_match, math, or ``package.module:function``). TRL's rollout metrics are logged
(``reward``, ``reward_std``, ``rewards/<name>/mean``, ...).

``objective=dpo``: the data is preference pairs (``{"prompt", "chosen", "rejected"}`` texts, or ``chosen`` and
``rejected`` conversations; :mod:`lightning_seqpar.data.preference`), ``data.batch_size`` pairs per micro-batch
(``dpo.packing=true``: rows of ``data.block_size`` tokens holding whole pairs, each reply attending to itself), and
the loss is DPO's (``dpo.loss=sigmoid``) or IPO's (``dpo.loss=ipo``) with ``dpo.beta``. The reference model is the
frozen base with LoRA's adapters off, in the same step (under pipeline parallelism, a forward-only schedule before
the step's); for full fine-tuning, its log-probabilities are computed first through the same layout and cached
(``dpo.reference``, default beside the data; a cache made for another model, data or settings is computed again, a
damaged one is refused by name when given explicitly). At the end: validation loss and TRL's reward metrics.
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: helpers of the recipes package

from lightning_seqpar import SeqParallelStrategy, generate  # noqa: E402
from lightning_seqpar.checkpoint.destination import refuse_export_destination  # noqa: E402
from lightning_seqpar.checkpoint.peft_export import export_peft_adapter  # noqa: E402
from lightning_seqpar.data.finetune_datamodule import FineTuneDataModule  # noqa: E402
from lightning_seqpar.data.preference_datamodule import PreferenceDataModule  # noqa: E402
from lightning_seqpar.data.prompt_datamodule import PromptDataModule  # noqa: E402
from lightning_seqpar.extras import require_extra  # noqa: E402
from lightning_seqpar.lightning.callbacks import LayoutReport, ParallelModelSummary, SampleText  # noqa: E402
from lightning_seqpar.models.dpo_reference import reference_for_run  # noqa: E402
from lightning_seqpar.models.finetune import FineTuneModule  # noqa: E402
from recipes.pretrain_gpt import CONF_DIR, memory_callbacks, route_logs_to_hydra  # noqa: E402

log = logging.getLogger("finetune")


def check_options(cfg: DictConfig, output_dir: Path) -> None:
    """Refuse, before any process starts, exports that cannot apply or would overwrite what must stay.

    Raises:
        ValueError: ``export_hf_merged`` without LoRA; an unknown ``objective``.
        FileExistsError: an export destination that must not be written (:mod:`lightning_seqpar.checkpoint.destination`).
        ImportError: without the ``[hf]`` extra (every run here fine-tunes a Hugging Face model), or ``peft=lora``
            without ``[peft]``.
    """
    require_extra("hf", "recipes/finetune.py (a Hugging Face model)")
    if cfg.peft.kind == "lora":
        require_extra("peft", "peft=lora")
    if cfg.objective not in ("sft", "dpo", "grpo"):
        raise ValueError(f"objective={cfg.objective!r}: sft (supervised fine-tuning), dpo (preference pairs) or grpo "
                         f"(prompts and verifiable rewards).")
    if cfg.export_hf_merged and cfg.peft.kind != "lora":
        raise ValueError("export_hf_merged needs peft=lora (full fine-tuning has no adapters to merge): use export_hf.")
    for out in (cfg.export_hf, cfg.export_hf_merged):
        if out:
            refuse_export_destination(out, overwrite=cfg.export_hf_overwrite,
                                      protected=(output_dir, cfg.model.pretrained))


def build(cfg: DictConfig, output_dir: Path) -> tuple[FineTuneModule, Any, pl.Trainer]:
    dpo = cfg.objective == "dpo"
    tokenizer = cfg.data.tokenizer or cfg.model.pretrained
    grpo = OmegaConf.to_container(cfg.grpo, resolve=True) if cfg.objective == "grpo" else None
    if grpo is not None:  # prompts, rolled out before each step
        data = PromptDataModule(cfg.data.path, tokenizer, cfg.data.batch_size, grpo.pop("max_prompt_length"), cfg.seed)
    elif dpo:  # one reply per row, padded, unless dpo.packing (data.packing is the supervised examples')
        data = PreferenceDataModule(cfg.data.path, tokenizer, cfg.data.block_size, cfg.data.batch_size,
                                    cfg.data.overflow, cfg.data.val_fraction, cfg.seed,
                                    packing=cfg.dpo.get("packing", False))
    else:
        data = FineTuneDataModule(cfg.data.path, tokenizer, cfg.data.block_size, cfg.data.batch_size, cfg.data.packing,
                                  cfg.data.overflow, cfg.data.val_fraction, cfg.seed, cfg.data.cache_dir,
                                  cfg.data.stall_timeout)
    lora, adapter = None, None
    if cfg.peft.kind == "lora":
        lora = {k: v for k, v in OmegaConf.to_container(cfg.peft, resolve=True).items() if k not in ("kind", "adapter")}
        adapter = cfg.peft.get("adapter")
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    optim["optimizer"] = optim.pop("name", "adamw")
    module = FineTuneModule(cfg.model.pretrained, lora, cfg.model.attn_implementation, adapter,
                            freeze_router=cfg.model.freeze_router, max_steps=cfg.trainer.max_steps,
                            objective=cfg.objective, dpo_beta=cfg.dpo.beta, dpo_loss=cfg.dpo.loss, grpo=grpo, **optim)
    callbacks: list[pl.Callback] = [
        ModelCheckpoint(dirpath=output_dir / cfg.checkpoint_dir, filename="step{step:06d}",
                        auto_insert_metric_name=False, save_last=True, every_n_train_steps=cfg.trainer.val_check_interval),
        ParallelModelSummary(),  # with a frozen base: PEFT's "trainable params: … || all params: …" line
        # tp/cp/pp/dp and the predicted, then measured, peak (DPO: two rows per pair)
        LayoutReport(cfg.data.block_size, cfg.data.batch_size * (2 if dpo else 1)),
    ]
    if cfg.trainer.get("enable_progress_bar", True):
        callbacks.append(TQDMProgressBar())  # Lightning's rich bar prints "Epoch 4/-2" for step-based runs
    callbacks += memory_callbacks(cfg)
    if cfg.sample.get("every_n_steps"):  # replies logged during training (logs/.../samples.csv, and the log)
        callbacks.append(SampleText([cfg.sample.prompt], lambda prompt: prompt_ids(data, prompt),
                                    data.tokenizer.decode, cfg.sample.every_n_steps, cfg.sample.max_new_tokens,
                                    module.hf_config.eos_token_id, data.tokenizer.separator[0]))
    trainer = pl.Trainer(strategy=SeqParallelStrategy(**OmegaConf.to_container(cfg.strategy, resolve=True)),
                         callbacks=callbacks, logger=CSVLogger(output_dir, name="logs"),
                         **OmegaConf.to_container(cfg.trainer, resolve=True))
    return module, data, trainer


def prompt_ids(data: Any, prompt: str) -> list[int]:
    """``prompt`` as one user turn, rendered with the chat template where the tokenizer has one, as token ids."""
    hf = data.tokenizer.tokenizer
    if getattr(hf, "chat_template", None):
        return hf.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
    return hf(prompt, add_special_tokens=False)["input_ids"]


def reply(module: FineTuneModule, trainer: pl.Trainer, data: Any, prompt: str, tokens: int) -> str:
    """A greedy reply to ``prompt`` (one user turn, rendered with the chat template when there is one), generated in
    the training layout (:func:`lightning_seqpar.generate`: every tensor, expert and pipeline layout; under context
    parallelism, where no decoded position splits, from a single-device copy of the fine-tuned model). Collective:
    every rank calls it."""
    ids = prompt_ids(data, prompt)
    batch = torch.tensor([ids], device=module.device)
    pad = data.tokenizer.separator[0]
    layout = trainer.strategy.layout
    if layout.cp == 1:
        out = generate(module, batch, tokens, eos_token_id=module.hf_config.eos_token_id, pad_token_id=pad)
        return data.tokenizer.decode(out[0, len(ids):].tolist())
    from transformers import AutoModelForCausalLM

    state = trainer.strategy.full_state_dict()  # collective: the single-device weights (LoRA: base and adapters)
    model = AutoModelForCausalLM.from_config(module.hf_config).to(module.device, torch.float32)
    if module.lora is not None:
        model = module.with_adapters(model)  # the same PEFT wrapping: the adapters' keys match
    model.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=batch, max_new_tokens=tokens, do_sample=False, pad_token_id=pad)
    return data.tokenizer.decode(out[0, len(ids):].tolist())


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="finetune")
def main(cfg: DictConfig) -> dict:
    route_logs_to_hydra()
    output_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    check_options(cfg, output_dir)
    pl.seed_everything(cfg.seed, workers=True)
    module, data, trainer = build(cfg, output_dir)
    if cfg.objective == "dpo":  # full fine-tuning: the reference's log-probabilities first (collective)
        data.reference = reference_for_run(trainer, module, data, cfg.dpo.reference)
    trainer.fit(module, datamodule=data, ckpt_path=cfg.ckpt_path)
    unvalidated = trainer.global_step % cfg.trainer.val_check_interval or "val/loss" not in trainer.callback_metrics
    if cfg.objective != "grpo" and unvalidated:  # (GRPO's prompts hold no loss out: its metrics are the rollouts')
        trainer.validate(module, datamodule=data, verbose=False)  # the last step was not validated yet
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if cfg.objective == "sft":
        metrics["val/ppl"] = math.exp(metrics["val/loss"])
    strategy = trainer.strategy
    if cfg.export_hf and module.lora is not None:  # collective
        export_peft_adapter(module, strategy.mesh, Path(cfg.export_hf).absolute(), overwrite=cfg.export_hf_overwrite)
        log.info("exported PEFT adapter: %s", cfg.export_hf)
    elif cfg.export_hf:
        strategy.save_hf_pretrained(Path(cfg.export_hf).absolute(), source=module.pretrained,
                                    overwrite=cfg.export_hf_overwrite, tokenizer=data.tokenizer)
        log.info("exported Hugging Face model: %s", cfg.export_hf)
    if cfg.export_hf_merged:
        strategy.save_hf_pretrained(Path(cfg.export_hf_merged).absolute(), source=module.pretrained,
                                    overwrite=cfg.export_hf_overwrite, tokenizer=data.tokenizer, merge_lora=True)
        log.info("exported merged Hugging Face model: %s", cfg.export_hf_merged)
    text = reply(module, trainer, data, cfg.sample.prompt, cfg.sample.max_new_tokens)
    if trainer.is_global_zero:
        log.info("final metrics: %s", metrics)
        log.info("--- sample ---\n%s\n%s\n--------------", cfg.sample.prompt, text)
    return metrics


if __name__ == "__main__":
    main()
