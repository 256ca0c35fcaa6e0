"""Muon with auxiliary AdamW in one optimizer: the matrices orthogonalised, everything else by AdamW.

The form Keller Jordan's ``MuonWithAuxAdam`` and Moonlight use: one optimizer whose param groups say ``use_muon``;
Muon's groups follow ``torch.optim.Muon`` exactly (momentum, Nesterov, torch's Newton–Schulz, decoupled weight decay,
the learning rate adjusted by each matrix's shape), AdamW's groups ``torch.optim.AdamW`` (its functional form, one
tensor at a time). One optimizer is what automatic optimization steps, so it is the way to train with Muon under
pipeline parallelism (where manual optimization is refused) and under any strategy that wants one optimizer.

Matrices of three dims (a mixture's experts, ``[E, n, m]`` as transformers packs them) are orthogonalised expert by
expert. Under :class:`~lightning_seqpar.SeqParallelStrategy` every matrix is orthogonalised whole, once, on one owner
rank (:func:`~lightning_seqpar.optim.sharded_muon.orthogonalised`): the strategy places the optimizer on its mesh
before the first step (:meth:`Muon.place`). Without it (one process) every matrix is whole where it is. Under
``zero=1`` the distributed optimizer steps its ranges with :class:`~lightning_seqpar.optim.range_muon.RangeMuon`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn as nn
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.adamw import adamw

from lightning_seqpar.optim.sharded_muon import matrix_split, muon_step, orthogonalised

_NS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's coefficients


class Muon(Optimizer):
    """Muon over the groups with ``use_muon=True``, AdamW over the others.

    Args:
        params: parameters (all Muon's), or groups each with ``use_muon`` (:meth:`groups` makes them for a model).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: Muon's, as
            ``torch.optim.Muon`` takes them (the same defaults).
        adamw_lr: AdamW's learning rate (default ``lr``); adamw_betas, adamw_eps, adamw_weight_decay (default
            ``weight_decay``): AdamW's. A group may set ``lr``, ``betas``, ``eps``, ``weight_decay`` itself.

    Attributes:
        newton_schulz_runs: orthogonalisations this rank ran (cumulative; an expert's matrix counts one).

    Raises:
        ValueError: a Muon parameter of fewer than two dims, or a negative learning rate, momentum or weight decay.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients: tuple[float, float, float] = _NS, eps: float = 1e-7,
                 ns_steps: int = 5, adjust_lr_fn: Optional[str] = None, adamw_lr: Optional[float] = None,
                 adamw_betas: tuple[float, float] = (0.9, 0.95), adamw_eps: float = 1e-8,
                 adamw_weight_decay: Optional[float] = None) -> None:
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if value < 0:
                raise ValueError(f"Muon: {name}={value} must be at least 0.")
        muon = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                    ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        adamw = dict(lr=lr if adamw_lr is None else adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                     weight_decay=weight_decay if adamw_weight_decay is None else adamw_weight_decay)
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups, "use_muon": True}]
        filled = [{**(muon if g.get("use_muon", True) else adamw), **g, "use_muon": g.get("use_muon", True)}
                  for g in groups]
        super().__init__(filled, {"use_muon": True})
        for group in self.param_groups:
            flat = [p for p in group["params"] if group["use_muon"] and self._matrix_of(p).dim() < 2]
            if flat:
                raise ValueError(f"Muon orthogonalises matrices; a parameter of shape "
                                 f"{tuple(self._matrix_of(flat[0]).shape)} is in a use_muon group. Put it in a group "
                                 f"with use_muon=False (AdamW).")
        self.newton_schulz_runs = 0
        self.mesh: Any = None
        """the :class:`~lightning_seqpar.parallel.mesh.ParallelMesh` whose groups split the matrices (:meth:`place`);
        ``None``: every matrix whole here"""
        self._splits: dict[int, Any] = {}

    def _matrix_of(self, held: Tensor) -> Tensor:
        """The parameter whose matrix ``held`` (what this optimizer updates) is: itself."""
        return held

    @staticmethod
    def matrices(model: nn.Module) -> list[nn.Parameter]:
        """The trainable parameters of ``model`` Muon is for: two dims or more, outside the embeddings and the output
        head (``nn.Embedding`` modules, what a Hugging Face model's ``get_input_embeddings`` and
        ``get_output_embeddings`` return, anywhere in ``model``, and parameters named ``lm_head``, ``wte``, ``wpe`` or
        ``embed_*``, the vocabulary-parallel versions of those included); what Keller Jordan's recipe leaves to
        AdamW."""
        apart = set()
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                apart |= {id(p) for p in module.parameters()}
            for getter in ("get_input_embeddings", "get_output_embeddings"):
                found = getattr(module, getter, None)
                found = found() if callable(found) else None
                if isinstance(found, nn.Module):
                    apart |= {id(p) for p in found.parameters()}
        for name, p in model.named_parameters():
            if any(part in ("lm_head", "wte", "wpe") or part.startswith("embed") for part in name.split(".")):
                apart.add(id(p))
        return [p for p in model.parameters() if p.requires_grad and p.dim() >= 2 and id(p) not in apart]

    @staticmethod
    def groups(model: nn.Module) -> list[dict[str, Any]]:
        """``model``'s trainable parameters as Muon's groups: :meth:`matrices` (``use_muon=True``), everything else
        (``use_muon=False``)."""
        matrices = Muon.matrices(model)
        chosen = {id(p) for p in matrices}
        return [{"params": matrices, "use_muon": True},
                {"params": [p for p in model.parameters() if p.requires_grad and id(p) not in chosen],
                 "use_muon": False}]

    def place(self, mesh: Any) -> None:
        """Orthogonalise each matrix whole over ``mesh``'s groups (a
        :class:`~lightning_seqpar.parallel.mesh.ParallelMesh`: the strategy's, before the first step).

        Raises:
            ValueError: a matrix split along both of its dims.
        """
        self.mesh = mesh
        self._splits = {id(p): matrix_split(p, mesh) for g in self.param_groups if g["use_muon"] for p in g["params"]}

    def _count(self, runs: int) -> None:
        self.newton_schulz_runs += runs

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One step: Muon's groups as ``torch.optim.Muon`` (each matrix whole), AdamW's as ``torch.optim.AdamW``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw(group)
        muon_step(self, [g for g in self.param_groups if g["use_muon"]], self._orthogonalised, self._matrix_of)
        return loss

    def _orthogonalised(self, entries: list[tuple[Tensor, Tensor, tuple]]) -> list[Tensor]:
        """Each entry's update orthogonalised whole (:func:`~lightning_seqpar.optim.sharded_muon.orthogonalised`)."""
        return orthogonalised(entries, self._splits, self.mesh, self._count)

    def _adamw(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if params:
            beta1, beta2 = group["betas"]
            adamw(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=False, amsgrad=False,
                                    beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                                    eps=group["eps"], maximize=False)
