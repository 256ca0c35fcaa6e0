"""The language-model data module: a corpus (text, JSON Lines, token files) in blocks of ``block_size`` tokens."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_seqpar.checkpoint.content import spread_digests
from lightning_seqpar.data.blocks import BlockDataset, TokenSource
from lightning_seqpar.data.cache import cache_path, ensure_token_cache, tokenize_documents, wait_for_token_cache
from lightning_seqpar.data.corpus import Piece, builtin_corpus, corpus_files
from lightning_seqpar.data.global_order import GlobalOrderSampler
from lightning_seqpar.data.step_batches import loader_place
from lightning_seqpar.data.token_file import body_damage, first_at_or_above, largest_id, open_bin, read_header
from lightning_seqpar.data.tokenizer import BYTES, Tokenizer, has_tokenizer, load_tokenizer

UINT16_IDS = 2**16


class TextDataModule(pl.LightningDataModule):
    """Train/validation split of a corpus into blocks of ``block_size`` tokens.

    Corpora (``path``):

    - ``None``: the Python reference documentation that ships with CPython (:func:`~.corpus.builtin_corpus`).
    - a text file, a ``.jsonl`` file (one document per line, the string under ``text_field``) or a folder of them:
      tokenized by ``tokenizer`` once, by each node's local rank 0 in ``setup`` while the node's other ranks wait for
      the file (no collective, so no timeout but ``stall_timeout``), into a token cache beside the corpus or in
      ``cache_dir`` (:mod:`~lightning_seqpar.data.cache`) that later runs reuse; documents are joined
      with the tokenizer's end-of-text token.
    - a ``.tokens`` cache, or a headerless ``.bin`` of ``token_dtype`` ids (nanoGPT's uint16 format).

    Token files are memory-mapped: every rank reads the same page cache, none holds the corpus.

    The training loader is torchdata's ``StatefulDataLoader``: its position is part of Lightning's checkpoints, so
    resuming mid-epoch continues with the exact next batch, at any data-parallel size (its sampler's position is the
    global sample index, :mod:`~lightning_seqpar.data.global_order`).

    Checked at ``setup``, before training, against the LightningModule's ``vocab_size`` (and ``tokenizer_path``,
    when it has them): ids at or above the model's vocabulary; a uint16 ``.bin`` for a vocabulary above 65 536;
    UTF-8 bytes fed by default to a model that has a tokenizer (``tokenizer="bytes"`` states that you mean it).

    Args:
        path: the corpus (see above).
        block_size: s, tokens per sample.
        batch_size: samples per data-parallel rank and step (b).
        val_fraction: share of the corpus (its tail) held out for validation.
        num_workers: DataLoader workers.
        vocab_size: a ``.bin`` corpus's vocabulary (default: the largest id + 1). Other corpora know theirs.
        tokenizer: ``"bytes"`` (UTF-8 bytes, vocabulary 256: the default for text), a Hugging Face tokenizer
            directory or name (``AutoTokenizer``), or a :class:`~lightning_seqpar.data.tokenizer.Tokenizer`. With a token file it decodes samples (a ``.tokens`` cache must have
            been made by it).
        text_field: the field of a JSON Lines record holding its text.
        cache_dir: where token caches go (default: beside the corpus).
        token_dtype: ``"uint16"`` or ``"uint32"``: the ids of a ``.bin`` file.
        stall_timeout: seconds the other ranks wait for the cache without seeing its writer make progress.

    Raises:
        FileNotFoundError: no corpus at ``path``.
        ValueError: ``val_fraction`` outside (0, 1); ``vocab_size`` given where the corpus or tokenizer fixes it, or
            below the largest id of a ``.bin``; a ``.bin`` dtype that cannot hold ``vocab_size``; a ``.tokens`` file
            made by another tokenizer than ``tokenizer``; a tokenizer directory without a tokenizer.
    """

    def __init__(self, path: Optional[str] = None, block_size: int = 128, batch_size: int = 8,
                 val_fraction: float = 0.05, num_workers: int = 0, vocab_size: Optional[int] = None,
                 tokenizer: Union[str, Tokenizer, None] = None, text_field: str = "text", cache_dir: Optional[str] = None,
                 token_dtype: str = "uint16", stall_timeout: float = 300.0) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}.")
        self.path = None if path is None else Path(path)
        self.block_size, self.batch_size = block_size, batch_size
        self.val_fraction, self.num_workers = val_fraction, num_workers
        self.text_field, self.cache_dir = text_field, None if cache_dir is None else Path(cache_dir)
        self.stall_timeout = stall_timeout
        self.tokenizer_explicit = tokenizer is not None
        if self.path is not None and not self.path.exists():
            raise FileNotFoundError(f"No corpus at {self.path}.")
        suffix = self.path.suffix if self.path is not None and self.path.is_file() else ""
        self.tokenizer: Optional[Tokenizer] = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.max_id: Optional[int] = None
        if suffix == ".tokens":
            self.kind = "tokens"
            header = read_header(self.path)
            damage = body_damage(self.path, header)
            if damage is not None:
                raise ValueError(f"{self.path}: {damage}. Given as a .tokens file, it cannot be rebuilt here (its "
                                 f"corpus is not named): tokenize the text again (data.path=TEXT).")
            self._refuse_vocab_size(vocab_size, header.vocab_size, f"the cache {self.path.name} records it")
            if self.tokenizer is not None and self.tokenizer.identity != header.tokenizer_identity:
                raise ValueError(f"{self.path} was tokenized by {header.tokenizer} (identity "
                                 f"{header.tokenizer_identity}), not by {self.tokenizer.name} "
                                 f"({self.tokenizer.identity}): its ids mean other tokens. Tokenize the text with "
                                 f"this tokenizer (data.path=TEXT), or use the tokenizer that made it.")
            self.vocab_size, self.max_id, self.token_dtype = header.vocab_size, header.max_id, header.dtype
        elif suffix == ".bin":
            self.kind, self.token_dtype = "bin", token_dtype
            why = "data.vocab_size"
            if self.tokenizer is not None:
                self._refuse_vocab_size(vocab_size, self.tokenizer.vocab_size, f"the tokenizer {self.tokenizer.name} "
                                        f"has that many ids")
                vocab_size, why = self.tokenizer.vocab_size, f"the tokenizer {self.tokenizer.name}'s"
            ids = open_bin(self.path, token_dtype)
            limit = np.iinfo(np.dtype(token_dtype)).max + 1
            if vocab_size is not None and vocab_size > limit:
                raise ValueError(f"{self.path} holds {token_dtype} ids, which cannot name a vocabulary of {vocab_size} "
                                 f"({why}; {token_dtype} names {limit}). If the file holds uint32 ids, set "
                                 f"data.token_dtype=uint32; or give the text and the tokenizer (data.path=TEXT), whose "
                                 f"cache stores ids wide enough.")
            self.max_id = largest_id(ids)
            if vocab_size is not None and self.max_id >= vocab_size:
                raise ValueError(f"{self.path} holds token id {self.max_id} (first out-of-range id at position "
                                 f"{first_at_or_above(ids, vocab_size)}), not below data.vocab_size={vocab_size}. Set "
                                 f"data.vocab_size to the tokenizer's vocabulary size, or check the file.")
            self.vocab_size = vocab_size if vocab_size is not None else self.max_id + 1
        else:
            self.kind, self.token_dtype = "text", None
            if self.tokenizer is None:
                self.tokenizer = load_tokenizer(BYTES)
            self._refuse_vocab_size(vocab_size, self.tokenizer.vocab_size,
                                    f"the tokenizer {self.tokenizer.name} has that many ids")
            self.vocab_size = self.tokenizer.vocab_size
        self.source: Optional[TokenSource] = None

    @staticmethod
    def _refuse_vocab_size(given: Optional[int], actual: int, why: str) -> None:
        if given is not None and given != actual:
            raise ValueError(f"data.vocab_size={given} cannot apply: the vocabulary is {actual} ({why}). Leave "
                             f"data.vocab_size unset (it is for headerless .bin files).")

    @property
    def is_bytes(self) -> bool:
        """Whether the ids are UTF-8 bytes."""
        return self.tokenizer is not None and self.tokenizer.name == BYTES

    def cache_path(self) -> Optional[Path]:
        """The token cache a text corpus is read from (``None`` for the built-in corpus and token files)."""
        if self.kind != "text" or self.path is None:
            return None
        assert self.tokenizer is not None
        return cache_path(self.path, self.tokenizer, self.cache_dir)

    def setup(self, stage: Optional[str] = None) -> None:
        """Map the ids, split them, and check them against the model (see the class)."""
        if self.source is None:
            self.source = self._open_source()
        ids = self.source.open()
        module = self.trainer.lightning_module if self.trainer is not None else None
        if module is not None:
            self.check_model(getattr(module, "vocab_size", None), getattr(module, "tokenizer_path", None))
        split = int(ids.shape[0] * (1 - self.val_fraction))
        self.train_set = BlockDataset(self.source, 0, split, self.block_size, "training")
        self.val_set = BlockDataset(self.source, split, ids.shape[0], self.block_size, "validation")

    def _open_source(self) -> TokenSource:
        """Where the ids are; for text, the cache made (or waited for) now, and its largest id."""
        if self.kind == "tokens":
            return TokenSource(self.path, "tokens")
        if self.kind == "bin":
            return TokenSource(self.path, "bin", self.token_dtype)
        if self.path is None:  # the built-in corpus: ~465 kB, tokenized in memory
            assert self.tokenizer is not None
            pieces = iter([Piece(builtin_corpus(), ends_document=True)])
            ids = np.concatenate(list(tokenize_documents(pieces, self.tokenizer)))
            self.max_id = int(ids.max())
            return TokenSource(kind="memory", array=ids.astype(np.int32))
        assert self.tokenizer is not None and self.path is not None
        if self.trainer is not None:  # each file of the corpus hashed by one rank, for the cache's identity
            spread_digests(corpus_files(self.path))
        if self.trainer is None or self.trainer.local_rank == 0:
            path = ensure_token_cache(self.path, self.tokenizer, self.cache_dir, self.text_field)
        else:  # not Lightning's prepare_data: its barrier never times out, so a stalled rank would hang the job
            path = wait_for_token_cache(self.path, self.tokenizer, self.cache_dir, self.text_field, self.stall_timeout)
        self.max_id = read_header(path).max_id
        return TokenSource(path, "tokens")

    def check_model(self, model_vocab_size: Optional[int], model_tokenizer: Optional[str] = None) -> None:
        """Refuse ids the model cannot embed, token files too narrow for its vocabulary, and byte text fed by default
        to a model that has a tokenizer.

        Raises:
            ValueError: naming the value and the fix.
        """
        if self.is_bytes and not self.tokenizer_explicit and has_tokenizer(model_tokenizer):
            raise ValueError(f"The corpus is read as UTF-8 bytes, but the model has a tokenizer ({model_tokenizer}): "
                             f"its token ids are not bytes. Tokenize with it (data.tokenizer={model_tokenizer}; the "
                             f"recipe does so by default for model=hf_pretrained), or set data.tokenizer=bytes to "
                             f"train on bytes anyway.")
        if self.is_bytes and not self.tokenizer_explicit and model_tokenizer is not None and self.kind == "text":
            raise ValueError(f"The model directory {model_tokenizer} holds no tokenizer, so the corpus would be read as "
                             f"UTF-8 bytes (ids 0..255), which are not the ids the pretrained model was trained on. Name "
                             f"the model's tokenizer with data.tokenizer=DIR, or set data.tokenizer=bytes to train on "
                             f"bytes anyway.")
        if model_vocab_size is None:
            return
        if self.kind == "bin" and self.token_dtype == "uint16" and model_vocab_size > UINT16_IDS:
            raise ValueError(f"{self.path} holds uint16 ids, which cannot name the model's {model_vocab_size} tokens: "
                             f"it was made by another tokenizer, or holds uint32 ids (set data.token_dtype=uint32). "
                             f"Tokenize the text with the model's tokenizer instead (data.path=TEXT).")
        if self.max_id is not None and self.max_id >= model_vocab_size:
            where = ""
            if self.source is not None:
                where = f" (first at or above it at position {first_at_or_above(self.source.open(), model_vocab_size)})"
            raise ValueError(f"The corpus {self.path or '(built-in)'} holds token id {self.max_id}{where}, but the "
                             f"model's vocabulary has {model_vocab_size} ids (0..{model_vocab_size - 1}). Use the "
                             f"tokenizer the model was trained with, or a model whose vocab_size is at least "
                             f"{self.max_id + 1}.")

    def decode(self, ids: Tensor) -> str:
        """Text of ``ids`` ``[n]`` by the tokenizer; a token file without one is written out as ids ``"[464 3 ...]"``."""
        if self.tokenizer is not None:
            return self.tokenizer.decode([int(i) for i in ids.tolist()])
        return "[" + " ".join(str(int(t)) for t in ids.tolist()) + "]"

    def prompt(self, text: str, max_tokens: int = 8) -> Tensor:
        """Token ids ``[n]`` to start generating from: ``text`` tokenized (the end-of-text token when it is empty);
        for a token file without a tokenizer, the first ``max_tokens`` ids of the validation split."""
        if self.tokenizer is not None:
            ids = list(self.tokenizer.encode_batch([text])[0]) if text else []
            return torch.tensor(ids or self.tokenizer.separator[-1:], dtype=torch.long)
        if self.source is None:
            self.source = self._open_source()
        ids = self.source.open()
        split = int(ids.shape[0] * (1 - self.val_fraction))
        return torch.from_numpy(np.asarray(ids[split:split + max_tokens], dtype=np.int64))

    def train_dataloader(self) -> DataLoader:
        """Shuffled blocks; a ``StatefulDataLoader``, whose position Lightning saves in checkpoints, so a run
        resumed mid-epoch continues with the exact next batch.

        The sampler is made here (:class:`~lightning_seqpar.data.global_order.GlobalOrderSampler`, with the
        strategy's data-parallel size and rank and Lightning's seed): its saved position is the global sample
        index, so a run resumed at another data-parallel size, batch size or accumulation continues at the same
        sample (Lightning's injected ``DistributedSampler`` would restore rank 0's own count under any size, and as a
        batch sampler torchdata 0.11 would count it in samples, not batches).
        """
        replicas, rank, accumulate = loader_place(self.trainer)
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # what Lightning's own sampler would use
        sampler = GlobalOrderSampler(self.train_set, replicas, rank, seed, self.batch_size * replicas * accumulate)
        return _stateful_loader(self.train_set, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                                num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        """Blocks of the held-out tail, in order."""
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, drop_last=True,
                          num_workers=self.num_workers)


def _stateful_loader(dataset: Dataset, **kwargs: Any) -> DataLoader:
    # torchdata is imported here, not with the package: only the data module needs it.
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(dataset, **kwargs)
