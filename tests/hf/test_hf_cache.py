"""A Hugging Face model under the rewrite takes the calls of transformers' own examples: the config's default
``use_cache`` trains and validates as on one device, and transformers' own ``generate`` at tp 2 (sequence parallelism
on or off, experts included) gives one process's tokens and logits, each rank caching its own key/value heads in
transformers' cache classes (the bytes exactly the formula's), two collectives per layer for each decoded token."""

import copy

import pytest
import torch

from lightning_seqpar import RewriteContext, rewrite
from lightning_seqpar.memory.kv_cache import kv_cache_bytes, layer_windows
from lightning_seqpar.parallel import CommunicationLog, ParallelGroup
from lightning_seqpar.parallel.emulated import run_emulated
from tests.helpers.models import build, token_data

NEW = 8  # past the sliding window of the windowed families (3): their cache layers drop old positions


def _rewritten(family: str):
    module = build("hf", family=family).double()
    reference = copy.deepcopy(module)
    rewrite(module, RewriteContext(ParallelGroup(), True, None, True))  # the parallel blocks, on one rank
    return module.model, reference.model


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_default_use_cache_gives_the_one_device_loss_and_keeps_no_tensors(family):
    model, reference = _rewritten(family)
    assert model.config.use_cache  # the published default
    x = token_data(1, 1).tensors[0]
    out = model(input_ids=x, labels=x)
    torch.testing.assert_close(out.loss, reference(input_ids=x, labels=x).loss, rtol=1e-12, atol=0)
    assert out.past_key_values is None or out.past_key_values.get_seq_length() == 0
    out.loss.backward()  # and it trains


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_cache_holding_past_tokens_is_refused_while_taking_gradients(family):
    model, reference = _rewritten(family)
    x = token_data(1, 1).tensors[0]
    past = reference(input_ids=x[:, :4]).past_key_values  # four tokens of a single-device run
    with pytest.raises(NotImplementedError, match="holding past tokens while taking gradients.*torch.no_grad"):
        model(input_ids=x[:, 4:5], past_key_values=past)


def _perturbed(family: str):
    """A tiny model whose greedy tokens vary (random weights scaled up: not one token repeated)."""
    model = build("hf", family=family).double().model
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype) * 0.3)
    return model


GENERATE = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True,
                pad_token_id=0)


def _generated_at_tp_2(reference, prompt, sequence_parallel=True, context=None, **settings):
    """transformers' ``generate`` on two emulated tensor-parallel ranks of ``reference``, rewritten: each rank's."""
    def one_rank(group):
        model = copy.deepcopy(reference)
        rewrite(model, RewriteContext(group, sequence_parallel, None, True, context=context))
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), **dict(GENERATE, **settings))

    return run_emulated(2, one_rank)


@pytest.mark.parametrize("family, sequence_parallel", [
    ("llama", True), ("llama", False), ("gpt2", True), ("gemma2", True), ("gpt_oss", True), ("qwen3_moe", True),
    ("qwen3", False)])
def test_transformers_generate_at_tp_2_is_one_process_s_and_caches_this_rank_s_heads(family, sequence_parallel):
    """Prompts of 5 positions (odd: the prefill too runs with SP suspended) and of 6 (the prefill split over t)."""
    reference = _perturbed(family)
    x = token_data(1, 1).tensors[0][:2]
    config = reference.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for length in (5, 6):
        prompt = x[:, :length]
        want = reference.generate(prompt, attention_mask=torch.ones_like(prompt), **GENERATE)
        for got in _generated_at_tp_2(reference, prompt, sequence_parallel):
            assert torch.equal(got.sequences, want.sequences), (family, length, got.sequences, want.sequences)
            for mine, theirs in zip(got.logits, want.logits):
                torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-10)
            cache = got.past_key_values if hasattr(got, "past_key_values") else got.cache
            kept = [layer.keys for layer in cache.layers]
            assert all(k.shape[:2] == (2, kv_heads // 2) and k.shape[-1] == head_dim for k in kept)
            held = sum(layer.keys.numel() * 8 + layer.values.numel() * 8 for layer in cache.layers)
            # the cache holds every position but the last generated token's (never fed back)
            assert held == kv_cache_bytes(2, length + NEW - 1, kv_heads, head_dim, 2, 8, layer_windows(config))
            if family in ("gemma2", "gpt_oss"):  # a sliding layer dropped positions
                assert min(k.shape[2] for k in kept) < length + NEW - 1


def test_a_static_cache_of_transformers_gives_the_same_tokens():
    reference = _perturbed("llama")
    prompt = token_data(1, 1).tensors[0][:2, :5]
    want = reference.generate(prompt, attention_mask=torch.ones_like(prompt), **GENERATE, cache_implementation="static")
    for got in _generated_at_tp_2(reference, prompt, cache_implementation="static"):
        assert torch.equal(got.sequences, want.sequences)


def test_a_decoded_token_costs_two_all_reduces_per_layer_and_no_sequence_collective():
    """The decode step runs without sequence parallelism: per layer the attention's and the MLP's row-parallel
    all-reduce, nothing else; plus the embedding's all-reduce and the logits' all-gather over the vocabulary."""
    reference = _perturbed("llama")
    layers = reference.config.num_hidden_layers
    prompt = token_data(1, 1).tensors[0][:2, :6]

    def one_rank(group):
        model = copy.deepcopy(reference)
        rewrite(model, RewriteContext(group, True, None, True))
        with torch.no_grad():
            out = model(input_ids=prompt, use_cache=True)
            group.log = CommunicationLog()
            model(input_ids=out.logits[:, -1:].argmax(-1), cache=out.past_key_values, use_cache=True)
        return [r.kind for r in group.log.records], [r.full_bytes for r in group.log.records]

    for kinds, sizes in run_emulated(2, one_rank):
        assert kinds.count("all_reduce") == 2 * layers + 1 and kinds.count("all_gather") == 1, kinds
        assert "reduce_scatter" not in kinds
        hidden = reference.config.hidden_size
        assert sorted(sizes)[:2 * layers + 1] == [2 * hidden * 8] * (2 * layers + 1)  # [1, b, h] float64 each


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_generation_under_the_strategys_entry_runs_at_cp_1_and_is_refused_at_cp_2(sequence_parallel):
    """The strategy installs the model's entry at every layout (packed documents): at cp=1 a cached call passes it
    unchanged; at cp=2 it is refused with the fix."""
    from lightning_seqpar.context_parallel import ContextParallel

    reference = _perturbed("llama")
    prompt = token_data(1, 1).tensors[0][:2, :6]
    want = reference.generate(prompt, attention_mask=torch.ones_like(prompt), **GENERATE)
    at_cp_1 = _generated_at_tp_2(reference, prompt, sequence_parallel, context=ContextParallel(ParallelGroup()))
    assert all(torch.equal(got.sequences, want.sequences) for got in at_cp_1)

    def context_parallel(group):
        model = copy.deepcopy(reference)
        rewrite(model, RewriteContext(ParallelGroup(), sequence_parallel, None, True, context=ContextParallel(group)))
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), **GENERATE)

    with pytest.raises(NotImplementedError, match=r"key/value cache .* under context parallelism \(cp=2\).*at cp=1"):
        run_emulated(2, context_parallel)
