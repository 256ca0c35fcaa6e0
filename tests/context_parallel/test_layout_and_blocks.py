"""Context parallelism on one process: which tokens a cp rank holds, what each attention block sees, the blockwise
kernel against dense attention (values and gradients, float64), and the refusals that come before training."""

import pytest
import torch

from lightning_seqpar import Layout, SeqParallelStrategy
from lightning_seqpar.context_parallel import (
    LAYOUT_ARGUMENT, ContextParallel, ContextParallelBatch, check_all_to_all_heads, check_context_length,
    context_parallel_attention, documents_from_positions, local_indices,
)
from lightning_seqpar.context_parallel.attention import bytes_per_layer
from lightning_seqpar.parallel import ParallelGroup, validate_layout


def test_each_rank_holds_chunks_r_and_2c_minus_1_minus_r_and_the_same_causal_work():
    s = 16
    for c in (1, 2, 4):
        held = [local_indices(s, c, r) for r in range(c)]
        assert torch.equal(torch.cat(held).sort().values, torch.arange(s))  # every position once
        n = s // (2 * c)
        assert [h[::n].tolist() for h in held] == [[r * n, (2 * c - 1 - r) * n] for r in range(c)]
        work = {int(((h + 1).sum())) for h in held}  # visible keys of a causal query at position i: i + 1
        assert len(work) == 1  # load balanced: every rank computes as many query-key pairs


def _layout(s, c=2, **kw):
    return ContextParallelBatch(ParallelGroup.virtual(c), "ring", s, **kw)


def test_blocks_are_skipped_full_or_masked_by_chunk_ids_alone():
    layout = _layout(8)  # chunks of 2
    assert layout.block_mask(1, 2) == ("skip", None)  # a later chunk: never seen
    assert layout.block_mask(2, 1) == ("full", None)  # an earlier chunk, nothing else to mask
    kind, allowed = layout.block_mask(1, 1)  # the diagonal: causal within the chunk
    assert kind == "mask" and allowed[0].tolist() == [[True, False], [True, True]]
    windowed = layout.with_window(2)  # a query sees itself and one key back
    assert windowed.block_mask(3, 1) == ("skip", None)  # positions 6-7 against 2-3: all outside the window
    kind, allowed = windowed.block_mask(2, 1)  # positions 4-5 against 2-3: only 3 for 4
    assert kind == "mask" and allowed[0].tolist() == [[False, True], [False, False]]
    documents = documents_from_positions(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]))
    assert documents.tolist() == [[1, 1, 1, 2, 2, 2, 2, 2]]
    kind, allowed = _layout(8, documents=documents).block_mask(2, 1)  # 4-5 (document 2) against 2-3 (1 | 2)
    assert kind == "mask" and allowed[0].tolist() == [[False, True], [False, True]]
    padding = torch.tensor([[False, False, True, False, False, False, False, False]])
    kind, allowed = _layout(8, padding=padding).block_mask(2, 1)
    assert kind == "mask" and allowed[0].tolist() == [[False, True], [False, True]]


def _dense(q, k, v, scale, softcap, documents, padding, window):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    i = torch.arange(q.shape[2])
    allowed = i[:, None] >= i[None, :]
    if window is not None:
        allowed = allowed & (i[:, None] - i[None, :] < window)
    allowed = (allowed[None] & (documents[:, :, None] == documents[:, None, :]) & ~padding[:, None, :])[:, None]
    seen = allowed.any(-1, keepdim=True)  # a query with no key to see gives zeros (no NaN through its row)
    probs = torch.softmax(scores.masked_fill(~allowed & seen, float("-inf")), -1) * seen
    return probs @ v


@pytest.mark.parametrize("window,softcap,fused", [(None, None, False), (3, None, False), (None, 2.0, False),
                                                  (5, 1.5, False), (None, None, True), (3, None, True)])
def test_blockwise_attention_equals_dense_attention_in_values_and_gradients(window, softcap, fused):
    torch.manual_seed(0)
    b, a, a_kv, s, d = 2, 4, 2, 8, 3  # grouped-query attention: two query heads per key/value head
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True) for h in (a, a_kv, a_kv))
    documents = documents_from_positions(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], list(range(8))]))
    padding = torch.zeros(b, s, dtype=torch.bool)
    padding[1, 6:] = True
    layout = ContextParallelBatch(ParallelGroup(None), "all_to_all", s, documents, padding, window)  # one rank
    got = context_parallel_attention(q, k, v, layout, 0.7, softcap, fused)
    want = _dense(q, k, v, 0.7, softcap, documents, padding, window)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda *x: context_parallel_attention(*x, layout, 0.7, softcap, fused), (q, k, v))


def _dense_with_sinks(q, k, v, scale, documents, padding, sinks):
    """gpt-oss's eager attention: a sink logit per head as one more column of each row's softmax, then dropped."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) * scale
    i = torch.arange(q.shape[2])
    allowed = ((i[:, None] >= i[None, :])[None] & (documents[:, :, None] == documents[:, None, :])
               & ~padding[:, None, :])[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    b, a, s = scores.shape[:3]
    combined = torch.cat([scores, sinks.view(1, a, 1, 1).expand(b, a, s, 1)], -1)
    return torch.softmax(combined, -1)[..., :-1] @ v


@pytest.mark.slow  # many seconds of blockwise attention: outside the fast lane
@pytest.mark.parametrize("comm,fused", [("ring", False), ("all_to_all", False), ("ring", True)])
def test_blockwise_attention_with_sinks_equals_dense_in_values_and_gradients(comm, fused):
    torch.manual_seed(0)
    b, a, a_kv, s, d = 2, 4, 2, 8, 3
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True) for h in (a, a_kv, a_kv))
    sinks = torch.randn(a, dtype=torch.float64, requires_grad=True)
    documents = documents_from_positions(torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], list(range(8))]))
    padding = torch.zeros(b, s, dtype=torch.bool)
    padding[1, :2] = True  # left padding: two queries see no key, only their sink
    layout = ContextParallelBatch(ParallelGroup(None), comm, s, documents, padding)
    got = context_parallel_attention(q, k, v, layout, 0.7, fused=fused, sinks=sinks)
    torch.testing.assert_close(got, _dense_with_sinks(q, k, v, 0.7, documents, padding, sinks), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda *x: context_parallel_attention(*x[:3], layout, 0.7, fused=fused, sinks=x[3]), (q, k, v, sinks))


@pytest.mark.parametrize("fused", [False, True])
def test_a_query_with_no_key_to_see_gives_zeros_not_nan(fused):
    q, k, v = (torch.randn(1, 1, 4, 2, dtype=torch.float64, requires_grad=True) for _ in range(3))
    padding = torch.tensor([[True, True, False, False]])  # left padding: queries 0 and 1 see no key
    layout = ContextParallelBatch(ParallelGroup(None), "all_to_all", 4, padding=padding)
    out = context_parallel_attention(q, k, v, layout, 1.0, fused=fused)
    assert out[0, 0, :2].abs().sum() == 0 and torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_the_cuda_kernel_calls_match_torchs_operator_schemas_and_shapes():
    """The CUDA branch of the fused kernel (SDPA's memory-efficient kernel, the one that takes a mask and returns the
    log-sum-exp), run on meta tensors: torch's meta kernels check the arguments and give the shapes a GPU would."""
    from lightning_seqpar._compat import fused_attention_backward, fused_attention_supported, fused_attention_with_lse

    b, a, n, d = 2, 4, 40, 16  # n not a multiple of 32 (the kernel's lse padding) nor of 16 (the bias alignment)
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.empty(b, a, n, d, dtype=dtype, device="meta") for _ in range(3))
        assert fused_attention_supported(q)
        for allowed in (None, torch.ones(b, n, n, dtype=torch.bool, device="meta")):
            out, lse = fused_attention_with_lse(q, k, v, allowed is None, allowed, 0.5)
            assert out.shape == (b, a, n, d) and out.dtype == dtype
            assert lse.shape == (b, a, n) and lse.dtype == torch.float32
            grads = fused_attention_backward(out, q, k, v, out, lse, allowed is None, allowed, 0.5)
            assert [g.shape for g in grads] == [(b, a, n, d)] * 3 and all(g.dtype == dtype for g in grads)
    assert not fused_attention_supported(torch.empty(1, 1, 4, 16, dtype=torch.float64, device="meta"))
    assert not fused_attention_supported(torch.empty(1, 1, 4, 12, dtype=torch.bfloat16, device="meta"))


def test_the_cuda_kernels_bias_is_aligned_finite_and_drops_exactly_the_masked_keys():
    """The memory-efficient kernel's additive bias: strides aligned to 16 elements, the dtype's lowest finite value
    where masked (a query that sees nothing stays finite). Fed to the CPU kernel, it gives the same output as the
    boolean mask wherever a query sees a key."""
    from lightning_seqpar._compat import _efficient_bias, fused_attention_with_lse

    torch.manual_seed(0)
    b, a, n, d = 1, 2, 5, 4
    q, k, v = (torch.randn(b, a, n, d, dtype=torch.float32) for _ in range(3))
    allowed = torch.rand(b, n, n) > 0.4
    allowed[0, 2] = False  # query 2 sees nothing
    bias = _efficient_bias(allowed, q, n)
    assert bias.shape == (b, a, n, n) and all(st % 16 == 0 for st in bias.stride()[:-1]) and bias.stride(-1) == 1
    assert torch.isfinite(bias).all() and torch.equal(bias[:, 0] == 0, allowed)
    want, want_lse = fused_attention_with_lse(q, k, v, False, allowed, 1.0)
    got, got_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                               scale=1.0)
    sees = allowed.any(-1)[:, None]  # [b, 1, n]
    torch.testing.assert_close(got[sees.expand(b, a, n)], want[sees.expand(b, a, n)])
    torch.testing.assert_close(got_lse[sees.expand(b, a, n)], want_lse[sees.expand(b, a, n)])
    assert torch.isfinite(got).all() and (got_lse[~sees.expand(b, a, n)] < -1e30).all()  # discarded by its lse


def test_bytes_per_layer_formulas():
    ring = bytes_per_layer("ring", b=2, s=32, heads=8, kv_heads=2, head_dim=4, t=2, c=4, element_size=2)
    kv = 2 * 1 * 8 * 4 * 2  # b · a_kv/t · s/c · d · bytes
    assert ring == {"forward": {"ring_send": 3 * 2 * kv}, "backward": {"ring_send": 7 * 2 * kv}}
    a2a = bytes_per_layer("all_to_all", b=2, s=32, heads=8, kv_heads=8, head_dim=4, t=2, c=4, element_size=2)
    q = 2 * 4 * 8 * 4 * 2
    assert a2a["forward"] == a2a["backward"] == {"all_to_all": 4 * (3 * q // 4)}


def test_refusals_name_the_numbers_and_the_fix():
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2·cp·tp = 2·2·2 = 8"):
        check_context_length(12, 2, 2, "here")
    with pytest.raises(ValueError, match=r"2 query heads and 1 key/value heads .*cp_comm='ring'"):
        check_all_to_all_heads(2, 1, 2, "here")
    with pytest.raises(ValueError, match="cp_comm='ulysses'"):
        SeqParallelStrategy(cp=2, layout=Layout(cp_comm="ulysses"))
    with pytest.raises(ValueError, match="`cp` must be a positive integer, got 0"):
        SeqParallelStrategy(cp=0)
    with pytest.raises(ValueError, match=r"not divisible by tp·cp·pp = 2·2·1 = 4"):
        validate_layout(6, 2, 1, 2)
    with pytest.raises(RuntimeError, match="called outside a forward that split the sequence"):
        ContextParallel(ParallelGroup.virtual(2)).layer_layout(None, "A layer")


def _rewritten(comm="ring", c=2, **model):
    from lightning_seqpar.policies import rewrite
    from lightning_seqpar.rewriting import RewriteContext
    from tests.helpers.models import build

    module = build("hf", labels=True, **model)
    rewrite(module, RewriteContext(ParallelGroup(None), context=ContextParallel(ParallelGroup.virtual(c), comm)))
    return module


def test_the_layout_travels_with_the_call_and_a_model_that_drops_it_is_refused():
    """Packed documents on one cp rank: the entry passes the layout as the layers' keyword argument. Llama passes its
    call's keyword arguments on to its decoder layers, and they receive it; Falcon's model drops them, so its layers
    would attend across the documents, and the entry refuses it after the forward."""
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)
    x = torch.randint(0, 12, (2, 8))
    received = []
    llama = _rewritten(c=1, family="llama")
    for layer in llama.model.model.layers:
        layer.register_forward_pre_hook(lambda m, a, k: received.append(k.get(LAYOUT_ARGUMENT)), with_kwargs=True)
    llama.model(input_ids=x, position_ids=positions)
    assert len(received) == 2 and all(isinstance(r, ContextParallelBatch) and r.delivered[0] for r in received)
    assert received[0].documents.tolist() == documents_from_positions(positions).tolist()
    llama.model(input_ids=x)  # no position_ids: no layout, the model's own masks
    assert received[2:] == [None, None]
    falcon = _rewritten(c=1, family="falcon")
    with pytest.raises(TypeError, match="does not pass its keyword arguments on to its decoder layers"):
        falcon.model(input_ids=x, position_ids=positions)
    falcon.model(input_ids=x)  # nothing to deliver: the model's masks serve


def test_what_context_parallel_attention_cannot_compute_is_refused_at_the_rewrite():
    import transformers

    with pytest.raises(ValueError, match=r"attention dropout p=0.1 under context parallelism"):
        module = _rewritten()
        config = module.model.config
        config.attention_dropout = 0.1
        from lightning_seqpar.policies import rewrite
        from lightning_seqpar.rewriting import RewriteContext

        rewrite(transformers.AutoModelForCausalLM.from_config(config),
                RewriteContext(ParallelGroup(None), context=ContextParallel(ParallelGroup.virtual(2))))
    with pytest.raises(ValueError, match=r"4 query heads and 2 key/value heads"):
        _rewritten("all_to_all", c=4)  # 2 key/value heads cannot be scattered over 4 ranks


def test_a_sequence_the_layout_cannot_split_and_a_cache_are_refused_before_any_communication():
    module = _rewritten()
    with pytest.raises(ValueError, match=r"sequence length 6 is not divisible by 2·cp·tp = 2·2·1 = 4"):
        module.model(input_ids=torch.zeros(1, 6, dtype=torch.long))
    with pytest.raises(TypeError, match="cache_position="):
        module.model(input_ids=torch.zeros(1, 8, dtype=torch.long), cache_position=torch.arange(8))
    with pytest.raises(TypeError, match=r"attention_mask as \[b, s\]"):
        module.model(input_ids=torch.zeros(1, 8, dtype=torch.long), attention_mask=torch.ones(1, 1, 8, 8))


def test_the_recipe_strategy_group_builds_a_context_parallel_strategy():
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[2] / "conf"
    with initialize_config_dir(str(conf), version_base=None):
        overrides = ["model=llama_tiny", "strategy=tp2_cp2", "strategy.layout.cp_comm=all_to_all"]
        cfg = compose("config", overrides=overrides)
    strategy = SeqParallelStrategy(**OmegaConf.to_container(cfg.strategy, resolve=True))
    assert (strategy.tp, strategy.cp, strategy.layout.cp_comm) == (2, 2, "all_to_all")
    assert cfg.model.block_size % (2 * strategy.cp * strategy.tp) == 0  # the published block splits


def test_a_loss_called_without_the_labels_shifted_over_the_whole_row_is_refused_under_context_parallelism():
    module = _rewritten()
    loss = module.model.loss_function
    logits, labels = torch.zeros(1, 4, 13), torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="called without shift_labels="):
        loss(logits, labels, 13)
    assert torch.isfinite(loss(logits, labels, 13, shift_labels=labels))  # as the model's entry calls it


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("window", [None, 3])
def test_block_masks_are_made_on_the_queries_device_when_the_batch_carries_no_tensor(fused, window):
    """A plain causal batch (no documents, no padding) has no tensor to take a device from: its diagonal blocks'
    masks must still be made where the scores are. Run on meta tensors (a device that is not the CPU, as CUDA is):
    a mask left on the CPU fails there as it does on a GPU."""
    b, a, s, d = 1, 2, 8, 8
    q, k, v = (torch.empty(b, a, s, d, device="meta", requires_grad=True) for _ in range(3))
    layout = ContextParallelBatch(ParallelGroup(None), "all_to_all", s, window=window)
    kind, allowed = layout.block_mask(1, 1, torch.device("meta"))
    assert kind == "mask" and allowed.device.type == "meta"
    out = context_parallel_attention(q, k, v, layout, 0.5, fused=fused)
    assert out.shape == (b, a, s, d) and out.device.type == "meta"
    out.sum().backward()
    assert all(x.grad.device.type == "meta" for x in (q, k, v))
