"""The whole-model check of a Hugging Face causal LM (:mod:`lightning_seqpar.rewriting.model_check`): a small copy
built from the model's own config, called as users call it, ``model(input_ids=x, labels=x)``.

The copy keeps everything that decides what the model computes: its class, the number of layers and every per-layer
list of the config (``layer_types``, ``no_rope_layers``, ...), the head counts (so the split over t), every flag and
multiplier; only the widths shrink (4 values per head, an MLP of 4·t, a vocabulary of 4·t + 1 rows, padded like
any). Its weights are redrawn (an initialization that zeroes a projection would hide a part left out).

When the copy disagrees, each config setting that differs from the config class's default is set back to it in turn;
those that make the difference go away are named (``clip_qkv``, ``residual_multiplier``): the rewrite does not
implement them.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from lightning_seqpar._compat import experts_implementation, use_eager_experts
from lightning_seqpar.parallel.collectives import ParallelGroup
from lightning_seqpar.rewriting.model_check import ModelCheckError, check_whole_model

_HEAD_DIM = 4
_BATCH = 2
_SIZES = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "head_dim", "vocab_size", "max_position_embeddings", "n_embd", "n_layer", "n_head", "n_inner",
          "n_positions", "pad_token_id", "bos_token_id", "eos_token_id", "torch_dtype", "dtype",
          "tie_word_embeddings", "architectures", "transformers_version", "model_type", "use_cache",
          "moe_intermediate_size", "shared_expert_intermediate_size"}
"""Config keys the check sets itself or that do not decide the function (not blamed)."""
_MAX_BLAMED_TRIES = 40


def _layer_stack(model: nn.Module) -> Optional[str]:
    # a PEFT wrapper's base_model is its LoRA model: the transformers model it wraps holds the layers
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    base = getattr(inner, "base_model", inner)
    prefix = next((n for n, m in model.named_modules() if m is base), "")
    for child_name, child in base.named_children():
        if isinstance(child, nn.ModuleList):
            return f"{prefix}.{child_name}" if prefix else child_name
    return None


def parts_in_order(model: nn.Module) -> list[str]:
    """The embedding, each decoder layer and the base model's parts after the layers (the final norm), by path."""
    embedding = model.get_input_embeddings()
    parts = [next(n for n, m in model.named_modules() if m is embedding)]
    stack = _layer_stack(model)
    if stack is None:
        return parts
    layers = model.get_submodule(stack)
    parts += [f"{stack}.{i}" for i in range(len(layers))]
    base_prefix, _, stack_name = stack.rpartition(".")
    base = model.get_submodule(base_prefix) if base_prefix else model
    after = False
    for child_name, child in base.named_children():
        if child_name == stack_name:
            after = True
        elif after and any(True for _ in child.parameters()):
            parts.append(f"{base_prefix}.{child_name}" if base_prefix else child_name)
    return parts


def _head_dim(config: Any) -> int:
    """Values per head of the small copy: :data:`_HEAD_DIM`, or the smallest size at least that whose rotated part
    (a partial rotary factor) is a whole, even number of dims, as in the real model (rotary pairs dims)."""
    factor = getattr(config, "partial_rotary_factor", None)
    if factor is None:
        factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor")
    if not isinstance(factor, (int, float)) or factor >= 1 or factor <= 0:
        return _HEAD_DIM
    return next(d for d in range(_HEAD_DIM, 257) if abs(d * factor - round(d * factor)) < 1e-9
                and round(d * factor) % 2 == 0 and round(d * factor) > 0)


def probe_head_dim(config: Any) -> int:
    """Values per head of a small copy of the model of ``config`` (:func:`small_config`)."""
    return _head_dim(config)


def small_config(config: Any, tp: int, overrides: Optional[dict[str, Any]] = None) -> Any:
    """A copy of ``config`` with the same layers and heads, small widths, and ``overrides`` set."""
    small = copy.deepcopy(config)
    heads = getattr(small, "num_attention_heads", None) or small.n_head
    head_dim = _head_dim(small)
    hidden = heads * head_dim
    vocab = _HEAD_DIM * tp + 1  # not a multiple of t: the padding of the vocabulary is checked too
    for key, value in (("hidden_size", hidden), ("head_dim", head_dim), ("intermediate_size", _HEAD_DIM * tp),
                       ("n_embd", hidden), ("n_inner", _HEAD_DIM * tp), ("vocab_size", vocab),
                       ("moe_intermediate_size", _HEAD_DIM), ("shared_expert_intermediate_size", _HEAD_DIM * tp)):
        if _settable(small, key):
            setattr(small, key, value)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(small, key, None)
        if isinstance(value, int) and value >= vocab:
            setattr(small, key, None)
    for key, value in (overrides or {}).items():
        if _settable(small, key) or not hasattr(small, key):
            setattr(small, key, value)
    return eager_experts(small)


def eager_experts(config: Any) -> Any:
    """``config`` with its experts (if any) computed one by one: the checks run in float64, which transformers'
    default ``grouped_mm`` experts do not take (the same function, another kernel)."""
    if experts_implementation(config) not in (None, "eager"):
        use_eager_experts(config)
    return config


def _settable(config: Any, key: str) -> bool:
    """Whether ``config`` holds ``key`` itself, or as a property with a setter (a read-only property is derived from
    other sizes and follows them)."""
    attribute = getattr(type(config), key, None)
    return key in vars(config) or isinstance(attribute, property) and attribute.fset is not None


def small_model(model: nn.Module, tp: int, overrides: Optional[dict[str, Any]] = None) -> nn.Module:
    """A float64 model of ``model``'s class from :func:`small_config`, on the CPU, weights redrawn (seed 0)."""
    config = small_config(model.config, tp, overrides)
    generator = torch.Generator().manual_seed(0)
    with torch.device("cpu"):
        small = type(model)(config).double()
    with torch.no_grad():
        for param in small.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * param.shape[-1] ** -0.5)
            else:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return small


def _check(model: nn.Module, tp: int, build: Callable[[nn.Module, ParallelGroup], nn.Module], name: str,
           overrides: Optional[dict[str, Any]] = None) -> float:
    small = small_model(model, tp, overrides)
    s = 4 * tp  # divisible by t (sequence parallelism)
    x = torch.randint(0, small.config.vocab_size, (_BATCH, s), generator=torch.Generator().manual_seed(1))
    padding = torch.ones_like(x)
    padding[0, -2:] = 0  # the first sequence ends in two padding tokens

    def call(model: nn.Module) -> dict[str, Any]:
        return {"": model(input_ids=x, labels=x), "with a padding mask:": model(input_ids=x, attention_mask=padding)}

    difference = check_whole_model(small, build, call, tp, parts_in_order(small), name,
                                   call_text="model(input_ids=x, labels=x) and model(input_ids=x, attention_mask=m)")
    return difference.relative


def _blamed(model: nn.Module, tp: int, build: Callable[[nn.Module, ParallelGroup], nn.Module], name: str) -> list[str]:
    config = model.config
    try:
        defaults = type(config)()
    except Exception:  # noqa: BLE001 - a config class without defaults: nothing to compare with
        return []
    found = []
    tried = 0
    for key, value in sorted(vars(config).items()):
        default = getattr(defaults, key, value)
        if key.startswith("_") or key in _SIZES or value == default or tried >= _MAX_BLAMED_TRIES:
            continue
        if not all(v is None or isinstance(v, (bool, int, float, str)) for v in (value, default)):
            continue
        tried += 1
        try:
            _check(model, tp, build, name, {key: default})
        except Exception:  # noqa: BLE001 - still different, or not buildable with the default
            continue
        found.append(f"config.{key}={value!r} (with its default {default!r} the outputs agree)")
    return found


def check_causal_lm(model: nn.Module, tp: int, build: Callable[[nn.Module, ParallelGroup], nn.Module],
                    name: str) -> float:
    """Check that the rewrite of ``model`` (a Hugging Face causal LM; ``build(copy, group)`` rewrites one emulated
    rank's copy) computes its loss and logits; return the relative difference.

    Raises:
        ModelCheckError: naming the first part that differs and the config settings responsible where found.
    """
    try:
        return _check(model, tp, build, name)
    except ModelCheckError as error:
        if "does not compute" not in str(error):
            raise
        blamed = _blamed(model, tp, build, name)
        cause = (f" Settings the rewrite does not implement: {'; '.join(blamed)}. Train with them at their default, "
                 f"or describe the block with a Policy that implements them." if blamed else
                 " No single config setting explains it: that part computes something the layout policy does not "
                 "describe; write a Policy for its block.")
        raise ModelCheckError(str(error) + cause) from None
