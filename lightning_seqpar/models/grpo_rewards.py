"""GRPO's verifiable rewards: the built-in ones and a user's, called as TRL calls them.

A reward function takes ``(prompts, completions, **columns)`` and returns one float per completion (TRL's signature:
``completions`` are strings, or for conversational prompts lists of one assistant message; ``columns`` are the
dataset's other columns, one value per completion). ``None`` marks a completion the function cannot score (it counts
as no reward from that function). Built in, each reading the ``answer`` column:

- ``contains``: 1.0 if the completion contains the answer (as text), else 0.0;
- ``exact_match``: 1.0 if the completion, stripped, is the answer, stripped;
- ``math``: 1.0 if ``math-verify`` finds the completion's final answer equal to the answer (LaTeX, fractions,
  boxed; the ``[math]`` extra).

Any other function is named as ``package.module:function``. :class:`Rewards` calls each once per completion batch and
weights them; an error names the function and, where one row causes it, the row.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

RewardFunction = Callable[..., Sequence[Optional[float]]]


def _text(completion: Any) -> str:
    """A completion's text: the string itself, or a conversational completion's (last) message content."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1]["content"]) if completion else ""


def contains(prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any], **columns: Any) -> list[float]:
    """1.0 where the completion contains the answer (as text), else 0.0."""
    return [float(str(a) in _text(c)) for c, a in zip(completions, answer)]


def exact_match(prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any],
                **columns: Any) -> list[float]:
    """1.0 where the completion, stripped, equals the answer, stripped, else 0.0."""
    return [float(_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def math(prompts: Sequence[Any], completions: Sequence[Any], answer: Sequence[Any], **columns: Any) -> list[float]:
    """1.0 where ``math-verify`` parses the completion's answer as equal to ``answer`` (math-verify's ``parse`` and
    ``verify``, the gold answer first), else 0.0."""
    from math_verify import parse, verify

    return [float(bool(verify(parse(str(a)), parse(_text(c))))) for c, a in zip(completions, answer)]


BUILT_IN: dict[str, RewardFunction] = {"contains": contains, "exact_match": exact_match, "math": math}
NEEDS_ANSWER = frozenset(BUILT_IN)
"""The built-ins that read the ``answer`` column."""


def reward_function(spec: Union[str, RewardFunction]) -> tuple[str, RewardFunction]:
    """``(name, function)`` of a built-in name, a ``package.module:function`` path, or a callable.

    Raises:
        ValueError: a name that is neither built in nor a ``module:function`` path; a module or attribute not found.
        TypeError: what it names is not callable.
        ImportError: ``math`` without the ``[math]`` extra (from :func:`~lightning_seqpar.extras.require_extra`).
    """
    if callable(spec):
        return getattr(spec, "__name__", type(spec).__name__), spec
    if spec in BUILT_IN:
        if spec == "math":
            from lightning_seqpar.extras import require_extra

            require_extra("math", "grpo.reward=math (math-verify)")
        return spec, BUILT_IN[spec]
    module, colon, attribute = str(spec).partition(":")
    if not colon or not module or not attribute:
        raise ValueError(f"grpo.reward={spec!r}: a built-in reward ({', '.join(BUILT_IN)}) or a function as "
                         f"package.module:function.")
    try:
        function = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"grpo.reward={spec!r}: {error}. Name an importable module and a function in it.") from error
    if not callable(function):
        raise TypeError(f"grpo.reward={spec!r} is a {type(function).__name__}, not a function "
                        f"f(prompts, completions, **columns) -> list[float].")
    return spec, function


class Rewards:
    """Weighted reward functions (see the module docstring).

    Args:
        functions: built-in names, ``package.module:function`` paths or callables.
        weights: one per function (default 1.0 each).

    Raises:
        ValueError: no function, or a number of weights that is not the number of functions; and as
            :func:`reward_function`.
    """

    def __init__(self, functions: Sequence[Union[str, RewardFunction]],
                 weights: Optional[Sequence[float]] = None) -> None:
        if not functions:
            raise ValueError("grpo.reward: at least one reward function.")
        named = [reward_function(f) for f in functions]
        self.names = [name for name, _ in named]
        self.functions = [function for _, function in named]
        self.weights = [1.0] * len(named) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(self.functions):
            raise ValueError(f"grpo.reward_weights: {len(self.weights)} weights for {len(self.functions)} reward "
                             f"functions ({self.names}); give one per function.")

    def check_columns(self, columns: Sequence[str]) -> None:
        """Refuse a built-in that reads ``answer`` when the data has no such column.

        Raises:
            ValueError: naming the reward and the columns the data has.
        """
        for name in self.names:
            if name in NEEDS_ANSWER and "answer" not in columns:
                raise ValueError(f"grpo.reward={name} compares with the 'answer' column, which the data does not have "
                                 f"(its columns: {sorted(columns)}). Add it, or name a reward that needs none.")

    def per_function(self, prompts: Sequence[Any], completions: Sequence[Any],
                     columns: dict[str, Sequence[Any]]) -> Tensor:
        """``[N, k]`` float64: each function's reward of each completion (NaN where it returned ``None``).

        Raises:
            RuntimeError: a function that raised, naming it and the first row that raises alone.
            ValueError: a function that returned another number of rewards than completions, or a value that is not a
                number, naming it.
        """
        n = len(completions)
        out = torch.full((n, len(self.functions)), float("nan"), dtype=torch.float64)
        for j, (name, function) in enumerate(zip(self.names, self.functions)):
            try:
                values = list(function(prompts=list(prompts), completions=list(completions), **columns))
            except Exception as error:  # noqa: BLE001 - re-raised naming the function and the row
                raise RuntimeError(f"reward {name} raised {type(error).__name__}: {error}"
                                   f"{_failing_row(function, prompts, completions, columns)}") from error
            if len(values) != n:
                raise ValueError(f"reward {name} returned {len(values)} rewards for {n} completions: one per "
                                 f"completion (None where it cannot score one).")
            for i, value in enumerate(values):
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ValueError(f"reward {name} returned {value!r} for row {i}: a number (or None).")
                out[i, j] = float(value)
        return out

    def total(self, per_function: Tensor) -> Tensor:
        """``[N]``: the weighted sum over the functions, NaN counted as 0; NaN where every function returned
        ``None`` (TRL's ``sum_then_normalize``)."""
        weights = torch.tensor(self.weights, dtype=per_function.dtype)
        total = (per_function * weights).nansum(-1)
        return total.masked_fill(torch.isnan(per_function).all(-1), float("nan"))


def _failing_row(function: RewardFunction, prompts: Sequence[Any], completions: Sequence[Any],
                 columns: dict[str, Sequence[Any]]) -> str:
    """`` (row i: ...)``, the first completion the function raises on alone, if one does."""
    for i in range(len(completions)):
        try:
            function(prompts=[prompts[i]], completions=[completions[i]], **{k: [v[i]] for k, v in columns.items()})
        except Exception:  # noqa: BLE001 - the row is what the message names
            return f" (row {i}: prompt {str(prompts[i])[:60]!r}, completion {str(completions[i])[:60]!r})"
    return ""
