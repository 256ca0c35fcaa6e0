"""The rewrite checks itself: a parallel block built from a declaration must compute what the block computes.

A declaration can be wrong in ways no shape check sees (a norm applied in another place, a part of the block
that is not declared, a scale or activation misnamed). Before training, one block of each declared class is
run both ways on a small float64 input: as the original block on one device, and as the t parallel blocks of
tensor (+ sequence) parallelism, emulated by t threads of this process (:mod:`lightning_seqpar.parallel.emulated`,
no communication). Their outputs must agree to float64 rounding (plus the float32 rounding of norms that compute
in float32, as Hugging Face's RMSNorm does).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.emulated import run_emulated
from lightning_seqpar.transformer.block_spec import BlockSpec, out_features, resolve, value_of
from lightning_seqpar.transformer.context import RewriteContext

RELATIVE_BOUND = 1e-5
"""‖parallel − original‖ / ‖original‖ allowed: float64 rounding plus float32 norms (a wrong part gives > 1e-2)."""
BATCH = 2


def _inputs(block: nn.Module, spec: BlockSpec, tp: int) -> tuple[Tensor, dict[str, Any]]:
    """A ``[b, s, h]`` float64 input (s a multiple of t, so that it splits under SP) and the keyword arguments
    the block takes: a causal additive ``attention_mask`` and, with a rotary function, ``position_embeddings``."""
    generator = torch.Generator().manual_seed(0)
    hidden = out_features(resolve(block, spec.attention.attention_out))
    heads = value_of(block, spec.attention.num_heads)
    head_dim = value_of(block, spec.attention.head_dim) or hidden // heads
    s = 4 * tp
    x = torch.randn(BATCH, s, hidden, generator=generator, dtype=torch.float64)
    accepted = inspect.signature(block.forward).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in accepted.values())
    kwargs: dict[str, Any] = {}
    if "attention_mask" in accepted or takes_any:
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        kwargs["attention_mask"] = torch.zeros(BATCH, 1, s, s, dtype=torch.float64).masked_fill(
            future, torch.finfo(torch.float64).min)
    if spec.attention.rotary and ("position_embeddings" in accepted or takes_any):
        angles = torch.rand(BATCH, s, head_dim, generator=generator, dtype=torch.float64) * 6.28
        kwargs["position_embeddings"] = (angles.cos(), angles.sin())
    return x, kwargs


def _output(result: Any) -> Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result


def verify_parallel_block(sample: nn.Module, spec: BlockSpec, ctx: RewriteContext, name: str,
                          build: Callable[[nn.Module, RewriteContext], nn.Module]) -> float:
    """Compare ``sample`` (a block of the declared class, with values; consumed) with its parallel version at
    ``ctx``'s tp, on emulated ranks (:meth:`RewriteContext.emulated`; ``build(block, ctx)`` makes one rank's parallel
    block); return the relative difference.

    Raises:
        ValueError: the outputs differ by more than :data:`RELATIVE_BOUND`, or the parallel block fails on the
            input: naming the block, the difference and the fix.
    """
    sample, tp = sample.double().eval(), ctx.tp
    x, kwargs = _inputs(sample, spec, tp)
    with torch.no_grad():
        try:
            want = _output(sample(x, **kwargs))
        except Exception as error:  # noqa: BLE001 - a block the check cannot call is not accepted unchecked
            raise ValueError(f"{name} ({type(sample).__name__}): the self-check cannot call the block as "
                             f"block(hidden_states{''.join(f', {k}=...' for k in kwargs)}) on a small input "
                             f"({type(error).__name__}: {error}), so its parallel version cannot be checked. Declare "
                             f"how the block is called (BlockSpec), or write a Policy for it.") from error

        def one_rank(group: ParallelGroup) -> Tensor:
            block = build(sample, ctx.emulated(group)).eval()
            return _output(block(x, **kwargs))

        try:
            outputs = run_emulated(tp, one_rank)
        except Exception as error:  # noqa: BLE001 - reported with the block it came from
            raise ValueError(f"{name} ({type(sample).__name__}): the parallel block built from the declaration fails "
                             f"on a small input at tp={tp}: {type(error).__name__}: {error}") from error
    got = outputs[0]
    if got.shape != want.shape:
        raise ValueError(f"{name} ({type(sample).__name__}): the parallel block returns shape {tuple(got.shape)}, "
                         f"the block {tuple(want.shape)}.")
    difference = ((got - want).norm() / want.norm().clamp_min(1e-300)).item()
    if not difference <= RELATIVE_BOUND:  # also NaN
        largest = (got - want).abs().max().item()
        raise ValueError(
            f"{name} ({type(sample).__name__}): the tensor-parallel block built from its declaration does not compute "
            f"what the block computes: on a small float64 input at tp={tp}, the outputs differ by {difference:.3g} "
            f"(relative; largest element difference {largest:.3g}). The declaration misses or misnames a part of "
            f"the block's forward (a scale, clipping, a norm in another place, an argument it reads); fix the "
            f"BlockSpec, or write a Policy for this block."
        )
    return difference
