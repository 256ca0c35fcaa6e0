"""A declaration of a transformer block as parts (:class:`BlockSpec`: an attention part and an MLP part, and how
they join the residual), and the checks that the declaration names every part the block has."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Optional, Union

import torch.nn as nn

from lightning_seqpar.transformer.attention_part import AttentionSpec
from lightning_seqpar.transformer.mlp_part import DenseMLPSpec
from lightning_seqpar.transformer.moe_part import MoESpec
from lightning_seqpar.transformer.paths import (  # noqa: F401  (resolve, value_of, out_features: re-exported)
    maybe_resolve, out_features, resolve, rotary_of, value_of,
)


ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")
_ATTENTION_FIELDS = {f.name for f in fields(AttentionSpec)}
_MLP_FIELDS = {f.name for f in fields(DenseMLPSpec)}


@dataclass(frozen=True, init=False)
class BlockSpec:
    """A transformer block as parts: which submodules of the user's block make its attention (:attr:`attention`, an
    :class:`~lightning_seqpar.transformer.attention_part.AttentionSpec`) and its MLP (:attr:`mlp`, a
    :class:`~lightning_seqpar.transformer.mlp_part.DenseMLPSpec`, or a mixture of experts,
    :class:`~lightning_seqpar.transformer.moe_part.MoESpec`), and how
    the block joins them to the residual stream (Megatron-Core's ``TransformerLayerSubmodules``).

    Declared nested, ``BlockSpec(AttentionSpec(...), DenseMLPSpec(...), residual_dropouts=...)``, or flat, each field of
    a part given by its name (``BlockSpec(attention_norm="ln_1", qkv="attn.c_attn", mlp_in="mlp.c_fc", ...)``;
    ``attention="sdpa"`` is the attention part's ``implementation``), which every declaration so far uses; flat fields
    given with a nested part change that part (``dataclasses.replace(spec, causal=True)``).

    Attributes:
        attention: the attention part's declaration (its norms, projections, heads, rotary, masks, soft-cap, window).
        mlp: the MLP part's declaration (its norms, projections, activation, inner dropout; or its router and
            experts).
        residual_dropouts: paths of the ``nn.Dropout`` after the attention and after the MLP output (0 or 2).
        transposed: the projections store their weights ``[in, out]`` (Hugging Face's ``Conv1D``, GPT-2); shards keep
            that layout, so state-dict shapes stay the original's.
        arguments: the names of the positional arguments the model passes after the hidden states, in order (GPT-2:
            ``("cache", "attention_mask", "encoder_hidden_states")``); default none, every other argument by keyword
            (:mod:`lightning_seqpar.transformer.block_arguments`); any other argument that is not ``None`` is refused.
        norm_first: pre-norm (``x + f(norm(x))``, the default) or post-norm (``norm(x + f(x))``, torch's
            ``norm_first=False``): a bool, or the path of a bool attribute.
        parallel_residual: attention and MLP both read the block's input, ``x + attn(norm1(x)) + mlp(norm2(x))``
            (Cohere with one norm, GPT-NeoX with two); pre-norm only.
        residual_multiplier: each branch's output scaled before joining the residual (Granite): a float or a float
            attribute's path; ``None``: 1.
        returns_attention_weights: the block returns ``(hidden_states, attention_weights)`` and its model reads
            ``outputs[0]`` (Falcon): the parallel block returns ``(hidden_states, None)``.
        batch_first: the block's input and output are ``[b, s, h]`` (default) or ``[s, b, h]`` where the parallel
            region starts or ends: a bool, or the path of a bool attribute.

    Every parameter and buffer of the block must sit in a declared part: :func:`undeclared_parts` lists the
    others, and the policy refuses such a block.

    Raises:
        TypeError: a flat field no part has (named), or a part's required field missing.
    """

    attention: AttentionSpec
    mlp: Union[DenseMLPSpec, MoESpec]
    residual_dropouts: tuple[str, ...] = ()
    transposed: bool = False
    arguments: tuple[str, ...] = ()
    norm_first: Union[bool, str] = True
    parallel_residual: bool = False
    residual_multiplier: Union[float, str, None] = None
    returns_attention_weights: bool = False
    batch_first: Union[bool, str] = True

    def __init__(self, attention: Union[AttentionSpec, str, None] = None,
                 mlp: Union[DenseMLPSpec, MoESpec, None] = None, *,
                 residual_dropouts: tuple[str, ...] = (), transposed: bool = False, arguments: tuple[str, ...] = (),
                 norm_first: Union[bool, str] = True, parallel_residual: bool = False,
                 residual_multiplier: Union[float, str, None] = None, returns_attention_weights: bool = False,
                 batch_first: Union[bool, str] = True, **parts: Any) -> None:
        if isinstance(attention, str):  # the flat declaration's attention="sdpa"
            parts["implementation"], attention = attention, None
        unknown = sorted(set(parts) - _ATTENTION_FIELDS - _MLP_FIELDS)
        if unknown:
            raise TypeError(f"BlockSpec has no field {', '.join(unknown)}: a block declares its attention "
                            f"({', '.join(sorted(_ATTENTION_FIELDS))}), its MLP ({', '.join(sorted(_MLP_FIELDS))}) and "
                            f"how they join the residual (residual_dropouts, transposed, arguments, norm_first, "
                            f"parallel_residual, residual_multiplier, returns_attention_weights, batch_first).")
        of_attention = {k: v for k, v in parts.items() if k in _ATTENTION_FIELDS}
        of_mlp = {k: v for k, v in parts.items() if k in _MLP_FIELDS}
        attention = replace(attention, **of_attention) if attention is not None else AttentionSpec(**of_attention)
        mlp = replace(mlp, **of_mlp) if mlp is not None else DenseMLPSpec(**of_mlp)
        values = dict(attention=attention, mlp=mlp, residual_dropouts=tuple(residual_dropouts), transposed=transposed,
                      arguments=tuple(arguments), norm_first=norm_first, parallel_residual=parallel_residual,
                      residual_multiplier=residual_multiplier, returns_attention_weights=returns_attention_weights,
                      batch_first=batch_first)
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def projections(self) -> tuple[list[str], list[str]]:
        """The column-parallel paths of the attention input and of the MLP input."""
        return self.attention.inputs(), self.mlp.inputs()

    def paths(self) -> dict[str, str]:
        """Every submodule path the declaration names, by role."""
        named = {**self.attention.paths(), **self.mlp.paths()}
        named.update({f"residual dropout {i}": p for i, p in enumerate(self.residual_dropouts)})
        return named


def rotary_function(block: nn.Module, spec: BlockSpec) -> Optional[Callable[..., Any]]:
    """The declared rotary function: as given, or found by name in ``block``'s own Python module (once, when the
    parallel block is built)."""
    return rotary_of(block, spec.attention.rotary)


def declared_modules(block: nn.Module, spec: BlockSpec) -> list[str]:
    """The paths of the submodules ``spec`` names in ``block`` (its projections, norms, activation and dropouts)."""
    paths = list(spec.paths().values())
    for extra in (spec.mlp.activation, spec.attention.attention_dropout):
        if isinstance(extra, str) and not extra.startswith("F.") and isinstance(maybe_resolve(block, extra), nn.Module):
            paths.append(extra)
    return paths


def undeclared_parts(block: nn.Module, spec: BlockSpec) -> list[str]:
    """The parameters and buffers of ``block`` that no part of ``spec`` holds: the parallel block would compute
    without them (a different function, silently) and they would leave the state dict."""
    declared = declared_modules(block, spec)

    def held(name: str) -> bool:  # inside a declared module, or a declared parameter itself (attention sinks)
        return any(name == path or name.startswith(path + ".") for path in declared)

    parameters = [f"{n} (parameter {tuple(p.shape)})" for n, p in block.named_parameters() if not held(n)]
    buffers = [f"{n} (buffer {tuple(b.shape)})" for n, b in block.named_buffers() if not held(n)]
    return parameters + buffers
