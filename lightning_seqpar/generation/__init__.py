"""Tokens out of a model in its training layout (:func:`generate`)."""

from lightning_seqpar.generation.generate import generate

__all__ = ["generate"]
