"""Language-model data: the built-in corpus, text and JSON Lines tokenized with a model's tokenizer into a
memory-mapped token cache, and token files.

- :mod:`.corpus`: documents read from files and folders, a piece at a time.
- :mod:`.tokenizer`: UTF-8 bytes or a Hugging Face tokenizer, each with an identity.
- :mod:`.token_file` and :mod:`.cache`: the ``.tokens`` format (uint16/uint32 ids behind a header) and the cache
  built once and reused.
- :mod:`.blocks` and :mod:`.datamodule`: blocks of ``block_size`` tokens and the LightningDataModule.
"""

from lightning_seqpar.data.blocks import BlockDataset, TokenSource
from lightning_seqpar.data.cache import ensure_token_cache
from lightning_seqpar.data.corpus import builtin_corpus
from lightning_seqpar.data.datamodule import TextDataModule
from lightning_seqpar.data.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer, load_tokenizer

__all__ = ["BYTE_VOCAB_SIZE", "BlockDataset", "ByteTokenizer", "TextDataModule", "TokenSource", "builtin_corpus",
           "ensure_token_cache", "load_tokenizer"]
