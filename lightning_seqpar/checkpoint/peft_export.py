"""LoRA adapters trained under the strategy, back to the ecosystem: a PEFT adapter directory, or merged weights.

- **Adapter directory** (:func:`export_peft_adapter`): ``adapter_config.json`` (the PEFT config the model was wrapped
  with) and ``adapter_model.safetensors`` under PEFT's own keys (``base_model.model.<module>.lora_A.weight``: the
  adapter's name dropped, as ``get_peft_model_state_dict`` saves them), so ``PeftModel.from_pretrained(base, DIR)``
  loads it. Adapters are r-sized: each is assembled from its tensor-parallel shards and pipeline stages (a few MB for
  a 70B model at r = 16) while no rank holds any base weight it does not hold already.
- **Merged** (:class:`MergedLoRA`, used by ``save_hf_pretrained(..., merge_lora=True)``): ``W + (α/r)·B·A`` of each
  adapted projection under the base model's key, every other tensor as it is: an ordinary Hugging Face directory. Each
  rank merges its own shard (column-parallel: ``B``'s rows and ``W``'s; row-parallel: ``A``'s columns and ``W``'s),
  so the merged shard is computed where the shards are and streamed like any other tensor.

Both are collective; the directory is published atomically.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from lightning_seqpar.checkpoint.atomic import publish, recover_stale, temporary_path
from lightning_seqpar.checkpoint.destination import export_refusal, mark_export
from lightning_seqpar.checkpoint.stages import merge_over_stages
from lightning_seqpar.hf.streaming import SafetensorsStreamWriter, TensorEntry
from lightning_seqpar.parallel.mesh import ParallelMesh
from lightning_seqpar.checkpoint.full_state import full_tensor
from lightning_seqpar.transformer.expert_lora import ExpertLoRA
from lightning_seqpar.transformer.tuner_layers import is_peft_tuner_layer

ADAPTER_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"


def peft_model(module: nn.Module, prefix: str) -> Any:
    """The PEFT-wrapped model under ``prefix`` in ``module``.

    Raises:
        ValueError: nothing there is a PEFT model, naming the fix.
    """
    model = module.get_submodule(prefix.rstrip(".")) if prefix else module
    if not isinstance(getattr(model, "peft_config", None), dict):
        raise ValueError(f"The model under prefix '{prefix}' ({type(model).__name__}) carries no PEFT adapters: "
                         f"export it with save_hf_pretrained, or wrap it with peft.get_peft_model before training.")
    return model


def _adapters(model: nn.Module) -> list[tuple[str, str, nn.Module]]:
    """``(layer path, adapter name, layer)`` of every adapted projection (rewritten or not)."""
    found = []
    for name, layer in model.named_modules():
        lora_a = getattr(layer, "lora_A", None)
        if isinstance(lora_a, nn.ModuleDict) and (is_peft_tuner_layer(layer) or hasattr(layer, "base_layer")):
            found.extend((name, adapter, layer) for adapter in lora_a)
    return found


def _gathered(param: Tensor, mesh: ParallelMesh) -> Tensor:
    """The single-device adapter: gathered over the groups its placement splits it over (tp; ep and etp for an
    expert's)."""
    return full_tensor(param, mesh).cpu().clone()


def export_peft_adapter(module: nn.Module, mesh: ParallelMesh, out: os.PathLike | str, prefix: str = "model.",
                        overwrite: bool = False, protected: Sequence[Optional[os.PathLike | str]] = ()) -> Path:
    """Write the adapters of the PEFT model under ``prefix`` as a PEFT adapter directory (see the module docstring).
    Collective over the default process group. Returns ``out``.

    Raises:
        ValueError: no PEFT model under ``prefix``.
        FileExistsError: a destination that must not be written (:mod:`lightning_seqpar.checkpoint.destination`).
    """
    model = peft_model(module, prefix)
    local: dict[str, Tensor] = {}
    for path, adapter, layer in _adapters(model):
        for matrix in ("lora_A", "lora_B"):
            key = f"{path}.{matrix}.weight"  # PEFT's saved key: the adapter's name dropped
            local[key] = _gathered(getattr(layer, matrix)[adapter].weight, mesh)
    adapters = merge_over_stages(local, mesh.pipeline)
    out = Path(out)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    decided = [str(temporary_path(out)), export_refusal(out, overwrite=overwrite, protected=protected)]
    if distributed:
        dist.broadcast_object_list(decided, src=0)
    if decided[1] is not None:
        raise FileExistsError(decided[1])
    if not distributed or dist.get_rank() == 0:
        tmp = Path(decided[0])
        out.parent.mkdir(parents=True, exist_ok=True)
        recover_stale(out.parent)
        tmp.mkdir()
        try:
            ordered = sorted(adapters.items())
            writer = SafetensorsStreamWriter(tmp / ADAPTER_FILE, [TensorEntry(k, v.dtype, tuple(v.shape))
                                                                  for k, v in ordered])
            for key, value in ordered:
                writer.write(key, value.contiguous())
            writer.close()
            name = next(iter(model.peft_config))
            config = model.peft_config[name].to_dict()
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True, default=_json_default))
            mark_export(tmp, "adapter", digests=True)  # verified when a run starts from it
            publish(tmp, out)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    if distributed:
        dist.barrier()
    return out


def adapter_state_dict(directory: Path, prefix: str, model: Any) -> Any:
    """A PEFT adapter directory's weights as the PEFT-wrapped ``model`` (under ``prefix``) names them: PEFT saves
    ``...q_proj.lora_A.weight``, the live model holds ``...q_proj.lora_A.<adapter>.weight``. Lazy: each rank reads
    its own slices.

    Raises:
        FileNotFoundError: no ``adapter_model.safetensors`` in ``directory``.
    """
    from lightning_seqpar.hf.weights import SafetensorsStateDict

    file = directory / ADAPTER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{directory} is not a PEFT adapter directory: it has no {ADAPTER_FILE}.")
    name = next(iter(model.peft_config)) if model is not None else "default"

    def rename(key: str) -> str:
        return re.sub(r"\.(lora_[AB])\.weight$", rf".\1.{name}.weight", key)

    return SafetensorsStateDict(file, prefix, rename)


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


def _base_key(key: str) -> str:
    """A PEFT-wrapped model's key as the base model's (``base_model.model.`` and ``base_layer.`` removed)."""
    key = key[len("base_model.model."):] if key.startswith("base_model.model.") else key
    return re.sub(r"(\.base_layer)+\.", ".", key)  # nested: one ParamWrapper per adapted expert weight


class MergedLoRA:
    """The merged export of the PEFT model under ``prefix`` in ``module``: :meth:`names` gives the tensors written (the
    module's, by state-dict key, the adapters dropped, under the base model's keys), and calling it with a written
    name and this rank's shard of the base weight gives ``W + scaling·B·A`` (this rank's shard: column-parallel, B's
    rows; row-parallel, A's columns), computed when that tensor is written, one at a time."""

    def __init__(self, module: nn.Module, prefix: str = "model.") -> None:
        self.prefix = prefix
        self.adapted = {_base_key(f"{path}.base_layer.{getattr(layer, 'parameter_name', 'weight')}"): (layer, adapter)
                        for path, adapter, layer in _adapters(peft_model(module, prefix))}

    def names(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        return {self.prefix + _base_key(key[len(self.prefix):] if key.startswith(self.prefix) else key): value
                for key, value in tensors.items() if ".lora_A." not in key and ".lora_B." not in key}

    def __call__(self, name: str, weight: Tensor) -> Tensor:
        if name not in self.adapted:
            return weight
        layer, adapter = self.adapted[name]
        if isinstance(layer, ExpertLoRA):  # this rank's experts (and slice of their width)
            return weight + layer.delta_weight().detach().to(weight.dtype)
        a, b = layer.lora_A[adapter].weight.detach(), layer.lora_B[adapter].weight.detach()
        scaling = layer.scaling if isinstance(layer.scaling, (int, float)) else layer.scaling[adapter]
        return weight + scaling * (b.to(weight.dtype) @ a.to(weight.dtype))
