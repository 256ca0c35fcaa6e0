"""``HFCausalLMModule`` builds its model on the meta device: each rank materializes only its shards and stage, a
pretrained directory read straight into them. Training then matches one process with the same weights (float64,
loss and every gradient, 3 AdamW steps), at tp 2 and pp 2 × tp 2."""

import os

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn
import transformers

from lightning_seqpar import RewriteContext, SeqParallelStrategy, rewrite
from lightning_seqpar.hf.init import hf_initializers
from lightning_seqpar.models import HFCausalLMModule
from lightning_seqpar.parallel import ParallelGroup
from lightning_seqpar.transformer.materialize import Materializer
from tests.helpers.distributed import run_distributed
from tests.helpers.memory import peak_resident_kib, reset_peak_resident, resident_kib
from tests.helpers.models import SEQ, VOCAB, Recorder, loader, reference_run, token_data
from tests.helpers.parity import relative_error_below

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

SEED, STEPS = 5, 3
CONFIG = dict(model_type="llama", vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ, tie_word_embeddings=True)
# Hugging Face's RMSNorm and loss round to float32 (see test_hf_models): whole-tensor relative errors reach ~1e-5 on
# small gradients; a missing reduction (a factor t = 2) gives >= 0.5.
LOSS_RTOL, GRAD_BOUND = 1e-6, 1e-4


def _fit(rank, world_size, tp, pp, config, pretrained):
    recorder = Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, precision="64-true", max_steps=STEPS, logger=False,
                         strategy=SeqParallelStrategy(tp=tp, pp=pp, seed=SEED), callbacks=[recorder],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0)
    module = HFCausalLMModule(config, pretrained, learning_rate=1e-2)
    trainer.fit(module, loader(token_data(STEPS, 1)))
    return recorder.losses, recorder.grads


def _materialized_reference(config: dict) -> HFCausalLMModule:
    """One device, with the weights the strategy draws from SEED on the meta device."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # as under precision="64-true", whose configure_model runs in float64
    try:
        module = HFCausalLMModule(config, learning_rate=1e-2)
        with torch.device("meta"):
            root = nn.Module()
            root.model = transformers.AutoModelForCausalLM.from_config(module.hf_config)
        materializer, group = Materializer(SEED, initializers=hf_initializers(root)), ParallelGroup()
        rewrite(root, RewriteContext(group, False, None, True, materializer), verify=False)
        materializer.fill(root, group)
        module.model = transformers.AutoModelForCausalLM.from_config(module.hf_config)
        module.model.load_state_dict(root.model.state_dict())
    finally:
        torch.set_default_dtype(previous)
    return module


def _assert_matches(runs, ref):
    compare = relative_error_below(GRAD_BOUND)
    for losses, grads in runs:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), rtol=LOSS_RTOL, atol=0)
        for got, want in zip(grads, ref.grads):
            assert set(got) == set(want)
            assert {n: compare(got[n], want[n]) for n in want if compare(got[n], want[n])} == {}


def _fit_both(rank, world_size, tp, pp, pretrained):
    return _fit(rank, world_size, tp, pp, None, pretrained), _fit(rank, world_size, tp, pp, CONFIG, None)


@pytest.fixture(scope="module")
def pretrained_directory(tmp_path_factory):
    """A tiny Llama saved in several safetensors files with an index, and its one-process reference run."""
    directory = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(0)
    source = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**CONFIG, attn_implementation="eager"))
    source.save_pretrained(directory, max_shard_size="20KB")
    reference = HFCausalLMModule(pretrained=str(directory), learning_rate=1e-2)
    reference.model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64)
    return str(directory), reference_run(reference, token_data(STEPS, 1), STEPS, 1)


@pytest.fixture(scope="module", params=[(2, 1), (2, 2)], ids=["tp2", "pp2tp2"])
def runs(request, pretrained_directory):
    """Both ways of building, trained in one group of spawned processes per layout."""
    tp, pp = request.param
    per_rank = run_distributed(_fit_both, tp * pp, tp, pp, pretrained_directory[0])
    return [from_directory for from_directory, _ in per_rank], [from_config for _, from_config in per_rank]


def test_a_pretrained_directory_is_read_into_the_shards_and_trains_like_one_process(runs, pretrained_directory):
    _assert_matches(runs[0], pretrained_directory[1])


def test_a_model_from_a_config_is_drawn_on_the_meta_device_and_trains_like_one_process(runs):
    _assert_matches(runs[1], reference_run(_materialized_reference(CONFIG), token_data(STEPS, 1), STEPS, 1))

BIG = dict(model_type="llama", vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=26,
           num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=64, tie_word_embeddings=True)


def _validate_and_export(rank, world_size, tp, pp, directory, exported):
    """Peak resident growth (bytes) while the model is built, loaded and validated; then while it is exported,
    over the resident size just before; and the bytes of this rank's shards."""
    import gc
    from torch.utils.data import DataLoader, TensorDataset

    gc.collect()
    before = resident_kib()
    tokens = torch.randint(0, BIG["vocab_size"], (4, 16))
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=SeqParallelStrategy(tp=tp, pp=pp), logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    module = HFCausalLMModule(pretrained=directory)
    trainer.validate(module, DataLoader(TensorDataset(tokens, tokens), batch_size=4), verbose=False)
    load = (peak_resident_kib() - before) * 1024
    gc.collect()
    reset_peak_resident()
    before = resident_kib()
    trainer.strategy.save_hf_pretrained(exported, max_shard_size="200MB")
    export = (peak_resident_kib() - before) * 1024
    return load, export, sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.fixture(scope="module")
def big_directory(tmp_path_factory):
    """A 315M-parameter Llama (1.26 GB in float32) saved in 7 safetensors shards with an index."""
    directory = tmp_path_factory.mktemp("llama315m")
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**BIG))
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    model.save_pretrained(directory, max_shard_size="200MB")
    del model
    # Freshly written pages are dirty in the page cache, and a process mapping such a file (safetensors reads
    # through mmap) is charged for all of it; a directory written earlier (downloaded, copied) is clean.
    os.sync()
    return str(directory), model_bytes


@pytest.mark.parametrize("tp, pp, bound", [(2, 1, 0.6), (2, 2, 0.35)], ids=["tp2", "pp2tp2"])
def test_no_rank_holds_the_whole_pretrained_model(big_directory, tmp_path, tp, pp, bound):
    """Peak resident growth per rank while ``HFCausalLMModule(pretrained=DIR)`` is built, loaded and validated, over
    the model's float32 bytes, in plain processes (glibc's defaults); then while ``save_hf_pretrained`` exports it:
    at most the largest tensor (gathered on one writer at a time) more than the rank held."""
    directory, model_bytes = big_directory
    assert model_bytes >= 300e6 * 4
    largest = BIG["vocab_size"] * BIG["hidden_size"] * 4  # the (tied) embedding
    for load, export, shards in run_distributed(_validate_and_export, tp * pp, tp, pp, directory, str(tmp_path / "out")):
        print(f"tp={tp} pp={pp}: load peak growth {load / model_bytes:.3f} x the whole model; export peak growth "
              f"{export / 2**20:.1f} MiB (largest tensor {largest / 2**20:.1f} MiB, shards {shards / 2**20:.1f} MiB)")
        assert load / model_bytes <= bound
        assert export <= largest + 8 * 2**20  # 8 MiB: the interpreter's own allocations
    reloaded = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert reloaded.num_hidden_layers == BIG["num_hidden_layers"]
    assert sum(f.stat().st_size for f in (tmp_path / "out").glob("*.safetensors")) >= model_bytes - largest


def _refused(rank, world_size):
    try:
        _fit(rank, world_size, 4, 1, CONFIG, None)
    except Exception as error:  # noqa: BLE001 - the test compares what each rank raised
        return type(error).__name__, str(error)
    return None


def test_a_rewrite_refused_on_the_ranks_ends_with_its_own_error_not_the_teardown_s():
    """A model built on the meta device that the rewrite refuses (2 key/value heads at tp 4) stays on the meta device;
    Lightning's teardown would move it to the CPU and raise over the refusal."""
    for raised in run_distributed(_refused, 4):
        assert raised is not None and raised[0] == "ValueError", raised
        assert "num_key_value_heads = 2 is not divisible by the tensor-parallel size tp = 4" in raised[1]
