"""A tiny pretrained Hugging Face model directory as users bring one: a Llama saved in several safetensors shards
with a byte-level BPE tokenizer trained offline (``tokenizers``) whose vocabulary exceeds 65 535 ids."""

from __future__ import annotations

import random
from pathlib import Path

VOCAB = 66_000  # above 65 535: token caches need uint32 ids
EOS = "<|endoftext|>"


def synthetic_text(words: int, seed: int = 0) -> str:
    """Sentences of pronounceable made-up words: enough distinct words for a BPE vocabulary of :data:`VOCAB`."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"]
    lexicon = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(90_000)})
    lines, line = [], []
    for _ in range(words):
        line.append(rng.choice(lexicon))
        if len(line) == 12:
            lines.append("The " + " ".join(line) + ".")
            line = []
    return "\n".join(lines) + "\n"


def train_tokenizer(text: str):
    """A byte-level BPE tokenizer (GPT-2's and Llama 3's kind) of :data:`VOCAB` ids, as transformers loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text[i:i + 10_000] for i in range(0, len(text), 10_000)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS,
                                   model_input_names=["input_ids", "attention_mask"])  # as Llama's tokenizers


def make_model_dir(directory: Path, text: str, hidden: int = 32, layers: int = 2, tie: bool = False) -> Path:
    """Save a random tiny ``LlamaForCausalLM`` (several safetensors files) and the tokenizer trained on ``text``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = train_tokenizer(text)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=tie, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="4MB")
    tokenizer.save_pretrained(directory)
    return directory
