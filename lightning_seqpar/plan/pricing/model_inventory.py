"""A model's parameters and sizes as the planner prices them: every parameter's single-device shape and how the
strategy splits it (:class:`ParameterEntry`), and the sizes the activation and FLOPs models read
(:class:`ModelInventory`). Data only: it is read off a rewritten model by :mod:`..measuring.inventory` (whose docstring
says what each split means), and kept on disk by :mod:`..measuring.inventory_record`.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, TypeVar

from lightning_seqpar.parallel.split_sizes import padded_size

Split = Literal["column", "row", "vocab", "replicated", "expert", "expert_width"]
Part = Literal["layer", "embedding", "head", "final", "other"]


@dataclass(frozen=True)
class ParameterEntry:
    """One parameter of the single-device model.

    Attributes:
        name: its state-dict key.
        shape: its single-device shape.
        split: how tensor parallelism splits it (see the module docstring).
        part: ``layer`` (with :attr:`layer` its index), ``embedding`` (first stage), ``head`` / ``final`` (last
            stage), ``other`` (every stage).
        layer: the decoder layer's index, for ``part == "layer"``.
        tied: the embedding and head share it (held by the first and the last stage).
        trainable: ``requires_grad``; a frozen parameter (LoRA's base) has no gradient and no optimizer state.
        deferred: its gradient is one a split backward (ZB-H1, ZB-V, DualPipeV) leaves to W: a trained weight of a
            column- or row-parallel linear or of the experts (:func:`~lightning_seqpar.tensor_parallel.split_backward.
            split_weight_gradients`); not a LoRA adapter's, nor a frozen one's.
    """

    name: str
    shape: tuple[int, ...]
    split: Split
    part: Part
    layer: Optional[int] = None
    tied: bool = False
    trainable: bool = True
    deferred: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def expert(self) -> bool:
        """Whether it is an expert's (split over ``ep``, its replicas the expert data-parallel group)."""
        return self.split in ("expert", "expert_width")

    def local_numel(self, t: int, ep: int = 1, expert_tp: int = 1) -> int:
        """Elements on one rank of ``t`` tensor-parallel, ``ep`` expert-parallel and ``expert_tp`` expert
        tensor-parallel ranks (every rank holds the same number: vocabulary padding rows are stored; an expert weight
        is split over ``ep``, and over ``expert_tp`` along its width)."""
        if self.split == "expert":
            return self.numel // ep
        if self.split == "expert_width":
            return self.numel // (ep * expert_tp)
        if self.split == "vocab":
            return padded_size(self.shape[0], t) // t * (self.numel // self.shape[0])
        if self.split in ("column", "row"):
            return self.numel // t
        return self.numel


@dataclass(frozen=True)
class ExpertShape:
    """The mixture of experts of each layer (the same in every layer the planner accepts).

    Attributes:
        num_experts: E, routed experts per layer.
        top_k: k, experts each token is routed to.
        expert_ffn: f_e, each expert's MLP width.
        shared_ffn: the width of the dense MLP every token also goes through (Qwen2-MoE, GLM-4.5); 0: none.
    """

    num_experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int = 0


@dataclass(frozen=True)
class SplitProjection:
    """A projection of the sampled layer whose weight gradient a split backward defers to W (what W reads of it:
    :func:`~lightning_seqpar.plan.pricing.activations.weight_gradient_bytes`).

    Attributes:
        kind: ``"column"`` (its output split over tp) or ``"row"`` (its input split).
        group: ``"attention"`` or ``"mlp"``: the column-parallel projections of a group read one input.
        width: single-device width of its split side, the output (column) or the input (row).
        rank: r of the LoRA adapter trained on it (its base frozen); 0 where the weight itself is trained.
    """

    kind: str
    group: str
    width: int
    rank: int = 0


T = TypeVar("T")


@dataclass
class ModelInventory:
    """A model's parameters (:class:`ParameterEntry`) and the sizes the activation and FLOPs models read.

    Attributes:
        name: the model's class or preset name.
        entries: every unique parameter, in the model's order.
        num_layers, hidden_size, num_heads, num_kv_heads, head_dim, ffn_hidden_size, vocab_size: L, h, a, g, d, f, v;
            under a mixture of experts ``f = k·f_e + f_shared``, the MLP width each token goes through (its FLOPs and
            the rows it keeps for backward).
        gated_mlp: three ``h × f`` matrices (SwiGLU) instead of two.
        attention_dropout: the attention-probability dropout (a mask is kept only when > 0).
        eager_attention: the explicit core attention (keeps ``a·s²`` probabilities unless recomputed) or a fused kernel.
    """

    name: str
    entries: list[ParameterEntry]
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    gated_mlp: bool
    attention_dropout: float = 0.0
    eager_attention: bool = True
    config: Any = None
    """the Hugging Face config the model was built from (what the activation probes copy)"""
    experts: Optional[ExpertShape] = None
    """each layer's mixture of experts; ``None``: dense MLPs"""
    training: Any = None
    """which parameters are trained (:class:`~lightning_seqpar.plan.measuring.trained.TrainedParts`: LoRA, frozen
    names), as the activation probes copy it; ``None``: every parameter"""
    sample_layer: int = 0
    """the index of the layer the shapes are read from (the first mixture of experts where dense layers lead)"""
    split_projections: tuple[SplitProjection, ...] = ()
    """the sampled layer's dense projections whose weight gradient W computes (none where nothing is deferred)"""
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def derived(self, key: tuple, compute: Callable[[], T]) -> T:
        """``compute()``, once per ``key`` for this inventory: a figure read off its entries alone (a rank's model-state
        bytes, the parameters a pipeline rank holds), which thousands of layouts sharing their grid and rank ask for
        again (a 70B question priced the same rank's state 50 000 times, walking 723 entries each time). The
        result is shared between the callers: an immutable value or one nobody changes."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    @functools.cached_property
    def probe_key(self) -> str:
        """What identifies the model to a cache of activation probes (its config, attention and which parameters are
        trained): two models never share a fit."""
        config = self.config
        text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
        trained = "" if self.training is None else f"|{self.training.key}"
        return hashlib.sha256(f"{self.name}|{self.eager_attention}|{text}{trained}".encode()).hexdigest()

    @property
    def num_trainable(self) -> int:
        """Single-device count of the parameters trained (``requires_grad``; LoRA's adapters, a partly frozen model's
        rest): those with gradients, main params and optimizer state."""
        return sum(e.numel for e in self.entries if e.trainable)

    @functools.cached_property
    def head_trained(self) -> bool:
        """Whether the LM head's weight is trained (its own, or the embedding tied to it): a frozen head (LoRA's)
        makes no weight gradient in backward."""
        return any(e.trainable for e in self.entries if e.part == "head" or e.tied)

    @functools.cached_property
    def frozen_gemm_elements(self) -> float:
        """Elements of the frozen weight matrices whose GEMMs run forward and backward but make no weight gradient
        (LoRA's base, a partly frozen model's rest): the layers', the head's and a tied embedding's (it is the head's
        weight), an expert's weighted by k/E (the tokens it sees). A step skips ``2 × tokens ×`` these FLOPs of
        Eq. 8's count; 0 when every weight is trained."""
        experts = self.experts
        return sum(e.numel * (experts.top_k / experts.num_experts if e.expert and experts is not None else 1.0)
                   for e in self.entries if not e.trainable and len(e.shape) >= 2
                   and (e.part in ("layer", "head") or (e.part == "embedding" and e.tied)))

    @functools.cached_property
    def weight_gradient_share(self) -> float:
        """W's share of a layer's weight-gradient FLOPs under a split backward (ZB-H1, ZB-V, DualPipeV): the deferred
        weights' elements over all the layer's matrices (each GEMM's FLOPs are its weight's elements × the tokens
        through it: an expert's weighted by k/E, the tokens it sees). 1 when every weight is trained; LoRA's
        adapters over their frozen bases, ``r·(in + out) / (in·out)`` each, near 0; 0 with nothing deferred."""
        def flops(e: ParameterEntry) -> float:
            experts = self.experts
            return e.numel * (experts.top_k / experts.num_experts if e.expert and experts is not None else 1.0)

        layer = [e for e in self.entries if e.part == "layer" and e.layer == self.sample_layer and len(e.shape) >= 2]
        total = sum(flops(e) for e in layer)
        return sum(flops(e) for e in layer if e.deferred) / total if total else 0.0

    @property
    def num_parameters(self) -> int:
        """Single-device parameter count (a tied weight once)."""
        return sum(e.numel for e in self.entries)

    @property
    def tied_embeddings(self) -> bool:
        return any(e.tied for e in self.entries)
