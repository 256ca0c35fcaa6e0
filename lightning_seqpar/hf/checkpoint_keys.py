"""The names a Hugging Face checkpoint stores its tensors under, read as the model's state-dict keys.

transformers 5 renames some checkpoints' keys when it loads them: GPT-NeoX's head is the model's ``lm_head`` but
``save_pretrained`` (and every Pythia on the Hub) stores it as ``embed_out``; older checkpoints keep legacy names.
Reading a directory into the shards without ``from_pretrained`` must rename the same way, or a checkpoint that
``from_pretrained`` loads is refused as missing keys. The renamings are the model's own
(``transformers.conversion_mapping.get_model_conversion_mapping``, which PEFT uses too); a key that transformers would
also convert (merge, split or permute: mixture-of-experts checkpoints) is refused by name, since a rename alone would
load it wrong. transformers is imported here, when called.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from lightning_seqpar.transformer.lora import peft_key_mapping


def checkpoint_key_renamer(model: Any) -> Optional[Callable[[str], str]]:
    """A function from a key stored in ``model``'s checkpoint to ``model``'s state-dict key, or ``None`` when ``model``
    is not a transformers model or its family stores its keys as they are.

    Raises (from the returned function):
        ValueError: a stored key that transformers converts beyond a rename, naming the key and the fix.
    """
    peft = peft_key_mapping(model) if model is not None else None
    if peft is not None:  # a PEFT-wrapped model: the base model's renamings, then PEFT's names (base_layer)
        base = checkpoint_key_renamer(model.get_base_model())
        return lambda key: peft.get(base(key) if base is not None else key, key)
    if getattr(model, "config", None) is None or not hasattr(model, "base_model_prefix"):
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:  # an older transformers: it renames nothing on load either
        return None
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    if not transforms:
        return None

    def rename(key: str) -> str:
        for renaming in renamings:
            key, _ = renaming.rename_source_key(key)
        for converter in converters:
            if converter.rename_source_key(key)[1] is not None:
                raise ValueError(
                    f"The checkpoint stores '{key}' in a layout transformers converts when loading "
                    f"{type(model).__name__} (not only renames), which reading into tensor-parallel shards does not "
                    f"do. Load it once with from_pretrained and save_pretrained it again, then start from that "
                    f"directory.")
        return key

    return rename
