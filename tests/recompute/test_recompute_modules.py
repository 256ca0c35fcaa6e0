"""``SelectiveRecompute(modules=[...])``: recomputation by module (core attention, a dense MLP, whole layers, any
combination; a mixture of experts) trains bit-identically to no recomputation in float64, keeps fewer bytes for backward in the order the
modules promise, and refuses names it does not recompute."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_seqpar import SelectiveRecompute
from tests.helpers.distributed import run_distributed
from tests.helpers.parity import Case, fit

pytestmark = pytest.mark.distributed

STEPS = 3
CASES = [  # (case, modules): each trained without recomputation and with these modules
    (Case("gpt", 2), ["mlp"]),                                              # reference GPT, tp 2 + SP
    (Case("gpt", 2, model=(("dropout", 0.1),)), ["core_attn", "mlp"]),     # dropout masks drawn again
    (Case("hf", 2, model=(("labels", True),)), ["mlp"]),                    # Llama: gated MLP
    (Case("hf", 2, model=(("labels", True), ("family", "phi"))), ["core_attn", "mlp"]),  # parallel residual
    (Case("gpt", 1, pp=2), ["mlp"]),                                        # two pipeline stages
    (Case("gpt", 2, model=(("n_layer", 4),)), ["full", "mlp"]),            # whole layers, and mlp in none left
    # the norms' outputs rebuilt from their inputs when the projections' backward reads them
    (Case("gpt", 2, model=(("dropout", 0.1),)), ["layernorm"]),
    (Case("hf", 2, model=(("labels", True),)), ["layernorm", "mlp"]),     # RMSNorm; the MLP keeps its input
    (Case("hf", 2, model=(("labels", True), ("family", "phi"))), ["layernorm", "core_attn"]),  # one norm, both parts
    (Case("gpt", 1, pp=2), ["layernorm"]),
    # mixtures of experts at ep 2: router, dispatch all-to-alls, experts and combine run again in backward
    (Case("hf", 2, model=(("family", "qwen3_moe"), ("labels", True), ("aux", 0.5)), strategy=(("ep", 2),)), ["moe"]),
    (Case("hf", 2, model=(("family", "qwen2_moe"), ("labels", True)), strategy=(("ep", 2),)), ["core_attn", "moe"]),
    (Case("gpt", 2, model=(("n_experts", 8), ("aux_loss_coef", 0.5)), strategy=(("ep", 2),)), ["moe"]),
    (Case("hf", 2, model=(("family", "qwen3_moe"), ("labels", True)), strategy=(("ep", 2),)), ["moe_act", "core_attn"]),
    (Case("hf", 2, model=(("family", "gpt_oss"), ("labels", True)), strategy=(("ep", 2),)), ["moe_act"]),  # its glu
    (Case("gpt", 2, model=(("n_experts", 8),)), ["moe_act", "layernorm"]),
    (Case("hf", 2, model=(("family", "qwen2_moe"), ("labels", True)), strategy=(("ep", 2),)),
     ["shared_experts", "moe_act"]),                                       # the gated shared expert
]


def _saved_bytes(rank: int, world: int, modules) -> int:
    """Bytes one training forward of a tp-2 + SP Llama (2 layers, its loss from ``labels=``) saves for backward,
    parameters excluded, each storage once."""
    import lightning.pytorch as pl

    from lightning_seqpar import SeqParallelStrategy
    from tests.helpers.models import build, token_data

    module = build("hf", labels=True, layers=2)
    callbacks = [SelectiveRecompute(modules=modules)] if modules else []
    trainer = pl.Trainer(accelerator="cpu", devices=world, precision="64-true", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         strategy=SeqParallelStrategy(tp=2), callbacks=callbacks)
    data = token_data(1, 1)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module.compute_loss(data.tensors[0][:2], data.tensors[1][:2])
    del loss
    return sum(seen.values())


def _world(rank: int, world: int) -> dict:
    out: dict = {"parity": [], "bytes": {}}
    for case, modules in CASES:
        # the records alone (a model with transformers' output-capturing hooks does not pickle)
        out["parity"].append((dataclasses.replace(fit(case, world, steps=STEPS)), dataclasses.replace(
            fit(case, world, steps=STEPS, callbacks=[SelectiveRecompute(modules=modules)]))))
    for modules in (None, ("core_attn",), ("mlp",), ("core_attn", "mlp"), ("full",)):
        out["bytes"][modules] = _saved_bytes(rank, world, modules and list(modules))
    for name, case, modules in (("moe", Case("hf", 2, model=(("family", "qwen3_moe"), ("labels", True))), ["mlp"]),
                                ("dense", Case("gpt", 2), ["moe"])):
        try:
            fit(case, world, steps=1, callbacks=[SelectiveRecompute(modules=modules)])
            out[name] = ""
        except ValueError as error:
            out[name] = str(error)
    return out


@pytest.fixture(scope="module")
def world():
    return run_distributed(_world, 2)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c.kind}-tp{c.tp}-pp{c.pp}-{'+'.join(m)}"
                                                          for c, m in CASES])
def test_module_recomputation_trains_bit_identically_to_none(world, index):
    for rank, results in enumerate(world):
        plain, recomputed = results["parity"][index]
        assert recomputed.losses == plain.losses, rank
        for step, (got, want) in enumerate(zip(recomputed.grads, plain.grads)):
            assert got.keys() == want.keys()
            differ = [name for name in want if not torch.equal(got[name], want[name])]
            assert differ == [], f"rank {rank} step {step}: {differ}"


def test_each_module_keeps_fewer_bytes_for_backward_in_the_order_it_promises(world):
    for results in world:
        saved = results["bytes"]
        print("\n| modules | bytes saved for backward (one forward, rank's own) |\n|---|---|")
        for modules, count in saved.items():
            print(f"| {'+'.join(modules) if modules else 'none'} | {count:,} |")
        assert saved[("full",)] < saved[("core_attn", "mlp")] < saved[("core_attn",)] < saved[None], saved
        assert saved[("core_attn", "mlp")] < saved[("mlp",)] < saved[None], saved


def test_mlp_recomputation_of_a_mixture_of_experts_and_moe_of_a_dense_mlp_are_refused_by_name(world):
    refused = world[0]["moe"]
    assert "recomputes a dense MLP" in refused and "MoEPart" in refused and "modules=['moe']" in refused, refused
    refused = world[0]["dense"]
    assert "recomputes a mixture of experts" in refused and "DenseMLPPart" in refused and "modules=['mlp']" in refused


@pytest.mark.parametrize("modules, message", [
    (["attention"], "['attention'] are not modules"),
    ([], "name at least one of"),
])
def test_names_it_does_not_recompute_are_refused_when_the_callback_is_made(modules, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SelectiveRecompute(modules=modules)
    with pytest.raises(ValueError, match="plans the recomputation itself"):
        SelectiveRecompute("auto", memory_budget=1e9, modules=["mlp"])


def test_the_recipe_passes_recompute_modules_to_the_callback(tmp_path):
    from hydra import compose, initialize_config_dir

    from recipes.pretrain_gpt import build_trainer
    from tests.moe.test_moe_recipe_config import CONF

    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose("config", overrides=["recompute.modules=[core_attn,mlp]", "trainer.devices=1",
                                           "strategy=single"])
    trainer = build_trainer(cfg, tmp_path)
    chosen = [c for c in trainer.callbacks if isinstance(c, SelectiveRecompute)]
    assert [c.modules for c in chosen] == [["core_attn", "mlp"]]
