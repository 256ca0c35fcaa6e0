"""ZeRO stage 1 with Megatron-LM's traffic: each data-parallel rank updates, and keeps the optimizer state of, 1/d of
every parameter's elements.

Megatron-LM's ``DistributedOptimizer`` (``--use-distributed-optimizer``; Rajbhandari et al. 2020, ZeRO-1): instead of
all-reducing gradients and updating every parameter everywhere,

1. gradients are reduce-scattered in buckets (:mod:`.sharded_buckets`), during the last backward of an accumulation
   window: rank r receives the average of its element range of each parameter;
2. the wrapped optimizer updates only those ranges: its "parameters" are views of the model's parameters
   (``param.view(-1)[start:stop]``), so its state (AdamW's ``exp_avg``, ``exp_avg_sq``) is 1/d of the model's,
   split by elements, not by whole parameters;
3. the updated ranges are all-gathered back into every replica's parameters, bucket by bucket.

Reduce-scatter + all-gather move what one all-reduce moves (``2 (d-1)/d`` of the gradient bytes per rank, ring
model; the all-gather in the parameters' dtype), against ZeRO's usual all-reduce + broadcast (3/2 of it). Only
optimizers that update each element from that element alone are exact under an element split: :data:`ELEMENTWISE`.

The sequence-parallel sums over tp and the sums of shared parameters over pipeline stages are taken on the owned
ranges (the ranges of a parameter are the same on every tensor-parallel and pipeline peer); the gradient norm for
clipping sums the ranges' squares over the data-parallel group too. After backward, ``param.grad`` is ``None``: the
averaged gradient of a range is :meth:`DistributedOptimizer.owned_gradient`, all of it
:meth:`DistributedOptimizer.gathered_gradient` (collective).

The optimizer owns its checkpoint state: :meth:`DistributedOptimizer.checkpoint_entries` describes each state tensor's
owned range to ``torch.distributed.checkpoint`` where it lives (:func:`~lightning_seqpar.tensor_parallel.dcp_ranges.dcp_range_view`:
chunks of the unsharded optimizer's tensor, under its key), and :meth:`DistributedOptimizer.checkpoint_targets` reads
the owned ranges back; no rank assembles another's state, and a checkpoint written under either ``zero`` resumes under
the other, or another d.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor
from torch.optim import Optimizer

from lightning_seqpar._compat import tensor_version, track_step_for_schedulers
from lightning_seqpar.optim.grad_buckets import Replicas
from lightning_seqpar.optim.muon import Muon
from lightning_seqpar.optim.range_muon import RangeMuon
from lightning_seqpar.optim.gradients import (
    _all_reduce_coalesced, by_group, norm_of_gradients, shared_over_stages, used_anywhere,
)
from lightning_seqpar.optim.sharded_buckets import ShardedGradientBuckets, _ShardedBucket, out_of_rows
from lightning_seqpar.parallel.split_sizes import owned_range
from lightning_seqpar.parallel.collectives import Pending
from lightning_seqpar.parallel.mesh import ParallelMesh
from lightning_seqpar.tensor_parallel.dcp_ranges import MAIN_PARAM, RangeLayout, dcp_range_view, range_layout
from lightning_seqpar.parallel.placement import placement_of, shard_spec
from lightning_seqpar.tensor_parallel.sharding import ShardMeshes, dcp_view, full_shape, saved_shape


#: 0-dim state every optimizer of :data:`ELEMENTWISE` keeps whole (a 0-dim parameter's other state is 0-dim too).
SCALAR_STATE = frozenset({"step", "eta", "mu"})

#: Optimizers whose update of an element reads only that element's parameter, gradient and state.
ELEMENTWISE: tuple[type[Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
)


class DistributedOptimizer(Optimizer):
    """``optimizer`` (fresh, as from ``configure_optimizers``) run as ZeRO-1 (see the module): each parameter's
    elements split over the group its placement replicates it over (``dp_cp``; ``edp`` for experts).

    ``param_groups`` are the model's parameters with the wrapped optimizer's settings: learning-rate schedulers
    and ``zero_grad`` work on them as on the original; each step copies the settings into the inner optimizer.

    Args:
        optimizer: an optimizer of a class in :data:`ELEMENTWISE`, or Muon (``torch.optim.Muon``,
            :class:`~lightning_seqpar.optim.Muon`: run as :class:`~lightning_seqpar.optim.range_muon.RangeMuon`), holding no
            state yet.
        mesh: the process mesh (the data-parallel group shards; tensor and pipeline groups finish the gradients).
        overlap: reduce-scatter buckets during backward (not under a pipeline schedule).
        main_params: for 16-bit parameters, update a float32 copy of this rank's ranges (Megatron-LM's main params,
            kept with the optimizer state, 1/d of them per rank) and round it into the parameters after each step;
            gradients reach the update in float32 as reduced. Without it a 16-bit parameter is updated in its dtype.

    Raises:
        ValueError: an optimizer class not in :data:`ELEMENTWISE` nor Muon, or one already holding state.
    """

    elementwise = True  # (exact on shards: it wraps element-wise optimizers, or Muon over whole matrices)

    def __init__(self, optimizer: Optimizer, mesh: ParallelMesh, overlap: bool = True, main_params: bool = False
                 ) -> None:
        kind = type(optimizer)
        muon = isinstance(optimizer, (torch.optim.Muon, Muon))
        if kind not in ELEMENTWISE and not muon:
            raise ValueError(
                f"zero=1 splits every parameter into element ranges, one per data-parallel rank, which is exact only "
                f"for optimizers that update each element on its own ({', '.join(c.__name__ for c in ELEMENTWISE)}) "
                f"and for Muon (its matrices gathered whole); {kind.__name__} is not one of them. Use zero=0, or one "
                f"of those optimizers.")
        if optimizer.state:
            raise ValueError(f"zero=1 shards a fresh optimizer; this {kind.__name__} already holds state. "
                             f"Return a new optimizer from configure_optimizers.")
        self.mesh = mesh
        groups = [dict(group) for group in optimizer.param_groups]
        super().__init__(groups, dict(optimizer.defaults))
        params = list({id(p): p for g in self.param_groups for p in g["params"] if p.requires_grad}.values())
        apart = frozenset(map(id, shared_over_stages(params))) if mesh.pp > 1 else frozenset()
        self.buckets = ShardedGradientBuckets(params, Replicas.of_mesh(mesh), overlap, apart)
        self._ranges = {id(p): owned_range(p.numel(), self._group(p).size, self._group(p).rank) for p in params}
        self._layouts: dict[tuple[str, str], Optional[RangeLayout]] = {}
        self._views = {id(p): self._piece_of(p) for p in params}  # the ranges of the parameters themselves
        # What the inner optimizer updates: a float32 copy of a 16-bit range (main params), else the range itself.
        self._pieces = {key: view.float() if main_params and view.element_size() < 4 else view
                        for key, view in self._views.items()}
        self._record_versions()
        # `defaults` can hold entries the constructor does not take (AdamW's decoupled_weight_decay); groups keep them.
        accepted = inspect.signature(kind.__init__).parameters
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": [self._pieces[id(p)] for p in g["params"] if id(p) in self._pieces]}
                        for g in self.param_groups]
        if muon:  # element-wise momentum on the ranges; each matrix's ranges gathered whole to orthogonalise it
            ranges = {id(self._pieces[id(p)]): (p, placement_of(p).replicated_over) for p in params}
            self.inner = RangeMuon([{**g, "use_muon": g.get("use_muon", True)} for g in inner_groups], ranges, mesh)
        else:
            self.inner = kind(inner_groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})

    def _group(self, param: nn.Parameter) -> Any:
        """The group ``param``'s element ranges are split over (its replicas)."""
        return self.mesh.group(placement_of(param).replicated_over)

    def _piece_of(self, param: nn.Parameter) -> Tensor:
        start, stop = self._ranges[id(param)]
        return param.detach().view(-1)[start:stop]

    # ------------------------------------------------------------------------------------------------ gradients
    def finish_gradients(self) -> None:
        """After the last backward: wait for the reduce-scatters, take the tensor-parallel and pipeline sums on the
        owned ranges, and hand each range its gradient (``None`` where no rank got one, as on one device)."""
        params = self.buckets.params
        here = dict(zip(map(id, params), self.buckets.finish()))
        used: dict[int, bool] = {}
        for name, chosen in by_group(params, "replicated_over"):
            used.update(zip(map(id, chosen), used_anywhere([here[id(p)] for p in chosen], self.mesh.host(name))))
        mesh = self.mesh
        owned = {id(p): self.buckets.owned_gradient(p) for p in params}
        for name, chosen in by_group(params, "partial_over"):
            _all_reduce_coalesced([owned[id(p)] for p in chosen], mesh.group(name))
        for name, chosen in by_group(params, "stage_group"):
            over, host = mesh.group(name), mesh.host(name)
            if over.size > 1:
                for p, u in zip(chosen, used_anywhere([used[id(p)] for p in chosen], host)):
                    used[id(p)] = u
                _all_reduce_coalesced([owned[id(p)] for p in chosen], over)
        for p in params:
            piece = self._pieces[id(p)]
            grad = owned[id(p)]
            piece.grad = (grad if grad.dtype == piece.dtype else grad.to(piece.dtype)) if used[id(p)] else None

    def owned_gradient(self, param: nn.Parameter) -> Optional[Tensor]:
        """The averaged gradient of this rank's element range of ``param`` (after :meth:`finish_gradients`)."""
        return self._pieces[id(param)].grad

    def gathered_gradient(self, param: nn.Parameter) -> Optional[Tensor]:
        """The whole averaged gradient of ``param`` (this rank's tensor-parallel shard), assembled from every
        data-parallel rank's range (collective over the data-parallel group; for inspection and tests). ``None``
        for a frozen parameter (``requires_grad=False``: it has no range, no gradient and no optimizer state)."""
        if not param.requires_grad:
            return None
        piece = self._pieces[id(param)]
        present = used_anywhere([piece.grad is not None], self.mesh.host(placement_of(param).replicated_over))[0]
        if not present:
            return None
        grad = piece.grad if piece.grad is not None else torch.zeros_like(piece)
        return self._gather_all(param, grad)

    def grad_norm(self, norm_type: float = 2.0) -> Tensor:
        """The whole model's gradient norm, as one process computes it, from the owned ranges (collective)."""
        pairs = [(p, self._pieces[id(p)].grad) for p in self.buckets.params if self._pieces[id(p)].grad is not None]
        device = self.buckets.params[0].device if self.buckets.params else torch.device("cpu")
        return norm_of_gradients(pairs, self.mesh, norm_type, device, data_parallel_parts=True)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Scale the owned gradients so that :meth:`grad_norm` is at most ``max_norm``; return the norm before."""
        total = self.grad_norm(norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for piece in self._pieces.values():
            if piece.grad is not None:
                piece.grad.mul_(coef.to(piece.grad.device, piece.grad.dtype))
        return total

    # ------------------------------------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Run ``closure`` (forward, backward, :meth:`finish_gradients`, clipping), update the owned ranges, and
        all-gather the updated parameters over the data-parallel group."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in group.items() if k != "params"})
        self._refresh_main_params()
        self.inner.step()
        for key, view in self._views.items():
            if self._pieces[key] is not view:  # main params: rounded into the parameter
                view.copy_(self._pieces[key])
        self._all_gather_parameters()
        self._record_versions()
        return loss

    def _all_gather_parameters(self) -> None:
        """Every rank's updated ranges into every replica's parameters, bucket by bucket, two in flight: the next
        bucket's all-gather runs while the previous one is copied out, and at most two buckets' buffers exist at once.
        Not deferred into the next forward (Megatron's ``overlap_param_gather``): whatever reads the parameters after
        ``step()`` (callbacks, checkpoints) reads them updated."""
        in_flight: list[tuple[_ShardedBucket, Pending]] = []
        for bucket in self.buckets.buckets:
            if bucket.group.size == 1:
                continue
            send = torch.zeros(bucket.width, dtype=bucket.params[0].dtype, device=bucket.params[0].device)
            for index, p in enumerate(bucket.params):
                view = self._views[id(p)]
                start = bucket.offsets[index]
                send[start:start + view.numel()].copy_(view)
            in_flight.append((bucket, bucket.group.all_gather_start(send)))
            if len(in_flight) == 2:
                self._copy_out(*in_flight.pop(0))
        for bucket, pending in in_flight:
            self._copy_out(bucket, pending)

    def _copy_out(self, bucket: _ShardedBucket, pending: Pending) -> None:
        gathered = pending.wait().view(bucket.group.size, bucket.width)
        for index, p in enumerate(bucket.params):
            out_of_rows(bucket.region(index, gathered), p.detach().view(-1))

    def _padded(self, param: nn.Parameter, piece: Tensor) -> Tensor:
        """This rank's range ``piece`` of ``param`` (or a state tensor of it) padded to ``ceil(numel / d)``: every
        rank's is then the same size for a gather."""
        padded = torch.zeros(-(-param.numel() // self._group(param).size), dtype=piece.dtype, device=piece.device)
        padded[: piece.numel()].copy_(piece)
        return padded

    def _gather_all(self, param: nn.Parameter, piece: Tensor) -> Tensor:
        """``param``-shaped tensor from every data-parallel rank's range ``piece`` (all-gather)."""
        group = self._group(param)
        if group.size == 1:
            return piece.view(param.shape)
        return group.all_gather(self._padded(param, piece))[: param.numel()].view(param.shape)

    # ------------------------------------------------------------------------------------------------ state
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its ranges'), summed over every state tensor, main params
        included."""
        main = sum(piece.numel() * piece.element_size() for key, piece in self._pieces.items()
                   if piece is not self._views[key])
        return main + sum(v.numel() * v.element_size() for s in self.inner.state.values() for v in s.values()
                          if isinstance(v, Tensor))

    def _range_layout(self, param: nn.Parameter) -> Optional[RangeLayout]:
        """Where every replica's ranges of ``param`` live (``None`` with one replica: nothing is split)."""
        placement = placement_of(param)
        key = (placement.replicated_over, placement.shard_over if placement.shard is not None else "")
        if key not in self._layouts:
            self._layouts[key] = (None if self._group(param).size == 1 else
                                  range_layout(self.mesh, placement.replicated_over, key[1] or None))
        return self._layouts[key]

    def _state_view(self, param: nn.Parameter, value: Tensor, shard_mesh: Any,
                    layout: Optional[RangeLayout]) -> Optional[Tensor]:
        """A range ``value`` of a state tensor shaped like ``param`` as DCP must see it (see the module); ``None``
        where this rank holds none of a 0-dim parameter's state."""
        if param.dim() == 0:  # one element: its owner writes it whole
            return value.detach().view(()) if value.numel() else None
        if layout is None:  # one data-parallel rank: the whole shard, the view an unsharded optimizer's state has
            return dcp_view(value.detach().view(param.shape), shard_spec(param), shard_mesh)
        return dcp_range_view(value.detach(), param, layout)

    def checkpoint_entries(self, names: Mapping[int, str], meshes: ShardMeshes) -> dict[str, Tensor]:
        """This rank's optimizer state as ``torch.distributed.checkpoint`` entries ``{"<parameter name>.<key>": view}``
        (the float32 main copy as :data:`MAIN_PARAM`): each tensor shaped like the owned range is written in place,
        as chunks of the unsharded optimizer's tensor (global shape: the parameter's saved shape); scalar state
        (``step``) as it is. No communication.

        Raises:
            TypeError: a non-tensor state value.
        """
        entries: dict[str, Tensor] = {}
        for p in self.buckets.params:
            layout = self._range_layout(p)
            piece = self._pieces[id(p)]
            state = dict(self.inner.state.get(piece, {}))
            if piece is not self._views[id(p)] and state:
                state[MAIN_PARAM] = piece
            for key, value in state.items():
                if not isinstance(value, Tensor):
                    raise TypeError(f"Optimizer state '{key}' of '{names[id(p)]}' is a {type(value).__name__}: sharded "
                                    f"checkpoints hold tensors only.")
                if value.dim() == 1 and value.shape == piece.shape:
                    view = self._state_view(p, value, meshes(p), layout)
                    if view is not None:
                        entries[f"{names[id(p)]}.{key}"] = view
                else:
                    entries[f"{names[id(p)]}.{key}"] = value.detach()
        return entries

    def checkpoint_targets(self, saved: Mapping[str, tuple[tuple[int, ...], torch.dtype]], names: Mapping[int, str],
                           meshes: ShardMeshes) -> tuple[dict[str, Tensor], Callable[[Sequence[Mapping[str, Any]]], None]]:
        """Where to read this rank's optimizer state from a checkpoint: ``saved`` maps ``"<parameter name>.<key>"`` to
        the saved ``(shape, dtype)``. Returns the DCP targets (keyed like ``saved``) and ``finish(groups)``, which
        hands the read ranges to the inner optimizer (main params from :data:`MAIN_PARAM` where saved, else from the
        parameters as loaded) and the saved settings ``groups`` to each parameter group."""
        targets: dict[str, Tensor] = {}
        ranges: dict[int, dict[str, Tensor]] = {}
        by_name: dict[str, list[tuple[str, str, tuple[int, ...], torch.dtype]]] = {}
        for key, (shape, dtype) in saved.items():
            name, _, field = key.rpartition(".")
            by_name.setdefault(name, []).append((key, field, shape, dtype))
        for p in self.buckets.params:
            layout = self._range_layout(p)
            start, stop = self._ranges[id(p)]
            for key, field, shape, dtype in by_name.get(names[id(p)], []):
                if p.dim() > 0 and tuple(shape) == saved_shape(shard_spec(p), full_shape(p)):
                    value = torch.zeros(stop - start, dtype=dtype, device=p.device)
                    targets[key] = self._state_view(p, value, meshes(p), layout)
                elif p.dim() == 0 and tuple(shape) == () and field not in SCALAR_STATE:
                    whole = torch.zeros((), dtype=dtype, device=p.device)
                    targets[key] = whole
                    value = whole.view(1)[start:stop]
                else:
                    value = torch.zeros(tuple(shape), dtype=dtype)
                    targets[key] = value
                ranges.setdefault(id(p), {})[field] = value

        def finish(groups: Sequence[Mapping[str, Any]]) -> None:
            self._load_ranges(ranges, groups)

        return targets, finish

    def _load_ranges(self, ranges: Mapping[int, Mapping[str, Tensor]], groups: Sequence[Mapping[str, Any]]) -> None:
        inner_state: dict[int, dict[str, Tensor]] = {}
        position = 0
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in self._pieces:
                    continue
                mine = {key: value.to(p.device) if value.dim() else value for key, value in ranges.get(id(p), {}).items()}
                main = mine.pop(MAIN_PARAM, None)
                piece, view = self._pieces[id(p)], self._views[id(p)]
                if piece is not view:
                    piece.copy_(main if main is not None else view)
                if mine:
                    inner_state[position] = mine
                position += 1
        self._record_versions()
        inner_groups = self.inner.state_dict()["param_groups"]
        self.inner.load_state_dict({"state": inner_state, "param_groups": [
            {**dict(saved), "params": live["params"]} for saved, live in zip(groups, inner_groups)]})
        for saved, group in zip(groups, self.param_groups):
            group.update(saved)

    def _record_versions(self) -> None:
        self._versions = {key: tensor_version(view) for key, view in self._views.items()
                          if self._pieces[key] is not view}

    def _refresh_main_params(self) -> None:
        """A parameter written outside this optimizer since its last step (weights loaded into it) is taken as it
        is: its main copy restarts from it, rather than the step overwriting it with the stale copy."""
        for key, version in self._versions.items():
            if tensor_version(self._views[key]) != version:
                self._pieces[key].copy_(self._views[key])

    def remove(self) -> None:
        """Take the bucket hooks off the parameters."""
        self.buckets.remove()


def distribute_optimizers(optimizers: Sequence[Optimizer], lr_scheduler_configs: Sequence[Any], mesh: ParallelMesh,
                          pipelined: bool, main_params: bool = False) -> list[DistributedOptimizer]:
    """:class:`DistributedOptimizer` for each optimizer, and each learning-rate scheduler pointed at its optimizer's
    replacement (a scheduler writes ``lr`` into ``scheduler.optimizer.param_groups``). With one data-parallel rank
    there is nothing to shard: a warning says so.

    Raises:
        ValueError: from :class:`DistributedOptimizer`.
    """
    if all(mesh.size(name) == 1 for name in ("dp_cp", "edp")):
        warnings.warn("zero=1 shards the optimizer state over the data-parallel ranks, and this run has one (dp = 1): "
                      "nothing is saved. Use zero=0, or more devices than tp·pp.", stacklevel=2)
    sharded = [o if isinstance(o, DistributedOptimizer) else DistributedOptimizer(o, mesh, not pipelined, main_params)
               for o in optimizers]
    repoint_schedulers(lr_scheduler_configs, optimizers, sharded)
    return sharded


def repoint_schedulers(lr_scheduler_configs: Sequence[Any], old: Sequence[Optimizer], new: Sequence[Optimizer]
                       ) -> None:
    """Point each learning-rate scheduler of an optimizer of ``old`` at its replacement in ``new`` (a scheduler
    writes ``lr`` into ``scheduler.optimizer.param_groups``)."""
    for config in lr_scheduler_configs:
        for before, after in zip(old, new):
            if before is not after and getattr(config.scheduler, "optimizer", None) is before:
                config.scheduler.optimizer = after
                track_step_for_schedulers(after)


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of optimizer state this rank holds (zero=1: its element ranges'), summed over every state tensor."""
    own = getattr(optimizer, "state_bytes", None)  # an optimizer that holds element ranges counts its own
    if callable(own):
        return own()
    return sum(value.numel() * value.element_size() for state in optimizer.state.values() for value in state.values()
               if isinstance(value, torch.Tensor))


