"""Pretrain the reference GPT with tensor + sequence parallelism and selective recomputation.

    python recipes/pretrain_gpt.py                                   # 2 CPU processes, tp=2, SP, selective
    python recipes/pretrain_gpt.py strategy.tp=4 trainer.devices=4 model.n_layer=8
    python recipes/pretrain_gpt.py data.path=my_corpus/ trainer.max_steps=2000
    python recipes/pretrain_gpt.py strategy=pp2_tp2 trainer.devices=4      # pipeline 2 × tensor 2, 1F1B
    python recipes/pretrain_gpt.py model=llama_tiny                         # a Llama-shaped Hugging Face model
    python recipes/pretrain_gpt.py model=hf_pretrained model.pretrained=DIR # fine-tune a local HF checkpoint

Every field of ``conf/`` can be overridden on the command line (Hydra).
"""

from __future__ import annotations

from pathlib import Path

import hydra
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

from lightning_seqpar import FlopsUtilization, SelectiveRecompute, SeqParallelStrategy
from lightning_seqpar.data import TextDataModule
from lightning_seqpar.lightning.callbacks import ParallelModelSummary
from lightning_seqpar.models import CausalLMModule, GPTConfig, GPTLightningModule, HFCausalLMModule

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def build_trainer(cfg: DictConfig, output_dir: Path) -> pl.Trainer:
    """A Trainer for ``cfg`` writing logs and checkpoints under ``output_dir``."""
    callbacks: list[pl.Callback] = [
        # "step000200.ckpt": no "=" in the name, so ckpt_path=... needs no quoting on Hydra's command line.
        ModelCheckpoint(dirpath=output_dir / cfg.checkpoint_dir, filename="step{step:06d}", auto_insert_metric_name=False,
                        save_last=True, every_n_train_steps=cfg.trainer.val_check_interval),
        LearningRateMonitor(logging_interval="step"),
        FlopsUtilization(peak_flops=cfg.peak_flops),
        ParallelModelSummary(),  # the whole model's parameter count; Lightning's summary sees one shard
    ]
    if cfg.trainer.enable_progress_bar:
        callbacks.append(TQDMProgressBar())  # Lightning's rich bar prints "Epoch 0/-2" for step-based runs
    if cfg.recompute.granularity != "none":
        callbacks.append(SelectiveRecompute(cfg.recompute.granularity, cfg.recompute.method, cfg.recompute.num_layers,
                                            memory_budget=cfg.recompute.memory_budget))
    strategy = SeqParallelStrategy(**OmegaConf.to_container(cfg.strategy, resolve=True))
    return pl.Trainer(strategy=strategy, callbacks=callbacks, logger=CSVLogger(output_dir, name="logs"),
                      **OmegaConf.to_container(cfg.trainer, resolve=True))


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
    """Generate from ``cfg.sample.prompt`` (a byte corpus) or from the validation split's first tokens (a token
    corpus, printed as ids); every rank must call it.

    Under pipeline parallelism no rank holds the whole model: generate with a single-device copy
    assembled from every stage (the checkpoint's state dict).
    """
    prompt = data.prompt(cfg.sample.prompt)[None].to(module.device)
    if isinstance(module, HFCausalLMModule):  # generation keeps a key/value cache: a single-device copy
        from transformers import AutoModelForCausalLM

        state = trainer.strategy.full_state_dict()  # collective: the single-device weights on every rank
        model = AutoModelForCausalLM.from_config(module.model.config).to(module.device, module.dtype)
        model.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
        model.eval()
        torch.manual_seed(cfg.seed)  # same draws on every rank
        out = model.generate(prompt, max_new_tokens=cfg.sample.max_new_tokens, do_sample=True,
                             temperature=cfg.sample.temperature, top_k=cfg.sample.top_k)
        return data.decode(out[0].cpu())
    if cfg.strategy.pp > 1:
        state = trainer.strategy.full_state_dict()  # collective: the single-device weights on every rank
        module = GPTLightningModule(module.gpt.config)
        module.load_state_dict(state)
    module.eval()
    generator = torch.Generator(device=module.device).manual_seed(cfg.seed)  # same draws on every rank
    out = module.gpt.generate(prompt, cfg.sample.max_new_tokens, cfg.sample.temperature, cfg.sample.top_k, generator)
    return data.decode(out[0].cpu())


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> dict:
    pl.seed_everything(cfg.seed, workers=True)
    output_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    data = TextDataModule(**OmegaConf.to_container(cfg.data, resolve=True))
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    # The cosine decay ends at optim.decay_steps (default: this run's trainer.max_steps). A resumed run with a
    # larger max_steps keeps the original curve only if decay_steps is set to the original horizon.
    decay_steps = optim.pop("decay_steps", None) or cfg.trainer.max_steps
    module = build_module(cfg, data, decay_steps, optim)
    trainer = build_trainer(cfg, output_dir)
    trainer.fit(module, datamodule=data, ckpt_path=cfg.ckpt_path)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.global_step % cfg.trainer.val_check_interval:  # the last step was not validated yet
        trainer.validate(module, datamodule=data, verbose=False)
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    text = sample(module, trainer, data, cfg)
    if trainer.is_global_zero:
        print(f"\nfinal metrics: {metrics}\ncheckpoints: {output_dir / cfg.checkpoint_dir}")
        print(f"--- sample ---\n{text}\n--------------")
    return metrics


if __name__ == "__main__":
    main()
