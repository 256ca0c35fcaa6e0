"""Activation offload on one process: every module and every pair of modules trains bit-identically to no offload; the
bytes left on the device and the bytes moved to the host are the memory model's, to the byte; the step's peak falls
in the order the choices promise; what cannot be offloaded is refused by name."""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_seqpar.memory import TransformerShape
from lightning_seqpar.memory.activations import layer_activation_terms, offloaded_activation_terms
from lightning_seqpar.memory.peak import PeakMemoryTracker
from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.offload import DENSE_OFFLOAD_MODULES, HostPool, apply_offload, check_offload_modules
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.parallel.random import RNGTracker
from lightning_seqpar.policies import rewrite
from lightning_seqpar.recompute import apply_recompute, apply_recompute_modules
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.core_attention import CoreAttention
from recipes.benchmarking.measure import measure_gpt_layer

CHOICES = [(m,) for m in DENSE_OFFLOAD_MODULES] + list(itertools.combinations(DENSE_OFFLOAD_MODULES, 2))
SHAPE = TransformerShape(s=64, b=2, h=64, a=4)


class _Root(torch.nn.Module):
    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.gpt = gpt


def _gpt(dropout: float = 0.1, layers: int = 3) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=32, n_layer=layers, n_head=4, n_embd=32, dropout=dropout)
    root = _Root(GPT(config))
    rewrite(root, RewriteContext(ParallelGroup.virtual(1), False, RNGTracker.for_tensor_parallel(0, 0),
                                 loss_parallel=True))
    return root.gpt.double().train()


def _step(model: GPT, pool: HostPool | None = None) -> tuple[float, dict[str, torch.Tensor], dict]:
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # the dropout masks
    loss = model(idx, idx)
    out = pool.counts() if pool is not None else {}
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, out


@pytest.fixture(scope="module")
def plain():
    return _step(_gpt())


@pytest.mark.parametrize("modules", CHOICES, ids="+".join)
def test_offloading_trains_bit_identically_and_every_byte_comes_back(plain, modules):
    model = _gpt()
    pool = HostPool("cpu")
    assert apply_offload(model, list(modules), pool) == 3
    loss, grads, after_forward = _step(model, pool)
    assert loss == plain[0]
    assert [n for n in grads if not torch.equal(grads[n], plain[1][n])] == []
    assert after_forward["bytes_out"] > 0 and after_forward["held"] == after_forward["bytes_out"]
    # every byte came back once, and the host copies were released with the graph
    assert pool.bytes_in == pool.bytes_out and pool.held == 0 and pool.peak_held == after_forward["bytes_out"]


@pytest.mark.parametrize("recompute, modules, offload", [
    ("none", (), ()),
    *[("none", (), c) for c in CHOICES],
    ("none", ("mlp",), ()),
    ("none", ("mlp",), ("core_attn", "attn_norm")),
    ("none", ("mlp",), ("mlp_norm", "attn_proj")),
    ("selective", (), ("attn_norm", "mlp")),
    ("selective", ("mlp",), ("qkv_linear", "attn_proj")),
    ("full", (), ("attn_norm",)),
    ("none", ("layernorm",), ()),
    ("none", ("layernorm", "mlp"), ()),
    ("selective", ("layernorm",), ()),
    ("selective", ("layernorm",), ("qkv_linear", "mlp")),
    ("none", ("layernorm",), ("core_attn", "attn_proj")),
], ids=lambda v: "+".join(v) if isinstance(v, tuple) else v)
def test_device_and_host_bytes_equal_the_model(recompute, modules, offload):
    """A middle layer of the reference GPT (bf16, dropout 0.1): the storages it leaves alive on the device, and the bytes
    its offloaded modules copied out, each equal to the model (LayerNorm statistics counted in the activations' dtype,
    as CPU kernels save them)."""
    m = measure_gpt_layer(SHAPE, ParallelGroup.virtual(1), False, recompute, modules=modules, offload=offload,
                          norm_statistics_bytes=2)
    rng_snapshots = m.remainder().get("RNG state snapshot", 0)
    assert m.measured_bytes - rng_snapshots == m.model_bytes, m.breakdown()
    assert m.offloaded_bytes == m.model_offloaded
    if offload and recompute != "full":
        assert m.model_offloaded > 0


def test_the_model_moves_exactly_what_it_removes_and_nothing_under_full_recomputation():
    for t, sp in ((1, False), (4, False), (4, True)):
        base = layer_activation_terms(SHAPE, t, sp, norm_statistics_bytes=4)
        for offload in CHOICES:
            left = layer_activation_terms(SHAPE, t, sp, offload=offload, norm_statistics_bytes=4)
            moved = offloaded_activation_terms(SHAPE, t, sp, offload=offload, norm_statistics_bytes=4)
            assert set(left) | set(moved) == set(base) and not set(left) & set(moved)
            assert sum(left.values()) + sum(moved.values()) == sum(base.values())
    assert offloaded_activation_terms(SHAPE, 2, True, "full", offload=DENSE_OFFLOAD_MODULES) == {}
    with pytest.raises(ValueError, match="recomputed core attention keeps only"):
        layer_activation_terms(SHAPE, recompute="selective", offload=["core_attn"])
    with pytest.raises(ValueError, match="Offload 'mlp_norm' instead"):
        layer_activation_terms(SHAPE, modules=["mlp"], offload=["mlp"])


def _peak(configure, layers: int = 4) -> int:
    model = _gpt(layers=layers)
    configure(model)
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    model(idx, idx).backward()  # warm-up: cached masks are not the step's
    with PeakMemoryTracker() as tracker:
        tracker.hold(model.parameters(), [p.grad for p in model.parameters()])
        model(idx, idx).backward()
    return tracker.peak


@pytest.mark.parametrize("layers, prefetch", [(4, False), (8, True)])
def test_the_step_peak_falls_from_none_to_recompute_to_offload(layers, prefetch):
    """The prefetch holds up to two layers' offloaded bytes in the backward (one read, one ahead): at 4 layers that
    outweighs what recomputation keeps, from 8 layers on it does not; without it, offload is the lowest at any depth."""
    none = _peak(lambda model: None, layers)
    recompute = _peak(lambda model: apply_recompute_modules(model, ["core_attn", "mlp"]), layers)
    offload = _peak(lambda model: apply_offload(model, list(DENSE_OFFLOAD_MODULES), HostPool("cpu", prefetch)), layers)
    print(f"\n| choice ({layers} layers, prefetch {prefetch}) | step peak (bytes) |\n|---|---|\n| none | {none:,} |\n"
          f"| recompute core_attn+mlp | {recompute:,} |\n| offload all | {offload:,} |")
    assert offload < recompute < none


@pytest.mark.parametrize("modules, message", [
    (["attention"], r"\['attention'\] are not modules"),
    ([], "name at least one of"),
])
def test_names_it_does_not_offload_are_refused(modules, message):
    from lightning_seqpar import ActivationOffload

    with pytest.raises(ValueError, match=message):
        check_offload_modules(modules)
    with pytest.raises(ValueError, match=message):
        ActivationOffload(modules=modules)


def test_a_module_both_recomputed_and_offloaded_is_refused_by_name():
    model = _gpt()
    apply_offload(model, ["core_attn", "mlp"], HostPool("cpu"))
    with pytest.raises(ValueError, match=r"core_attn both recomputed \(core_attn\) and offloaded: recomputed core "
                                         r"attention keeps only q, k, v"):
        apply_recompute(model, "selective")
    with pytest.raises(ValueError, match=r"mlp both recomputed \(mlp\) and offloaded: .* Offload 'mlp_norm' instead"):
        apply_recompute_modules(model, ["mlp"])
    layers = list(model.transformer.h)
    assert not any(layer.recompute_mlp or layer.checkpointed_whole for layer in layers)  # each refusal changed nothing
    assert not any(m.recompute for m in model.modules() if isinstance(m, CoreAttention))
    apply_recompute(model, "full")  # whole layers keep only their input: nothing left to offload, nothing refused
    assert all(layer.checkpointed_whole and layer.offload is not None for layer in layers)
    apply_offload(model, None, HostPool("cpu"))
    apply_recompute(model, "selective")
    with pytest.raises(ValueError, match=r"core_attn both recomputed"):  # the other order refuses the same
        apply_offload(model, ["core_attn"], HostPool("cpu"))


@pytest.mark.parametrize("config", ["config", "finetune"])
def test_the_recipes_pass_offload_modules_to_the_callback(config):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from lightning_seqpar import ActivationOffload, SelectiveRecompute
    from recipes.pretrain_gpt import memory_callbacks
    from tests.moe.test_moe_recipe_config import CONF

    with initialize_config_dir(str(CONF), version_base=None):
        cfg = compose(config, overrides=["offload.modules=[attn_norm,mlp]", "recompute.modules=[core_attn]"])
    made = memory_callbacks(cfg)
    assert [(c.modules, c.prefetch) for c in made if isinstance(c, ActivationOffload)] == [(["attn_norm", "mlp"], True)]
    assert [c.prefetch for c in memory_callbacks(OmegaConf.merge(cfg, {"offload": {"prefetch": False}}))
            if isinstance(c, ActivationOffload)] == [False]
    assert [c.modules for c in made if isinstance(c, SelectiveRecompute)] == [["core_attn"]]
    cfg = OmegaConf.merge(cfg, {"offload": {"modules": None}})
    assert not any(isinstance(c, ActivationOffload) for c in memory_callbacks(cfg))


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped_mm"])
def test_the_experts_offload_their_rows_and_activation_inputs_and_train_bit_identically(grouped):
    import contextlib

    from lightning_seqpar.memory.saved_tensors import saved_tensor_policy
    from lightning_seqpar.moe.experts import GroupedExperts

    dtype = torch.bfloat16 if grouped else torch.float64  # grouped_mm's kernels take 16-bit operands
    rows_per_expert = [3, 5, 0, 4]

    def run(offload: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, int]]:
        torch.manual_seed(0)
        experts = GroupedExperts(4, 16, 32, dtype=dtype, grouped_mm=grouped)
        for weight in experts.parameters():
            torch.nn.init.normal_(weight, std=0.1)
        pool = HostPool("cpu")
        keep = {p.untyped_storage().data_ptr() for p in experts.parameters()}
        experts.offloading = lambda module: (saved_tensor_policy(None, pool.packer(keep)) if module in offload
                                             else contextlib.nullcontext())
        rows = torch.randn(12, 16, dtype=dtype, requires_grad=True)
        out = experts(rows, rows_per_expert, torch.tensor(rows_per_expert))
        moved = pool.counts()
        out.square().sum().backward()
        return {n: p.grad for n, p in experts.named_parameters()}, rows.grad, moved

    plain = run(())
    element = torch.empty((), dtype=dtype).element_size()
    offsets = 4 * 4 if grouped else 0  # the grouped GEMM keeps its int32 offsets [E/e] too
    for offload, expected in ((("expert_fc1",), 12 * 16 * element + offsets), (("moe_act",), 3 * 12 * 32 * element)):
        grads, rows_grad, moved = run(offload)
        assert [n for n in grads if not torch.equal(grads[n], plain[0][n])] == [] and torch.equal(rows_grad, plain[1])
        # expert_fc1: the rows [R, h]; moe_act: the gate and up halves and the gate's activation, [R, f] each
        assert moved["bytes_out"] == expected, (offload, moved)


def test_a_module_offloaded_and_recomputed_is_refused_before_any_step(tmp_path):
    import lightning.pytorch as pl

    from lightning_seqpar import ActivationOffload, SelectiveRecompute, SeqParallelStrategy
    from tests.helpers.models import build, loader, token_data

    for recompute, offload, clash in ((dict(modules=["layernorm"]), ["attn_norm"], "attn_norm both recomputed"),
                                      (dict(granularity="selective"), ["core_attn", "mlp"], "core_attn both")):
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                             strategy=SeqParallelStrategy(tp=1),
                             callbacks=[ActivationOffload(modules=offload), SelectiveRecompute(**recompute)])
        with pytest.raises(ValueError, match=clash):
            trainer.fit(build("gpt"), loader(token_data(1, 1), 2))
        assert trainer.global_step == 0
