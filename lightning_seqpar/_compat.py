"""Every private torch or transformers name the library uses, in one place (Lightning's are in
:mod:`lightning_seqpar.lightning._compat`, the only folder that may import Lightning).

Each entry says why it is needed and which public alternative was checked (torch 2.13, transformers 5, the
versions ``setup.cfg`` pins and CI tests). ``tests/package/test_layering.py`` fails if a private name of a
library is used in any module but the two ``_compat`` modules, so an upgrade has two files to review.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

# The live-activation tracker, the collective counter and the planner's element-wise work counter sit below autograd,
# where only a dispatch mode sees every op's outputs (saved_tensors_hooks miss checkpoint caches). torch documents
# TorchDispatchMode but keeps it in a private module; tree_flatten has no public module in torch 2.13
# (torch.utils.pytree does not exist there).
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
from torch.utils._pytree import tree_flatten  # noqa: F401

# Activation offload on CPU copies saved tensors to a host pool that is not device memory: the memory trackers (dispatch
# modes) must not count those copies. torch has no public way to step outside the active dispatch modes for a moment;
# torch's own FakeTensor and checkpointing code use this one.
from torch.utils._python_dispatch import _disable_current_modes as outside_dispatch_modes  # noqa: F401

# What .item(), float(), int() and bool() of a tensor, and a kernel's own read of a device value, all reach: the one
# operation behind a host read (HostSyncCounter). aten's operator names carry no public alias.
SCALAR_READ = torch.ops.aten._local_scalar_dense.default
try:  # what dist.barrier dispatches (no public name for the op)
    BARRIER: Any = torch.ops.c10d.barrier.default
except (AttributeError, RuntimeError):  # a torch built without distributed: no barrier to count
    BARRIER = None


def mutates_input(func: Any) -> bool:
    """Whether an ATen operator (an ``OpOverload``) writes into a tensor it was given (in place, ``out=``): the
    element-wise work counter (:mod:`lightning_seqpar.plan.measuring.work`) counts its bytes though its output aliases
    an input. Only the operator's schema says so (``_schema.is_mutable``); ``torch.Tag`` marks views, not writes."""
    return func._schema.is_mutable


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``tensor``'s memory: a DTensor's local shard, else itself.

    Called inside a dispatch mode, where ``DTensor.to_local()`` (the public way) would dispatch again.
    """
    return getattr(tensor, "_local_tensor", tensor)


def reset_multihead_attention(module: torch.nn.MultiheadAttention) -> None:
    """``nn.MultiheadAttention``'s own initializer, for modules built on the meta device.

    torch names it ``_reset_parameters`` (no public ``reset_parameters`` on this module in torch 2.13).
    """
    module._reset_parameters()


def default_store() -> Any:
    """The key-value store of the default process group (``torch.distributed.distributed_c10d._get_default_store``),
    or ``None`` when no process group exists or it is torch's ``fake`` backend (no peers: nothing to coordinate)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_backend() == "fake":  # one rank of a simulated world (recipes/gpu_check.py): its store serves nothing
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def set_process_group_timeout(timeout: Any, group: Any = None) -> None:
    """How long the collectives of ``group`` (default: the default process group) wait for a peer, changed after it
    started (``torch.distributed.distributed_c10d._set_pg_timeout``; ``init_process_group`` takes one timeout for the
    start and for every collective, with no public way to tell them apart, and ``init_device_mesh`` none: its groups
    get torch's default of 30 minutes)."""
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout, group)


def storage_key(storage: torch.UntypedStorage) -> int:
    """An identity of a storage that is equal for every view of it (what ``StorageWeakRef`` keys on).

    ``data_ptr()`` (public) is not an identity: distinct empty storages share 0.
    """
    return storage._cdata


__all__: list[Any] = [
    "BARRIER",
    "SCALAR_READ",
    "TorchDispatchMode",
    "hf_attention_implementation",
    "hf_init_weights",
    "local_tensor",
    "reset_multihead_attention",
    "default_store",
    "set_process_group_timeout",
    "storage_key",
    "tree_flatten",
]


def hf_attention_implementation(config: object) -> str:
    """The attention kernel a Hugging Face config selects (``"eager"``, ``"sdpa"``, ...). transformers 5 keeps
    it in ``config._attn_implementation`` (the public ``attn_implementation`` is only a constructor argument)."""
    return getattr(config, "_attn_implementation", None) or "eager"


def hf_init_weights(model: Any) -> Any:
    """The initializer of a Hugging Face ``PreTrainedModel``, ``model._init_weights(module)`` (``None`` for any other
    module): it initializes one module's own weights as the model's constructor does, including recomputing rotary
    ``inv_freq`` buffers. transformers 5 exposes no public per-module initializer (``init_weights()`` walks the
    whole model, which on a model larger than one device is what must not happen)."""
    if getattr(model, "config", None) is None or not callable(getattr(type(model), "_init_weights", None)):
        return None
    return model._init_weights


def track_step_for_schedulers(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` as a learning-rate scheduler built on it would (``_opt_called`` /
    ``_wrapped_by_lr_sched``), for an optimizer that replaces the one the scheduler was built on.

    A scheduler patches its optimizer's ``step`` in its constructor to check that ``optimizer.step()`` runs before
    ``scheduler.step()``; pointing ``scheduler.optimizer`` at a replacement (the distributed optimizer) leaves the
    replacement unpatched and every ``scheduler.step()`` warns that ``optimizer.step()`` "has been overridden".
    torch has no public way to re-patch it.
    """
    step = optimizer.step
    if getattr(step, "_wrapped_by_lr_sched", False):
        return

    def tracked(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked  # type: ignore[method-assign]


def tensor_version(tensor: torch.Tensor) -> int:
    """How many times ``tensor``'s memory was written in place (autograd's version counter, shared by views).

    The distributed optimizer's float32 main params must notice weights loaded into a parameter between steps;
    torch exposes the counter only as ``Tensor._version``.
    """
    return tensor._version


def sharded_tensor(local: list[tuple[torch.Tensor, list[int]]], placed: list[tuple[list[int], list[int], int]],
                   size: list[int], dtype: torch.dtype) -> Any:
    """A ``ShardedTensor`` (``torch.distributed._shard``, which ``torch.distributed.checkpoint`` reads and writes by
    arbitrary chunks) of global ``size``: ``local`` this rank's pieces ``(tensor, offsets)``, ``placed`` every piece
    of the tensor ``(offsets, sizes, global rank)`` (this rank's included), covering it once. No communication:
    torch's constructor from local shards and global metadata trusts the caller's metadata."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    device = local[0][0].device if local else torch.device("cpu")
    metadata = [ShardMetadata(list(offsets), list(sizes), f"rank:{rank}/{device}") for offsets, sizes, rank in placed]
    mine = {tuple(m.shard_offsets): m for m in metadata if m.placement.rank() == torch.distributed.get_rank()}
    shards = [Shard(tensor, mine[tuple(offsets)]) for tensor, offsets in local]
    properties = TensorProperties(dtype=dtype, layout=torch.strided, requires_grad=False, pin_memory=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata(metadata, torch.Size(size), properties))


def destroy_library(library: Any) -> None:
    """Remove the kernels a ``torch.library.Library`` registered (``Library._destroy``): torch has no public way to
    take back an ``IMPL`` registration before the object is garbage-collected."""
    library._destroy()


def fused_attention_supported(q: torch.Tensor) -> bool:
    """Whether :func:`fused_attention_with_lse` has a kernel for ``q`` ``[b, a, n, d]``: SDPA's flash kernel on CPU
    (any floating dtype); on CUDA the memory-efficient kernel, the one of SDPA's CUDA kernels that takes an additive
    mask and returns the log-sum-exp (16/32-bit, ``d`` a multiple of 8)."""
    if q.device.type == "cpu":
        return True
    return q.dtype in (torch.float16, torch.bfloat16, torch.float32) and q.shape[-1] % 8 == 0


_BIAS_ALIGNMENT = 16
"""The memory-efficient kernel reads its bias in 128-bit rows: every stride but the last a multiple of 8 (16-bit) or
4 (32-bit) elements. torch's SDPA pads the last dimension to 16 and slices it back (``preprocess_mask``)."""


def _efficient_bias(allowed: Optional[torch.Tensor], q: torch.Tensor, keys: int) -> Optional[torch.Tensor]:
    """``allowed`` ``[b, n, n_k]`` (bool) as the kernel's additive bias ``[b, a, n, n_k]`` in q's dtype: the dtype's
    lowest finite value where masked, not ``-inf``, so a query row that sees nothing stays finite (its weight is
    removed by the caller through its log-sum-exp) instead of NaN."""
    if allowed is None:
        return None
    b, n, _ = allowed.shape
    padded = -(-keys // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT
    bias = torch.zeros((b, 1, n, padded), dtype=q.dtype, device=q.device)
    bias[..., :keys].masked_fill_(~allowed[:, None], torch.finfo(q.dtype).min)
    return bias[..., :keys].expand(b, q.shape[1], n, keys)


def _cpu_mask(allowed: Optional[torch.Tensor], q: torch.Tensor) -> Optional[torch.Tensor]:
    """``allowed`` ``[b, n, n_k]`` as the CPU kernel's additive mask ``[b, 1, n, n_k]`` (``-inf`` where masked)."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~allowed, float("-inf"))[:, None]


def fused_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                             allowed: Optional[torch.Tensor], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused attention kernel that returns, with the output ``[b, a, n, d]``, the log-sum-exp of each query's scores
    ``[b, a, n]`` (float32, or float64 on CPU for float64 inputs): what a ring merges blocks by. ``allowed``
    ``[b, n, n_k]`` (bool, or ``None``) is the block's mask; a query row with no allowed key gets an arbitrary
    finite output and lse that the caller must discard.

    - CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (private, torch 2.13), additive ``-inf`` mask.
    - CUDA: ``aten._scaled_dot_product_efficient_attention`` with ``compute_log_sumexp`` (its lse is padded to a
      multiple of 32 queries; sliced here). SDPA's CUDA flash kernel takes no mask, so it serves no masked block.
    """
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal,
                                                                           attn_mask=_cpu_mask(allowed, q), scale=scale)
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, _efficient_bias(allowed, q, k.shape[2]), True, 0.0, is_causal, scale=scale)
    return out, lse[..., :q.shape[2]]


def fused_attention_backward(d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, is_causal: bool, allowed: Optional[torch.Tensor],
                             scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k, v of :func:`fused_attention_with_lse` for the given (final) output ``[b, a, n, d]`` and
    log-sum-exp ``[b, a, n]`` (``aten._scaled_dot_product_flash_attention_for_cpu_backward`` on CPU,
    ``aten._scaled_dot_product_efficient_attention_backward`` on CUDA: no dropout, so its random-state tensors are
    the empty scalars its forward returns without dropout)."""
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=_cpu_mask(allowed, q), scale=scale)
    n = q.shape[2]
    lse = torch.nn.functional.pad(lse.float(), (0, -(-n // 32) * 32 - n)).contiguous()  # the kernel's padded layout
    no_rng = torch.empty((), dtype=torch.long)
    d_q, d_k, d_v, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        d_out, q, k, v, _efficient_bias(allowed, q, k.shape[2]), out, lse, no_rng, no_rng, 0.0,
        [True, True, True, False], is_causal, scale=scale)
    return d_q, d_k, d_v


def inside_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread: a forward that activation checkpointing
    recomputes runs inside one (``torch._C._current_graph_task_id()``, -1 outside any; private)."""
    return torch._C._current_graph_task_id() != -1


def experts_implementation(config: Any) -> Optional[str]:
    """The experts kernel a transformers config selects (``config._experts_implementation``: ``"eager"``,
    ``"grouped_mm"``, ...; private, set by ``from_pretrained(experts_implementation=...)``; no public getter in
    transformers 5.24)."""
    return getattr(config, "_experts_implementation", None)


def use_eager_experts(config: Any) -> None:
    """Make a transformers config's experts run one by one (the ``"eager"`` kernel), the public
    ``experts_implementation=`` argument being available at model construction only."""
    config._experts_implementation = "eager"


def compile_errors() -> tuple[type[BaseException], ...]:
    """What ``torch.compile(fullgraph=True)`` raises where it cannot trace one graph (a graph break): dynamo's
    ``Unsupported`` (``torch._dynamo.exc``; torch has no public name for it)."""
    from torch._dynamo.exc import Unsupported

    return (Unsupported,)


def fake_process_group_store() -> Any:
    """The store of torch's ``fake`` process-group backend (one rank of a large world, collectives that return at
    once: ``recipes/gpu_check.py``'s memory rows). torch keeps it in ``torch.testing._internal.distributed.fake_pg``
    (no public module, torch 2.13)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def muon_orthogonalise(matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
                       ) -> torch.Tensor:
    """``torch.optim.Muon``'s own Newton–Schulz orthogonalisation of a 2-D ``matrix`` (bfloat16 result): the sharded
    Muon runs torch's function so that its numbers are one process's (torch keeps it private, ``_muon``)."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(matrix, coefficients, steps, eps)


def muon_adjusted_lr(lr: float, adjust_lr_fn: Optional[str], shape: torch.Size) -> float:
    """``torch.optim.Muon``'s learning rate for a matrix of single-device ``shape`` (private in torch, ``_muon``)."""
    from torch.optim._muon import _adjust_lr

    return _adjust_lr(lr, adjust_lr_fn, shape)


def has_gradient_hooks(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has hooks that take its gradient before it is accumulated (``register_hook``): a split
    backward's W then hands the gradient to autograd, which runs them. torch keeps them in ``_backward_hooks`` and
    offers no public way to ask (torch's FSDP2 reads the same attributes)."""
    return bool(tensor._backward_hooks)


def run_post_accumulate_grad_hooks(tensor: torch.Tensor) -> None:
    """Call ``tensor``'s post-accumulate-grad hooks, as autograd's accumulation does after adding a gradient to
    ``.grad``: a split backward's W adds its gradient in place without the engine
    (:func:`lightning_seqpar.tensor_parallel.weight_gradients.accumulate`). torch has no public call for it; its own
    FSDP2 runs ``_post_accumulate_grad_hooks`` the same way after its reduce-scatter."""
    for hook in (tensor._post_accumulate_grad_hooks or {}).values():
        hook(tensor)
