"""A model's inventory as plain values, so the planner keeps it on disk beside the probes' fits
(:class:`~.fit_cache.FitCache`): a question asked again reads it instead of building the model on the meta device,
wrapping it with PEFT and rewriting it (most of a repeated answer's time for an 80-layer model).

What is kept is everything :func:`~.inventory.inventory_of_model` read from the model, and its trained parts as
values (the LoRA settings PEFT's config held after wrapping the model, the frozen names follow from the entries). The
Hugging Face config is not kept: the caller gives it again, from the config dict it loaded
(:func:`~.models.model_inventory`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, get_args

from lightning_seqpar.plan.pricing.model_inventory import (
    ExpertShape, ModelInventory, ParameterEntry, Part, Split, SplitProjection,
)


@dataclass(frozen=True)
class InventoryRecord:
    """:class:`~.inventory.ModelInventory` less its config, as JSON keeps it (tuples, scalars and the LoRA settings).

    Attributes:
        name: the inventory's name.
        entries: ``(name, shape, split, part, layer, tied, trainable, deferred)`` per
            :class:`~.inventory.ParameterEntry`.
        sizes: ``(L, h, a, g, d, f, v)``.
        gated_mlp, attention_dropout, eager_attention, sample_layer: the inventory's own.
        experts: ``(E, k, f_e, f_shared)``, or ``None`` for dense MLPs.
        split_projections: ``(kind, group, width, rank)`` per :class:`~.inventory.SplitProjection`.
        lora: the LoRA settings as JSON text (:meth:`~.trained.TrainedParts.lora_settings`), ``None`` without.

    Raises:
        ValueError: a value that is not what an inventory holds (a file from another version, or damaged: the caller
            builds the inventory again).
    """

    name: str
    entries: tuple
    sizes: tuple
    gated_mlp: bool
    attention_dropout: float
    eager_attention: bool
    sample_layer: int
    experts: Optional[tuple]
    split_projections: tuple
    lora: Optional[str] = None

    def __post_init__(self) -> None:
        self._parts()  # a record that cannot be read back is refused where it is read
        if self.lora is not None and not isinstance(json.loads(self.lora), dict):
            raise ValueError(f"LoRA settings {self.lora!r} in an inventory record")

    @classmethod
    def of(cls, inventory: ModelInventory) -> "InventoryRecord":
        experts, training = inventory.experts, inventory.training
        return cls(inventory.name,
                   tuple((e.name, e.shape, e.split, e.part, e.layer, e.tied, e.trainable, e.deferred)
                         for e in inventory.entries),
                   (inventory.num_layers, inventory.hidden_size, inventory.num_heads, inventory.num_kv_heads,
                    inventory.head_dim, inventory.ffn_hidden_size, inventory.vocab_size),
                   inventory.gated_mlp, inventory.attention_dropout, inventory.eager_attention, inventory.sample_layer,
                   None if experts is None else (experts.num_experts, experts.top_k, experts.expert_ffn,
                                                 experts.shared_ffn),
                   tuple((p.kind, p.group, p.width, p.rank) for p in inventory.split_projections),
                   None if training is None or training.lora is None else json.dumps(training.lora_settings()))

    def inventory(self, config: Any) -> ModelInventory:
        """The :class:`~.inventory.ModelInventory` recorded, with ``config``, the Hugging Face config it was built
        from.

        Raises:
            ImportError: LoRA settings without PEFT installed.
        """
        from lightning_seqpar.plan.measuring.trained import TrainedParts, generic_name, lora_from_settings

        entries, sizes, experts, projections = self._parts()
        frozen = frozenset(generic_name(e.name) for e in entries if not e.trainable)
        lora = None if self.lora is None else lora_from_settings(json.loads(self.lora))
        return ModelInventory(str(self.name), entries, *sizes, gated_mlp=bool(self.gated_mlp),
                              attention_dropout=float(self.attention_dropout),
                              eager_attention=bool(self.eager_attention), config=config, experts=experts,
                              training=TrainedParts(lora, frozen) if lora is not None or frozen else None,
                              sample_layer=_count(self.sample_layer, "a layer index", 0),
                              split_projections=projections)

    def _parts(self) -> tuple[list[ParameterEntry], list[int], Optional[ExpertShape], tuple[SplitProjection, ...]]:
        """The entries, sizes, experts and split projections, checked.

        Raises:
            ValueError: a value of the wrong kind or range.
        """
        entries = [_entry(values) for values in self.entries]
        sizes = [_count(value, "a size") for value in self.sizes]
        if len(sizes) != 7 or not entries:
            raise ValueError(f"an inventory record with {len(sizes)} sizes and {len(entries)} entries")
        experts = None if self.experts is None else ExpertShape(*(_count(v, "an expert size", 0) for v in self.experts))
        projections = tuple(SplitProjection(str(kind), str(group), _count(width, "a width"), _count(rank, "a rank", 0))
                            for kind, group, width, rank in self.split_projections)
        return entries, sizes, experts, projections


def _count(value: Any, what: str, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{what} of {value!r} in an inventory record")
    return value


def _entry(values: Any) -> ParameterEntry:
    name, shape, split, part, layer, tied, trainable, deferred = values
    if split not in get_args(Split) or part not in get_args(Part) or not isinstance(name, str):
        raise ValueError(f"parameter entry {values!r} in an inventory record")
    return ParameterEntry(name, tuple(_count(size, "a dimension", 0) for size in shape), split, part,
                          None if layer is None else _count(layer, "a layer index", 0), bool(tied), bool(trainable),
                          bool(deferred))
