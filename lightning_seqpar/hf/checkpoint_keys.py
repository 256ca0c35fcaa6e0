"""The names a Hugging Face checkpoint stores its tensors under, read as the model's state-dict keys.

transformers 5 renames some checkpoints' keys when it loads them: GPT-NeoX's head is the model's ``lm_head`` but
``save_pretrained`` (and every Pythia on the Hub) stores it as ``embed_out``; older checkpoints keep legacy names.
Reading a directory into the shards without ``from_pretrained`` must rename the same way, or a checkpoint that
``from_pretrained`` loads is refused as missing keys. The renamings are the model's own
(``transformers.conversion_mapping.get_model_conversion_mapping``, which PEFT uses too). Mixture-of-experts checkpoints
store one tensor per expert (``mlp.experts.3.gate_proj.weight``) where the model packs them (``mlp.experts.gate_up_proj``
``[E, 2f, h]``): such a key is read as an :class:`ExpertPiece` of the packed weight, and
:class:`~lightning_seqpar.hf.weights.SafetensorsStateDict` reads each rank's experts only. A key that transformers
converts otherwise (split, permute) is refused by name, since a rename alone would load it wrong. transformers is
imported here, when called.
"""

from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple, Optional, Union

from lightning_seqpar.transformer.lora import peft_key_mapping


class ExpertPiece(NamedTuple):
    """One stored tensor of a packed expert weight: the hub's ``mlp.experts.3.up_proj.weight`` is expert 3's part 1
    (after ``gate_proj``, part 0) of the model's ``mlp.experts.gate_up_proj`` ``[E, 2f, h]``: the pieces are stacked
    over experts (dim 0) and each expert's parts concatenated along its rows (transformers' ``MergeModulelist(dim=0)``
    then ``Concatenate(dim=1)``)."""

    target: str
    expert: int
    part: int
    parts: int


Renamed = Union[str, ExpertPiece]


def _packs_experts(converter: Any) -> bool:
    """Whether ``converter`` only stacks per-expert tensors (``MergeModulelist(dim=0)``) and joins its source patterns
    along each expert's rows (``Concatenate(dim=1)``): the mixture-of-experts conversion the reader implements."""
    allowed = {"MergeModulelist": 0, "Concatenate": 1}
    return all(getattr(op, "dim", None) == allowed.get(type(op).__name__) for op in converter.operations) and all(
        pattern.count("*") == 1 for pattern in converter.source_patterns)


def _expert_piece(converter: Any, key: str, target: str, pattern: str) -> ExpertPiece:
    index = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), key)
    return ExpertPiece(target, int(index.group(1)), converter.source_patterns.index(pattern),
                       len(converter.source_patterns))


def checkpoint_key_renamer(model: Any) -> Optional[Callable[[str], Renamed]]:
    """A function from a key stored in ``model``'s checkpoint to ``model``'s state-dict key (or, for one expert's
    tensor of a packed expert weight, its :class:`ExpertPiece`), or ``None`` when ``model`` is not a transformers model
    or its family stores its keys as they are.

    Raises (from the returned function):
        ValueError: a stored key that transformers converts otherwise than a rename or the stacking of experts, naming
            the key and the fix.
    """
    peft = peft_key_mapping(model) if model is not None else None
    if peft is not None:  # a PEFT-wrapped model: the base model's renamings, then PEFT's names (base_layer)
        base = checkpoint_key_renamer(model.get_base_model())

        def through_peft(key: str) -> Renamed:
            renamed = base(key) if base is not None else key
            if isinstance(renamed, ExpertPiece):  # the packed weight's key as PEFT names it
                return renamed._replace(target=peft.get(renamed.target, renamed.target))
            return peft.get(renamed, key)

        return through_peft
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

    def rename(key: str) -> Renamed:
        for renaming in renamings:
            key, _ = renaming.rename_source_key(key)
        for converter in converters:
            target, pattern = converter.rename_source_key(key)
            if pattern is not None and _packs_experts(converter):
                return _expert_piece(converter, key, target, pattern)
            if pattern is not None:
                raise ValueError(
                    f"The checkpoint stores '{key}' in a layout transformers converts when loading "
                    f"{type(model).__name__} (not only renames), which reading into tensor-parallel shards does not "
                    f"do. Load it once with from_pretrained and save_pretrained it again, then start from that "
                    f"directory.")
        return key

    return rename


def expert_piece_names(model: Any) -> Optional[Callable[[str, int], Optional[list[list[str]]]]]:
    """The inverse of the packing :func:`checkpoint_key_renamer` reads: for a key of ``model``'s state dict and its
    number of experts E, the names the hub's checkpoints store its pieces under, ``[[expert 0's parts], ...]``
    (``mlp.experts.gate_up_proj`` → ``mlp.experts.{e}.gate_proj.weight`` and ``...up_proj.weight``, each ``[f, h]``);
    ``None`` for a key that is not packed. ``None`` for a model whose family packs nothing.
    """
    if getattr(model, "config", None) is None or not hasattr(model, "base_model_prefix"):
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter
    except ImportError:
        return None
    packing = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightConverter) and _packs_experts(t)]
    if not packing:
        return None

    def pieces(key: str, experts: int) -> Optional[list[list[str]]]:
        for converter in packing:
            target = converter.target_patterns[0]
            if len(converter.target_patterns) == 1 and key.endswith(target):
                stem = key[: len(key) - len(target)]
                return [[stem + source.replace("*", str(e)) for source in converter.source_patterns]
                        for e in range(experts)]
        return None

    return pieces


def hub_key_namer(model: Any) -> Optional[Callable[[str], str]]:
    """The inverse of the renamings :func:`checkpoint_key_renamer` reads: ``model``'s state-dict key → the key
    ``save_pretrained`` stores it under (GraniteMoE's ``block_sparse_moe.experts.gate_up_proj`` →
    ``block_sparse_moe.input_linear.weight``; Mixtral's ``mlp.`` → ``block_sparse_moe.``), as transformers'
    ``revert_weight_conversion`` renames: the model's mapping without legacy names or prefix changes, each renaming
    reversed, last first. ``None`` for a model whose family renames nothing.
    """
    if getattr(model, "config", None) is None or not hasattr(model, "base_model_prefix"):
        return None
    try:
        from transformers import core_model_loading
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return None
    prefix_change = getattr(core_model_loading, "PrefixChange", ())
    transforms = [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, prefix_change)]
    renamings = [t.reverse_transform() for t in transforms[::-1] if isinstance(t, core_model_loading.WeightRenaming)]
    if not renamings:
        return None

    def name(key: str) -> str:
        for renaming in renamings:
            key, _ = renaming.rename_source_key(key)
        return key

    return name
