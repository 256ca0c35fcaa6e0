"""Outputs rebuilt in backward instead of kept, on one process: the norms' (``modules=["layernorm"]``: bit-identical
under CPU autocast, the rebuild running under the forward's autocast state; the layers that cannot rebuild them refused
by name) and the experts' activation (``modules=["moe_act"]``: bit-identical, its two ``[R, f]`` tensors not kept, on
the loop and the grouped GEMM)."""

from __future__ import annotations

import pytest
import torch

from lightning_seqpar.memory.tracker import LiveActivationTracker
from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.offload import HostPool, apply_offload
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.parallel.random import RNGTracker
from lightning_seqpar.policies import rewrite
from lightning_seqpar.recompute import apply_recompute_modules
from lightning_seqpar.transformer.context import RewriteContext


class _Root(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model


def _gpt() -> GPT:
    torch.manual_seed(0)
    root = _Root(GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32, dropout=0.1)))
    rewrite(root, RewriteContext(ParallelGroup.virtual(1), False, RNGTracker.for_tensor_parallel(0, 0),
                                 loss_parallel=True))
    return root.model.train()


def _step(model: GPT) -> tuple[float, dict[str, torch.Tensor], int]:
    idx = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    with torch.autocast("cpu", torch.bfloat16):
        model(idx, idx).backward()  # warm-up: the cached causal mask
        model.zero_grad()
        torch.manual_seed(2)
        with LiveActivationTracker(model) as tracker:
            loss = model(idx, idx)
        kept = tracker.live_bytes("transformer.h.0")
        loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, kept


def test_rebuilt_norm_outputs_train_bit_identically_under_autocast_and_are_not_kept():
    plain = _step(_gpt())
    model = _gpt()
    apply_recompute_modules(model, ["layernorm"])
    loss, grads, kept = _step(model)
    assert loss == plain[0]
    assert [n for n in grads if not torch.equal(grads[n], plain[1][n])] == []
    # the two norms' bf16 outputs [s, b, h] are not kept
    assert plain[2] - kept == 2 * 32 * 2 * 32 * 2, (plain[2], kept)


def test_a_post_norm_block_and_a_compiled_one_are_refused_by_name():
    encoder = _Root(torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(32, 4, 64, norm_first=False), 2,
                                                enable_nested_tensor=False))
    rewrite(encoder, RewriteContext(ParallelGroup.virtual(1), False, RNGTracker.for_tensor_parallel(0, 0)))
    with pytest.raises(ValueError, match="post-norm"):
        apply_recompute_modules(encoder, ["layernorm"])
    model = _gpt()
    for layer in model.transformer.h:
        layer.compile_config = object()
    with pytest.raises(ValueError, match=r"compile=True"):
        apply_recompute_modules(model, ["layernorm"])


def test_a_norm_input_offloaded_where_its_output_is_rebuilt_is_refused():
    model = _gpt()
    apply_recompute_modules(model, ["layernorm"])
    with pytest.raises(ValueError, match="rebuilt from their inputs"):
        apply_offload(model, ["attn_norm"], HostPool("cpu"))
    assert all(layer.offload is None and layer.recompute_norms for layer in model.transformer.h)  # nothing changed


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped_mm"])
def test_the_experts_activation_recomputed_keeps_only_the_gate_up_output(grouped):
    from lightning_seqpar.moe.experts import GroupedExperts

    dtype = torch.bfloat16 if grouped else torch.float64  # grouped_mm's kernels take 16-bit operands

    def run(recompute: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
        torch.manual_seed(0)
        experts = GroupedExperts(4, 16, 32, dtype=dtype, grouped_mm=grouped)
        for weight in experts.parameters():
            torch.nn.init.normal_(weight, std=0.1)
        experts.recompute_activation = recompute
        rows = torch.randn(12, 16, dtype=dtype, requires_grad=True)
        with LiveActivationTracker() as tracker:
            out = experts(rows, [3, 5, 0, 4], torch.tensor([3, 5, 0, 4]))
        kept = tracker.live_bytes()
        out.square().sum().backward()
        return {n: p.grad for n, p in experts.named_parameters()}, rows.grad, kept

    plain, rebuilt = run(False), run(True)
    assert [n for n in plain[0] if not torch.equal(plain[0][n], rebuilt[0][n])] == []
    assert torch.equal(plain[1], rebuilt[1])
    # the activation's output and the gate's activation [R, f] each, R = 12 rows, f = 32: no longer kept
    assert plain[2] - rebuilt[2] == 2 * 12 * 32 * torch.empty((), dtype=dtype).element_size(), (plain[2], rebuilt[2])
