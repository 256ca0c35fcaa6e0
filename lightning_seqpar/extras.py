"""The optional extras of ``setup.cfg`` and whether this environment has them, asked without importing them.

A bare install (``pip install -e .``) trains the reference GPT; Hugging Face models, their tokenizers and weights need
``[hf]``, LoRA needs ``[peft]``. A command that needs an extra asks :func:`require_extra` where it starts, so the
user reads which extra to install before any rank starts, not an ``ImportError`` from deep inside a rank.
"""

from __future__ import annotations

import importlib.util

EXTRAS: dict[str, tuple[str, ...]] = {
    "hf": ("transformers", "safetensors", "tokenizers"),
    "peft": ("peft", "transformers", "safetensors", "tokenizers"),
    "math": ("math_verify",),
}
"""Each extra's importable top-level modules (``setup.cfg``'s ``[options.extras_require]``, by import name)."""


def missing_modules(extra: str) -> tuple[str, ...]:
    """The modules of ``extra`` this environment cannot import (empty: it is installed). Nothing is imported: a module
    is found or not by :func:`importlib.util.find_spec` (one blocked by ``sys.modules[name] = None`` counts as
    missing).

    Raises:
        KeyError: an extra :data:`EXTRAS` does not name, listing them.
    """
    if extra not in EXTRAS:
        raise KeyError(f"no extra {extra!r}; the extras are {', '.join(EXTRAS)}.")
    return tuple(name for name in EXTRAS[extra] if not _importable(name))


def has_extra(extra: str) -> bool:
    """Whether every module of ``extra`` can be imported here."""
    return not missing_modules(extra)


def require_extra(extra: str, needed_by: str) -> None:
    """Refuse ``needed_by`` (what the user asked for, e.g. ``"model=llama_tiny (a Hugging Face model)"``) when
    ``extra`` is not installed.

    Raises:
        ImportError: naming what needs it, the modules missing and the install command.
    """
    missing = missing_modules(extra)
    if missing:
        raise ImportError(f"{needed_by} needs the [{extra}] extra ({', '.join(missing)} not installed): "
                          f"pip install -e '.[{extra}]' in a checkout, or pip install 'lightning_seqpar[{extra}]'.")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, or a module without a spec
        return False
