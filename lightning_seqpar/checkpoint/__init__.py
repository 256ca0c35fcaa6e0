"""Checkpoints that no rank has to hold whole: sharded, resharding, atomic.

- :mod:`.sharded`: the model's and optimizers' shards described to ``torch.distributed.checkpoint`` by
  single-device name, global shape and offset (``ShardSpec``'s DCP view,
  :mod:`lightning_seqpar.tensor_parallel.sharding`), so any layout loads any other.
- :mod:`.trainer_checkpoint`: a Lightning checkpoint as such a directory plus ``trainer_state.pt``.
- :mod:`.writer` and :mod:`.atomic`: written by every rank in parallel, published atomically, optionally
  in the background.
- :mod:`.checks`: shapes, keys and finiteness of what is loaded, refused on every rank together.
- :mod:`.full_state`: the single-file format's gathered single-device model and optimizer state.
- :mod:`.safe_reader`: the DCP index read with an allowlist, never an arbitrary unpickle.
- :mod:`.consolidate` and ``python -m lightning_seqpar.checkpoint consolidate CKPT_DIR OUT``: the
  single-device state dict, without a process group.
- :mod:`.hf_export` (collective, from the live model) and :mod:`.hf_from_checkpoint` (``export-hf``, one process,
  from a checkpoint): a Hugging Face directory ``from_pretrained`` loads.
"""

from lightning_seqpar.checkpoint.consolidate import (
    consolidate, consolidate_to_safetensors, load_state_dict_file, write_state_dict,
)
from lightning_seqpar.checkpoint.sharded import is_sharded_checkpoint

__all__ = ["consolidate", "consolidate_to_safetensors", "is_sharded_checkpoint", "load_state_dict_file", "write_state_dict"]
