"""Hugging Face models: everything that knows transformers' layouts or needs ``transformers`` / ``safetensors``
(the ``[hf]`` extra), which are imported only in this folder and only when used.

- :mod:`.layouts`: decoder blocks of the Llama, GPT-2, GPT-NeoX and Falcon layouts recognized by structure, as
  :class:`~lightning_seqpar.DeclaredBlockPolicy` objects read off each block's config (Falcon's in :mod:`.falcon`).
- :mod:`.checkpoint_keys`: a checkpoint's stored names as the model's keys (transformers' own renamings).
- :mod:`.vocabulary`: the embedding, LM head and loss split over the vocabulary (``labels=`` never builds
  ``[b, s, v]`` logits; ``.logits`` gathered when read).
- :mod:`.init`: the models' own initializers, for building them on the meta device.
- :mod:`.weights`: safetensors files and Hugging Face checkpoint directories, read lazily (each rank only its rows)
  and written.
- :mod:`.models`: causal LMs built from a config or a pretrained directory.
- :mod:`.tokenizer`: a model's tokenizer as the data pipeline uses it (:mod:`lightning_seqpar.data`).
"""
