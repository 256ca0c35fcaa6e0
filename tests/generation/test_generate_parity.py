"""Tokens out of a model in its training layout are one process's: after training under SeqParallelStrategy, every
rank calls ``generate`` inside the run (a callback at the end of fit), and

- greedy tokens of left-padded prompts equal transformers' ``generate`` of each prompt alone on the one-process model
  with the trained weights (gathered from the run);
- sampled tokens (temperature, top-k, top-p, a seeded generator) equal transformers' sampling of the same batch with
  the same seed;
- the returned log-probabilities equal the one-process forward's log-probabilities of the chosen tokens (float32)
  within 1e-6: the trainer/rollout mismatch;
- every rank of a replica (its tensor- and pipeline-parallel ranks) returns the same tokens, and each data-parallel
  replica continues its own prompts; rows end at their end-of-sequence token, and every replica stops with the last to
  end.

Llama, Qwen3, Gemma 2 (soft-capped logits and attention, sliding windows), gpt-oss (attention sinks, experts) at
tp 2; Llama at pp 2 (1F1B's placement) and tp 2 × pp 2 (sequence parallelism on a later stage); Gemma 2 at pp 2 in
ZB-V's placement (rank 0 holds the first and the last stage); Qwen3-MoE at tp 2 × ep 2 with two data-parallel
replicas. Float64, 2 training steps first."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch

from lightning_seqpar import generate
from lightning_seqpar.memory.kv_cache import kv_cache_bytes, layer_windows
from tests.helpers.distributed import run_distributed
from tests.helpers.models import build, loader, token_data
from tests.helpers.prompts import replica_prompts
from tests.helpers.strategy import strategy_of

pytestmark = pytest.mark.distributed  # starts processes: outside the fast lane

NEW = 6
END, PAD = 7, 12  # an end-of-sequence token some rows produce, and the padding after it
SAMPLING = dict(do_sample=True, temperature=0.8, top_k=5, top_p=0.9)
CASES = {2: [("llama", (("tp", 2),)), ("qwen3", (("tp", 2),)), ("gemma2", (("tp", 2),)), ("gpt_oss", (("tp", 2),)),
             ("llama", (("pp", 2),)), ("gemma2", (("pp", 2), ("schedule", "ZB-V"), ("layers", 4)))],
         4: [("qwen3_moe", (("tp", 2), ("ep", 2))), ("llama", (("tp", 2), ("pp", 2)))]}
"""(family, layout) by world size; ``layers``: the model's (ZB-V's 2 chunks per rank need 4)."""


class _Generate(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        replica = trainer.strategy.mesh.batch_rank
        prompts, mask = replica_prompts(replica)
        self.result = dict(
            state=trainer.strategy.full_state_dict(), replica=replica,
            greedy=generate(pl_module, prompts, NEW, attention_mask=mask, return_logprobs=True),
            sampled=generate(pl_module, prompts[1:].expand(2, -1), NEW, generator=torch.Generator().manual_seed(3),
                             **SAMPLING),
            ended=generate(pl_module, prompts, NEW, attention_mask=mask, eos_token_id=END, pad_token_id=PAD))
        self.result["cache"] = _cache_bytes(pl_module, prompts, mask)
        if trainer.strategy.pipeline is None:  # (a training step under pp runs through the schedule)
            self.result["peaks"] = _peaks(pl_module, prompts, mask)
            # transformers' own generate on the rewritten model: its DynamicCache holds each rank's heads
            self.result["transformers"] = pl_module.model.generate(
                input_ids=prompts[1:], max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)


def _cache_bytes(pl_module, prompts, mask):
    """Bytes of the key/value cache a greedy generation leaves on this rank: of the layers it holds (its heads), and of
    the other layers' slots (one byte per position each)."""
    import lightning_seqpar.generation.model_steps as model_steps

    made = []
    original = model_steps.new_cache
    model_steps.new_cache = lambda model: made.append(original(model)) or made[-1]  # a spy on the cache generate makes
    try:
        generate(pl_module, prompts, NEW, attention_mask=mask)
    finally:
        model_steps.new_cache = original
    cache = next(iter(made[0].values()))
    runtime = getattr(pl_module.trainer.strategy.pipeline, "executor", None)
    runtime = runtime.runtime if runtime is not None else None
    held = set(range(len(cache.layers))) if runtime is None else {
        i for stage in runtime.layout.stages_of(pl_module.trainer.strategy.pipeline.pipeline.rank)
        for i in range(*runtime.layout.bounds(stage))}
    size = lambda layer: layer.keys.numel() * layer.keys.element_size() * 2  # noqa: E731 (keys and values)
    return (sum(size(layer) for i, layer in enumerate(cache.layers) if i in held),
            sum(size(layer) for i, layer in enumerate(cache.layers) if i not in held), sorted(held),
            pl_module.trainer.strategy.mesh.tensor.size)


def _peaks(pl_module, prompts, mask):
    """Peak bytes (parameters held, and every storage made) of a generation and of a training step's forward and
    backward on the whole generated length; the bytes of this rank's parameters and of the whole model's."""
    from lightning_seqpar.memory.peak import PeakMemoryTracker

    with PeakMemoryTracker() as tracker:
        tracker.hold(pl_module.parameters())
        tokens = generate(pl_module, prompts, NEW, attention_mask=mask)
    generation = tracker.peak
    x = tokens[:, :10]  # (a length every layout's t divides)
    with PeakMemoryTracker() as tracker:
        tracker.hold(pl_module.parameters())
        pl_module.model(input_ids=x, labels=x).loss.backward()
    pl_module.zero_grad(set_to_none=True)
    local = sum(p.numel() * p.element_size() for p in pl_module.parameters())
    return generation, tracker.peak, local


def _run(rank, world, family, layout):
    settings = dict(layout)
    layers = settings.pop("layers", 2)
    callback = _Generate()
    trainer = pl.Trainer(accelerator="cpu", devices=world, precision="64-true", max_steps=2, logger=False,
                         strategy=strategy_of(**settings), enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[callback])
    dp = world // settings.get("tp", 1) // settings.get("pp", 1)
    trainer.fit(build("hf", labels=True, family=family, layers=layers), loader(token_data(2, dp)))
    return callback.result


def _all_cases():
    return [(world, case) for world, cases in CASES.items() for case in cases]


@pytest.fixture(scope="module")
def generated():
    done = {}

    def of(world, case):
        if (world, case) not in done:
            done[world, case] = run_distributed(_run, world, *case)
        return done[world, case]
    return of


def _reference(family, layout, state):
    # (its prompts unpadded: each alone, or of one length)
    model = build("hf", labels=True, family=family, layers=dict(layout).get("layers", 2)).double()
    model.load_state_dict(state)
    model.model.generation_config.eos_token_id = None  # every row runs to NEW tokens, as generate() without one
    return model.model


@pytest.mark.parametrize("world, case", _all_cases(), ids=lambda v: str(v))
def test_generated_tokens_and_logprobs_are_one_process_s(generated, world, case):
    per_rank = generated(world, case)
    replicas = {}
    for result in per_rank:  # every rank of a replica (its tensor and pipeline ranks) returns the same tokens
        first = replicas.setdefault(result["replica"], result)
        assert torch.equal(result["greedy"][0], first["greedy"][0]) and torch.equal(result["sampled"],
                                                                                     first["sampled"])
        assert torch.equal(result["greedy"][1], first["greedy"][1])  # and log-probabilities
    for result in replicas.values():  # each data-parallel replica's own prompts
        model = _reference(*case, result["state"])
        prompts, mask = replica_prompts(result["replica"])
        tokens, logprobs = result["greedy"]
        assert tokens.shape == (2, 5 + NEW) and torch.equal(tokens[:, :5], prompts)
        for row in range(2):
            alone = prompts[row][mask[row] == 1][None]
            want = model.generate(input_ids=alone, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
            assert torch.equal(tokens[row, 5:], want[0, -NEW:]), (case, row, tokens, want)
            with torch.no_grad():
                whole = want[0][None]
                forward = model(input_ids=whole).logits.float().log_softmax(-1)[0, -NEW - 1:-1]
            chosen = forward.gather(-1, whole[0, -NEW:, None]).squeeze(-1)
            assert (logprobs[row] - chosen).abs().max().item() < 1e-6, (logprobs[row], chosen)
        torch.manual_seed(3)  # transformers draws from the default generator
        want = model.generate(input_ids=prompts[1:].expand(2, -1), max_new_tokens=NEW, pad_token_id=0, **SAMPLING)
        assert torch.equal(result["sampled"], want), (result["sampled"], want)
    config = _reference(*case, per_rank[0]["state"]).config
    kv_heads, head_dim = config.num_key_value_heads, getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    windows = layer_windows(config)
    for result in per_rank:  # each rank's cache: its layers' a_kv/t heads, the formula's bytes exactly
        heads, remote, held, t = result["cache"]
        assert heads == kv_cache_bytes(2, 5 + NEW - 1, kv_heads, head_dim, t, 8, [windows[i] for i in held])
        others = [w for i, w in enumerate(windows) if i not in held]  # keys and values: a byte per position kept
        assert remote == kv_cache_bytes(1, 5 + NEW - 1, 1, 1, 1, 1, others)
    for result in per_rank:  # transformers' generate in the layout: the unpadded prompt's greedy tokens
        if "transformers" in result:
            assert torch.equal(result["transformers"][0], result["greedy"][0][1]), (result["transformers"], result)
    for result in per_rank:  # no rank gathers the model, nor holds more while generating than while training
        if "peaks" in result:
            generation, training, local = result["peaks"]
            whole = sum(v.numel() * v.element_size() for v in result["state"].values())
            # (a gathered copy of the model alone would add `whole` to what the rank holds)
            assert generation <= training and generation - local < whole, (generation, training, local, whole)
    if len(replicas) > 1:  # the replicas continued different prompts
        assert not torch.equal(replicas[0]["greedy"][0], replicas[1]["greedy"][0])
    # Rows end at END, padded after it; every replica stops together (its ranks share a mixture's all-to-all).
    assert len({result["ended"].shape[1] for result in per_rank}) == 1
    length = per_rank[0]["ended"].shape[1]
    for result in per_rank:
        free = result["greedy"][0][:, :length]
        ended = (free[:, 5:] == END).int().cumsum(-1) - (free[:, 5:] == END).int() > 0  # after a row's first END
        assert torch.equal(result["ended"][:, 5:], free[:, 5:].masked_fill(ended, PAD))
    stopped = [bool((r["greedy"][0][:, 5:length] == END).any(-1).all()) for r in per_rank]
    assert length == 5 + NEW or all(stopped)  # shorter only when every row of every replica had ended


class _Refused(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        try:
            generate(pl_module, replica_prompts(0)[0], 2)
            self.message = ""
        except NotImplementedError as error:
            self.message = str(error)


def _context_parallel(rank, world):
    callback = _Refused()
    trainer = pl.Trainer(accelerator="cpu", devices=world, precision="64-true", max_steps=1, logger=False,
                         strategy=strategy_of(cp=2), enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[callback])
    trainer.fit(build("hf", labels=True), loader(token_data(1, 1)))
    return callback.message


def test_generation_under_context_parallelism_is_refused_by_name_on_every_rank():
    messages = run_distributed(_context_parallel, 2)
    assert all("generate() under context parallelism (cp=2) is not implemented" in m for m in messages), messages


class _GenerateGPT(pl.Callback):
    def on_train_end(self, trainer, pl_module):
        prompts = replica_prompts(trainer.strategy.mesh.batch_rank)[0]  # one length (the reference GPT takes no mask)
        self.result = dict(state=trainer.strategy.full_state_dict(), prompts=prompts,
                           greedy=generate(pl_module, prompts, NEW, return_logprobs=True),
                           sampled=generate(pl_module, prompts, NEW, generator=torch.Generator().manual_seed(3),
                                            **SAMPLING))


def _run_gpt(rank, world, layout):
    callback = _GenerateGPT()
    trainer = pl.Trainer(accelerator="cpu", devices=world, precision="64-true", max_steps=2, logger=False,
                         strategy=strategy_of(**dict(layout)), enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[callback])
    trainer.fit(build("gpt"), loader(token_data(2, 1)))
    return callback.result


@pytest.mark.parametrize("layout", [(("tp", 2),), (("pp", 2),)], ids=str)
def test_the_reference_gpt_generates_one_process_s_tokens(layout):
    """The reference GPT (no cache: each token recomputes its last block_size tokens, padded to t under SP) at tp 2
    and pp 2 gives the tokens and log-probabilities of the same function on the one-process model."""
    per_rank = run_distributed(_run_gpt, 2, layout)
    model = build("gpt").double()
    model.load_state_dict(per_rank[0]["state"])
    prompts = per_rank[0]["prompts"]
    tokens, logprobs = generate(model, prompts, NEW, return_logprobs=True)
    sampled = generate(model, prompts, NEW, generator=torch.Generator().manual_seed(3), **SAMPLING)
    for result in per_rank:
        assert torch.equal(result["greedy"][0], tokens) and torch.equal(result["sampled"], sampled)
        assert (result["greedy"][1] - logprobs).abs().max().item() < 1e-6
