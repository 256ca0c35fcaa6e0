"""The probes' small models, built once and copied for each probe that needs them.

A question prices tens of layouts; each layout's fit probes the same thirteen small configs
(:data:`~.probe._PROBES`) under its own recomputation and split backward. Building one (transformers' constructor and
weight init, PEFT's LoRA injection, the rewrite) cost several times what copying it does, and every layout built all
thirteen again. Here each is built and rewritten once per precision and tp, never run, and handed out as a deep copy:
recomputation, offload and the split backward then change the copy, never the one kept.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Optional

import torch
import torch.nn as nn


class ProbeModels:
    """Rewritten small models by config, trained parts, dtype and rank; the ``most`` last used are kept (a mixture's
    small copy holds all its experts).

    Args:
        most: how many models are kept (0: none, each built for its probe alone).
    """

    def __init__(self, most: int = 32) -> None:
        self.most = most
        self._held: OrderedDict[tuple, tuple[nn.Module, torch.Tensor]] = OrderedDict()

    def __getstate__(self) -> dict:
        # A cache does not travel: the probes' cache sent to another process (spawned ranks given the fits) carries
        # its fits, not hundreds of small models' tensors (each one a file descriptor under torch's sharing).
        return {"most": self.most}

    def __setstate__(self, state: dict) -> None:
        self.most, self._held = state["most"], OrderedDict()

    def rewritten(self, small: Any, training: Any, dtype: torch.dtype, group: Any,
                  sequence_parallel: bool) -> nn.Module:
        """A new copy of the model of ``small`` (a transformers config) as a run builds it on ``group``'s rank, before
        recomputation: ``training``'s LoRA and frozen parts (:func:`~.trained.apply_trained_parts`) on weights seeded
        0, cast to ``dtype``, rewritten with ``sequence_parallel``; never run. The global generator is left where that
        build left it, so what the probe draws next is what it drew after a build of its own."""
        from lightning_seqpar.hf.models import build_causal_lm
        from lightning_seqpar.plan.measuring.trained import apply_trained_parts
        from lightning_seqpar.policies import rewrite
        from lightning_seqpar.layout import Layout
        from lightning_seqpar.parallel.mesh import ParallelMesh
        from lightning_seqpar.transformer.context import RewriteContext

        key = (small.to_json_string(use_diff=False), None if training is None else training.key, dtype, group.size,
               group.rank, sequence_parallel)
        held = self._held.get(key)
        if held is not None:
            self._held.move_to_end(key)
            model, state = held
            torch.set_rng_state(state)
            return copy.deepcopy(model)
        torch.manual_seed(0)
        # trained as the run is (LoRA, frozen names) before the dtype, as the run's precision casts its wrapped model
        model = apply_trained_parts(build_causal_lm(small), training).to(dtype).train()
        # the run's context at the probe's tensor-parallel group; the loss whole (the planner prices its chunks)
        layout = Layout(tp=group.size, sequence_parallel=sequence_parallel, loss_chunk=None)
        rewrite(model, RewriteContext.of(layout, ParallelMesh({"tp": group})), verify=False)
        if self.most:
            self._held[key] = (copy.deepcopy(model), torch.get_rng_state())
            while len(self._held) > self.most:
                self._held.popitem(last=False)
        return model


def probe_models(measured: Optional[dict]) -> Optional[ProbeModels]:
    """The :class:`ProbeModels` kept in ``measured`` (the probes' cache a question shares between its fits), made
    there on first use; ``None`` without one (each probe builds its own)."""
    if measured is None:
        return None
    if _KEY not in measured:
        measured[_KEY] = ProbeModels()
    return measured[_KEY]


_KEY = ("probe models",)
