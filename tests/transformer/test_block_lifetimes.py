"""What a rewritten block's forward lets go of before its MLP runs: the core attention's context and the output
projection's result, which nothing saves for backward when the projection is frozen (LoRA's base), are freed once
added to the residual, instead of living through the MLP. A recomputed layer runs this forward again in its backward,
where the MLP's moment is often the step's peak (Hugging Face Llama at tp 1, float64, every weight but the
embedding frozen). A mixture likewise lets go of the rows its experts received and of their outputs once combined."""

from __future__ import annotations

import weakref

from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.policies import rewrite
from lightning_seqpar.rewriting import RewriteContext
from lightning_seqpar.transformer.declared_block import ParallelBlock
from tests.helpers.models import BATCH, build, token_data


def test_the_attention_s_output_is_freed_before_the_mlp_runs():
    module = build("hf", labels=True).double()
    rewrite(module, RewriteContext(ParallelGroup.virtual(1), True))
    for p in module.parameters():
        p.requires_grad_(False)
    module.model.get_input_embeddings().weight.requires_grad_(True)  # a backward graph through every layer
    block = next(m for m in module.modules() if isinstance(m, ParallelBlock))
    produced: list[weakref.ref] = []
    alive_at_mlp: list[bool] = []
    hooks = [block._attention.out.register_forward_hook(lambda _m, _i, out: produced.append(weakref.ref(out)))]
    mlp = block._normed_mlp

    def normed_mlp(x):
        alive_at_mlp.append(produced[-1]() is not None)
        return mlp(x)

    block._normed_mlp = normed_mlp
    try:
        x, y = token_data(1, 1).tensors
        loss = module.compute_loss(x[:BATCH], y[:BATCH])
    finally:
        for hook in hooks:
            hook.remove()
        del block._normed_mlp
    assert produced and alive_at_mlp == [False]
    loss.backward()  # the graph is whole: what was freed was not needed
    assert module.model.get_input_embeddings().weight.grad is not None


def test_a_mixture_frees_the_rows_and_its_experts_outputs_before_its_shared_expert_runs():
    """The rows its experts received and their outputs (``[R, h]`` each) are not alive once the combine has run (a
    frozen expert saves neither; nothing else reads them), so they do not live on through the shared expert (a
    Qwen2-MoE at tp 1, float64, every weight but the embedding frozen)."""
    module = build("hf", labels=True, family="qwen2_moe").double()
    rewrite(module, RewriteContext(ParallelGroup.virtual(1), True))
    for p in module.parameters():
        p.requires_grad_(False)
    module.model.get_input_embeddings().weight.requires_grad_(True)
    part = next(m.mlp_slot for m in module.modules() if isinstance(m, ParallelBlock) and m.mlp_slot.kind == "moe")
    assert part.shared is not None
    made: list[weakref.ref] = []
    alive_at_shared: list[list[bool]] = []
    hook = part.experts.register_forward_hook(lambda _m, args, out: made.extend([weakref.ref(args[0]),
                                                                                 weakref.ref(out)]))
    shared = part.shared.forward

    def shared_forward(x):
        alive_at_shared.append([ref() is not None for ref in made[-2:]])
        return shared(x)

    part.shared.forward = shared_forward
    try:
        x, y = token_data(1, 1).tensors
        loss = module.compute_loss(x[:BATCH], y[:BATCH])
    finally:
        hook.remove()
        del part.shared.forward
    assert alive_at_shared and all(alive == [False, False] for alive in alive_at_shared), alive_at_shared
    loss.backward()  # the graph is whole: what was freed was not needed
    assert module.model.get_input_embeddings().weight.grad is not None
