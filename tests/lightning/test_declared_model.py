"""What the launching process checks and plans is the module's model as the ranks will build it, and the module is
left as given: the declared model where the module declares one, else ``configure_model`` on a copy, else nothing
(the ranks check it)."""

import contextlib

import lightning.pytorch as pl
import torch
import torch.nn as nn

from lightning_seqpar.lightning.declared_model import model_for_checks
from lightning_seqpar.models import GPTConfig, GPTLightningModule


def _meta():
    return torch.device("meta")


def test_a_declared_model_is_built_on_the_meta_device_and_the_module_is_left_unbuilt():
    module = GPTLightningModule(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8), empty_init=True)
    model = model_for_checks(module, _meta)
    assert type(model).__name__ == "GPT" and all(p.is_meta for p in model.parameters())
    assert not hasattr(module, "gpt")


class _Builds(pl.LightningModule):
    def configure_model(self):
        if not hasattr(self, "net"):
            self.net = nn.Linear(4, 4)


class _NeedsTrainer(pl.LightningModule):
    def configure_model(self):
        self.net = nn.Linear(4, self.trainer.world_size)  # raises: not attached to a Trainer yet


def test_any_other_module_is_built_on_a_copy_or_left_to_the_ranks():
    module = _Builds()
    built = model_for_checks(module, _meta)
    assert built is not module and built.net.weight.is_meta and not hasattr(module, "net")
    assert model_for_checks(_NeedsTrainer(), _meta) is None
    plain = nn.Sequential(nn.Linear(2, 2))
    assert model_for_checks(plain, contextlib.nullcontext) is plain  # built in __init__: itself
