"""Column- and row-parallel linear layers (Shoeybi et al. 2019; Korthikanti et al. 2022 §4.2.2).

A transformer sub-block is ``ColumnParallelLinear → elementwise → RowParallelLinear``: the first
splits its output features over t ranks, the second its input features, so the pair needs one
communication on each side. Under sequence parallelism those are g (all-gather of the
sequence-sharded input) and ḡ (reduce-scatter of the partial outputs).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Sequence, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup, Pending
from lightning_seqpar.tensor_parallel.mappings import (
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from lightning_seqpar.tensor_parallel.weight_gradients import WeightGradientStore, accumulate
from lightning_seqpar.tensor_parallel.sharding import init_shard, shard_parameter
from lightning_seqpar.parallel.placement import ShardSpec, set_sequence_parallel, set_shard_spec


def autocast_input(x: Tensor) -> Tensor:
    """``x`` in autocast's dtype when autocast is on for its device and would cast it for a matmul (a float32 input;
    float64 is never cast), else ``x``. Casting before the all-gather sends, and keeps for backward, 16 bits
    instead of the 32 of a norm's output under autocast (norms run in float32), with the same product: the
    matmul would have cast the gathered tensor itself. The input's gradient is reduced in the matmul's dtype, as
    before, and returned in ``x``'s."""
    device = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


class _ColumnParallelLinearFunction(torch.autograd.Function):
    """``y = g(x) Aᵀ + b`` (SP) or ``y = f(x) Aᵀ + b`` (TP), saving only the local input shard.

    Under SP the forward all-gathers ``x [s/t, b, h]`` but keeps only the shard for backward and
    gathers it again there (Korthikanti et al. 2022 §4.2.2, the detail that makes Eq. 4 hold;
    Megatron-LM ``LinearWithGradAccumulationAndAsyncCommunication``).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], group: ParallelGroup, sequence_parallel: bool,
                store: Optional[WeightGradientStore] = None):
        ctx.group, ctx.sequence_parallel, ctx.has_bias, ctx.input_dtype = group, sequence_parallel, bias is not None, x.dtype
        ctx.store, ctx.params = store, (weight, bias)  # (the tensors W hands its gradients to, when split)
        x = autocast_input(x)  # the matmul would cast it: gather and keep it in 16 bits
        total = group.all_gather(x, dim=0) if sequence_parallel else x  # [s, b, h]
        # x is the local [s/t, b, h] shard under SP, kept for the weight gradient only: a frozen weight (LoRA's base)
        # keeps none, as torch's own linear keeps none
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        return F.linear(total, weight, bias)  # [s, b, out/t]

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        x, weight = ctx.saved_tensors
        group = ctx.group
        # Autocast ran the forward matmul in grad_output's dtype; backward mirrors it by hand.
        compute = grad_output.dtype
        grad_weight = grad_bias = None
        weights_need = ctx.needs_input_grad[1]
        if ctx.store is not None and ctx.store.is_deferring and (weights_need or ctx.needs_input_grad[2]):
            reducing = _input_gradient(ctx, group, [grad_output], [weight], compute)  # B
            ctx.store.defer(_column_weight_gradient(x, [grad_output], ctx.params, group, ctx.sequence_parallel,
                                                    ctx.needs_input_grad[1:3]))
            grad_input = reducing.wait().to(ctx.input_dtype) if reducing is not None else None
            return grad_input, None, None, None, None, None
        # Megatron's overlap: the input's re-gather runs during the input-gradient GEMM, and the input gradient's
        # reduce-scatter during the weight-gradient GEMM.
        gathering = group.all_gather_start(x) if weights_need and ctx.sequence_parallel else None
        reducing = _input_gradient(ctx, group, [grad_output], [weight], compute)
        if weights_need:
            total = gathering.wait() if gathering is not None else x  # [s, b, h]
            g2d = grad_output.reshape(-1, grad_output.shape[-1])
            grad_weight = g2d.t().matmul(total.reshape(-1, total.shape[-1]).to(compute)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        grad_input = reducing.wait().to(ctx.input_dtype) if reducing is not None else None
        return grad_input, grad_weight, grad_bias, None, None, None


def _column_weight_gradient(x: Tensor, grad_outputs: list[Tensor], params: Sequence[Optional[Tensor]],
                            group: ParallelGroup, sequence_parallel: bool, needs: Sequence[bool]) -> Callable[[], None]:
    """W of column-parallel projections of one input ``x`` (the local shard under SP): the input re-gathered once
    (the all-gather the unsplit backward makes for these GEMMs), then per projection ``dYᵀ·X`` ``[out/t, in]`` and the
    bias's ``Σ dY``, handed to autograd for ``params`` (weight, bias, weight, bias, …) where ``needs`` says."""

    def weight_gradient() -> None:
        total2d = None
        if any(needs[0::2]):  # (x is kept only then)
            total = group.all_gather(x, dim=0) if sequence_parallel else x  # [s, b, h]
            total2d = total.reshape(-1, total.shape[-1]).to(grad_outputs[0].dtype)
        gradients: list[Optional[Tensor]] = []
        for i, g in enumerate(grad_outputs):
            g2d = g.reshape(-1, g.shape[-1])
            weight, bias = params[2 * i], params[2 * i + 1]
            gradients.append(g2d.t().matmul(total2d).to(weight.dtype) if needs[2 * i] else None)
            gradients.append(g2d.sum(0) if bias is not None and needs[2 * i + 1] else None)
        accumulate(params, gradients)

    return weight_gradient


def _input_gradient(ctx, group: ParallelGroup, grad_outputs: list[Tensor], weights: list[Tensor],
                    compute: torch.dtype) -> Optional[Pending]:
    """The input gradient ``Σ_i dY_i A_i`` ``[s, b, h]``, partial over ranks, being reduced: under SP a reduce-scatter
    started and returned in flight (waited for after the weight-gradient GEMM); without SP the f operator's
    all-reduce, done. ``None`` when the input needs no gradient."""
    if not ctx.needs_input_grad[0]:
        return None
    grad_total = grad_outputs[0].matmul(weights[0].to(compute))
    for g, w in zip(grad_outputs[1:], weights[1:]):
        grad_total = grad_total + g.matmul(w.to(compute))
    if ctx.sequence_parallel:
        return group.reduce_scatter_start(grad_total)
    return Pending(group.all_reduce(grad_total))


def column_parallel_linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], group: ParallelGroup, sequence_parallel: bool,
    store: Optional[WeightGradientStore] = None,
) -> Tensor:
    """Functional column-parallel linear.

    Args:
        x: ``[s/t, b, in]`` under SP, else ``[s, b, in]`` (replicated).
        weight: local ``[out/t, in]``; bias: local ``[out/t]`` or ``None``.
        store: where the backward leaves its weight gradient while the store is deferring (the B/W split:
            :mod:`lightning_seqpar.tensor_parallel.weight_gradients`); ``None``: never split.

    Returns:
        ``[s, b, out/t]``: this rank's output features for the whole sequence.
    """
    if group.size == 1 and store is None:
        return F.linear(x, weight, bias)
    return _ColumnParallelLinearFunction.apply(x, weight, bias, group, sequence_parallel, store)


class _ColumnParallelLinearsFunction(torch.autograd.Function):
    """Several column-parallel projections of one input (``q/k/v``, ``gate/up``): one g, one saved shard.

    ``y_i = g(x) A_iᵀ + b_i`` for each weight; the forward all-gathers ``x`` once and, like
    :class:`_ColumnParallelLinearFunction`, keeps only the local shard (and the weights themselves, no
    concatenated copy) for backward, where it gathers it once again and sums the input gradients of all
    projections before the one reduce-scatter.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group: ParallelGroup, sequence_parallel: bool,
                store: Optional[WeightGradientStore], *params: Optional[Tensor]):
        ctx.group, ctx.sequence_parallel, ctx.input_dtype = group, sequence_parallel, x.dtype
        ctx.store, ctx.params = store, params
        weights, biases = params[0::2], params[1::2]
        ctx.has_bias = [b is not None for b in biases]
        x = autocast_input(x)  # the matmuls would cast it: gather and keep it in 16 bits
        total = group.all_gather(x, dim=0) if sequence_parallel else x  # [s, b, h]
        # x (the local [s/t, b, h] shard under SP) only where a weight is trained, as above
        trained = any(ctx.needs_input_grad[4::2])
        ctx.save_for_backward(x if trained else None, *weights)
        return tuple(F.linear(total, w, b) for w, b in zip(weights, biases))  # each [s, b, out_i/t]

    @staticmethod
    def backward(ctx, *grad_outputs: Tensor):
        x, *weights = ctx.saved_tensors
        group = ctx.group
        compute = grad_outputs[0].dtype
        grads: list[Optional[Tensor]] = [None] * (2 * len(weights))
        needs = ctx.needs_input_grad[4:]
        weights_need = any(needs[0::2])
        if ctx.store is not None and ctx.store.is_deferring and any(needs):
            reducing = _input_gradient(ctx, group, list(grad_outputs), list(weights), compute)  # B
            ctx.store.defer(_column_weight_gradient(x, list(grad_outputs), ctx.params, group, ctx.sequence_parallel,
                                                    needs))
            grad_input = reducing.wait().to(ctx.input_dtype) if reducing is not None else None
            return (grad_input, None, None, None, *grads)
        gathering = group.all_gather_start(x) if weights_need and ctx.sequence_parallel else None  # see above
        reducing = _input_gradient(ctx, group, list(grad_outputs), list(weights), compute)
        if weights_need or any(needs[1::2]):
            total = gathering.wait() if gathering is not None else x  # [s, b, h]
            total2d = total.reshape(-1, total.shape[-1]).to(compute) if weights_need else None
            for i, (g, w) in enumerate(zip(grad_outputs, weights)):
                g2d = g.reshape(-1, g.shape[-1])
                if needs[2 * i]:
                    grads[2 * i] = g2d.t().matmul(total2d).to(w.dtype)
                if ctx.has_bias[i] and needs[2 * i + 1]:
                    grads[2 * i + 1] = g2d.sum(0)
        grad_input = reducing.wait().to(ctx.input_dtype) if reducing is not None else None
        return (grad_input, None, None, None, *grads)


def column_parallel_linears(x: Tensor, layers: "list[ColumnParallelLinear]", group: ParallelGroup,
                            sequence_parallel: bool) -> tuple[Tensor, ...]:
    """Several column-parallel linears applied to the same input with one all-gather (Megatron fuses q/k/v into
    one weight; this keeps separate weights, e.g. a Hugging Face model's ``q_proj``/``k_proj``/``v_proj``).

    Args:
        x: ``[s/t, b, in]`` under SP, else ``[s, b, in]``.
        layers: the :class:`ColumnParallelLinear` modules (their local ``[out_i/t, in]`` weights and biases). A layer
            with an ``adapter`` (LoRA: :mod:`lightning_seqpar.transformer.lora`) adds ``adapter(x)`` ``[s, b, out_i/t]``
            to its output unless its ``adapter_enabled`` is false; the adapter takes ``x`` as given (sequence-local
            under SP) and does its own communication.

    Returns:
        One ``[s, b, out_i/t]`` per layer.
    """
    params = [p for layer in layers for p in (layer.linear_weight, layer.bias)]
    store = getattr(layers[0], "weight_gradients", None)  # (set on every layer of a model at once)
    if group.size == 1 and store is None:
        outputs = tuple(F.linear(x, w, b) for w, b in zip(params[0::2], params[1::2]))
    else:
        outputs = _ColumnParallelLinearsFunction.apply(x, group, sequence_parallel, store, *params)
    adapters = [getattr(layer, "adapter", None) if getattr(layer, "adapter_enabled", True) else None
                for layer in layers]
    if not any(adapters):
        return tuple(outputs)
    return tuple(out if adapter is None else out + adapter(x) for out, adapter in zip(outputs, adapters))


class ColumnParallelLinear(nn.Module):
    """``Y = X Aᵀ + b`` with A split by rows (output features) over the tensor-parallel group.

    Args:
        in_features, out_features: global sizes; ``out_features`` must divide by t.
        group: the tensor-parallel :class:`ParallelGroup`.
        sequence_parallel: input is sequence-sharded ``[s/t, b, in]`` and all-gathered (g);
            otherwise it is replicated ``[s, b, in]`` (f).
        gather_output: all-gather the output features, returning ``[s, b, out]``.
        chunks: number of stacked blocks in the output dimension split separately (3 for fused QKV), or
            their sizes when they differ (``(a·d, a_kv·d, a_kv·d)`` for fused QKV under grouped-query attention).

    Shapes: weight ``[out/t, in]``; output ``[s, b, out/t]`` (or ``[s, b, out]`` with ``gather_output``).

    Raises:
        ValueError: if ``out_features`` (per chunk) is not divisible by t.

    Source: Megatron-LM ``ColumnParallelLinear``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: ParallelGroup,
        *,
        bias: bool = True,
        sequence_parallel: bool = False,
        gather_output: bool = False,
        chunks: Union[int, Sequence[int]] = 1,
    ) -> None:
        super().__init__()
        sizes = tuple(chunks) if not isinstance(chunks, int) else (out_features // chunks,) * chunks
        if sum(sizes) != out_features or any(size % group.size for size in sizes):
            raise ValueError(
                f"ColumnParallelLinear: output features {out_features} (in blocks of {list(sizes)}) are not "
                f"divisible by the tensor-parallel size {group.size}."
            )
        uneven = sizes if len(set(sizes)) > 1 else ()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel, self.gather_output = group, sequence_parallel, gather_output
        self.spec = ShardSpec(dim=0, full_size=out_features, padded_size=out_features, chunks=len(sizes),
                              chunk_sizes=uneven)
        local = out_features // group.size
        self.weight = init_shard((out_features, in_features), self.spec, group)
        self.bias_spec = self.spec
        self.bias = nn.Parameter(torch.zeros(local)) if bias else None
        if self.bias is not None:
            set_shard_spec(self.bias, self.bias_spec)

    transposed = False

    @property
    def linear_weight(self) -> Tensor:
        """The local weight as ``F.linear`` takes it, ``[out/t, in]`` (a transposed view for a Conv1D's)."""
        return self.weight.t() if self.transposed else self.weight

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: ParallelGroup, **kwargs) -> "ColumnParallelLinear":
        """Shard a single-device ``nn.Linear`` (weights sliced, so both compute the same function)."""
        with torch.device("meta"):  # a skeleton: its weights are replaced by the slices
            layer = cls(linear.in_features, linear.out_features, group, bias=linear.bias is not None, **kwargs)
        return layer.load_full(linear.weight, linear.bias)

    @classmethod
    def from_conv1d(cls, conv: nn.Module, group: ParallelGroup, **kwargs) -> "ColumnParallelLinear":
        """Shard a Hugging Face ``Conv1D`` (GPT-2's linear with weights stored ``[in, out]``): the weight stays
        ``[in, out/t]`` (split along dim 1), so state-dict shapes stay the original's."""
        in_features, out_features = conv.weight.shape
        with torch.device("meta"):
            layer = cls(in_features, out_features, group, bias=conv.bias is not None, **kwargs)
        layer.transposed = True
        layer.spec = replace(layer.spec, dim=1)
        layer.weight = shard_parameter(conv.weight, layer.spec, group)
        if conv.bias is not None:
            layer.bias = shard_parameter(conv.bias, layer.bias_spec, group)
        return layer

    def load_full(self, weight: Tensor, bias: Optional[Tensor]) -> "ColumnParallelLinear":
        """Set this rank's shard from single-device ``weight [out, in]`` and ``bias [out]``."""
        self.weight = shard_parameter(weight, self.spec, self.group)
        if bias is not None:
            self.bias = shard_parameter(bias, self.bias_spec, self.group)
        return self

    weight_gradients: Optional[WeightGradientStore] = None  # the B/W split's store (split_weight_gradients)

    def forward(self, x: Tensor) -> Tensor:
        out = column_parallel_linear(x, self.linear_weight, self.bias, self.group, self.sequence_parallel,
                                     self.weight_gradients)
        if self.gather_output:
            out = gather_from_tensor_parallel_region(out, self.group)  # [s, b, out]
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} (local {self.linear_weight.shape[0]}), "
            f"sequence_parallel={self.sequence_parallel}, tp={self.group.size}"
        )


class _SplitProductFunction(torch.autograd.Function):
    """``X Aᵀ`` with no communication and no bias — a row-parallel projection's local product (``[s, b, in/t]`` input,
    ``[out, in/t]`` weight, partial over ranks), a LoRA adapter's two products — with a backward that splits into B
    (``dY·A``) and W (``dYᵀ·X``) while its store is deferring; used only where a store is set (the plain product
    otherwise: :func:`split_product`). Autocast is mirrored as in the column-parallel one."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, store: WeightGradientStore):
        ctx.store, ctx.weight, ctx.input_dtype = store, weight, x.dtype  # the weight: what W hands its gradient to
        x = autocast_input(x)  # the matmul would cast it: keep the cast, as it would
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None)  # for the weight gradient only
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (x,), weight = ctx.saved_tensors, ctx.weight
        compute = grad_output.dtype
        grad_input = grad_output.matmul(weight.to(compute)).to(ctx.input_dtype) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return grad_input, None, None

        def weight_gradient() -> Optional[Tensor]:
            g2d = grad_output.reshape(-1, grad_output.shape[-1])
            return g2d.t().matmul(x.reshape(-1, x.shape[-1]).to(compute)).to(weight.dtype)

        if ctx.store.is_deferring:
            ctx.store.defer(lambda: accumulate([weight], [weight_gradient()]))
            return grad_input, None, None
        return grad_input, weight_gradient(), None


def split_product(x: Tensor, weight: Tensor, store: Optional[WeightGradientStore]) -> Tensor:
    """``x weightᵀ`` (``F.linear`` without bias), its backward split into B and W through ``store`` while it defers
    (:mod:`.weight_gradients`); ``store`` ``None``: ``F.linear`` itself."""
    return F.linear(x, weight) if store is None else _SplitProductFunction.apply(x, weight, store)


class RowParallelLinear(nn.Module):
    """``Y = X Aᵀ + b`` with A split by columns (input features) over the tensor-parallel group.

    The partial products are summed by ḡ (reduce-scatter to ``[s/t, b, out]``) under sequence
    parallelism, by f̄ (all-reduce to ``[s, b, out]``) otherwise; the bias is added after the
    reduction, once. Under SP the bias sees only s/t tokens per rank, so it is tagged
    ``sequence_parallel`` and its gradient is summed over the group before the optimizer step.

    Args:
        in_features, out_features: global sizes; ``in_features`` must divide by t.
        group: the tensor-parallel :class:`ParallelGroup`.
        sequence_parallel: reduce-scatter the output along s instead of all-reducing it.

    Shapes: input ``[s, b, in/t]``; weight ``[out, in/t]``; output ``[s/t, b, out]`` (SP) or ``[s, b, out]``.

    Raises:
        ValueError: if ``in_features`` is not divisible by t.

    Source: Megatron-LM ``RowParallelLinear``.
    """

    def __init__(
        self, in_features: int, out_features: int, group: ParallelGroup, *, bias: bool = True, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        if in_features % group.size:
            raise ValueError(
                f"RowParallelLinear: input features {in_features} are not divisible by the tensor-parallel "
                f"size {group.size}."
            )
        self.in_features, self.out_features = in_features, out_features
        self.group, self.sequence_parallel = group, sequence_parallel
        self.spec = ShardSpec(dim=1, full_size=in_features, padded_size=in_features)
        self.weight = init_shard((out_features, in_features), self.spec, group)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        if self.bias is not None and sequence_parallel:
            set_sequence_parallel(self.bias)

    transposed = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: ParallelGroup, **kwargs) -> "RowParallelLinear":
        """Shard a single-device ``nn.Linear`` (weights sliced, so both compute the same function)."""
        return cls._sliced(linear.weight, linear.bias, group, transposed=False, **kwargs)

    @classmethod
    def from_conv1d(cls, conv: nn.Module, group: ParallelGroup, **kwargs) -> "RowParallelLinear":
        """Shard a Hugging Face ``Conv1D`` (weights ``[in, out]``): the weight stays ``[in/t, out]`` (split along
        dim 0), so state-dict shapes stay the original's."""
        return cls._sliced(conv.weight, conv.bias, group, transposed=True, **kwargs)

    @classmethod
    def _sliced(cls, weight: Tensor, bias: Optional[Tensor], group: ParallelGroup, transposed: bool,
                **kwargs) -> "RowParallelLinear":
        out_features, in_features = weight.shape[::-1] if transposed else weight.shape
        with torch.device("meta"):  # a skeleton: its weights are replaced by the slices
            layer = cls(in_features, out_features, group, bias=bias is not None, **kwargs)
        if transposed:
            layer.transposed = True
            layer.spec = ShardSpec(dim=0, full_size=in_features, padded_size=in_features)
        layer.weight = shard_parameter(weight, layer.spec, group)
        if bias is not None:  # replicated: added once, after the reduction
            layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
            if layer.sequence_parallel:
                set_sequence_parallel(layer.bias)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        return self.reduce(self.partial(x))

    weight_gradients: Optional[WeightGradientStore] = None  # the B/W split's store (split_weight_gradients)

    def partial(self, x: Tensor) -> Tensor:
        """This rank's product ``[s, b, out]``, partial over ranks (before ḡ / f̄; no bias)."""
        weight = self.weight.t() if self.transposed else self.weight
        return split_product(x, weight, self.weight_gradients)

    def reduce(self, partial: Tensor) -> Tensor:
        """The partial products summed over ranks (ḡ: ``[s/t, b, out]``; f̄: ``[s, b, out]``), plus the bias: other
        partial sums of the same output (a LoRA adapter's) are added to ``partial`` first, reduced once."""
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(partial, self.group)  # [s/t, b, out]
        else:
            out = reduce_from_tensor_parallel_region(partial, self.group)  # [s, b, out]
        # Under autocast the product is 16-bit, and so is a single-device Linear's output with its bias: a float32
        # bias would promote the sum, and with it the residual stream it is added to.
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.in_features // self.group.size}), out_features={self.out_features}, "
            f"sequence_parallel={self.sequence_parallel}, tp={self.group.size}"
        )


class ColumnParallelInProjection(nn.Module):
    """The packed ``[q; k; v]`` input projection of an ``nn.MultiheadAttention`` split by head blocks over the
    tensor-parallel group, under torch's parameter names (``in_proj_weight`` ``[3h/t, h]``, ``in_proj_bias``
    ``[3h/t]``), so state-dict keys stay those of torch's module. Applied by
    :func:`column_parallel_linears` as a :class:`ColumnParallelLinear` is (``linear_weight``, ``bias``).
    """

    def __init__(self, mha: nn.MultiheadAttention, group: ParallelGroup) -> None:
        super().__init__()
        spec = ShardSpec(dim=0, full_size=3 * mha.embed_dim, padded_size=3 * mha.embed_dim, chunks=3)
        self.in_proj_weight = shard_parameter(mha.in_proj_weight, spec, group)
        self.in_proj_bias = shard_parameter(mha.in_proj_bias, spec, group) if mha.in_proj_bias is not None else None

    @property
    def linear_weight(self) -> Tensor:
        return self.in_proj_weight

    @property
    def bias(self) -> Optional[Tensor]:
        return self.in_proj_bias
