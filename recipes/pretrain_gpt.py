"""Pretrain the reference GPT with tensor + sequence parallelism and selective recomputation.

    python recipes/pretrain_gpt.py                                   # 2 CPU processes, tp=2, SP, selective
    python recipes/pretrain_gpt.py strategy.tp=4 trainer.devices=4 model.n_layer=8
    python recipes/pretrain_gpt.py data.path=my_corpus/ trainer.max_steps=2000
    python recipes/pretrain_gpt.py strategy=pp2_tp2 trainer.devices=4      # pipeline 2 × tensor 2, 1F1B
    python recipes/pretrain_gpt.py model=llama_tiny                         # a Llama-shaped Hugging Face model
    python recipes/pretrain_gpt.py model=hf_pretrained model.pretrained=DIR data.path=corpus.jsonl export_hf=out
                                                                            # fine-tune a local HF checkpoint

Every field of ``conf/`` can be overridden on the command line (Hydra).

Preemption: SIGTERM (e.g. ``kill PID`` of the launching process, or a scheduler's notice) stops every rank after one
agreed step with ``checkpoints/last.ckpt`` and exits 0; resume with ``ckpt_path=.../checkpoints/last.ckpt``. Under
SLURM, ask for the requeue signal ahead of the time limit, ``#SBATCH --signal=SIGUSR1@90``, and launch with ``srun``:
Lightning's SLURM environment (auto-requeue on) then has the job save ``hpc_ckpt_N.ckpt`` in the run folder, requeue
itself with ``scontrol requeue`` and resume from it when it starts again.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import hydra
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

from lightning_seqpar import (
    ActivationOffload, FlopsUtilization, Preemption, SelectiveRecompute, SeqParallelStrategy, generate,
)
from lightning_seqpar.data import TextDataModule
from lightning_seqpar.checkpoint.destination import refuse_export_destination
from lightning_seqpar.data.tokenizer import BYTES, has_tokenizer
from lightning_seqpar.extras import require_extra
from lightning_seqpar.lightning.callbacks import LayoutReport, ParallelModelSummary
from lightning_seqpar.models import CausalLMModule, GPTConfig, GPTLightningModule, HFCausalLMModule

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
log = logging.getLogger("pretrain_gpt")


# Warnings no user of this recipe can act on: torch 2.13 deprecations inside Lightning and torchdata, and
# ModelCheckpoint's note on resuming into a new folder (every run writes into its own Hydra folder).
QUIET_WARNINGS = (r".*isinstance\(treespec, LeafSpec\).*", r".*'set_vital' is deprecated.*", r"The dirpath has changed")


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip:" not in str(record.msg)  # Lightning's advertisement for optional packages


def route_logs_to_hydra() -> None:
    """Send Lightning's and transformers' messages and Python warnings through Hydra's handlers, so the job's log
    file (``pretrain_gpt.log``) holds what the console shows; ranks other than 0 write to their own log file
    (``train_ddp_process_N.log``) and show only errors on the console, so nothing is printed once per rank."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers", "torchmetrics"):
        logger = logging.getLogger(name)
        logger.handlers.clear()  # handlers added at import, before Hydra configured logging, would print twice
        logger.propagate = True
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropTips())
    for pattern in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    logging.captureWarnings(True)
    if any(int(os.environ.get(name, 0)) for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK")):
        for handler in logging.getLogger().handlers:
            if not isinstance(handler, logging.FileHandler):
                handler.setLevel(logging.ERROR)


def check_options(cfg: DictConfig, output_dir: Path) -> None:
    """Refuse options that cannot apply to this run, before any process starts.

    Raises:
        ValueError: ``empty_init`` or ``export_hf`` where they have no effect, naming the fix.
        FileExistsError: an ``export_hf`` destination that holds anything but a previous export (or that, without
            ``export_hf_overwrite``), or that is or holds the run folder or the source model directory: refused
            before training, not after it.
        ImportError: an option that needs an extra not installed (:func:`check_extras`).
    """
    check_extras(cfg)
    kind = cfg.model.get("kind", "gpt")
    if cfg.empty_init and kind == "hf":
        raise ValueError("empty_init=true has no effect with a Hugging Face model: HFCausalLMModule always builds it "
                         "in configure_model() on the meta device, each rank materializing only its shards. Drop "
                         "empty_init.")
    if cfg.export_hf and kind != "hf":
        raise ValueError(f"export_hf={cfg.export_hf} needs a Hugging Face model (model=hf_pretrained or "
                         f"model=llama_tiny); the reference GPT has no Hugging Face layout. To keep its weights, use "
                         f"python -m lightning_seqpar.checkpoint consolidate CKPT_DIR model.safetensors.")
    if cfg.export_hf:
        refuse_export_destination(cfg.export_hf, overwrite=cfg.export_hf_overwrite,
                                  protected=(output_dir, cfg.model.get("pretrained")))


def check_extras(cfg: DictConfig) -> None:
    """The default run (the reference GPT on UTF-8 bytes) needs no extra; a Hugging Face model, a Hugging Face
    tokenizer and the planner (``strategy=auto``, which prices every model through transformers) need ``[hf]``.

    Raises:
        ImportError: naming the option, the extra and the install command.
    """
    if cfg.model.get("kind", "gpt") == "hf":
        require_extra("hf", f"model={cfg.model.get('pretrained') or 'a Hugging Face config'} (a Hugging Face model)")
    tokenizer = cfg.data.get("tokenizer")
    if tokenizer is not None and tokenizer != BYTES:
        require_extra("hf", f"data.tokenizer={tokenizer} (a Hugging Face tokenizer)")
    if "seq_len" in (cfg.strategy.get("layout") or {}) or cfg.strategy.get("tp") == "auto":
        require_extra("hf", "strategy=auto (the planner)")


def data_module(cfg: DictConfig) -> TextDataModule:
    """The corpus read with ``data.tokenizer``; by default with a pretrained model's own tokenizer."""
    data = OmegaConf.to_container(cfg.data, resolve=True)
    pretrained = cfg.model.get("pretrained") if cfg.model.get("kind", "gpt") == "hf" else None
    if data.get("tokenizer") is None and has_tokenizer(pretrained):
        data["tokenizer"] = pretrained
    return TextDataModule(**data)


def build_trainer(cfg: DictConfig, output_dir: Path) -> pl.Trainer:
    """A Trainer for ``cfg`` writing logs and checkpoints under ``output_dir``."""
    callbacks: list[pl.Callback] = [
        # "step000200.ckpt": no "=" in the name, so ckpt_path=... needs no quoting on Hydra's command line.
        ModelCheckpoint(dirpath=output_dir / cfg.checkpoint_dir, filename="step{step:06d}", auto_insert_metric_name=False,
                        save_last=True, every_n_train_steps=cfg.trainer.val_check_interval),
        LearningRateMonitor(logging_interval="step"),
        FlopsUtilization(peak_flops=cfg.peak_flops),
        ParallelModelSummary(),  # the whole model's parameter count; Lightning's summary sees one shard
        LayoutReport(cfg.data.block_size, cfg.data.batch_size),  # tp/cp/pp/dp and the predicted, then measured, peak
    ]
    if cfg.trainer.enable_progress_bar:
        callbacks.append(TQDMProgressBar())  # Lightning's rich bar prints "Epoch 0/-2" for step-based runs
    callbacks += memory_callbacks(cfg)
    strategy = SeqParallelStrategy(**OmegaConf.to_container(cfg.strategy, resolve=True))
    return pl.Trainer(strategy=strategy, callbacks=callbacks, logger=CSVLogger(output_dir, name="logs"),
                      **OmegaConf.to_container(cfg.trainer, resolve=True))


def memory_callbacks(cfg: DictConfig) -> list[pl.Callback]:
    """The recomputation (``recompute:``) and activation offload (``offload:``) a config asks for, as callbacks."""
    callbacks: list[pl.Callback] = []
    recompute, modules = cfg.recompute, cfg.recompute.get("modules")
    if recompute.granularity != "none" or modules:
        granularity = "selective" if modules and recompute.granularity == "none" else recompute.granularity
        callbacks.append(SelectiveRecompute(granularity, recompute.get("method", "uniform"),
                                            recompute.get("num_layers"), memory_budget=recompute.get("memory_budget"),
                                            modules=modules))
    offloaded = cfg.get("offload", {}).get("modules")
    if offloaded:
        callbacks.append(ActivationOffload(modules=list(offloaded), prefetch=bool(cfg.offload.get("prefetch", True))))
    return callbacks


def build_module(cfg: DictConfig, data: TextDataModule, decay_steps: int, optim: dict) -> CausalLMModule:
    """The reference GPT (``model.kind: gpt``, the default) or a Hugging Face causal LM (``model.kind: hf``)."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    kind = model.pop("kind", "gpt")
    if kind == "hf":
        model.pop("block_size")
        pretrained = model.pop("pretrained", None)
        attn = model.pop("attn_implementation", "eager")
        config = None if pretrained else {**model, "vocab_size": data.vocab_size}
        return HFCausalLMModule(config, pretrained, attn, max_steps=decay_steps, **optim)
    return GPTLightningModule(GPTConfig(**{**model, "vocab_size": data.vocab_size}), max_steps=decay_steps,
                              empty_init=cfg.empty_init, **optim)


def sample(module: CausalLMModule, trainer: pl.Trainer, data: TextDataModule, cfg: DictConfig) -> str:
    """Generate from ``cfg.sample.prompt`` (tokenized by the corpus's tokenizer) or, for a token file without a
    tokenizer, from the validation split's first tokens (printed as ids); every rank must call it.

    In the training layout, through :func:`lightning_seqpar.generate` (a Hugging Face model over its key/value cache,
    the reference GPT recomputing its context), at every tensor, expert and pipeline layout; under context parallelism
    each rank holds chunks of the sequence and a decoded position has none to split: there the sample comes from a
    single-device copy assembled from every shard (the checkpoint's state dict).
    """
    prompt = data.prompt(cfg.sample.prompt)[None].to(module.device)
    if trainer.strategy.cp == 1:
        generator = torch.Generator(device=module.device).manual_seed(cfg.seed)  # same draws on every rank
        ends = module.model.config.eos_token_id if isinstance(module, HFCausalLMModule) else None
        out = generate(module, prompt, cfg.sample.max_new_tokens, do_sample=True, temperature=cfg.sample.temperature,
                       top_k=cfg.sample.top_k, generator=generator, eos_token_id=ends)
        return data.decode(out[0].cpu())
    state = trainer.strategy.full_state_dict()  # collective: the single-device weights on every rank
    if isinstance(module, HFCausalLMModule):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(module.model.config).to(module.device, module.dtype)
        model.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
        model.eval()
        torch.manual_seed(cfg.seed)  # same draws on every rank
        out = model.generate(prompt, max_new_tokens=cfg.sample.max_new_tokens, do_sample=True,
                             temperature=cfg.sample.temperature, top_k=cfg.sample.top_k)
        return data.decode(out[0].cpu())
    module = GPTLightningModule(module.gpt.config)
    module.load_state_dict(state)
    module.eval()
    generator = torch.Generator(device=module.device).manual_seed(cfg.seed)  # same draws on every rank
    out = module.gpt.generate(prompt, cfg.sample.max_new_tokens, cfg.sample.temperature, cfg.sample.top_k, generator)
    return data.decode(out[0].cpu())


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> dict:
    route_logs_to_hydra()
    output_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    check_options(cfg, output_dir)
    pl.seed_everything(cfg.seed, workers=True)
    data = data_module(cfg)
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    optim["optimizer"] = optim.pop("name", "adamw")
    # The cosine decay ends at optim.decay_steps (default: this run's trainer.max_steps). A resumed run with a
    # larger max_steps keeps the original curve only if decay_steps is set to the original horizon.
    decay_steps = optim.pop("decay_steps", None) or cfg.trainer.max_steps
    module = build_module(cfg, data, decay_steps, optim)
    trainer = build_trainer(cfg, output_dir)
    trainer.fit(module, datamodule=data, ckpt_path=cfg.ckpt_path)
    preemption = next((c for c in trainer.callbacks if isinstance(c, Preemption)), None)
    if preemption is not None and preemption.preempted is not None:  # SIGTERM: saved, nothing more before the end
        return {"preempted_after_step": float(trainer.global_step)}
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.global_step % cfg.trainer.val_check_interval:  # the last step was not validated yet
        trainer.validate(module, datamodule=data, verbose=False)
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    if cfg.export_hf:  # collective: each stage's tp rank 0 streams its tensors into the files
        exported = trainer.strategy.save_hf_pretrained(Path(cfg.export_hf).absolute(), source=module.pretrained,
                                                       overwrite=cfg.export_hf_overwrite,
                                                       tokenizer=data.tokenizer if hasattr(data.tokenizer, "save_pretrained") else None)
        log.info("exported Hugging Face model: %s", exported)
    text = sample(module, trainer, data, cfg)
    if trainer.is_global_zero:
        log.info("final metrics: %s", metrics)
        log.info("checkpoints: %s", output_dir / cfg.checkpoint_dir)
        log.info("--- sample ---\n%s\n--------------", text)
    return metrics


if __name__ == "__main__":
    main()
