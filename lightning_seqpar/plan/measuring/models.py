"""The model a plan is for: a Hugging Face ``config.json`` (or a directory holding one, or its dict), or a size of the
paper's GPT models, built on the meta device and inventoried (:mod:`.inventory`). transformers is imported here, when
called."""

from __future__ import annotations

import json
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from lightning_seqpar.checkpoint.peft_adapter import (
    LORA_TARGETS, check_lora_targets, expert_parameter_targets, lora_config,
)
from lightning_seqpar.plan.pricing.model_inventory import ModelInventory
from lightning_seqpar.plan.measuring.inventory import inventory_of_model

GPT_SIZES = {  # Korthikanti et al. 2022, Table 3: the GPT models of the paper (vocabulary 51 200, learned positions)
    "gpt-22b": dict(n_embd=6144, n_head=64, n_layer=48),
    "gpt-175b": dict(n_embd=12288, n_head=96, n_layer=96),
    "gpt-530b": dict(n_embd=20480, n_head=128, n_layer=105),
    "gpt-1t": dict(n_embd=25600, n_head=160, n_layer=128),
}


def load_model_config(model: Union[str, Path, dict], seq_len: int = 2048) -> dict:
    """The config dict of ``model``: a dict with ``model_type``, a ``config.json`` file or a directory holding one,
    or a name of :data:`GPT_SIZES` (a GPT-2-layout config with ``seq_len`` positions).

    Raises:
        FileNotFoundError: a path without a ``config.json``.
        ValueError: a name that is none of these, listing the sizes.
    """
    if isinstance(model, dict):
        return check_sizes(dict(model), "the config")
    if str(model).lower() in GPT_SIZES:
        return gpt2_config(vocab_size=51200, n_positions=seq_len, **GPT_SIZES[str(model).lower()])
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model}: neither a config.json, a directory holding one, nor a GPT size "
                                f"({', '.join(GPT_SIZES)}).")
    return check_sizes(json.loads(path.read_text()), str(path))


def gpt2_config(*, vocab_size: int, n_positions: int, n_embd: int, n_head: int, n_layer: int, **options: Any) -> dict:
    """The Hugging Face GPT-2 config dict of these sizes: how the paper's GPTs (:data:`GPT_SIZES`, with GPT-2's own
    dropout 0.1 and tanh GELU) and the reference GPT (:meth:`lightning_seqpar.models.GPTConfig.planned_config`) are
    planned. ``options``: more of ``GPT2Config``'s fields (``n_inner``, ``activation_function``, ``attn_pdrop``, ...)."""
    return dict(model_type="gpt2", vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_head=n_head,
                n_layer=n_layer, tie_word_embeddings=options.pop("tie_word_embeddings", True), **options)


REQUIRED_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
MAX_LAYERS = 10_000
"""Far above any published model (a few hundred layers): a larger count is a typo, and building it would not end."""


def check_sizes(options: dict, where: str) -> dict:
    """``options`` if it states the sizes a plan needs, as positive integers: the layers, hidden size, heads and
    vocabulary (under the names its ``model_type`` uses; a composite config's ``text_config`` is read for them).
    transformers would fill what is missing with its defaults (32 layers of 4096: Llama-2-7B) and plan a model nobody
    asked for.

    Raises:
        ValueError: a size missing, not a positive integer, or layers above :data:`MAX_LAYERS`, naming it.
    """
    from lightning_seqpar.hf.models import config_aliases

    model_type = options.get("model_type")
    if not isinstance(model_type, str) or config_aliases(model_type) is None:
        raise ValueError(f"{where}: model_type {model_type!r} is not one transformers knows; name the model's family "
                         f"(e.g. \"llama\").")
    text = options.get("text_config") if isinstance(options.get("text_config"), dict) else options
    aliases = config_aliases(text.get("model_type", model_type)) or config_aliases(model_type) or {}
    for name in REQUIRED_SIZES:
        key = name if name in text else aliases.get(name, name)
        if key not in text:
            raise ValueError(f"{where}: no {name!r}{f' (or {aliases[name]!r})' if name in aliases else ''}; a plan "
                             f"needs the model's {', '.join(REQUIRED_SIZES)}. Give the model's own config.json.")
        value = text[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {key} = {value!r}; it must be a positive integer.")
        if name == "num_hidden_layers" and value > MAX_LAYERS:
            raise ValueError(f"{where}: {key} = {value:,}; no model has more than a few hundred layers (at most "
                             f"{MAX_LAYERS:,} are planned). Check the config.")
    check_expert_sizes(text, text.get("model_type", model_type), where)
    return options


EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
"""The names families give the mixture's expert count (Qwen-MoE and OLMoE; Mixtral, gpt-oss and GraniteMoE; GLM-4.5)."""


def check_expert_sizes(options: dict, model_type: str, where: str) -> None:
    """A mixture-of-experts family's config must state its expert count (transformers would fill in its default, 128
    for Qwen3-MoE, and plan a model nobody asked for), and route each token to 1..E of them.

    Raises:
        ValueError: the count missing or not a positive integer, or ``num_experts_per_tok`` outside ``1..E``, naming
            the key.
    """
    from lightning_seqpar.hf.models import config_aliases, config_defaults

    defaults = config_defaults(model_type)
    key = next((k for k in EXPERT_COUNTS if k in defaults), None)
    if key is None or defaults.get(key) in (None, 0):  # not a mixture (or one whose count defaults to none)
        return
    names = [key] + [alias for alias, target in (config_aliases(model_type) or {}).items() if target == key]
    count = next((options[n] for n in names if n in options), None)  # under its name or an alias (num_experts)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"{where}: a {model_type} mixture of experts needs its expert count "
                         f"({' or '.join(map(repr, names))}; transformers would take {defaults[key]}). Give the model's "
                         f"own config.json.")
    k = options.get("num_experts_per_tok", defaults.get("num_experts_per_tok"))
    if isinstance(k, int) and not 1 <= k <= count:
        raise ValueError(f"{where}: num_experts_per_tok = {k} with {key} = {count}: each token is routed to 1..{count} "
                         f"experts.")


def model_inventory(model: Union[str, Path, dict], seq_len: int = 2048, attention: str = "eager",
                    lora: Optional[int] = None, lora_targets: Sequence[str] = LORA_TARGETS,
                    frozen: Sequence[str] = (), cache: Optional[MutableMapping] = None,
                    lora_experts: bool = False) -> ModelInventory:
    """Build ``model`` (see :func:`load_model_config`) on the meta device and classify its parameters as the rewrite
    splits them. ``attention``: the kernel the run will use, ``"eager"`` (the explicit core attention, whose ``s²``
    probabilities selective recomputation drops) or ``"sdpa"`` (fused: no ``s²`` tensor). ``lora``: LoRA of this rank
    on ``lora_targets`` (:func:`with_lora`), and with ``lora_experts`` on a mixture's packed experts too; ``frozen``:
    parameters held but not trained (:func:`freeze`).
    ``cache``: where inventories are kept (a :class:`~.fit_cache.FitCache`, keyed by the config and these arguments),
    read instead of building the model when it holds this one.

    Raises:
        ValueError: a model whose layers no built-in layout recognizes (the reasons of
            :func:`lightning_seqpar.explain`); from :func:`with_lora` and :func:`freeze`.
        ImportError: ``lora`` without PEFT.
    """
    options = load_model_config(model, seq_len)
    if lora is not None and frozen:
        raise ValueError(f"frozen={list(frozen)} with LoRA: LoRA trains the adapters only, the base is frozen already; "
                         f"give one of them.")
    if lora_experts and lora is None:
        raise ValueError("LoRA on the experts (--lora-experts) needs a LoRA rank: give --lora R too.")
    key = ("inventory", json.dumps(options, sort_keys=True, default=str), attention, lora,
           tuple(lora_targets) if lora is not None else (), tuple(frozen)) + (("experts",) if lora_experts else ())
    if cache is not None and key in cache:
        from lightning_seqpar.hf.models import causal_lm_config

        try:
            return cache[key].inventory(causal_lm_config(config=options, attn_implementation=attention))
        except (TypeError, ValueError):  # LoRA settings PEFT does not take (a damaged file): built again
            pass
    built = meta_model(options, attention)
    name = str(options.get("_name_or_path") or type(built).__name__)
    if lora is not None:
        built = with_lora(built, lora, lora_targets, experts=lora_experts)
        name = f"{name} + LoRA r={lora}{' (experts too)' if lora_experts else ''}"
    elif frozen:
        name = f"{name}, {freeze(built, frozen):,} parameters frozen"
    inventory = inventory_of_hf_model(built, name=name, consume=True)
    if cache is not None:
        from lightning_seqpar.plan.measuring.inventory_record import InventoryRecord

        cache[key] = InventoryRecord.of(inventory)
    return inventory


def with_attention(inventory: ModelInventory, options: dict, attention: str) -> ModelInventory:
    """``inventory``, of the model of the config dict ``options`` (:func:`load_model_config`), for a run with the
    ``attention`` kernel (``"eager"``, ``"sdpa"``) instead: a kernel holds no parameter, so the entries and sizes are
    the same; the config the probes build from, and what selective recomputation drops, follow the kernel. What
    :func:`model_inventory` at ``attention`` gives, without building and rewriting the model again."""
    from dataclasses import replace

    from lightning_seqpar.hf.models import causal_lm_config

    return replace(inventory, config=causal_lm_config(config=options, attn_implementation=attention),
                   eager_attention=attention == "eager")


def with_lora(model: Any, rank: int, targets: Sequence[str] = LORA_TARGETS, experts: bool = False) -> Any:
    """``model`` (on the meta device) wrapped with PEFT's LoRA of rank ``rank`` on ``targets`` (and with ``experts``
    on every mixture's packed expert weights, PEFT's ``target_parameters``), as
    :class:`~lightning_seqpar.models.FineTuneModule` wraps it: the base frozen (its parameters held, without gradients,
    main params or optimizer state), the adapters trained.

    Raises:
        ValueError: a rank below 1, targets that match no module (naming the model's linear layers), ``experts`` on a
            model without experts.
        ImportError: PEFT not installed, with the install command.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank {rank!r}: a positive integer (8, 16, 64, ...).")
    check_lora_targets(list(targets), model)
    parameters = expert_parameter_targets(model) if experts else []
    if experts and not parameters:
        raise ValueError(f"LoRA on the experts (--lora-experts): {type(model).__name__} has no mixture of experts.")
    settings = dict(r=rank, alpha=2 * rank, dropout=0.0, target_modules=list(targets), target_parameters=parameters)
    try:
        config = lora_config(settings)
        from peft import get_peft_model
    except ImportError as error:
        raise ImportError("Planning LoRA needs PEFT: pip install 'lightning_seqpar[peft]'.") from error
    with torch.device("meta"):
        return get_peft_model(model, config)


def freeze(model: Any, patterns: Sequence[str]) -> int:
    """Freeze (``requires_grad=False``) every parameter of ``model`` whose name contains one of ``patterns``
    (``embed_tokens``, ``lm_head``, ``router``, ...): held, but without gradients, main params or optimizer state.
    Returns the elements frozen.

    Raises:
        ValueError: a pattern no parameter name contains, listing the parameters of the first layer.
    """
    named = dict(model.named_parameters())
    for pattern in patterns:
        if not any(pattern in name for name in named):
            first = sorted({n.rpartition(".")[0] for n in named if ".0." in n})
            raise ValueError(f"frozen {pattern!r} names no parameter of {type(model).__name__}; the names look like "
                             f"{', '.join(first[:8])}, embed_tokens, lm_head.")
    count = 0
    for name, param in named.items():
        if any(pattern in name for pattern in patterns):
            param.requires_grad_(False)
            count += param.numel()
    return count


def meta_model(options: dict, attention: str = "eager") -> Any:
    """The Hugging Face causal LM of the config dict ``options`` built on the meta device (nothing allocated)."""
    from lightning_seqpar.hf.models import build_causal_lm, causal_lm_config

    with torch.device("meta"):
        return build_causal_lm(causal_lm_config(config=options, attn_implementation=attention))


def inventory_of_hf_model(model: Any, name: Optional[str] = None, consume: bool = False) -> ModelInventory:
    """:func:`~lightning_seqpar.plan.measuring.inventory.inventory_of_model` of a Hugging Face causal LM, its layers
    declared by the built-in layouts (as the rewrite declares them). ``consume``: ``model`` is not used again (it may be
    rewritten in place).

    Raises:
        ValueError: no layer of a built-in layout (the reasons of :func:`lightning_seqpar.explain`).
    """
    from lightning_seqpar.hf.layouts import hf_policies

    policies = hf_policies()
    specs: dict[str, Any] = {}
    for path, module in model.named_modules():
        policy = next((p for p in policies if p.matches(module)), None)
        if policy is not None:
            specs[path] = policy.spec_for(module)
    if not specs:
        from lightning_seqpar.plan.explain import explain

        explain(model, tp=1, verify=False)  # raises, naming each block class and why it is not known
    from lightning_seqpar.plan.measuring.trained import trained_parts_of
    from lightning_seqpar.policies import pipeline_placement

    config, training = getattr(model, "config", None), trained_parts_of(model)
    inventory = inventory_of_model(model, specs, pipeline_placement(model), name=name, consume=consume)
    inventory.config, inventory.training = config, training
    return inventory
