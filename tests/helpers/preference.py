"""Preference pairs over the chat tokenizer's words (tests/helpers/chat_tokenizer.py) that follow a rule: the chosen
reply begins with "yes", the rejected one with "no"; the rest of each reply and the prompt are random words. Half of
the records are TRL's standard text format, half conversations with a shared prompt."""

from __future__ import annotations

import json
import random

from tests.helpers.chat_tokenizer import WORDS


def preference_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` records (see the module docstring)."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        prompt = " ".join(rng.choices(WORDS, k=rng.randint(2, 5)))
        chosen = " ".join(["yes"] + rng.choices(WORDS, k=rng.randint(0, 3)))
        rejected = " ".join(["no"] + rng.choices(WORDS, k=rng.randint(0, 3)))
        if i % 2:
            records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
        else:
            user = {"role": "user", "content": prompt}
            records.append({"chosen": [user, {"role": "assistant", "content": chosen}],
                            "rejected": [user, {"role": "assistant", "content": rejected}]})
    return records


def write_preferences(path, n: int, seed: int = 0):
    """``path`` holding :func:`preference_records` as JSON Lines; ``path``."""
    path.write_text("".join(json.dumps(r) + "\n" for r in preference_records(n, seed)))
    return path
