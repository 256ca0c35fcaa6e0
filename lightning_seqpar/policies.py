"""The built-in policies, and the rewrite with them: where the rewriting engine (:mod:`lightning_seqpar.rewriting`)
and the Hugging Face layouts (:mod:`lightning_seqpar.hf`) meet.

:func:`rewrite`, :func:`plan_rewrite`, :func:`explain` and :func:`pipeline_placement` take the user's policies and put
them before :func:`default_policies` (a user's policy for a class wins over a built-in one).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch.nn as nn

from lightning_seqpar.hf.layouts import hf_policies
from lightning_seqpar.hf.vocabulary import HFVocabularyPolicy
from lightning_seqpar.rewriting import rewriter
from lightning_seqpar.rewriting.encoder_policy import TransformerEncoderLayerPolicy, TransformerEncoderPolicy
from lightning_seqpar.rewriting.policy import Policy
from lightning_seqpar.rewriting.rewriter import RewritePlan
from lightning_seqpar.transformer.context import RewriteContext


def default_policies() -> list[Policy]:
    """The built-in policies: ``nn.TransformerEncoder``, ``nn.TransformerEncoderLayer``, Hugging Face decoder blocks
    of the Llama, GPT-2, GPT-NeoX and Falcon layouts (recognized by structure) and the vocabulary of a Hugging Face causal LM.

    Block classes that declare their own policy (:class:`~lightning_seqpar.rewriting.policy.DeclaresPolicy`, e.g.
    the reference GPT) need no entry here.
    """
    return [TransformerEncoderPolicy(), TransformerEncoderLayerPolicy(), *hf_policies(), HFVocabularyPolicy()]


def _with_defaults(policies: Optional[Iterable[Policy]]) -> list[Policy]:
    return [*(policies or ()), *default_policies()]


def plan_rewrite(model: nn.Module, ctx: RewriteContext, policies: Optional[Iterable[Policy]] = None,
                 verify: bool = True) -> RewritePlan:
    """What :func:`rewrite` would do, every shape checked, nothing changed
    (:func:`lightning_seqpar.rewriting.rewriter.plan_rewrite` with the built-in policies after ``policies``).

    Raises:
        ValueError: nothing recognized, a shape that does not split t ways, or a self-check that fails.
    """
    return rewriter.plan_rewrite(model, ctx, _with_defaults(policies), verify)


def rewrite(model: nn.Module, ctx: RewriteContext, policies: Optional[Iterable[Policy]] = None,
            verify: bool = True) -> RewritePlan:
    """Replace every recognized block of ``model`` in place by its tensor (+sequence) parallel version
    (:func:`lightning_seqpar.rewriting.rewriter.rewrite` with the built-in policies after ``policies``).

    Raises:
        ValueError: as :func:`plan_rewrite`, before any module is changed.
    """
    return rewriter.rewrite(model, ctx, _with_defaults(policies), verify)


def explain(model: nn.Module, ctx: RewriteContext, policies: Optional[Iterable[Policy]] = None, verify: bool = True,
            seq_len: Optional[int] = None, micro_batch_size: int = 1, bytes_per_element: int = 2,
            pipeline: Optional[Callable[[nn.Module, Optional[Any]], Any]] = None) -> RewritePlan:
    """Print and return what a rewrite under ``ctx`` with the built-in policies after ``policies`` would do to
    ``model``; change nothing (:func:`lightning_seqpar.rewriting.rewriter.explain`). The public
    ``lightning_seqpar.explain`` (:func:`lightning_seqpar.plan.explain.explain`) makes ``ctx`` from the strategy's
    settings and adds the pipeline's schedule with ``pp=``, through ``pipeline``.

    Needs no process group. Raises the same ``ValueError`` as the real rewrite would.
    """
    return rewriter.explain(model, ctx, _with_defaults(policies), verify, seq_len, micro_batch_size, bytes_per_element,
                            pipeline)


def pipeline_placement(model: nn.Module, policies: Optional[Iterable[Policy]] = None) -> dict[str, str]:
    """The parts outside the layer stack that one pipeline stage holds
    (:func:`lightning_seqpar.rewriting.rewriter.pipeline_placement` with the built-in policies after ``policies``)."""
    return rewriter.pipeline_placement(model, _with_defaults(policies))
