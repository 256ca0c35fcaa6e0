"""The context-parallel attentions by name (:mod:`.attention`): torch-free, so a layout names one without loading
them."""

from __future__ import annotations

COMMS = ("ring", "all_to_all")


def check_comm(comm: str) -> str:
    """``comm`` if it names a context-parallel attention.

    Raises:
        ValueError: an unknown ``comm``.
    """
    if comm not in COMMS:
        raise ValueError(f"cp_comm={comm!r}: context-parallel attention is 'ring' or 'all_to_all'.")
    return comm
