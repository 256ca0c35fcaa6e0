"""A Hugging Face model under the rewrite takes the calls of transformers' own examples: the config's default
``use_cache`` trains and validates as on one device; a key/value cache is refused where it would be read."""

import copy

import pytest
import torch

from lightning_seqpar import RewriteContext, rewrite
from lightning_seqpar.parallel import ParallelGroup
from tests.helpers.models import build, token_data


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
def test_a_cache_holding_past_tokens_or_generation_is_refused_with_the_fix(family):
    model, reference = _rewritten(family)
    x = token_data(1, 1).tensors[0]
    past = reference(input_ids=x[:, :4]).past_key_values  # four tokens of a single-device run
    with pytest.raises(NotImplementedError, match="keeps no key/value cache.*generate from the single-device"):
        model(input_ids=x[:, 4:5], past_key_values=past)
    with pytest.raises(NotImplementedError, match="keeps no key/value cache"):
        model.generate(x[:, :4], attention_mask=torch.ones_like(x[:, :4]), max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generation_at_tp_2_is_refused_never_different_tokens(family, sequence_parallel):
    """Each rank holds half the heads and would attend without a cache of past keys: refused with the fix, whether
    the layers pass the cache as ``cache=`` (transformers >= 5.24) or ``past_key_values=``, SP on or off."""
    from lightning_seqpar.parallel.emulated import run_emulated

    module = build("hf", family=family).double()
    x = token_data(1, 1).tensors[0][:, :4]

    def one_rank(group):
        model = copy.deepcopy(module.model)
        rewrite(model, RewriteContext(group, sequence_parallel, None, True))
        return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False)

    with pytest.raises(NotImplementedError, match=r"tensor-parallel \w+ was called with a key/value cache holding "
                                                  r"past tokens .* generate from the single-device model"):
        run_emulated(2, one_rank)


@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_generation_under_the_strategys_entry_says_how_to_generate_from_the_single_device_model(sequence_parallel):
    """The strategy installs the model's entry at every layout (packed documents): generate() meets it first, with an
    odd-length step of one token; the refusal names generation and the way to the single-device model, not a
    sequence length (before: "sequence length 1 is not divisible by 2·cp·tp = 2·1·1")."""
    from lightning_seqpar.context_parallel import ContextParallel
    from lightning_seqpar.parallel.emulated import run_emulated

    module = build("hf", family="llama").double()
    x = token_data(1, 1).tensors[0][:, :5]

    def one_rank(group):
        model = copy.deepcopy(module.model)
        rewrite(model, RewriteContext(group, sequence_parallel, None, True, context=ContextParallel(ParallelGroup())))
        return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False)

    with pytest.raises(NotImplementedError, match=r"called with a key/value cache \(past_key_values=, as generate\(\) "
                                                  r"does\).*Generation runs on the single-device model: gather it .*"
                                                  r"full_state_dict\(\).*save_hf_pretrained"):
        run_emulated(2, one_rank)
