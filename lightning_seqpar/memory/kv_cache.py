"""Bytes of a key/value cache on one rank, as the rewritten layers fill transformers' ``DynamicCache``.

Each rank keeps its own key/value heads: per layer, keys and values of ``[b, a_kv/t, s_kept, d]``, where ``s_kept`` is
the whole sequence s on a full-attention layer and ``min(s, w − 1)`` on a sliding-window layer of window w
(transformers' ``DynamicSlidingWindowLayer`` keeps the last ``w − 1`` positions: the next query adds itself). Under
pipeline parallelism a rank holds its stage's layers only: pass their windows.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


def kv_cache_bytes(b: int, s: int, kv_heads: int, head_dim: int, t: int, bytes_per_element: int,
                   windows: Sequence[Optional[int]]) -> int:
    """Bytes of one rank's key/value cache: ``Σ_layers 2 · b · (a_kv/t) · s_kept · d · bytes_per_element``.

    Args:
        b, s: rows and positions cached (prompt and generated tokens).
        kv_heads, head_dim: a_kv and d of the model; ``t``: the tensor-parallel size (a_kv divides by it).
        windows: one entry per layer on this rank: ``None`` for full attention, else the sliding window w.

    Raises:
        ValueError: a_kv not divisible by t.
    """
    if kv_heads % t:
        raise ValueError(f"a_kv={kv_heads} key/value heads do not split over t={t} tensor-parallel ranks.")
    kept = sum(s if w is None else min(s, w - 1) for w in windows)
    return 2 * b * (kv_heads // t) * kept * head_dim * bytes_per_element


def layer_windows(config: Any) -> list[Optional[int]]:
    """Each decoder layer's window in a Hugging Face ``config`` (``None``: full attention), as ``DynamicCache(config=
    config)`` lays its layers out: ``layer_types`` entries ``"sliding_attention"`` / ``"chunked_attention"`` take
    ``sliding_window`` / ``attention_chunk_size``."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = config.num_hidden_layers
    sliding, chunk = getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None) or [
        "sliding_attention" if sliding is not None else "chunked_attention" if chunk is not None else "full_attention"
    ] * layers
    window = {"sliding_attention": sliding, "chunked_attention": chunk}
    return [window.get(kind) for kind in types[:layers]]
