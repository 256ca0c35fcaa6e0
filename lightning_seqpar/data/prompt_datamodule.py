"""Prompts for GRPO: JSON Lines of ``{"prompt": str | [messages], ...}``, each other column handed to the rewards.

A conversational prompt (a list of messages) is rendered with the tokenizer's chat template and its generation prompt
(the assistant's turn opened, as TRL renders it); a text prompt is tokenized as it is. Micro-batches are this rank's
``b`` prompts of each optimizer step (the order and placement of :class:`~lightning_seqpar.data.step_batches.
StepBatches`: the same global order at any data-parallel size, resumable mid-epoch), left-padded to the longest:
``input_ids``, ``attention_mask`` ``[b, P]`` and ``prompt_index`` ``[b]`` (the prompt's record: its reward columns and
its completions' seeds, :mod:`~lightning_seqpar.models.grpo_objective`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import numpy as np
import torch

from lightning_seqpar.data.step_batches import StepBatches, loader_place
from lightning_seqpar.data.supervised_cache import read_records
from lightning_seqpar.data.tokenizer import Tokenizer, load_tokenizer


@dataclass
class PromptRows:
    """The rendered prompts (token ids each) and what :class:`StepBatches` counts per row (one prompt each)."""

    ids: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def supervised(self) -> np.ndarray:
        return np.ones(len(self.ids), dtype=np.int64)


class PromptBatches(StepBatches):
    """This rank's micro-batches of prompts, left-padded (see the module docstring)."""

    def __init__(self, rows: PromptRows, batch_size: int, replicas: int, rank: int, accumulate: int, seed: int,
                 pad: int) -> None:
        super().__init__(rows, batch_size, replicas, rank, accumulate, seed)  # type: ignore[arg-type]
        self.pad = pad

    def __getitem__(self, index: tuple[int, int]) -> dict[str, torch.Tensor]:
        _, mine = self.placed(index)
        prompts = [self.rows.ids[i] for i in mine]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):], mask[row, width - len(prompt):] = torch.from_numpy(prompt), 1
        return {"input_ids": ids, "attention_mask": mask, "prompt_index": torch.from_numpy(mine.astype(np.int64))}


class PromptDataModule(pl.LightningDataModule):
    """GRPO's prompts from a JSON Lines file (see the module docstring).

    Args:
        path: a ``.jsonl`` file, one ``{"prompt": ..., <columns>}`` record per line.
        tokenizer: a Hugging Face tokenizer directory or name, or a :class:`~lightning_seqpar.data.tokenizer.Tokenizer`.
        batch_size: prompts per data-parallel rank and micro-batch (each gives G completions).
        max_prompt_length: a longer prompt is refused, naming its line.
        seed: the prompts' order each epoch is a permutation seeded by ``seed + epoch``.

    Attributes (after :meth:`setup`):
        prompts: each record's prompt as given; columns: ``{name: [value per record]}`` of every other key.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: in :meth:`setup`: a record without ``prompt``, a prompt of another type, messages without a
            chat template, records whose columns differ, a prompt longer than ``max_prompt_length``, a token id
            outside the model's vocabulary; each naming the file and line.
    """

    def __init__(self, path: str, tokenizer: Union[str, Tokenizer], batch_size: int = 2,
                 max_prompt_length: int = 512, seed: int = 0) -> None:
        super().__init__()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"No prompts at {self.path} (a .jsonl file of {{\"prompt\": ...}} records).")
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.batch_size, self.max_prompt_length, self.seed = batch_size, max_prompt_length, seed
        self.prompts: list[Any] = []
        self.columns: dict[str, list[Any]] = {}
        self.rows: Optional[PromptRows] = None

    def setup(self, stage: Optional[str] = None) -> None:
        if self.rows is not None:
            return
        ids, names = [], None
        for number, _, record in read_records(self.path):
            where = f"{self.path}:{number}"
            if not isinstance(record, dict) or "prompt" not in record:
                found = sorted(record) if isinstance(record, dict) else repr(record)
                raise ValueError(f"{where}: a GRPO record is {{\"prompt\": str | [messages], ...}} (other keys: the "
                                 f"rewards' columns); found {found}.")
            others = sorted(k for k in record if k != "prompt")
            if names is None:
                names = others
                self.columns = {k: [] for k in names}
            if others != names:
                raise ValueError(f"{where}: columns {others}, where the first record has {names}: every record "
                                 f"carries the same columns.")
            ids.append(self._rendered(record["prompt"], where))
            self.prompts.append(record["prompt"])
            for k in names:
                self.columns[k].append(record[k])
        self.rows = PromptRows(ids)
        vocab = getattr(self.trainer.lightning_module, "vocab_size", None) if self.trainer is not None else None
        largest = max(int(p.max()) for p in ids) if ids else -1
        if vocab is not None and largest >= vocab:
            raise ValueError(f"{self.path} rendered to token id {largest}, but the model's vocabulary has {vocab} ids: "
                             f"the tokenizer ({self.tokenizer.name}) is not the model's.")

    def _rendered(self, prompt: Any, where: str) -> np.ndarray:
        if isinstance(prompt, str):
            rendered = self.tokenizer.encode_batch([prompt])[0]
        elif isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
            hf = getattr(self.tokenizer, "tokenizer", None)
            if not getattr(hf, "chat_template", None):
                raise ValueError(f"{where}: a conversational prompt, but the tokenizer ({self.tokenizer.name}) has no "
                                 f"chat template. Give the prompt as text, or use a chat model's tokenizer.")
            rendered = np.asarray(hf.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                         return_dict=True)["input_ids"], dtype=np.int64)
        else:
            raise ValueError(f"{where}: prompt is a {type(prompt).__name__}; a text or a list of messages "
                             f"({{\"role\", \"content\"}}).")
        if len(rendered) == 0 or len(rendered) > self.max_prompt_length:
            raise ValueError(f"{where}: the prompt renders to {len(rendered)} tokens; between 1 and "
                             f"grpo.max_prompt_length={self.max_prompt_length}.")
        return rendered

    def train_dataloader(self) -> Any:
        """This rank's micro-batches (a ``StatefulDataLoader``: resuming mid-epoch continues with the next one)."""
        from torchdata.stateful_dataloader import StatefulDataLoader

        assert self.rows is not None
        replicas, rank, accumulate = loader_place(self.trainer)
        seed = self.seed + int(os.environ.get("PL_GLOBAL_SEED", 0))
        batches = PromptBatches(self.rows, self.batch_size, replicas, rank, accumulate, seed,
                                int(self.tokenizer.separator[-1]))
        return StatefulDataLoader(batches, batch_size=None, sampler=batches.sampler())

    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode([int(i) for i in ids])
