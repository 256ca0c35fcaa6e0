"""Checks before a run wraps a model with LoRA: target names that match a module, and an adapter directory that is
whole and made for this base. Each raises before any process starts, naming the directory, the file or the name and
the fix, where transformers, PEFT or safetensors would fail later with a message about something else (a meta tensor
that cannot be copied, a header that cannot be parsed, adapters silently on fewer modules than asked).

The base is the plain causal LM (no PEFT wrapping), typically built on the meta device from its config: nothing is
allocated.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch.nn as nn

from lightning_seqpar.checkpoint.atomic import file_digest
from lightning_seqpar.checkpoint.destination import EXPORT_MARKER
from lightning_seqpar.checkpoint.peft_export import ADAPTER_FILE, CONFIG_FILE
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections LoRA adapts unless told otherwise: every projection of a Llama-layout block (QLoRA's choice, Dettmers
et al. 2023; the fine-tuning module's and the planner's default)."""

_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


def linear_names(base: nn.Module) -> list[str]:
    """The last name of every linear layer of ``base`` (``q_proj``, ``down_proj``, ``lm_head``, ...), once each."""
    return sorted({name.rpartition(".")[2] for name, module in base.named_modules()
                   if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"})  # GPT-2's projections


def check_lora_targets(targets: Union[str, Sequence[str]], base: nn.Module) -> None:
    """Refuse LoRA ``target_modules`` that match no module of ``base`` (PEFT's rule: a name matches a module whose
    qualified name is it or ends with ``.name``; a string is a regular expression over the qualified names, and
    ``"all-linear"`` matches every linear layer but the head).

    Raises:
        ValueError: naming the targets that match nothing and the linear names the model has.
    """
    names = [name for name, _ in base.named_modules() if name]
    if isinstance(targets, str):
        if targets == "all-linear" or any(re.fullmatch(targets, name) for name in names):
            return
        unmatched = [targets]
    else:
        unmatched = [t for t in targets if not any(name == t or name.endswith("." + t) for name in names)]
    if unmatched:
        raise ValueError(f"LoRA target_modules {unmatched} match no module of {type(base).__name__}, so no adapter "
                         f"would be put there. Its linear layers are named {', '.join(linear_names(base))}; set "
                         f"peft.target_modules to some of those.")


def expert_parameter_targets(base: nn.Module) -> list[str]:
    """PEFT ``target_parameters`` for LoRA on every mixture's experts in ``base``: both packed projections,
    ``<mlp>.experts.gate_up_proj`` and ``<mlp>.experts.down_proj`` (``mlp``, or ``block_sparse_moe`` for GraniteMoE);
    empty for a dense model. What ``"all-linear"`` means on a mixture, where PEFT's own rule skips the experts of some
    families (gpt-oss, Qwen2-MoE)."""
    from lightning_seqpar.hf.layouts import mlp_name, moe_parts

    found = []
    for module in base.modules():
        name = mlp_name(module)
        if moe_parts(getattr(module, name, None)) is not None:
            found += [f"{name}.experts.{weight}" for weight in ("gate_up_proj", "down_proj")]
    return list(dict.fromkeys(found))  # once each, in the model's order


def check_lora_parameters(targets: Optional[Sequence[str]], base: nn.Module) -> None:
    """Refuse LoRA ``target_parameters`` that name no parameter of ``base`` (PEFT's rule: a parameter whose qualified
    name is the target or ends with ``.target``).

    Raises:
        ValueError: naming the targets that match nothing and the packed expert weights the model has.
    """
    names = [name for name, _ in base.named_parameters()]
    unmatched = [t for t in targets or () if not any(name == t or name.endswith("." + t) for name in names)]
    if unmatched:
        packed = sorted({name.split(".layers.")[-1].partition(".")[2] for name, p in base.named_parameters()
                         if p.dim() == 3})
        raise ValueError(f"LoRA target_parameters {unmatched} match no parameter of {type(base).__name__}. Its packed "
                         f"expert weights are {packed or 'none (a dense model: use target_modules)'}; set "
                         f"peft.target_parameters to some of those.")


def lora_config(settings: dict) -> Any:
    """PEFT's ``LoraConfig`` of LoRA settings as this project records them: ``r``, ``alpha``, ``dropout``,
    ``target_modules`` (names, or ``"all-linear"``) and ``target_parameters`` (packed expert weights, or ``None``).

    Raises:
        ImportError: PEFT not installed, with the install command.
    """
    try:
        from peft import LoraConfig
    except ImportError as error:
        raise ImportError("LoRA needs PEFT: pip install 'lightning_seqpar[peft]'.") from error
    modules, parameters = settings["target_modules"], settings.get("target_parameters")
    return LoraConfig(r=settings["r"], lora_alpha=settings["alpha"], lora_dropout=settings["dropout"],
                      target_modules=modules if isinstance(modules, str) else list(modules),
                      target_parameters=list(parameters) if parameters else None)


def safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Name → shape of each tensor in a safetensors file, read from its header alone.

    Raises:
        ValueError: a header that cannot be read (a damaged or truncated file), naming the file.
    """
    try:
        with open(file, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > file.stat().st_size - 8:
                raise ValueError(f"its header claims {length:,} bytes, more than the file holds")
            header = json.loads(handle.read(length))
        return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{file} cannot be read as safetensors: its header is damaged ({error}). Export the adapter "
                         f"again, or copy it whole.") from None


def check_adapter_directory(directory: Union[str, Path], base: nn.Module, base_name: str) -> dict[str, Any]:
    """The adapter config of ``directory`` once the directory is whole and made for ``base``: its two files present,
    their digests (recorded by this project's exports) matching, and every LoRA tensor the shape ``base``'s module
    of that name needs (``A`` ``[r, in]``, ``B`` ``[out, r]``).

    Raises:
        FileNotFoundError: no such directory, or one without ``adapter_config.json`` / ``adapter_model.safetensors``.
        ValueError: a file whose digest differs from the one recorded at export, a damaged header, or a tensor for a
            module ``base`` does not have or of another shape, naming the adapter, the base it was made for
            (``base_model_name_or_path``) and the fix.
    """
    directory = Path(directory)
    for name in (CONFIG_FILE, ADAPTER_FILE):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory} is not a PEFT adapter directory: it has no {name} (peft.adapter= "
                                    f"names the directory export_peft_adapter or PeftModel.save_pretrained wrote).")
    _check_digests(directory)
    config = json.loads((directory / CONFIG_FILE).read_text())
    made_for = config.get("base_model_name_or_path") or "an unnamed base"
    modules = dict(base.named_modules())
    for key, shape in safetensors_shapes(directory / ADAPTER_FILE).items():
        match = _LORA_KEY.match(key)
        if match is None:
            continue
        path, part = match["module"], match["part"]
        if ".base_layer" in path or path.endswith(".experts"):  # PEFT's nested wrappers of packed expert weights
            _check_expert_adapter(directory, made_for, base_name, key, shape, modules, path, part, config.get("r"))
            continue
        module = modules.get(path)
        if module is None:
            raise ValueError(f"The adapter {directory} was made for {made_for}: it adapts {path}, which this base "
                             f"({base_name}) does not have. Start from an adapter of this base, or set "
                             f"model.pretrained to the base it was made for.")
        out_features, in_features = _features(module)
        want = (config.get("r"), in_features) if part == "A" else (out_features, config.get("r"))
        if tuple(shape) != tuple(want):
            raise ValueError(f"The adapter {directory} was made for {made_for}: its {key} is {list(shape)}, but this "
                             f"base ({base_name}) needs {list(want)} for {path} (r={config.get('r')}). Start from an "
                             f"adapter of this base, or set model.pretrained to the base it was made for.")
    return config


def _check_expert_adapter(directory: Path, made_for: str, base_name: str, key: str, shape: tuple[int, ...],
                          modules: dict[str, nn.Module], path: str, part: str, r: Any) -> None:
    """An adapter of a packed expert weight (``...experts[.base_layer].lora_A``): ``A`` ``[r·E, in]``, ``B``
    ``[out, r·E]`` of one of the experts' two projections."""
    experts = modules.get(path.replace(".base_layer", ""))
    weights = [getattr(experts, n, None) for n in ("gate_up_proj", "down_proj")]
    if experts is None or any(w is None or w.dim() != 3 for w in weights):
        raise ValueError(f"The adapter {directory} was made for {made_for}: it adapts packed expert weights at "
                         f"{path}, which this base ({base_name}) does not have. Start from an adapter of this base, "
                         f"or set model.pretrained to the base it was made for.")
    transposed = bool(getattr(experts, "is_transposed", False))
    allowed = set()
    for weight in weights:
        count, first, second = weight.shape
        fan_in, fan_out = (first, second) if transposed else (second, first)
        allowed.add((r * count, fan_in) if part == "A" else (fan_out, r * count))
    if tuple(shape) not in allowed:
        raise ValueError(f"The adapter {directory} was made for {made_for}: its {key} is {list(shape)}, but this base "
                         f"({base_name}) needs one of {sorted(map(list, allowed))} for the experts at "
                         f"{path.replace('.base_layer', '')} (r={r}). Start from an adapter of this base, or set "
                         f"model.pretrained to the base it was made for.")


def _features(module: nn.Module) -> tuple[int, int]:
    if hasattr(module, "out_features") and hasattr(module, "in_features"):
        return int(module.out_features), int(module.in_features)
    weight = getattr(module, "weight", None)  # GPT-2's Conv1D keeps [in, out]
    return (int(weight.shape[1]), int(weight.shape[0])) if weight is not None else (-1, -1)


def _check_digests(directory: Path) -> None:
    """Verify the files an export of this project recorded digests for (none recorded: nothing to verify)."""
    try:
        recorded = json.loads((directory / EXPORT_MARKER).read_text()).get("sha256", {})
    except (OSError, ValueError, AttributeError):
        return
    for name, digest in sorted(recorded.items()):
        if (directory / name).is_file() and file_digest(directory / name) != digest:
            raise ValueError(f"{directory / name} differs from what was exported (its SHA-256 does not match the one "
                             f"recorded in {EXPORT_MARKER}): the file is damaged. Export the adapter again.")
