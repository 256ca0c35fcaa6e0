"""Rewriting models: the policy contract, declared blocks and their policies, the self-checks, and the engine that
walks a model and applies policies. The built-in policies and the public :func:`lightning_seqpar.rewrite` are in
:mod:`lightning_seqpar.policies`, where this folder and :mod:`lightning_seqpar.hf` meet."""

from lightning_seqpar.rewriting.declared_policy import DeclaredBlockPolicy
from lightning_seqpar.rewriting.policy import DeclaresPolicy, ModelPolicy, Policy, StackPolicy
from lightning_seqpar.rewriting.rewriter import PlannedRewrite, RewritePlan
from lightning_seqpar.transformer.context import RewriteContext

__all__ = ["DeclaredBlockPolicy", "DeclaresPolicy", "ModelPolicy", "PlannedRewrite", "Policy", "RewriteContext",
           "RewritePlan", "StackPolicy"]
