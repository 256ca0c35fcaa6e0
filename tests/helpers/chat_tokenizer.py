"""A tiny Hugging Face tokenizer with a chat template, built offline (``tokenizers`` word level): what a chat model's
tokenizer directory gives the fine-tuning data pipeline."""

from __future__ import annotations

WORDS = ("hello how are you i am fine thanks what is two plus two four the sky blue why because light scatters "
         "tell me a joke no say yes ok bye good morning night sun moon star").split()
WORDS = list(dict.fromkeys(WORDS))  # each word once: ids are 0..n-1
SPECIALS = ["<unk>", "<pad>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

# The assistant's turn inside {% generation %} markers (transformers' return_assistant_tokens_mask reads them).
MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}"
          "<|end|>{% endgeneration %}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PLAIN = MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")  # most templates: no markers


def chat_tokenizer(template: str | None = PLAIN):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="<|end|>", additional_special_tokens=SPECIALS[3:])
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


CONVERSATIONS = [
    [{"role": "system", "content": "good morning"}, {"role": "user", "content": "what is two plus two"},
     {"role": "assistant", "content": "four"}, {"role": "user", "content": "why"},
     {"role": "assistant", "content": "because the sky is blue"}],
    [{"role": "user", "content": "tell me a joke"}, {"role": "assistant", "content": "no"}],
    [{"role": "user", "content": "hello how are you"}, {"role": "assistant", "content": "i am fine thanks"}],
]


def make_chat_model_dir(directory, hidden: int = 32, layers: int = 2, experts: int = 0):
    """A tiny random Llama (with ``experts``: a Qwen3-MoE of that many experts, top-2) saved with the chat tokenizer
    (its template included): a chat model's directory."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    tokenizer = chat_tokenizer()
    torch.manual_seed(0)
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    config = Qwen3MoeConfig(**common, num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=hidden // 2) \
        if experts else LlamaConfig(**common)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def chat_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` conversations of made-up turns over the tokenizer's words (one to three exchanges each)."""
    import random

    rng = random.Random(seed)
    records = []
    for _ in range(n):
        messages = []
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(2, 6)))})
            messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 5)))})
        records.append({"messages": messages})
    return records


def make_chat_dir(root, conversations: int, experts: int = 0):
    """``root/model`` (:func:`make_chat_model_dir`, a mixture of ``experts`` where given) and ``root/chat.jsonl`` of
    ``conversations`` records; ``root``."""
    import json

    make_chat_model_dir(root / "model", experts=experts)
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_records(conversations)))
    return root
