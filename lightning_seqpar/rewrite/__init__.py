"""Rewriting standard transformer modules into tensor + sequence parallel ones."""

from lightning_seqpar.rewrite.rewriter import RewritePlan, default_policies, explain, plan_rewrite, rewrite
from lightning_seqpar.transformer.context import RewriteContext
from lightning_seqpar.transformer.policy import DeclaresPolicy, Policy

__all__ = ["DeclaresPolicy", "Policy", "RewriteContext", "RewritePlan", "default_policies", "explain", "plan_rewrite", "rewrite"]
