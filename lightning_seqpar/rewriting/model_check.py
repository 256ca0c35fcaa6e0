"""The rewrite checks the whole model, called as its user calls it: accepted means it computes what one device does.

A per-block check misses what lies between blocks (an embedding scale), what differs from one layer to the next (a
layer without rotary embeddings) and arguments the model passes in its own way. So before training, a small copy of
the whole model (every layer with its own settings, its embedding, final norm and head) runs through the model's own
``forward``, once as it is and once rewritten, on t tensor-parallel ranks emulated by threads of this process
(:mod:`lightning_seqpar.parallel.emulated`, no process group), in float64; the outputs must agree to float64
rounding plus the float32 rounding of parts that compute in float32 (Hugging Face's RMSNorm and loss).

On a mismatch, each part's output (embedding, layers, final norm) is compared in model order, and the first part that
differs is named; a part that raises is named with its error.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.parallel.emulated import run_emulated

RELATIVE_BOUND = 1e-6
"""‖parallel − original‖ / ‖original‖ allowed on the model's outputs: float64 rounding plus float32 norms and loss
(a missing part gives > 1e-3: Gemma's embedding scale 2e-2, a NoPE layer 1e-1)."""


class ModelCheckError(ValueError):
    """The whole-model check refused the model (a ``ValueError``: raised before any process communicates)."""


@dataclass
class Difference:
    """How the parallel model's outputs compare with the model's: the largest relative difference and where."""

    relative: float
    output: str


def _relative(got: Tensor, want: Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    return ((got - want).norm() / want.norm().clamp_min(1e-300)).item()


def _as_plain(value: Any) -> Any:
    gathered = getattr(value, "gathered", None)  # vocabulary-sharded logits: the single-device tensor
    return gathered().detach().clone() if callable(gathered) else value


PER_RANK_OUTPUTS = frozenset({"router_logits"})
"""Outputs that hold each rank's own tokens by design, not compared: a mixture of experts' router logits are those of
the rank's ``s/t·b`` rows (the load-balancing loss pools them over the ranks, and ``aux_loss`` is compared)."""


def _outputs(result: Any) -> dict[str, Tensor]:
    """The tensors a model returns, by name (``loss``, ``logits`` of a Hugging Face output; or the tensor; a dict of
    such results, by its keys, :data:`PER_RANK_OUTPUTS` left out)."""
    if isinstance(result, dict):
        return {f"{key} {name}".strip(): v for key, value in result.items() if key not in PER_RANK_OUTPUTS
                for name, v in _outputs(value).items()}
    if isinstance(result, Tensor):
        return {"output": _as_plain(result)}
    if isinstance(result, (tuple, list)):
        return {f"output {i}": _as_plain(v) for i, v in enumerate(result) if isinstance(v, Tensor)}
    names = [n for n in ("loss", "logits") if isinstance(getattr(result, n, None), Tensor)]
    return {n: _as_plain(getattr(result, n)) for n in names}


def _first_tensor(value: Any) -> Optional[Tensor]:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
        return value[0]
    return None


class _Recorder:
    """Forward hooks on the parts of one model: the output of each (first tensor), and the part that was running
    when an error was raised."""

    def __init__(self, model: nn.Module, parts: Sequence[str]) -> None:
        self.outputs: dict[str, Tensor] = {}
        self.running: list[str] = []
        self.handles = []
        for name in parts:
            module = model.get_submodule(name)
            self.handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self.running.append(n)))
            self.handles.append(module.register_forward_hook(lambda m, a, out, n=name: self._done(n, out)))

    def _done(self, name: str, out: Any) -> None:
        self.running.pop()
        tensor = _first_tensor(out)
        if tensor is not None:
            self.outputs[name] = _as_plain(tensor).detach().clone()


def _assemble(shards: list[Tensor], want: Tensor) -> Optional[Tensor]:
    """A part's single-device output ``[b, s, ...]`` from the ranks' outputs: batch-first as on one device, or
    sequence-first ``[s, b, ...]`` (replicated) or ``[s/t, b, ...]`` (a sequence-parallel shard)."""
    first = shards[0]
    if first.shape == want.shape:
        return first
    if first.dim() >= 2 and first.shape[1] == want.shape[0]:
        whole = torch.cat(shards, dim=0) if first.shape[0] * len(shards) == want.shape[1] else first
        whole = whole.transpose(0, 1)
        return whole if whole.shape == want.shape else None
    return None


def check_whole_model(original: nn.Module, build_parallel: Callable[[nn.Module, ParallelGroup], nn.Module],
                      call: Callable[[nn.Module], Any], tp: int, parts: Sequence[str], name: str,
                      call_text: str = "model(...)") -> Difference:
    """Run ``call(model)`` on ``original`` (float64, eval) and on its rewritten copies at ``tp`` emulated ranks
    (``build_parallel(copy, group)`` rewrites one rank's copy in place and returns it); compare the outputs.

    ``parts``: submodule paths, in the order the model runs them, whose outputs locate a difference; ``call_text``:
    how ``call`` calls the model, for the messages.

    Returns:
        The largest relative difference of the outputs (≤ :data:`RELATIVE_BOUND`).

    Raises:
        ModelCheckError: the outputs differ (naming the first part whose output differs), or the original or the
            parallel model fails on the input (naming the running part and the error).
    """
    original = original.double().eval()
    reference = _Recorder(original, parts)
    try:
        with torch.no_grad():
            want = _outputs(call(original))
    except Exception as error:  # noqa: BLE001 - the model cannot be run as the check runs it: refused, named
        raise ModelCheckError(
            f"{name}: the rewrite's whole-model check could not run a small copy of the model on one device "
            f"({type(error).__name__}: {error}). The model cannot be checked, so it is not accepted.") from error

    def one_rank(group: ParallelGroup) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        parallel = build_parallel(copy.deepcopy(original), group).eval()
        recorder = _Recorder(parallel, parts)
        try:
            with torch.no_grad():
                return _outputs(call(parallel)), recorder.outputs
        except Exception as error:
            where = recorder.running[-1] if recorder.running else "the model"
            raise ModelCheckError(
                f"{name}: its tensor-parallel version fails at {where} on a small input at tp={tp}: "
                f"{type(error).__name__}: {error}") from error

    try:
        ranks = run_emulated(tp, one_rank)
    except ModelCheckError:
        raise
    except Exception as error:  # noqa: BLE001 - the rewrite of the small copy itself failed
        raise ModelCheckError(f"{name}: rewriting a small copy of the model at tp={tp} failed: "
                              f"{type(error).__name__}: {error}") from error
    got = ranks[0][0]
    worst = Difference(0.0, "")
    for key, value in want.items():
        relative = _relative(got[key], value) if key in got else float("inf")
        if not relative <= worst.relative:
            worst = Difference(relative, key)
    if worst.relative <= RELATIVE_BOUND:
        return worst
    raise ModelCheckError(
        f"{name}: its tensor-parallel version does not compute what the model computes: on a small float64 copy at "
        f"tp={tp}, called as {call_text}, the {worst.output} differs by {worst.relative:.3g} "
        f"(relative). {_locate(reference.outputs, [r[1] for r in ranks], parts)}"
    )


def _locate(want: dict[str, Tensor], ranks: list[dict[str, Tensor]], parts: Sequence[str]) -> str:
    for part in parts:
        if part not in want or part not in ranks[0]:
            continue
        got = _assemble([r[part] for r in ranks], want[part])
        relative = float("inf") if got is None else _relative(got, want[part])
        if not relative <= RELATIVE_BOUND:
            return f"The first part whose output differs is {part} ({relative:.3g} relative)."
    return "Every part's output agrees; the difference comes after the last one (the head or the loss)."
