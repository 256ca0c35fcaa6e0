"""Which transformer layers each pipeline stage holds.

With p pipeline ranks and v model chunks per rank there are ``p·v`` *virtual stages*. In the ``"loop"`` placement
virtual stage ``k`` runs on pipeline rank ``k mod p`` as its chunk ``k // p`` (Narayanan et al. 2021 §2.2, the
interleaved layout of Megatron-LM); with ``v = 1`` this is the plain contiguous split. In the ``"V"`` placement
(``v = 2``: ZB-V, Qi et al. 2024 §4; DualPipeV) rank r holds stages r and ``2p − 1 − r``: the activations go down
the ranks and come back up, so stage ``p − 1`` hands its output to stage p on the same rank, and the first and the last stage
(the embedding and the loss) share rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence

StagePlacement = Literal["loop", "V"]
PLACEMENTS = ("loop", "V")


@dataclass(frozen=True)
class StageLayout:
    """Layers per virtual stage.

    Attributes:
        pp: pipeline-parallel size p.
        virtual_stages: model chunks per pipeline rank v.
        sizes: number of layers of each virtual stage, in model order (length ``p·v``).
        placement: which rank runs which virtual stage: ``"loop"`` (round robin) or ``"V"`` (two chunks per rank,
            the second in reverse order).
    """

    pp: int
    virtual_stages: int
    sizes: tuple[int, ...]
    placement: StagePlacement = "loop"

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"A stage placement is one of {PLACEMENTS}, got {self.placement!r}.")
        if self.placement == "V" and self.virtual_stages != 2:
            raise ValueError(f"The V placement holds two model chunks per rank; got virtual_stages="
                             f"{self.virtual_stages}. Use virtual_stages=2.")

    @classmethod
    def build(cls, num_layers: int, pp: int, virtual_stages: int = 1, split: Optional[Sequence[int]] = None,
              placement: StagePlacement = "loop") -> "StageLayout":
        """A balanced split of ``num_layers`` (L) layers, or the explicit ``split`` (layers per virtual stage), placed
        on the ranks as ``placement`` says.

        Raises:
            ValueError: ``p·v`` exceeds L (interleaving needs at least one layer per virtual stage);
                L not divisible by ``p·v`` without an explicit split; an explicit split of the wrong
                length, with an empty stage, or not summing to L; an unknown placement, or ``"V"`` with
                ``virtual_stages != 2``.
        """
        stages = pp * virtual_stages
        if split is not None:
            split = tuple(int(n) for n in split)
            if len(split) != stages or any(n < 1 for n in split) or sum(split) != num_layers:
                raise ValueError(
                    f"pipeline_split={list(split)} must give {stages} positive layer counts (pp={pp} × "
                    f"virtual_stages={virtual_stages}) that sum to the model's {num_layers} layers."
                )
            return cls(pp, virtual_stages, split, placement)
        if stages > num_layers:
            raise ValueError(
                f"pp={pp} × virtual_stages={virtual_stages} = {stages} pipeline stages need at least {stages} "
                f"transformer layers; the model has {num_layers}. Lower pp or virtual_stages, or add layers."
            )
        if num_layers % stages:
            raise ValueError(
                f"{num_layers} transformer layers do not divide into {stages} equal pipeline stages "
                f"(pp={pp} × virtual_stages={virtual_stages}). Choose pp·virtual_stages among the divisors of "
                f"{num_layers}, or pass pipeline_split=[...] with the layers of each stage."
            )
        return cls(pp, virtual_stages, (num_layers // stages,) * stages, placement)

    @property
    def num_stages(self) -> int:
        """Virtual stages ``p·v``."""
        return len(self.sizes)

    @property
    def num_layers(self) -> int:
        """L."""
        return sum(self.sizes)

    def bounds(self, stage: int) -> tuple[int, int]:
        """``(first layer, one past the last layer)`` of virtual stage ``stage``."""
        start = sum(self.sizes[:stage])
        return start, start + self.sizes[stage]

    def stage_of_layer(self, layer: int) -> int:
        """The virtual stage holding layer ``layer``."""
        end = 0
        for stage, size in enumerate(self.sizes):
            end += size
            if layer < end:
                return stage
        raise IndexError(f"Layer {layer} is outside the model's {self.num_layers} layers.")

    def rank_of(self, stage: int) -> int:
        """Pipeline rank running virtual stage ``stage``."""
        return rank_of_stage(stage, self.pp, self.placement)

    def stage(self, rank: int, chunk: int) -> int:
        """Virtual stage of model chunk ``chunk`` on pipeline rank ``rank``."""
        return stage_of_chunk(rank, chunk, self.pp, self.placement)

    def stages_of(self, rank: int) -> list[int]:
        """Virtual stages held by pipeline rank ``rank``, chunk by chunk."""
        return [self.stage(rank, c) for c in range(self.virtual_stages)]


def stage_of_chunk(rank: int, chunk: int, pp: int, placement: StagePlacement = "loop") -> int:
    """Virtual stage of model chunk ``chunk`` on pipeline rank ``rank`` of ``pp`` under ``placement``."""
    if placement == "V" and chunk == 1:
        return 2 * pp - 1 - rank
    return chunk * pp + rank


def rank_of_stage(stage: int, pp: int, placement: StagePlacement = "loop") -> int:
    """Pipeline rank of ``pp`` running virtual stage ``stage`` under ``placement``."""
    if placement == "V" and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp
