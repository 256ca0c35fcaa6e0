"""Hugging Face models: everything that knows transformers' layouts or needs ``transformers`` / ``safetensors``
(the ``[hf]`` extra), which are imported only in this folder and only when used.

- :mod:`.layouts`: decoder blocks of the Llama and GPT-2 layouts recognized by structure, as
  :class:`~lightning_seqpar.DeclaredBlockPolicy` objects read off each block's config.
- :mod:`.weights`: safetensors files and Hugging Face checkpoint directories, read lazily (each rank only its rows)
  and written.
- :mod:`.models`: causal LMs built from a config or a pretrained directory.
"""
