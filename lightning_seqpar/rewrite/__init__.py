"""Rewriting standard transformer modules into tensor + sequence parallel ones."""

from lightning_seqpar.rewrite.context import RewriteContext
from lightning_seqpar.rewrite.policy import Policy
from lightning_seqpar.rewrite.rewriter import RewritePlan, default_policies, explain, plan_rewrite, rewrite

__all__ = ["Policy", "RewriteContext", "RewritePlan", "default_policies", "explain", "plan_rewrite", "rewrite"]
