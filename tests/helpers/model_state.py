"""The tensors that make up a rank's model state under the strategy, by kind (what the planner's state bytes count)."""

from __future__ import annotations

import torch


def model_state(trainer, pl_module) -> dict[str, list]:
    """``parameters``, ``gradients`` (each ``.grad`` and the reduction buckets with their reduced ranges),
    ``main_params`` (the distributed optimizer's float32 copies, not the parameters themselves) and ``optimizer``
    (the optimizer's state tensors); entries may be ``None``."""
    params = list({id(p): p for p in pl_module.parameters()}.values())
    optimizer = trainer.optimizers[0]
    inner = getattr(optimizer, "inner", optimizer)  # the distributed optimizer's wrapped optimizer
    own = {p.untyped_storage().data_ptr() for p in params}
    pieces = [p for g in inner.param_groups for p in g["params"]] if inner is not optimizer else []
    buckets = [*getattr(trainer.strategy.grad_sync.buckets, "buckets", []),
               *getattr(getattr(optimizer, "buckets", None), "buckets", [])]
    return dict(
        parameters=params,
        gradients=[*[p.grad for p in params], *[b.buffer for b in buckets], *[getattr(b, "reduced", None) for b in buckets]],
        main_params=[p for p in pieces if p.untyped_storage().data_ptr() not in own],
        optimizer=[v for state in inner.state.values() for v in state.values() if torch.is_tensor(v)],
    )
