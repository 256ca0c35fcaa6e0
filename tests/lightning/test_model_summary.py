"""The printed parameter count is the whole model's, not one rank's shard."""

import torch.nn as nn

from lightning_seqpar import RewriteContext, rewrite
from lightning_seqpar.lightning.callbacks import parameter_counts
from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.parallel import ParallelGroup


def test_whole_model_count_is_the_single_device_count_and_rank_count_is_the_shard():
    config = GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=4, n_embd=16)  # 13: vocabulary padding at tp 2
    single = sum(p.numel() for p in GPT(config).parameters())
    root = nn.Module()
    root.gpt = GPT(config)
    rewrite(root, RewriteContext(ParallelGroup.virtual(2), True, None, True))
    counts = parameter_counts(root, strategy=None)
    local = sum(p.numel() for p in root.parameters())
    assert counts["gpt"] == counts["total"] == (single, local)
    assert local < single
