"""Hugging Face causal LMs built from a config or a local pretrained directory (``transformers`` imported here,
when called)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch.nn as nn


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError("Hugging Face models need transformers: pip install 'lightning_seqpar[hf]'.") from error
    return transformers


def causal_lm_config(config: Optional[dict] = None, pretrained: Optional[str] = None,
                     attn_implementation: str = "eager") -> Any:
    """The ``PretrainedConfig`` of a causal LM: from ``config`` (keyword arguments with ``model_type``, e.g.
    ``{"model_type": "llama", "hidden_size": 64, ...}``) or read from the local directory ``pretrained``.

    Raises:
        ValueError: neither or both of ``config`` and ``pretrained``.
        ImportError: without transformers, with the install command.
    """
    if (config is None) == (pretrained is None):
        raise ValueError("Give either config (a model of random init) or pretrained (a checkpoint directory), "
                         f"got config={config!r}, pretrained={pretrained!r}.")
    auto_config = _transformers().AutoConfig
    if pretrained is not None:
        check_model_directory(pretrained)
        return auto_config.from_pretrained(pretrained, attn_implementation=attn_implementation)
    options = dict(config)
    return auto_config.for_model(options.pop("model_type"), attn_implementation=attn_implementation, **options)


def check_model_directory(directory: str) -> None:
    """Refuse a local model directory that cannot be read as one, naming what is missing.

    Raises:
        FileNotFoundError: no such directory, one without ``config.json`` (listing what it holds), a weight file its
            index names missing, or no weights at all.
    """
    path = Path(directory)
    if not path.exists():
        raise FileNotFoundError(f"No model directory at {directory} (model.pretrained must be a local Hugging Face "
                                f"model directory: config.json, *.safetensors and its tokenizer; nothing is downloaded).")
    if path.is_dir() and not (path / "config.json").is_file():
        held = sorted(p.name for p in path.iterdir())
        raise FileNotFoundError(f"{directory} has no config.json, so it is not a Hugging Face model directory (it holds "
                                f"{held[:12]}{' ...' if len(held) > 12 else ''}). Point model.pretrained at the directory "
                                f"save_pretrained wrote (config.json beside the *.safetensors).")
    index = path / "model.safetensors.index.json"
    if path.is_dir() and index.is_file():  # a sharded checkpoint: every file its index names
        files = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing = [name for name in files if not (path / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{directory} lacks {missing[:6]}{' ...' if len(missing) > 6 else ''}, named by "
                                    f"its model.safetensors.index.json: the model directory is incomplete. Copy it "
                                    f"whole again.")
    elif path.is_dir() and not any(path.glob("*.safetensors")) and not any(path.glob("pytorch_model*.bin")):
        raise FileNotFoundError(f"{directory} holds no weights (no *.safetensors): copy the model directory whole "
                                f"again, or give a config for a model of random init.")


def build_causal_lm(config: Any) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)``: a model of random init (its weights are replaced when
    pretrained ones are loaded)."""
    return _transformers().AutoModelForCausalLM.from_config(config)


def pretrained_state_dict(directory: str) -> dict:
    """The state dict of the pretrained causal LM in ``directory``, read whole (for one device)."""
    return _transformers().AutoModelForCausalLM.from_pretrained(directory).state_dict()


def saved_tensor_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Name → shape of each tensor ``save_pretrained`` writes for a causal LM of ``config``, in the model's order: its
    persistent state, a tied weight once (under its first name). Built on the meta device: no memory is used."""
    import torch

    with torch.device("meta"):
        model = build_causal_lm(config)
    shapes, seen = {}, set()
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) not in seen:
            seen.add(id(value))
            shapes[name] = tuple(value.shape)
    return shapes


def config_defaults(model_type: str) -> dict[str, Any]:
    """The default values of the config class of ``model_type`` (``{}`` for a model type transformers does not
    know, or whose config cannot be made with no arguments)."""
    mapping = _transformers().CONFIG_MAPPING
    if model_type not in mapping:
        return {}
    try:
        return mapping[model_type]().to_dict()
    except Exception:  # noqa: BLE001 - a composite config that needs its parts: no defaults to read
        return {}


def config_aliases(model_type: str) -> Optional[dict[str, str]]:
    """The ``attribute_map`` of the config class of ``model_type`` (``hidden_size`` → ``n_embd`` for GPT-2...), or
    ``None`` for a model type transformers does not know."""
    mapping = _transformers().CONFIG_MAPPING
    if model_type not in mapping:
        return None
    return dict(getattr(mapping[model_type], "attribute_map", {}))
